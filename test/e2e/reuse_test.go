package e2e

import (
	"context"
	"errors"
	"io"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/bench/cluster"
)

// dialFrom dials dst from src (a fixed address and port) in ns, the way a
// client that reuses its port does: SO_REUSEADDR, and retried while the
// client's own kernel still refuses the tuple (EADDRNOTAVAIL: it has a
// socket for it that it will not reuse yet). The retry waits on the
// kernel, the only one who knows when.
//
// A refusal (a reset) is retried a few times within about 100 ms, and no
// longer: a SYN that reaches node 1's netstack before it has processed the
// client's final ACK of the previous connection is queued on the closing
// endpoint, and gVisor answers segments left on a closed endpoint with a
// reset unless another registered endpoint matches; it never offers them
// to the TCP forwarder (see
// docs/decisions/2026-11-29-port-reuse.md). A proxy that refuses the tuple for longer, as a netstack TIME_WAIT
// of 60 s did, still fails the test.
func dialFrom(t testing.TB, ns *cluster.NS, src, dst netip.AddrPort) (net.Conn, error) {
	t.Helper()
	d := net.Dialer{
		LocalAddr: net.TCPAddrFromAddrPort(src),
		Control: func(_, _ string, rc syscall.RawConn) error {
			var serr error
			if err := rc.Control(func(fd uintptr) {
				serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_REUSEADDR, 1)
			}); err != nil {
				return err
			}
			return serr
		},
	}
	deadline := time.Now().Add(10 * time.Second)
	refusals := 0
	for {
		var c net.Conn
		err := ns.Do(func() error {
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer cancel()
			var err error
			c, err = d.DialContext(ctx, "tcp", dst.String())
			return err
		})
		switch {
		case errors.Is(err, unix.ECONNREFUSED) && refusals < 5:
			refusals++
		case !errors.Is(err, unix.EADDRNOTAVAIL) || time.Now().After(deadline):
			return c, err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestClientReusesItsPort: a client may open a new connection from the
// same address and port to the same server as soon as its own kernel
// allows, and the proxies must carry it, although their netstacks saw the
// previous connection with that tuple close moments ago (and, as the side
// that sent the first FIN towards one of the pods, hold it in TIME_WAIT).
// Both orders of closing are covered: client first (node 2's netstack
// holds the tuple towards the server) and server first (node 1's
// netstack holds it towards the client).
func TestClientReusesItsPort(t *testing.T) {
	mc := newMeshCluster(t, "reuse")
	mc.m1 = mc.start(t, mc.n1)
	mc.m2 = mc.start(t, mc.n2)
	p11, p21 := mc.p11, mc.p21
	// The client's kernel may reuse a tuple in TIME_WAIT after a second,
	// as busy Linux clients are commonly configured to.
	if err := p11.NS.SetSysctl("net.ipv4.tcp_tw_reuse", "1"); err != nil {
		t.Fatal(err)
	}
	const port = 7060
	serve(t, p21, port, func(c net.Conn) {
		buf := make([]byte, 5)
		if _, err := io.ReadFull(c, buf); err != nil {
			return
		}
		c.Write(buf)
		if string(buf) == "quit!" { // server closes first
			return
		}
		io.Copy(io.Discard, c) // client closes first: wait for its FIN
	})
	src := netip.AddrPortFrom(p11.IPv4, 41234)
	dst := netip.AddrPortFrom(p21.IPv4, port)
	round := func(t *testing.T, msg string, clientFirst bool) {
		t.Helper()
		c, err := dialFrom(t, p11.NS, src, dst)
		if err != nil {
			t.Fatalf("dial %s from %s: %v", dst, src, err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Write([]byte(msg)); err != nil {
			t.Fatal(err)
		}
		buf := make([]byte, 5)
		if _, err := io.ReadFull(c, buf); err != nil || string(buf) != msg {
			t.Fatalf("echo: %q, %v", buf, err)
		}
		if clientFirst {
			c.(*net.TCPConn).CloseWrite()
		}
		if n, err := c.Read(buf); n != 0 || err != io.EOF {
			t.Fatalf("end of connection: %d bytes, %v; want EOF", n, err)
		}
	}
	t.Run("client closes first", func(t *testing.T) {
		round(t, "hello", true)
		round(t, "again", true)
		round(t, "third", true)
	})
	t.Run("server closes first", func(t *testing.T) {
		round(t, "quit!", false)
		round(t, "quit!", false)
	})
}
