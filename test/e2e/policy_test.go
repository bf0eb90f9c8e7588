package e2e

import (
	"context"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
)

// policyMesh is the mesh of TestPolicy: n1p1 is "client", n1p3
// "intruder", n1p2 and n2p1 run "echo" (one service, endpoints on both
// nodes), n2p2 runs "db".
func policyMesh(extra string) noderun.Mesh {
	return noderun.Mesh{
		Pods: map[string]noderun.Pod{
			"n1p1": {Name: "client"},
			"n1p2": {Name: "echo-a", Labels: map[string]string{"app": "echo"}},
			"n1p3": {Name: "intruder"},
			"n2p1": {Name: "echo-b", Labels: map[string]string{"app": "echo"}},
			"n2p2": {Name: "db", Labels: map[string]string{"app": "db"}},
		},
		Extra: `services:
  - {name: echo, namespace: default, vips: [198.18.100.1], ports: [{port: 80, targetPort: 8080}], selector: {app: echo}}
authorizationPolicies:
  - name: echo-from-client
    namespace: default
    selector: {app: echo}
    action: ALLOW
    rules: [{from: [{principals: [cluster.local/ns/default/sa/client]}]}]
  - name: no-telnet
    namespace: istio-system
    action: DENY
    rules: [{to: [{ports: [23]}]}]
  - name: db-from-node-1-pods
    namespace: default
    selector: {app: db}
    action: ALLOW
    rules: [{from: [{ipBlocks: [{cidr: 198.18.1.0/24, except: [198.18.1.13/32]}]}]}]
` + extra,
	}
}

// TestPolicy checks services and authorization end to end: a service VIP
// balanced over endpoints on both nodes, an ALLOW for one identity, a
// DENY on a port, an IP block with an exception, and a live config change
// that cuts an open connection.
func TestPolicy(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "pol", Nodes: 2, PodsPerNode: 3, NoExternal: true, Control: true})
	n1, n2 := c.Nodes[0], c.Nodes[1]
	client, echoA, intruder := n1.Pods[0], n1.Pods[1], n1.Pods[2]
	echoB, db := n2.Pods[0], n2.Pods[1]
	cfg := writeConfig(t, c, policyMesh(""))
	m1 := startWithConfig(t, n1, cfg)
	startWithConfig(t, n2, cfg)

	for _, p := range []*cluster.Pod{echoA, echoB} {
		name := p.ID
		serve(t, p, 8080, func(c net.Conn) { c.Write([]byte(name)) })
		serve(t, p, 23, func(c net.Conn) { c.Write([]byte("login: ")) })
	}
	refused := func(t *testing.T, from *cluster.Pod, to netip.AddrPort) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := from.Dial(ctx, "tcp", to.String())
		if err == nil {
			// Over HBONE the refusal may arrive as a reset after connect.
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			if n, rerr := c.Read(make([]byte, 16)); rerr == nil || n > 0 {
				c.Close()
				t.Fatalf("%s → %s: connected and read %d bytes; want refused", from.ID, to, n)
			}
			c.Close()
		}
	}
	reply := func(t *testing.T, from *cluster.Pod, to netip.AddrPort) string {
		t.Helper()
		cl := dial(t, from.NS, to.Addr(), int(to.Port()))
		cl.SetReadDeadline(time.Now().Add(10 * time.Second))
		b, err := io.ReadAll(cl)
		if err != nil {
			t.Fatalf("%s → %s: %v", from.ID, to, err)
		}
		return string(b)
	}

	t.Run("service VIP reaches endpoints on both nodes", func(t *testing.T) {
		vip := netip.MustParseAddrPort("198.18.100.1:80")
		seen := map[string]int{}
		for i := 0; i < 40; i++ {
			seen[reply(t, client, vip)]++
		}
		if seen[echoA.ID] == 0 || seen[echoB.ID] == 0 || len(seen) != 2 {
			t.Fatalf("40 connections to the VIP reached %v; want both %s and %s", seen, echoA.ID, echoB.ID)
		}
		t.Logf("endpoints reached: %v", seen)
	})
	t.Run("ALLOW admits one identity and keeps another out", func(t *testing.T) {
		if got := reply(t, client, netip.AddrPortFrom(echoB.IPv4, 8080)); got != echoB.ID {
			t.Fatalf("client → echo-b: %q", got)
		}
		refused(t, intruder, netip.AddrPortFrom(echoB.IPv4, 8080))
		refused(t, intruder, netip.AddrPortFrom(echoA.IPv4, 8080)) // same node
	})
	t.Run("DENY on a port", func(t *testing.T) {
		refused(t, client, netip.AddrPortFrom(echoB.IPv4, 23))
	})
	t.Run("IP block with an exception", func(t *testing.T) {
		serve(t, db, 5432, func(c net.Conn) { c.Write([]byte("db")) })
		if got := reply(t, client, netip.AddrPortFrom(db.IPv4, 5432)); got != "db" {
			t.Fatalf("client (198.18.1.11, in the block) → db: %q", got)
		}
		refused(t, intruder, netip.AddrPortFrom(db.IPv4, 5432)) // 198.18.1.13: the exception
	})
	t.Run("a live config change cuts an open connection", func(t *testing.T) {
		serve(t, db, 5433, func(c net.Conn) {
			c.Write([]byte("hello"))
			io.Copy(io.Discard, c) // until the connection ends
		})
		cl := dial(t, client.NS, db.IPv4, 5433)
		cl.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.ReadFull(cl, make([]byte, 5)); err != nil {
			t.Fatalf("open connection: %v", err)
		}
		mark := m1.Len()
		deny := `  - name: no-db-for-client
    namespace: default
    selector: {app: db}
    action: DENY
    rules: [{from: [{principals: [cluster.local/ns/default/sa/client]}]}]
`
		path := writeConfig(t, c, policyMesh(deny))
		if path != cfg {
			t.Fatalf("config written to %s, nodes watch %s", path, cfg)
		}
		_, err := cl.Read(make([]byte, 1))
		if !isReset(err) {
			t.Fatalf("read on the connection after the policy change: %v, want connection reset", err)
		}
		// Node 1 (the source) reloaded too.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := m1.WaitLogSince(ctx, mark, func(l noderun.Line) bool { return l.Str("message") == "mesh model updated" }); err != nil {
			t.Fatalf("node 1 did not reload: %v", err)
		}
		refused(t, client, netip.AddrPortFrom(db.IPv4, 5432))
	})
	t.Run("an invalid config keeps the last good model", func(t *testing.T) {
		mark := m1.Len()
		if err := os.WriteFile(cfg, []byte("trustDomain: [oops\n"), 0o644); err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		l, err := m1.WaitLogSince(ctx, mark, func(l noderun.Line) bool {
			return strings.Contains(l.Str("message"), "keeping the last good model")
		})
		if err != nil {
			t.Fatalf("no log of the rejected config: %v", err)
		}
		if !strings.Contains(l.Str("error"), "mesh.yaml:1") {
			t.Errorf("error %q does not name the file and line", l.Str("error"))
		}
		if got := reply(t, client, netip.AddrPortFrom(echoB.IPv4, 8080)); got != echoB.ID {
			t.Fatalf("after the invalid config, client → echo-b: %q", got)
		}
	})
}
