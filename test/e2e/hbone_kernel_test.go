package e2e

import (
	"context"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshtun/meshtun/bench/noderun"
	"github.com/meshtun/meshtun/mesh/node"
)

// TestInboundHBONESocket checks which socket terminates inbound HBONE: by
// default a kernel socket of the destination node (the node's netstack
// never sees a port-15008 flow, and the node has an established kernel
// socket whose local address is the pod's port 15008), with the fallback
// flag the netstack; in both, mesh traffic arrives byte-exact from the
// client's own address, over IPv4 and IPv6, and a pod's own server on
// port 15008 is reached through the mesh as before.
func TestInboundHBONESocket(t *testing.T) {
	mc := newMeshCluster(t, "hk")
	p11, p21 := mc.p11, mc.p21
	mc.m1 = mc.start(t, mc.n1)

	// kernelSockets returns the local addresses of node 2's established
	// TCP sockets whose local port is 15008.
	kernelSockets := func(t *testing.T) []netip.AddrPort {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		out, err := mc.n2.NS.Command(ctx, "ss", "-Htn", "state", "established", "( sport = :15008 )").CombinedOutput()
		if err != nil {
			t.Fatalf("ss in %s: %v: %s", mc.n2.Name(), err, out)
		}
		var locals []netip.AddrPort
		for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
			f := strings.Fields(line)
			if len(f) < 4 {
				continue
			}
			a, err := netip.ParseAddrPort(f[2])
			if err != nil {
				t.Fatalf("ss line %q: %v", line, err)
			}
			locals = append(locals, netip.AddrPortFrom(a.Addr().Unmap(), a.Port()))
		}
		return locals
	}
	hboneAccepted := func(t *testing.T, socket string) float64 {
		return value(scrape(t, mc.n2), "meshtun_hbone_inbound_connections_total", map[string]string{"socket": socket})
	}
	traffic := func(t *testing.T, m2 nodeProc, port int) {
		t.Helper()
		for i, dst := range []netip.Addr{p21.IPv4, p21.IPv6} {
			s := serve(t, p21, port+i, exchangeServer(4<<20))
			cl := dial(t, p11.NS, dst, port+i)
			exchange(t, cl, 4<<20)
			if peer, local := s.peer(t), localAddr(cl); peer != local {
				t.Errorf("server saw %s, want the client's own address %s", peer, local)
			}
			cl.Close()
			wantFields(t, accessLog(t, m2, cl, "connection complete"), "route", "hbone", "direction", "inbound", "src.identity", id("n1p1"))
		}
		// The pod's own server on port 15008, reached by a mesh client:
		// the tunnel's target is the pod's 15008, which the node dials
		// through the netstack (the TUN's packets skip local delivery).
		own := serve(t, p21, 15008, func(c net.Conn) { io.Copy(c, c) })
		cl := dial(t, p11.NS, p21.IPv4, 15008)
		echo(t, cl)
		cl.Close()
		own.ln.Close()
		own.wg.Wait() // the pod's end closed too: nothing left to drain
	}
	ready := func(t *testing.T, m nodeProc) noderun.Line {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		l, err := m.WaitLog(ctx, func(l noderun.Line) bool { return l.Str("message") == node.ReadyMessage })
		if err != nil {
			t.Fatal(err)
		}
		return l
	}

	t.Run("kernel socket", func(t *testing.T) {
		m2 := mc.start(t, mc.n2)
		if got := ready(t, m2).Str("hbone_inbound"); got != "kernel" {
			t.Fatalf("node 2 terminates inbound HBONE on %q, want kernel", got)
		}
		traffic(t, m2, 7101)
		socks := kernelSockets(t)
		for _, a := range []netip.Addr{p21.IPv4, p21.IPv6} {
			if local := netip.AddrPortFrom(a, 15008); !slices.Contains(socks, local) {
				t.Errorf("node 2 has no established kernel socket at %s: %v", local, socks)
			}
		}
		if k, ns := hboneAccepted(t, "kernel"), hboneAccepted(t, "netstack"); k < 2 || ns != 0 {
			t.Errorf("node 2 accepted %v HBONE connections on kernel sockets and %v on the netstack; want ≥ 2 and 0", k, ns)
		}

		// The listener also holds port 15008 of the node's own addresses:
		// a connection there is reset before any TLS byte, and logged.
		// (The reset may come before connect returns.)
		mark := m2.Len()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		nodeAddr := netip.AddrPortFrom(mc.n2.IPv4, 15008)
		c, err := mc.ext.Dial(ctx, "tcp", nodeAddr.String())
		if err == nil {
			c.SetDeadline(time.Now().Add(10 * time.Second))
			_, err = c.Read(make([]byte, 1))
			c.Close()
		}
		if !isReset(err) {
			t.Errorf("a connection to node 2's own %s read %v, want a reset", nodeAddr, err)
		}
		if _, err := m2.WaitLogSince(ctx, mark, func(l noderun.Line) bool {
			return l.Str("message") == "connection refused" && l.Str("dst.addr") == nodeAddr.String() &&
				strings.HasPrefix(l.Str("src.addr"), mc.ext.IPv4.String()+":")
		}); err != nil {
			t.Errorf("node 2 logged no refusal of the connection to %s: %v", nodeAddr, err)
		}

		if err := m2.stop(syscall.SIGTERM); err != nil {
			t.Errorf("node 2 exit: %v", err)
		}
	})
	t.Run("netstack fallback", func(t *testing.T) {
		m2 := mc.start(t, mc.n2, "--hbone-netstack")
		if got := ready(t, m2).Str("hbone_inbound"); got != "netstack" {
			t.Fatalf("node 2 terminates inbound HBONE on %q, want netstack", got)
		}
		traffic(t, m2, 7111)
		if socks := kernelSockets(t); len(socks) > 0 {
			t.Errorf("node 2 has established kernel sockets on port 15008: %v", socks)
		}
		if k, ns := hboneAccepted(t, "kernel"), hboneAccepted(t, "netstack"); k != 0 || ns < 2 {
			t.Errorf("node 2 accepted %v HBONE connections on kernel sockets and %v on the netstack; want 0 and ≥ 2", k, ns)
		}
		if err := m2.stop(syscall.SIGTERM); err != nil {
			t.Errorf("node 2 exit: %v", err)
		}
	})
}
