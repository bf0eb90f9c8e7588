package e2e

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/meshtun/meshtun/test/cluster"
	"github.com/meshtun/meshtun/test/noderun"
)

// TestNodeTrafficIsAuthorized: a process of the node itself (a socket in
// the node's namespace, like a hostNetwork pod or a node daemon) is
// treated like plaintext from outside the mesh: refused by a STRICT
// workload and by an ALLOW policy that names identities, admitted where a
// policy allows the node's address, and served directly on the ports a
// workload declares for probes. And a passthrough destination sees the
// pod's own address and port, not the node's.
//
//	n1p1 STRICT, probe port 7101
//	n1p2 PERMISSIVE, ALLOW from n1p3's identity, or from the node's
//	     addresses to port 7104
//	n1p3 mesh client
func TestNodeTrafficIsAuthorized(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "advnode", Nodes: 1, PodsPerNode: 3, Control: true})
	n1 := c.Nodes[0]
	strict, guarded, client, ext := n1.Pods[0], n1.Pods[1], n1.Pods[2], c.External
	m := noderun.Mesh{
		Pods: map[string]noderun.Pod{
			"n1p1": {Strict: true, ProbePorts: []uint16{7101}},
			"n1p2": {Labels: map[string]string{"app": "guarded"}},
		},
		Extra: fmt.Sprintf(`authorizationPolicies:
  - name: guarded-from-client
    namespace: default
    selector: {app: guarded}
    action: ALLOW
    rules:
      - from: [{principals: [cluster.local/ns/default/sa/n1p3]}]
      - from: [{ipBlocks: [%s/32, %s/32, "%s/128", "%s/128"]}]
        to: [{ports: [7104]}]
`, n1.IPv4, n1.Gateway4, n1.IPv6, n1.Gateway6),
	}
	mt := startWithConfig(t, n1, writeConfig(t, c, m))

	echoSrv := func(c net.Conn) { io.Copy(c, c) }
	// refused asserts that a connection from the node to dst is refused
	// (a reset to its SYN) and that the server never saw it.
	refused := func(t *testing.T, s *server, dst netip.AddrPort) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		cl, err := n1.Dial(ctx, "tcp", dst.String())
		if err == nil {
			cl.Close()
			t.Fatalf("node → %s: connected; want refused", dst)
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("node → %s: %v, want connection refused", dst, err)
		}
		select {
		case p := <-s.peers:
			t.Fatalf("the workload received a connection from %s", p)
		default:
		}
		if _, err := mt.WaitLog(ctx, func(l noderun.Line) bool {
			return l.Str("message") == "connection refused" && l.Str("dst.addr") == dst.String() && l.Str("route") == "plaintext"
		}); err != nil {
			t.Fatalf("no access log of the refusal of node → %s: %v", dst, err)
		}
	}

	for _, v6 := range []bool{false, true} {
		family, addr := "IPv4", func(p *cluster.Pod) netip.Addr { return p.IPv4 }
		if v6 {
			family, addr = "IPv6", func(p *cluster.Pod) netip.Addr { return p.IPv6 }
		}
		port := func(base int) int {
			if v6 {
				return base + 100
			}
			return base
		}
		t.Run(family+" node to a STRICT workload is refused", func(t *testing.T) {
			s := serve(t, strict, port(7102), echoSrv)
			refused(t, s, netip.AddrPortFrom(addr(strict), uint16(port(7102))))
		})
		t.Run(family+" node to a PERMISSIVE workload an identity policy protects is refused", func(t *testing.T) {
			s := serve(t, guarded, port(7103), echoSrv)
			refused(t, s, netip.AddrPortFrom(addr(guarded), uint16(port(7103))))
			// The identity the policy names gets through (same node).
			cl := dial(t, client.NS, addr(guarded), port(7103))
			echo(t, cl)
			if p := s.peer(t); p.Addr() != addr(client) {
				t.Fatalf("workload saw %s, want the client %s", p, addr(client))
			}
		})
	}
	t.Run("node to a STRICT workload's probe port is served directly", func(t *testing.T) {
		s := serve(t, strict, 7101, echoSrv)
		for _, a := range []netip.Addr{strict.IPv4, strict.IPv6} {
			cl := dial(t, n1.NS, a, 7101)
			echo(t, cl)
			if peer, local := s.peer(t), localAddr(cl); peer != local {
				t.Fatalf("workload saw %s, the node's socket is %s: the probe was proxied", peer, local)
			}
		}
		// From anywhere else the probe port is an ordinary STRICT port.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if cl, err := ext.Dial(ctx, "tcp", netip.AddrPortFrom(strict.IPv4, 7101).String()); err == nil {
			cl.Close()
			t.Fatal("external host → the STRICT workload's probe port: connected; want refused")
		}
	})
	t.Run("node to a port a policy opens to the node's address is authorized and delivered", func(t *testing.T) {
		s := serve(t, guarded, 7104, echoSrv)
		for _, a := range []netip.Addr{guarded.IPv4, guarded.IPv6} {
			cl := dial(t, n1.NS, a, 7104)
			echo(t, cl)
			// Proxied (a kernel socket of the proxy, marked so that it is
			// not captured again): the node's address, another port.
			if peer, local := s.peer(t), localAddr(cl); peer.Addr() != local.Addr() || peer == local {
				t.Fatalf("workload saw %s, the node's socket is %s: want the node's address from the proxy's own socket", peer, local)
			}
			cl.Close()
			wantFields(t, accessLog(t, mt, cl, "connection complete"), "route", "plaintext", "direction", "inbound")
		}
	})
	t.Run("a pod reaches a server of the node (its replies cross the TUN verbatim)", func(t *testing.T) {
		s := serve(t, n1.NS, 7107, echoSrv)
		for _, a := range []netip.Addr{n1.Gateway4, n1.Gateway6} {
			cl := dial(t, client.NS, a, 7107)
			echo(t, cl)
			if peer, local := s.peer(t), localAddr(cl); peer != local {
				t.Fatalf("node saw %s, want the pod's own %s", peer, local)
			}
		}
	})
	t.Run("passthrough destination sees the pod's own address and port", func(t *testing.T) {
		s := serve(t, ext, 7105, exchangeServer(4<<20))
		for _, a := range []netip.Addr{ext.IPv4, ext.IPv6} {
			cl := dial(t, client.NS, a, 7105)
			exchange(t, cl, 4<<20)
			if peer, local := s.peer(t), localAddr(cl); peer != local {
				t.Fatalf("external host saw %s, want the pod's own %s", peer, local)
			}
			cl.Close()
			wantFields(t, accessLog(t, mt, cl, "connection complete"), "route", "passthrough")
		}
		// A closed port is refused as it would be without meshtun.
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if cl, err := client.Dial(ctx, "tcp", netip.AddrPortFrom(ext.IPv4, 7106).String()); !errors.Is(err, syscall.ECONNREFUSED) {
			if err == nil {
				cl.Close()
			}
			t.Fatalf("pod → a closed port of the external host: %v, want connection refused", err)
		}
	})
}
