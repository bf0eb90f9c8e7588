package e2e

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/test/cluster"
)

const bulk = 64 << 20 // bytes each way in the byte-exact transfers

func dial(t testing.TB, ns *cluster.NS, addr netip.Addr, port int) net.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := ns.Dial(ctx, "tcp", netip.AddrPortFrom(addr, uint16(port)).String())
	if err != nil {
		t.Fatalf("dial %s:%d from %s: %v", addr, port, ns.Name(), err)
	}
	t.Cleanup(func() { c.Close() })
	return c
}

// TestDataPath runs meshtun on both nodes of a two-node cluster, every pod
// captured, and checks each kind of traffic end to end; then that stopping
// meshtun (also after a SIGKILL and restart) leaves routing as it was.
func TestDataPath(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "dp", Nodes: 2, PodsPerNode: 2})
	n1, n2 := c.Nodes[0], c.Nodes[1]
	p11, p12, p21 := n1.Pods[0], n1.Pods[1], n2.Pods[0]
	ext := c.External

	before := map[*cluster.Node]routing{}
	for _, n := range c.Nodes {
		before[n] = snapshot(t, n)
	}

	m1 := startNode(t, n1)
	m2 := startNode(t, n2)
	_ = m2

	// intercepted asserts that a connection went through the proxy: the
	// server saw a peer other than the client's own socket address.
	intercepted := func(t *testing.T, s *server, client net.Conn, wantPeer netip.Addr) {
		t.Helper()
		peer := s.peer(t)
		local := client.LocalAddr().(*net.TCPAddr).AddrPort()
		if peer == local {
			t.Fatalf("server saw %s, the client's own address: the connection was not intercepted", peer)
		}
		if peer.Addr() != wantPeer {
			t.Fatalf("server saw peer %s, want a connection from %s (the proxy's kernel socket)", peer, wantPeer)
		}
	}

	t.Run("TCP cross-node 64MiB both ways", func(t *testing.T) {
		s := serve(t, p21, 7001, exchangeServer(bulk))
		cl := dial(t, p11.NS, p21.IPv4, 7001)
		intercepted(t, s, cl, n1.IPv4)
		exchange(t, cl, bulk)
	})
	t.Run("TCP same-node 64MiB both ways", func(t *testing.T) {
		s := serve(t, p12, 7002, exchangeServer(bulk))
		cl := dial(t, p11.NS, p12.IPv4, 7002)
		peer := s.peer(t)
		if peer == cl.LocalAddr().(*net.TCPAddr).AddrPort() {
			t.Fatalf("server saw the client's own address %s: not intercepted", peer)
		}
		exchange(t, cl, bulk)
	})
	t.Run("IPv6 TCP cross-node", func(t *testing.T) {
		s := serve(t, p21, 7003, exchangeServer(8<<20))
		cl := dial(t, p11.NS, p21.IPv6, 7003)
		intercepted(t, s, cl, n1.IPv6)
		exchange(t, cl, 8<<20)
	})
	t.Run("server-first protocol", func(t *testing.T) {
		banner := []byte("220 meshtun-e2e ESMTP ready\r\n")
		s := serve(t, p21, 7004, func(c net.Conn) {
			c.Write(banner)
			io.Copy(c, c) // then echo
		})
		cl := dial(t, p11.NS, p21.IPv4, 7004)
		intercepted(t, s, cl, n1.IPv4)
		cl.SetReadDeadline(time.Now().Add(10 * time.Second))
		got := make([]byte, len(banner))
		if _, err := io.ReadFull(cl, got); err != nil {
			t.Fatalf("read banner before sending anything: %v", err)
		}
		if !bytes.Equal(got, banner) {
			t.Fatalf("banner %q, want %q", got, banner)
		}
	})
	t.Run("half-close", func(t *testing.T) {
		// The server answers only after the client's FIN, and the
		// client's read side must stay open until then.
		s := serve(t, p21, 7005, func(c net.Conn) {
			req, err := io.ReadAll(c)
			if err != nil {
				return
			}
			c.Write(append([]byte("got: "), req...))
		})
		cl := dial(t, p11.NS, p21.IPv4, 7005)
		intercepted(t, s, cl, n1.IPv4)
		cl.Write([]byte("question"))
		if err := cl.(*net.TCPConn).CloseWrite(); err != nil {
			t.Fatal(err)
		}
		cl.SetReadDeadline(time.Now().Add(10 * time.Second))
		got, err := io.ReadAll(cl)
		if err != nil {
			t.Fatalf("read after half-close: %v", err)
		}
		if string(got) != "got: question" {
			t.Fatalf("reply %q, want %q", got, "got: question")
		}
	})
	t.Run("reset from server becomes reset at client", func(t *testing.T) {
		s := serve(t, p21, 7006, func(c net.Conn) {
			buf := make([]byte, 5)
			io.ReadFull(c, buf)
			c.(*net.TCPConn).SetLinger(0)
			c.Close() // RST
		})
		cl := dial(t, p11.NS, p21.IPv4, 7006)
		intercepted(t, s, cl, n1.IPv4)
		cl.Write([]byte("hello"))
		cl.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err := cl.Read(make([]byte, 10))
		if !isReset(err) {
			t.Fatalf("client read after server reset: %v, want connection reset (not EOF)", err)
		}
	})
	t.Run("reset from client becomes reset at server", func(t *testing.T) {
		got := make(chan error, 1)
		s := serve(t, p21, 7007, func(c net.Conn) {
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			_, err := io.ReadAll(c)
			got <- err
		})
		cl := dial(t, p11.NS, p21.IPv4, 7007)
		intercepted(t, s, cl, n1.IPv4)
		cl.Write([]byte("x"))
		cl.(*net.TCPConn).SetLinger(0)
		cl.Close()
		if err := <-got; !isReset(err) {
			t.Fatalf("server read after client reset: %v, want connection reset (not EOF)", err)
		}
	})
	t.Run("refused port is a reset", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := p11.Dial(ctx, "tcp", netip.AddrPortFrom(p21.IPv4, 7999).String())
		if err == nil || !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("dial a closed port: %v, want connection refused", err)
		}
	})
	t.Run("pod to external host", func(t *testing.T) {
		s := serve(t, ext, 7008, exchangeServer(4<<20))
		cl := dial(t, p11.NS, ext.IPv4, 7008)
		intercepted(t, s, cl, n1.IPv4)
		exchange(t, cl, 4<<20)
	})
	t.Run("probe from node to pod is not intercepted", func(t *testing.T) {
		s := serve(t, p11, 7009, func(c net.Conn) { io.Copy(c, c) })
		cl := dial(t, n1.NS, p11.IPv4, 7009)
		if peer, local := s.peer(t), cl.LocalAddr().(*net.TCPAddr).AddrPort(); peer != local {
			t.Fatalf("pod saw %s, the node's socket is %s: the probe was proxied", peer, local)
		}
		echo(t, cl)
	})
	t.Run("UDP request/response", func(t *testing.T) {
		udpEcho(t, p11.NS, p11.IPv4, p21.NS, p21.IPv4, 9001)
		udpEcho(t, p11.NS, p11.IPv6, p21.NS, p21.IPv6, 9003)
	})
	t.Run("UDP burst of 10000 datagrams", func(t *testing.T) {
		udpBurst(t, p11.NS, p21.NS, p21.IPv4, 10000)
	})
	t.Run("ICMP echo", func(t *testing.T) {
		ping(t, p11.NS, p21.IPv4)
		ping(t, p11.NS, p21.IPv6)
	})
	t.Run("unknown IP protocol 253 arrives byte-identical", func(t *testing.T) {
		rawProto(t, p11.NS, p21.NS, p11.IPv4, p21.IPv4)
	})

	// Stop both proxies: routing must be exactly as before.
	for _, m := range []nodeProc{m1, m2} {
		if err := m.stop(syscall.SIGTERM); err != nil {
			t.Errorf("meshtun exit after SIGTERM: %v\n%s", err, m.dump())
		}
	}
	for _, n := range c.Nodes {
		assertSnapshot(t, n, before[n], "after SIGTERM")
	}

	t.Run("restart after SIGKILL cleans up and serves", func(t *testing.T) {
		k := startNode(t, n1)
		k.stop(syscall.SIGKILL)
		if s := snapshot(t, n1); s.Equal(before[n1]) {
			t.Fatalf("after SIGKILL the rules are gone already; the test cannot tell whether the restart cleans up")
		}
		r := startNode(t, n1)
		s := serve(t, p21, 7010, exchangeServer(1<<20))
		cl := dial(t, p11.NS, p21.IPv4, 7010)
		intercepted(t, s, cl, n1.IPv4)
		exchange(t, cl, 1<<20)
		if err := r.stop(syscall.SIGTERM); err != nil {
			t.Fatalf("meshtun exit: %v", err)
		}
		assertSnapshot(t, n1, before[n1], "after SIGKILL, restart and SIGTERM")
	})
}

func echo(t testing.TB, c net.Conn) {
	t.Helper()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	msg := []byte("ping through the mesh")
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("echo: %q, %v", got, err)
	}
}

// routing is a node's policy rules and routes of every table, IPv4 and
// IPv6, as text.
type routing []string

func (r routing) Equal(o routing) bool { return slices.Equal(r, o) }

// Diff lists the lines only in r (-) and only in o (+).
func (r routing) Diff(o routing) string {
	var b strings.Builder
	for _, l := range r {
		if !slices.Contains(o, l) {
			b.WriteString("- " + l + "\n")
		}
	}
	for _, l := range o {
		if !slices.Contains(r, l) {
			b.WriteString("+ " + l + "\n")
		}
	}
	return b.String()
}

func snapshot(t testing.TB, n *cluster.Node) routing {
	t.Helper()
	var out routing
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		rules, err := n.IPRules(fam)
		if err != nil {
			t.Fatalf("snapshot rules of %s: %v", n.Name(), err)
		}
		routes, err := n.Routes(fam, 0)
		if err != nil {
			t.Fatalf("snapshot routes of %s: %v", n.Name(), err)
		}
		for _, r := range rules {
			out = append(out, "rule "+r)
		}
		for _, r := range routes {
			out = append(out, "route "+r)
		}
	}
	return out
}

func assertSnapshot(t testing.TB, n *cluster.Node, want routing, when string) {
	t.Helper()
	got := snapshot(t, n)
	if !got.Equal(want) {
		t.Errorf("%s: routing of %s differs from before meshtun started:\n%s", when, n.Name(), want.Diff(got))
	}
}
