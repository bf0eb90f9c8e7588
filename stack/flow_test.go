package stack

import (
	"net/netip"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/meshtun/meshtun/stack/classify"
	"github.com/meshtun/meshtun/tun"
)

// TestFlowEndsWithTheEndpoint: the flow of an accepted connection lives as
// long as the netstack's connection, however long it is idle, and a
// segment of it after the netstack let go is answered with a RST, not
// forwarded verbatim: a connection between mesh workloads never continues
// in the clear (after an idle period, a restart, or a spoofed RST).
func TestFlowEndsWithTheEndpoint(t *testing.T) {
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			dev := newFakeDev(0)
			conns := make(chan *Conn, 1)
			// Both ends are "mesh workloads": intercepted whichever
			// side opens the connection.
			cls := classify.New(classify.Config{
				Policy:       classify.PolicyFunc(func(_, _ netip.AddrPort) bool { return true }),
				IdleTimeout:  time.Minute,
				CloseTimeout: time.Second,
			})
			st, err := newStarted(startedConfig{Device: dev, Classifier: cls, Logger: zerolog.Nop(), HandleTCP: func(req *TCPRequest) {
				c, err := req.Accept()
				if err != nil {
					t.Error(err)
					return
				}
				conns <- c
			}})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { dev.close(); st.Close() }()

			c, seq, ack := handshake(t, dev, conns, fam.src, fam.dst)
			// A day of idleness: the flow stays, it is the netstack's.
			if n := cls.Sweep(time.Now().Add(24 * time.Hour)); n != 0 || cls.Len() != 1 {
				t.Fatalf("sweep removed %d flows of a live connection (%d left)", n, cls.Len())
			}
			dev.send(t, tun.VnetHdr{}, seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck | header.TCPFlagPsh, payload: []byte("hello")}.build())
			buf := make([]byte, 5)
			c.SetReadDeadline(time.Now().Add(5 * time.Second))
			if _, err := c.Read(buf); err != nil || string(buf) != "hello" {
				t.Fatalf("read %q, %v after the idle day", buf, err)
			}
			seq += 5
			recvUntil(t, dev, func(p parsed) bool { return p.ack == seq })

			// The netstack lets go (the proxy aborts the connection);
			// after the close grace the flow is gone.
			c.Abort()
			recvUntil(t, dev, func(p parsed) bool { return p.flags&header.TCPFlagRst != 0 })
			cls.Sweep(time.Now().Add(48 * time.Hour))
			if cls.Len() != 0 {
				t.Fatalf("%d flows after release and grace", cls.Len())
			}
			// The pod, unaware, sends more: reset, not verbatim.
			dev.send(t, tun.VnetHdr{}, seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck | header.TCPFlagPsh, payload: []byte("secret")}.build())
			rst := recvUntil(t, dev, func(parsed) bool { return true })
			if rst.flags&header.TCPFlagRst == 0 || rst.seq != ack {
				t.Fatalf("answer to a segment of the gone flow: flags %v seq %d, want RST with seq %d", rst.flags, rst.seq, ack)
			}
			if s := cls.Stats(); s.UnknownIntercepted != 1 || s.Verbatim != 0 {
				t.Fatalf("classifier stats %+v: want the segment intercepted as unknown, nothing verbatim", s)
			}
		})
	}
}

// recvUntil reads the netstack's packets until one satisfies ok.
func recvUntil(t *testing.T, dev *fakeDev, ok func(parsed) bool) parsed {
	t.Helper()
	for range 20 {
		vh, p := dev.recv(t)
		if pp := parseOut(t, vh, p); ok(pp) {
			return pp
		}
	}
	t.Fatal("the netstack did not send the expected packet")
	return parsed{}
}

// TestListenSynCookies: a Listener keeps state for ListenBacklog pending
// handshakes; beyond that it answers with SYN cookies, so that a client
// still connects while spoofed SYNs fill the backlog.
func TestListenSynCookies(t *testing.T) {
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			dev := newFakeDev(0)
			cls := classify.New(classify.Config{
				Policy:               classify.PolicyFunc(func(_, _ netip.AddrPort) bool { return true }),
				MaxHalfOpenPerSource: 1 << 20,
			})
			st, err := newStarted(startedConfig{Device: dev, Classifier: cls, Logger: zerolog.Nop(), HandleTCP: func(req *TCPRequest) {
				t.Errorf("forwarder got %v → %v, want the listener", req.Src, req.Dst)
				req.Reject()
			}})
			if err != nil {
				t.Fatal(err)
			}
			defer func() { dev.close(); st.Close() }()
			conns := make(chan *Conn, 1)
			l, err := st.Listen(fam.dst, func(c *Conn) { conns <- c })
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()

			// Spoofed SYNs from many ports, never acknowledged: more
			// than the backlog.
			for i := range ListenBacklog + 64 {
				src := netip.AddrPortFrom(fam.src.Addr(), uint16(10000+i))
				dev.send(t, tun.VnetHdr{}, seg{src: src, dst: fam.dst, seq: 1, flags: header.TCPFlagSyn, mss: 1400}.build())
				recvUntil(t, dev, func(p parsed) bool { return p.flags == header.TCPFlagSyn|header.TCPFlagAck })
			}
			if n := st.s.Stats().TCP.ListenOverflowSynCookieSent.Value(); n == 0 {
				t.Fatal("no SYN cookie sent with the backlog full")
			}
			// A client still connects.
			c, _, _ := handshake(t, dev, conns, fam.src, fam.dst)
			if c.LocalAddrPort() != fam.dst || c.RemoteAddrPort() != fam.src {
				t.Fatalf("accepted %v → %v, want %v → %v", c.RemoteAddrPort(), c.LocalAddrPort(), fam.src, fam.dst)
			}
			c.Close()
		})
	}
}
