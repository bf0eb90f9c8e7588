package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
	"github.com/meshtun/meshtun/mesh/proxy"
	"github.com/meshtun/meshtun/protocols/hbone"
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

// meshCluster is the cluster most end-to-end tests share: two nodes of
// three pods and the external host, meshtun on both nodes.
//
//	node 1: n1p1 mesh client, n1p2 mesh (same-node target), n1p3 outside the mesh
//	node 2: n2p1 mesh server, n2p2 outside the mesh, n2p3 mesh STRICT
type meshCluster struct {
	c                  *cluster.Cluster
	n1, n2             *cluster.Node
	p11, p12, p13      *cluster.Pod
	p21, p22, p23      *cluster.Pod
	ext                *cluster.Host
	m1, m2             nodeProc
	outside, strictSet map[string]bool
}

func newMeshCluster(t testing.TB, name string) *meshCluster {
	c := cluster.NewT(t, cluster.Spec{Name: name, Nodes: 2, PodsPerNode: 3, Control: true})
	mc := &meshCluster{
		c: c, n1: c.Nodes[0], n2: c.Nodes[1],
		p11: c.Nodes[0].Pods[0], p12: c.Nodes[0].Pods[1], p13: c.Nodes[0].Pods[2],
		p21: c.Nodes[1].Pods[0], p22: c.Nodes[1].Pods[1], p23: c.Nodes[1].Pods[2],
		ext:       c.External,
		outside:   map[string]bool{"n1p3": true, "n2p2": true},
		strictSet: map[string]bool{"n2p3": true},
	}
	return mc
}

func (mc *meshCluster) start(t testing.TB, n *cluster.Node, extra ...string) nodeProc {
	return startMeshNode(t, mc.c, n, mc.outside, mc.strictSet, extra...)
}

// accessLog waits for node m's access-log line (message) of the
// connection from client to its peer (the client's view of both ends).
func accessLog(t testing.TB, m nodeProc, client net.Conn, message string) noderun.Line {
	t.Helper()
	src, dst := localAddr(client), remoteAddr(client)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := m.WaitLog(ctx, func(l noderun.Line) bool {
		return l.Str("message") == message && l.Str("src.addr") == src.String() && l.Str("dst.addr") == dst.String()
	})
	if err != nil {
		t.Fatalf("no %q access log for %s → %s on %s: %v", message, src, dst, m.Node.Name(), err)
	}
	return l
}

// sameTrace checks that one connection's access-log lines on the
// client's node (out) and the server's (in) carry the same W3C trace id,
// sent in the CONNECT's traceparent, and that the server's node received
// the source's baggage with ztunnel's keys (its debug line of the
// request). The nodes' config gives the pods no owner or app label: the
// workload is k8s.pod.name and the canonical service falls back to the
// pod's name, the revision to "latest".
func sameTrace(t testing.TB, in nodeProc, outLine, inLine noderun.Line, srcPod string) {
	t.Helper()
	trace := outLine.Str("trace_id")
	if len(trace) != 32 || strings.Trim(trace, "0123456789abcdef") != "" {
		t.Fatalf("outbound access log trace_id %q: want 32 lowercase hex digits (line %v)", trace, outLine)
	}
	if got := inLine.Str("trace_id"); got != trace {
		t.Errorf("inbound access log trace_id %q, want the outbound side's %q", got, trace)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := in.WaitLog(ctx, func(l noderun.Line) bool {
		return l.Str("message") == proxy.InboundRequestMessage && l.Str("trace_id") == trace
	})
	if err != nil {
		t.Fatalf("no %q line with trace_id %s on %s: %v", proxy.InboundRequestMessage, trace, in.Node.Name(), err)
	}
	if tp := req.Str("traceparent"); !strings.HasPrefix(tp, "00-"+trace+"-") {
		t.Errorf("traceparent received %q, want version 00 with trace id %s", tp, trace)
	}
	b, err := hbone.ParseBaggage(req.Str("baggage"))
	if err != nil {
		t.Fatalf("baggage received %q: %v", req.Str("baggage"), err)
	}
	want := hbone.Baggage{"k8s.namespace.name": "default", "k8s.pod.name": srcPod, "service.name": srcPod, "service.version": "latest"}
	if !maps.Equal(b, want) {
		t.Errorf("baggage received %v, want %v", b, want)
	}
}

func localAddr(c net.Conn) netip.AddrPort {
	a := c.LocalAddr().(*net.TCPAddr).AddrPort()
	return netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
}

func remoteAddr(c net.Conn) netip.AddrPort {
	a := c.RemoteAddr().(*net.TCPAddr).AddrPort()
	return netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
}

func wantFields(t testing.TB, l noderun.Line, kv ...string) {
	t.Helper()
	for i := 0; i+1 < len(kv); i += 2 {
		if got := l.Str(kv[i]); got != kv[i+1] {
			t.Errorf("access log %s = %q, want %q (line %v)", kv[i], got, kv[i+1], l)
		}
	}
}

func id(pod string) string { return "spiffe://cluster.local/ns/default/sa/" + pod }

// TestDataPath runs meshtun on both nodes, every pod captured, and checks
// each kind of traffic end to end; then that stopping meshtun (also after
// a SIGKILL and restart) leaves routing as it was.
func TestDataPath(t *testing.T) {
	mc := newMeshCluster(t, "dp")
	n1, n2 := mc.n1, mc.n2
	p11, p12, p21, p22, p23, ext := mc.p11, mc.p12, mc.p21, mc.p22, mc.p23, mc.ext

	before := map[*cluster.Node]routing{}
	for _, n := range mc.c.Nodes {
		before[n] = snapshot(t, n)
	}
	mc.m1 = mc.start(t, n1)
	mc.m2 = mc.start(t, n2)
	m1, m2 := mc.m1, mc.m2

	// mesh asserts that the connection from client travelled in an HBONE
	// tunnel from node 1 to node 2 and that the server saw the client's
	// own address: the application sees the real client.
	mesh := func(t *testing.T, s *server, client net.Conn, srcPod, dstPod string) {
		t.Helper()
		if peer, local := s.peer(t), localAddr(client); peer != local {
			t.Errorf("server saw %s, want the client's own address %s", peer, local)
		}
		client.Close()
		out := accessLog(t, m1, client, "connection complete")
		wantFields(t, out, "route", "hbone", "direction", "outbound", "src.identity", id(srcPod), "dst.identity", id(dstPod))
		in := accessLog(t, m2, client, "connection complete")
		wantFields(t, in, "route", "hbone", "direction", "inbound", "src.identity", id(srcPod))
		sameTrace(t, m2, out, in, srcPod)
	}
	// passthrough asserts that a connection went through node m's proxy
	// to a destination outside the mesh (its access log says so) and that
	// the destination saw the pod's own address and port.
	passthrough := func(t *testing.T, m nodeProc, s *server, client net.Conn) {
		t.Helper()
		if peer, local := s.peer(t), localAddr(client); peer != local {
			t.Fatalf("server saw peer %s, want the pod's own %s", peer, local)
		}
		client.Close()
		wantFields(t, accessLog(t, m, client, "connection complete"), "route", "passthrough")
	}

	t.Run("mesh TCP cross-node 64MiB both ways", func(t *testing.T) {
		s := serve(t, p21, 7001, exchangeServer(bulk))
		cl := dial(t, p11.NS, p21.IPv4, 7001)
		exchange(t, cl, bulk)
		mesh(t, s, cl, "n1p1", "n2p1")
	})
	t.Run("mesh TCP same-node 64MiB both ways", func(t *testing.T) {
		s := serve(t, p12, 7002, exchangeServer(bulk))
		cl := dial(t, p11.NS, p12.IPv4, 7002)
		exchange(t, cl, bulk)
		if peer := s.peer(t); peer.Addr() != p11.IPv4 {
			t.Errorf("server saw %s, want the client's address %s", peer, p11.IPv4)
		}
		cl.Close()
		l := accessLog(t, m1, cl, "connection complete")
		wantFields(t, l, "route", "local", "src.identity", id("n1p1"), "dst.identity", id("n1p2"))
	})
	t.Run("mesh IPv6 TCP cross-node", func(t *testing.T) {
		s := serve(t, p21, 7003, exchangeServer(8<<20))
		cl := dial(t, p11.NS, p21.IPv6, 7003)
		exchange(t, cl, 8<<20)
		mesh(t, s, cl, "n1p1", "n2p1")
	})
	t.Run("server-first protocol through the tunnel", func(t *testing.T) {
		banner := []byte("220 meshtun-e2e ESMTP ready\r\n")
		s := serve(t, p21, 7004, func(c net.Conn) {
			c.Write(banner)
			io.Copy(c, c) // then echo
		})
		cl := dial(t, p11.NS, p21.IPv4, 7004)
		cl.SetReadDeadline(time.Now().Add(10 * time.Second))
		got := make([]byte, len(banner))
		if _, err := io.ReadFull(cl, got); err != nil {
			t.Fatalf("read banner before sending anything: %v", err)
		}
		if !bytes.Equal(got, banner) {
			t.Fatalf("banner %q, want %q", got, banner)
		}
		mesh(t, s, cl, "n1p1", "n2p1")
	})
	t.Run("bytes that are not valid HTTP pass untouched", func(t *testing.T) {
		s := serve(t, p21, 7011, func(c net.Conn) { io.Copy(c, c) })
		cl := dial(t, p11.NS, p21.IPv4, 7011)
		for _, msg := range [][]byte{
			[]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"),
			[]byte("GET / HTTP/1.1\r\nHost: \x00\xff\r\n\r\n"),
			[]byte("CONNECT 198.18.2.11:15008 HTTP/1.1\r\n\r\n"),
			{0x16, 0x03, 0x01, 0x02, 0x00, 0x01}, // a TLS record header
		} {
			cl.SetDeadline(time.Now().Add(10 * time.Second))
			if _, err := cl.Write(msg); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, len(msg))
			if _, err := io.ReadFull(cl, got); err != nil || !bytes.Equal(got, msg) {
				t.Fatalf("echo of %q: %q, %v", msg, got, err)
			}
		}
		mesh(t, s, cl, "n1p1", "n2p1")
	})
	t.Run("half-close through the tunnel", func(t *testing.T) {
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
		mesh(t, s, cl, "n1p1", "n2p1")
	})
	t.Run("reset from server becomes reset at client", func(t *testing.T) {
		s := serve(t, p21, 7006, func(c net.Conn) {
			buf := make([]byte, 5)
			io.ReadFull(c, buf)
			c.(*net.TCPConn).SetLinger(0)
			c.Close() // RST
		})
		cl := dial(t, p11.NS, p21.IPv4, 7006)
		cl.Write([]byte("hello"))
		cl.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, err := cl.Read(make([]byte, 10))
		if !isReset(err) {
			t.Fatalf("client read after server reset: %v, want connection reset (not EOF)", err)
		}
		mesh(t, s, cl, "n1p1", "n2p1")
	})
	t.Run("reset from client becomes reset at server", func(t *testing.T) {
		got := make(chan error, 1)
		s := serve(t, p21, 7007, func(c net.Conn) {
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			_, err := io.ReadAll(c)
			got <- err
		})
		cl := dial(t, p11.NS, p21.IPv4, 7007)
		cl.Write([]byte("x"))
		s.peer(t)
		cl.(*net.TCPConn).SetLinger(0)
		cl.Close()
		if err := <-got; !isReset(err) {
			t.Fatalf("server read after client reset: %v, want connection reset (not EOF)", err)
		}
		wantFields(t, accessLog(t, m1, cl, "connection complete"), "route", "hbone", "error", "connection reset")
	})
	t.Run("refused port through the tunnel is a reset", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := p11.Dial(ctx, "tcp", netip.AddrPortFrom(p21.IPv4, 7999).String())
		if err == nil || !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("dial a closed port: %v, want connection refused", err)
		}
		// The refusal came back through the tunnel (a 503 from node 2).
		lctx, lcancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer lcancel()
		dst := netip.AddrPortFrom(p21.IPv4, 7999).String()
		if _, err := m1.WaitLog(lctx, func(l noderun.Line) bool {
			return l.Str("message") == "connection refused" && l.Str("dst.addr") == dst && l.Str("route") == "hbone"
		}); err != nil {
			t.Fatalf("node 1 logged no HBONE refusal for %s: %v", dst, err)
		}
	})
	t.Run("1000 concurrent tunnelled connections", func(t *testing.T) {
		serve(t, p21, 7012, func(c net.Conn) { io.Copy(c, c) })
		const n = 1000
		conns := make([]net.Conn, n)
		for i := range conns {
			conns[i] = dial(t, p11.NS, p21.IPv4, 7012)
		}
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for i, c := range conns {
			wg.Add(1)
			go func() {
				defer wg.Done()
				msg := []byte(fmt.Sprintf("connection %d of %d", i, n))
				c.SetDeadline(time.Now().Add(30 * time.Second))
				if _, err := c.Write(msg); err != nil {
					errs <- err
					return
				}
				got := make([]byte, len(msg))
				if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
					errs <- fmt.Errorf("connection %d: echo %q, %v", i, got, err)
				}
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			t.Error(err)
		}
		conns[n-1].Close()
		l := accessLog(t, m1, conns[n-1], "connection complete")
		wantFields(t, l, "route", "hbone")
	})
	t.Run("passthrough to a pod outside the mesh", func(t *testing.T) {
		s := serve(t, p22, 7013, exchangeServer(4<<20))
		cl := dial(t, p11.NS, p22.IPv4, 7013)
		exchange(t, cl, 4<<20)
		passthrough(t, m1, s, cl)
	})
	t.Run("passthrough to a pod outside the mesh on the same node", func(t *testing.T) {
		s := serve(t, mc.p13, 7016, exchangeServer(4<<20))
		cl := dial(t, p11.NS, mc.p13.IPv4, 7016)
		exchange(t, cl, 4<<20)
		passthrough(t, m1, s, cl)
	})
	t.Run("pod to external host", func(t *testing.T) {
		s := serve(t, ext, 7008, exchangeServer(4<<20))
		cl := dial(t, p11.NS, ext.IPv4, 7008)
		exchange(t, cl, 4<<20)
		passthrough(t, m1, s, cl)
	})
	t.Run("plaintext from outside the mesh to a PERMISSIVE workload", func(t *testing.T) {
		s := serve(t, p21, 7014, func(c net.Conn) { io.Copy(c, c) })
		cl := dial(t, p22.NS, p21.IPv4, 7014)
		echo(t, cl)
		if peer, local := s.peer(t), localAddr(cl); peer != local {
			t.Fatalf("server saw %s, want the client's own %s (delivered directly)", peer, local)
		}
	})
	t.Run("plaintext to a STRICT workload is refused", func(t *testing.T) {
		s := serve(t, p23, 7015, func(c net.Conn) { io.Copy(c, c) })
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := p22.Dial(ctx, "tcp", netip.AddrPortFrom(p23.IPv4, 7015).String())
		if err == nil {
			c.Close()
			t.Fatalf("plaintext connection to the STRICT workload succeeded")
		}
		if !errors.Is(err, syscall.ECONNREFUSED) {
			t.Fatalf("dial: %v, want connection refused", err)
		}
		select {
		case p := <-s.peers:
			t.Fatalf("the STRICT workload received a connection from %s", p)
		default:
		}
		// From a mesh workload, through HBONE, it is reachable.
		cl := dial(t, p11.NS, p23.IPv4, 7015)
		echo(t, cl)
		mesh(t, s, cl, "n1p1", "n2p3")
	})
	t.Run("probe from node to pod is not intercepted", func(t *testing.T) {
		s := serve(t, p11, 7009, func(c net.Conn) { io.Copy(c, c) })
		cl := dial(t, n1.NS, p11.IPv4, 7009)
		if peer, local := s.peer(t), localAddr(cl); peer != local {
			t.Fatalf("pod saw %s, the node's socket is %s: the probe was proxied", peer, local)
		}
		echo(t, cl)
	})
	// throughTUN runs traffic and checks that node 1 forwarded packets of
	// protocol verbatim meanwhile: the traffic crossed the TUN, not a
	// path around it.
	throughTUN := func(t *testing.T, protocol string, traffic func()) {
		t.Helper()
		labels := map[string]string{"verdict": "verbatim", "protocol": protocol}
		before := value(scrape(t, n1), "meshtun_packets_total", labels)
		traffic()
		if after := value(scrape(t, n1), "meshtun_packets_total", labels); after <= before {
			t.Fatalf("node 1 forwarded no %s packets verbatim (%v before, %v after)", protocol, before, after)
		}
	}
	t.Run("UDP request/response", func(t *testing.T) {
		throughTUN(t, "udp", func() {
			udpEcho(t, p11.NS, p11.IPv4, p21.NS, p21.IPv4, 9001)
			udpEcho(t, p11.NS, p11.IPv6, p21.NS, p21.IPv6, 9003)
		})
	})
	t.Run("a node is one hop, as without meshtun", func(t *testing.T) {
		throughTUN(t, "udp", func() {
			for _, dst := range []netip.Addr{p21.IPv4, p21.IPv6} {
				if hops := udpHops(t, p11.NS, p21.NS, dst, 9005); hops != 1 {
					t.Errorf("to %s: sent with 3 hops left, arrived with %d; want 1 (two nodes, one hop each)", dst, hops)
				}
			}
		})
	})
	t.Run("UDP burst of 10000 datagrams", func(t *testing.T) {
		throughTUN(t, "udp", func() { udpBurst(t, p11.NS, p21.NS, p21.IPv4, 10000) })
	})
	t.Run("ICMP echo", func(t *testing.T) {
		throughTUN(t, "icmp", func() {
			ping(t, p11.NS, p21.IPv4)
			ping(t, p11.NS, p21.IPv6)
		})
	})
	t.Run("unknown IP protocol 253 arrives byte-identical", func(t *testing.T) {
		throughTUN(t, "other", func() { rawProto(t, p11.NS, p21.NS, p11.IPv4, p21.IPv4, 2) })
	})
	t.Run("TCP fragments from a pod are dropped and counted", func(t *testing.T) {
		// The classifier cannot see a fragment's ports; passed on, the
		// receiving pod would reassemble a TCP segment that no proxy
		// saw. UDP fragments, the control, go on verbatim and are
		// reassembled by the pod.
		sn := sniff(t, mc.c.Fabric)
		dropped := map[string]string{"reason": "fragmented-tcp"}
		before := value(scrape(t, n1), "meshtun_classifier_drops_total", dropped)
		stamp := time.Now().UnixNano()
		tcpMarker := []byte(fmt.Sprintf("MESHTUN-TCP-FRAGMENT-%d", stamp))
		udpMarker := []byte(fmt.Sprintf("MESHTUN-UDP-FRAGMENT-%d", stamp))
		up := listenPacket(t, p21.NS, "udp4", ":9007")
		fragmentedTCP(t, p11.NS, netip.AddrPortFrom(p11.IPv4, 40007), netip.AddrPortFrom(p21.IPv4, 7009), tcpMarker)
		fragmentedUDP(t, p11.NS, netip.AddrPortFrom(p11.IPv4, 40008), netip.AddrPortFrom(p21.IPv4, 9007), udpMarker)
		up.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 1500)
		n, _, err := up.ReadFrom(buf)
		if err != nil || !bytes.Contains(buf[:n], udpMarker) {
			t.Fatalf("the fragmented UDP datagram (the control) did not reach the pod: %q, %v", buf[:n], err)
		}
		if !sn.waitSeen(udpMarker, 5*time.Second) {
			t.Fatalf("the UDP fragment never showed on the node-to-node link: the capture does not see the wire")
		}
		deadline := time.Now().Add(5 * time.Second)
		var after float64
		for {
			after = value(scrape(t, n1), "meshtun_classifier_drops_total", dropped)
			if after-before >= 2 || time.Now().After(deadline) {
				break
			}
			time.Sleep(50 * time.Millisecond)
		}
		if after-before != 2 {
			t.Errorf("meshtun_classifier_drops_total{reason=fragmented-tcp} on node 1 grew by %v, want 2 (both fragments)", after-before)
		}
		if sn.seen(tcpMarker) {
			t.Errorf("a TCP fragment crossed the node-to-node link")
		}
	})

	// Stop both proxies: the rules stay (the pods' traffic is blocked
	// while no proxy runs); uninstalling leaves routing exactly as before.
	for _, m := range []nodeProc{m1, m2} {
		if err := m.stop(syscall.SIGTERM); err != nil {
			t.Errorf("meshtun exit after SIGTERM: %v\n%s", err, m.dump())
		}
	}
	for _, n := range mc.c.Nodes {
		if s := snapshot(t, n); s.Equal(before[n]) {
			t.Errorf("after SIGTERM the routing of %s is as before meshtun: nothing blocks its pods' traffic", n.Name())
		}
		uninstall(t, n)
		assertSnapshot(t, n, before[n], "after SIGTERM and uninstall")
	}

	t.Run("restart after SIGKILL cleans up and serves", func(t *testing.T) {
		k := mc.start(t, n1)
		k.stop(syscall.SIGKILL)
		if s := snapshot(t, n1); s.Equal(before[n1]) {
			t.Fatalf("after SIGKILL the rules are gone already; the test cannot tell whether the restart cleans up")
		}
		r := mc.start(t, n1)
		s := serve(t, ext, 7010, exchangeServer(1<<20))
		cl := dial(t, p11.NS, ext.IPv4, 7010)
		exchange(t, cl, 1<<20)
		passthrough(t, r, s, cl)
		if err := r.stop(syscall.SIGTERM); err != nil {
			t.Fatalf("meshtun exit: %v", err)
		}
		uninstall(t, n1)
		assertSnapshot(t, n1, before[n1], "after SIGKILL, restart, SIGTERM and uninstall")
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
