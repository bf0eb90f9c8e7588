package e2e

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
)

// l7Mesh is the mesh of TestAdversarialConfig: n1p1 is "client", n2p1
// "web" (app: web), n2p2 "api" (app: api). api has an ALLOW policy whose
// only rule is an HTTP method (it matches nothing at L4); web is audited on
// port 8080. extra is appended to the policies.
func l7Mesh(extra string) noderun.Mesh {
	return noderun.Mesh{
		Pods: map[string]noderun.Pod{
			"n1p1": {Name: "client"},
			"n2p1": {Name: "web", Labels: map[string]string{"app": "web"}},
			"n2p2": {Name: "api", Labels: map[string]string{"app": "api"}},
		},
		Extra: `authorizationPolicies:
  - name: api-get-only
    namespace: default
    selector: {matchLabels: {app: api}}
    action: ALLOW
    rules:
      - to: [{operation: {methods: [GET]}}]
  - name: audit-web
    namespace: default
    selector: {matchLabels: {app: web}}
    action: AUDIT
    rules:
      - to: [{operation: {ports: ["8080"]}}]
` + extra,
	}
}

// l7Deny is an Istio DENY policy with an HTTP method: enforced on its L4
// part, it denies every connection to web's port 9090.
const l7Deny = `  - name: no-delete-on-admin
    namespace: default
    selector: {matchLabels: {app: web}}
    action: DENY
    rules:
      - to: [{operation: {methods: [DELETE], ports: ["9090"]}}]
`

// TestAdversarialConfig: policies Istio accepts but an L4 proxy cannot
// read in full neither make the config invalid nor open a hole. A config
// with an L7-only ALLOW loads with a warning naming the file, line and
// field, and the ALLOW matches nothing (refused, with the reason in the
// access log). A reload that adds a DENY with an HTTP method is applied
// (it used to make the file invalid, so the new DENY was never enforced)
// and the DENY is enforced on its L4 part: connections to its port are
// refused, with the policy named in the log; the other port still works,
// logged by an AUDIT policy.
func TestAdversarialConfig(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "l7cfg", Nodes: 2, PodsPerNode: 2, NoExternal: true, Control: true})
	client, web, api := c.Nodes[0].Pods[0], c.Nodes[1].Pods[0], c.Nodes[1].Pods[1]
	cfg := writeConfig(t, c, l7Mesh(""))
	startWithConfig(t, c.Nodes[0], cfg)
	m2 := startWithConfig(t, c.Nodes[1], cfg)

	serve(t, web, 8080, func(c net.Conn) { c.Write([]byte("web")) })
	serve(t, web, 9090, func(c net.Conn) { c.Write([]byte("admin")) })
	serve(t, api, 8080, func(c net.Conn) { c.Write([]byte("api")) })

	waitLog := func(t *testing.T, since int, what string, pred func(noderun.Line) bool) noderun.Line {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		l, err := m2.WaitLogSince(ctx, since, pred)
		if err != nil {
			t.Fatalf("node 2 logged no %s: %v", what, err)
		}
		return l
	}
	reply := func(t *testing.T, to netip.AddrPort) string {
		t.Helper()
		cl := dial(t, client.NS, to.Addr(), int(to.Port()))
		cl.SetReadDeadline(time.Now().Add(10 * time.Second))
		b, err := io.ReadAll(cl)
		if err != nil {
			t.Fatalf("client → %s: %v", to, err)
		}
		return string(b)
	}
	// refused checks that to refuses the client, and that node 2 logs the
	// refusal with reason.
	refused := func(t *testing.T, to netip.AddrPort, reason string) {
		t.Helper()
		mark := m2.Len()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if cl, err := client.Dial(ctx, "tcp", to.String()); err == nil {
			// Over HBONE the refusal arrives as a reset after connect.
			cl.SetReadDeadline(time.Now().Add(5 * time.Second))
			n, rerr := cl.Read(make([]byte, 16))
			cl.Close()
			if rerr == nil || n > 0 {
				t.Fatalf("client → %s: connected and read %d bytes; want refused", to, n)
			}
		}
		waitLog(t, mark, "refusal", func(l noderun.Line) bool {
			return l.Str("message") == "connection refused" && l.Str("dst.addr") == to.String() && l.Str("error") == reason
		})
	}

	t.Run("an L7-only ALLOW loads with a warning and matches nothing", func(t *testing.T) {
		l := waitLog(t, 0, "warning for methods", func(l noderun.Line) bool {
			return l.Str("level") == "warn" && strings.Contains(l.Str("message"), "operation.methods")
		})
		msg := l.Str("message")
		for _, want := range []string{"mesh.yaml:", "authorizationPolicies[0].rules[0].to[0].operation.methods", "this ALLOW rule matches nothing"} {
			if !strings.Contains(msg, want) {
				t.Errorf("warning %q does not say %q", msg, want)
			}
		}
		refused(t, netip.AddrPortFrom(api.IPv4, 8080), "denied: no ALLOW policy matched")
	})
	t.Run("an AUDIT policy logs and allows", func(t *testing.T) {
		mark := m2.Len()
		if got := reply(t, netip.AddrPortFrom(web.IPv4, 8080)); got != "web" {
			t.Fatalf("client → web:8080: %q", got)
		}
		waitLog(t, mark, "audit line", func(l noderun.Line) bool {
			return l.Str("message") == "audit policy matched" && l.Str("policy") == "default/audit-web"
		})
		if got := reply(t, netip.AddrPortFrom(web.IPv4, 9090)); got != "admin" {
			t.Fatalf("client → web:9090 before the DENY: %q", got)
		}
	})
	t.Run("a reloaded L7 DENY is enforced on its L4 part", func(t *testing.T) {
		mark := m2.Len()
		if path := writeConfig(t, c, l7Mesh(l7Deny)); path != cfg {
			t.Fatalf("config written to %s, nodes watch %s", path, cfg)
		}
		l := waitLog(t, mark, "warning for the DENY's methods", func(l noderun.Line) bool {
			return l.Str("level") == "warn" && strings.Contains(l.Str("message"), "authorizationPolicies[2].rules[0].to[0].operation.methods")
		})
		if msg := l.Str("message"); !strings.Contains(msg, "mesh.yaml:") || !strings.Contains(msg, "this DENY rule is enforced on its L4 part alone") {
			t.Errorf("warning %q does not name the file or say how the DENY is enforced", msg)
		}
		waitLog(t, mark, "reload", func(l noderun.Line) bool { return l.Str("message") == "mesh model updated" })
		refused(t, netip.AddrPortFrom(web.IPv4, 9090), "denied by policy default/no-delete-on-admin")
		if got := reply(t, netip.AddrPortFrom(web.IPv4, 8080)); got != "web" {
			t.Fatalf("client → web:8080, a port the DENY does not name: %q", got)
		}
	})
}

// TestStrictResetsOpenPlaintext: a plaintext connection from outside the
// mesh to a PERMISSIVE workload with no policy is not proxied (it travels
// verbatim, at kernel speed). A reload that makes the workload STRICT must
// not leave it open: its next segment meets the capture policy, which now
// intercepts it, and the netstack, which has no such connection, resets
// it. Nothing sent after the reload reaches the workload, and a new
// plaintext connection is refused.
func TestStrictResetsOpenPlaintext(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "strictrs", Nodes: 1, PodsPerNode: 2, NoExternal: true, Control: true})
	outside, web := c.Nodes[0].Pods[0], c.Nodes[0].Pods[1]
	mesh := func(strict bool) noderun.Mesh {
		return noderun.Mesh{Pods: map[string]noderun.Pod{
			outside.ID: {Outside: true},
			web.ID:     {Name: "web", Strict: strict},
		}}
	}
	cfg := writeConfig(t, c, mesh(false))
	n := startWithConfig(t, c.Nodes[0], cfg)

	got := make(chan string, 16)
	serve(t, web, 8080, func(c net.Conn) {
		buf := make([]byte, 64)
		for {
			k, err := c.Read(buf)
			if k > 0 {
				got <- string(buf[:k])
				c.Write(buf[:k])
			}
			if err != nil {
				return
			}
		}
	})

	cl := dial(t, outside.NS, web.IPv4, 8080)
	defer cl.Close()
	roundTrip := func(msg string) error {
		if _, err := cl.Write([]byte(msg)); err != nil {
			return err
		}
		cl.SetReadDeadline(time.Now().Add(10 * time.Second))
		b := make([]byte, len(msg))
		_, err := io.ReadFull(cl, b)
		return err
	}
	if err := roundTrip("before"); err != nil {
		t.Fatalf("plaintext to the PERMISSIVE workload: %v", err)
	}
	if s := <-got; s != "before" {
		t.Fatalf("workload received %q", s)
	}

	mark := n.Len()
	writeConfig(t, c, mesh(true))
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if _, err := n.WaitLogSince(ctx, mark, func(l noderun.Line) bool { return l.Str("message") == "mesh model updated" }); err != nil {
		t.Fatalf("node logged no reload: %v", err)
	}

	err := roundTrip("after")
	if err == nil {
		t.Fatal("the open plaintext connection still works after its workload turned STRICT")
	}
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Errorf("the open plaintext connection ended with %v; want a reset", err)
	}
	select {
	case s := <-got:
		t.Fatalf("workload received %q after it turned STRICT", s)
	case <-time.After(500 * time.Millisecond):
	}
	ctx2, cancel2 := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel2()
	if nc, err := outside.Dial(ctx2, "tcp", netip.AddrPortFrom(web.IPv4, 8080).String()); err == nil {
		nc.SetReadDeadline(time.Now().Add(5 * time.Second))
		k, rerr := nc.Read(make([]byte, 16))
		nc.Close()
		if rerr == nil || k > 0 {
			t.Fatalf("a new plaintext connection to the STRICT workload read %d bytes", k)
		}
	}
}
