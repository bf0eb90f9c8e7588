package stack

import (
	"context"
	"io"
	"net/netip"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/meshtun/meshtun/stack/classify"
	"github.com/meshtun/meshtun/tun"
)

// newAckDelayStack is newTestStack with Config.AckDelay set.
func newAckDelayStack(t *testing.T, dev Device, delay time.Duration) (*Stack, <-chan *Conn) {
	t.Helper()
	conns := make(chan *Conn, 1)
	cls := classify.New(classify.Config{Policy: classify.PolicyFunc(func(_, dst netip.AddrPort) bool { return dst.Port() == 80 })})
	st, err := newStarted(startedConfig{
		Device: dev, Classifier: cls, Logger: zerolog.Nop(), AckDelay: delay,
		HandleTCP: func(req *TCPRequest) {
			c, err := req.Accept()
			if err != nil {
				t.Error(err)
				return
			}
			conns <- c
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return st, conns
}

// recvTCP returns the next packet the netstack wrote, parsed, and how long
// after since it came.
func recvTCP(t *testing.T, dev *fakeDev, since time.Time) (parsed, time.Duration) {
	t.Helper()
	vh, p := dev.recv(t)
	return parseOut(t, vh, p), time.Since(since)
}

// TestAckDelay: with AckDelay, on a flow whose both ends are the
// netstack's, the pure ACK for a small request is not written when a
// response follows within the delay (the response carries
// the acknowledgment); without a response it is written once the delay has
// passed; an ACK for two segments or more, and the handshake's ACK of a
// connection the netstack dials, are written at once; so are all ACKs of a
// flow the netstack is one end of.
func TestAckDelay(t *testing.T) {
	const delay = time.Second
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			dev := newFakeDev(tun.VnetHdrLen)
			st, conns := newAckDelayStack(t, dev, delay)
			defer func() { dev.close(); st.Close() }()
			c, seq, ack := handshake(t, dev, conns, fam.src, fam.dst)
			defer c.Close()
			c.SetReadDeadline(time.Now().Add(10 * time.Second))

			// Held once (the netstack is one end only, as on
			// either node of a cross-node mesh connection): ACKs
			// go at once.
			req := []byte("GET / small request")
			dev.send(t, tun.VnetHdr{}, seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck | header.TCPFlagPsh, payload: req}.build())
			seq += uint32(len(req))
			if s, _ := recvTCP(t, dev, time.Now()); len(s.payload) != 0 || s.ack != seq {
				t.Fatalf("got %d bytes acking %d, want a pure ACK of %d at once", len(s.payload), s.ack, seq)
			}
			buf := make([]byte, len(req))
			if _, err := io.ReadFull(c, buf); err != nil {
				t.Fatal(err)
			}
			// The netstack holds the other end too (passthrough's
			// dial from the client's address does so).
			if !st.cls.Own(fam.dst, fam.src) {
				t.Fatal("Own failed")
			}

			// Request, then a response within the delay: the first
			// packet written is the response, acknowledging the
			// request.
			start := time.Now()
			dev.send(t, tun.VnetHdr{}, seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck | header.TCPFlagPsh, payload: req}.build())
			seq += uint32(len(req))
			if _, err := io.ReadFull(c, buf); err != nil {
				t.Fatal(err)
			}
			resp := []byte("200 small response")
			if _, err := c.Write(resp); err != nil {
				t.Fatal(err)
			}
			s, took := recvTCP(t, dev, start)
			if len(s.payload) == 0 {
				t.Fatalf("netstack wrote a pure ACK (flags %v, ack %d) before the response", s.flags, s.ack-seq)
			}
			if string(s.payload) != string(resp) || s.ack != seq {
				t.Fatalf("got %q acking %d, want the response acking the request (%d)", s.payload, s.ack, seq)
			}
			if took >= delay/2 {
				t.Fatalf("response written after %v", took)
			}
			ack += uint32(len(resp))
			dev.send(t, tun.VnetHdr{}, seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck}.build())

			// A request without a response: its ACK comes after the
			// delay.
			start = time.Now()
			dev.send(t, tun.VnetHdr{}, seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck | header.TCPFlagPsh, payload: req}.build())
			seq += uint32(len(req))
			if _, err := io.ReadFull(c, buf); err != nil {
				t.Fatal(err)
			}
			s, took = recvTCP(t, dev, start)
			if len(s.payload) != 0 || s.flags != header.TCPFlagAck || s.ack != seq {
				t.Fatalf("got flags %v ack %d and %d bytes, want a pure ACK of %d", s.flags, s.ack, len(s.payload), seq)
			}
			if took < delay*9/10 {
				t.Fatalf("pure ACK written after %v, want the delay (%v)", took, delay)
			}

			// Three full segments at once: acknowledged at once.
			big := make([]byte, 3*1400)
			start = time.Now()
			dev.send(t, tun.VnetHdr{}, seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck | header.TCPFlagPsh, payload: big}.build())
			seq += uint32(len(big))
			s, took = recvTCP(t, dev, start)
			if len(s.payload) != 0 || s.ack != seq || took >= delay/2 {
				t.Fatalf("got ack %d, %d bytes after %v; want a pure ACK of %d at once", s.ack, len(s.payload), took, seq)
			}

			cs := st.Stats()
			if cs.AcksElided != 1 || cs.AcksDelayed != 1 {
				t.Fatalf("AcksElided %d, AcksDelayed %d; want 1 and 1", cs.AcksElided, cs.AcksDelayed)
			}

			// A connection the netstack dials: the handshake's ACK
			// goes at once (a server that speaks first waits for it).
			peer := netip.AddrPortFrom(fam.src.Addr(), 7000)
			from := netip.AddrPortFrom(fam.dst.Addr(), 41000)
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			dialed := make(chan error, 1)
			go func() {
				dc, err := st.DialTCP(ctx, from, peer)
				if err == nil {
					defer dc.Close()
				}
				dialed <- err
			}()
			syn, _ := recvTCP(t, dev, time.Now())
			if syn.flags != header.TCPFlagSyn {
				t.Fatalf("dial wrote flags %v, want SYN", syn.flags)
			}
			start = time.Now()
			dev.send(t, tun.VnetHdr{}, seg{src: peer, dst: from, seq: 5000, ack: syn.seq + 1, flags: header.TCPFlagSyn | header.TCPFlagAck, mss: 1400}.build())
			s, took = recvTCP(t, dev, start)
			if s.flags != header.TCPFlagAck || s.ack != 5001 || took >= delay/2 {
				t.Fatalf("got flags %v ack %d after %v; want the handshake's ACK of 5001 at once", s.flags, s.ack, took)
			}
			if err := <-dialed; err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestPureACK: which outbound segments the delayer may hold.
func TestPureACK(t *testing.T) {
	src, dst := families[0].src, families[0].dst
	sack := func(b []byte) []byte {
		// Replace the MSS option (kind 2, length 4) by NOP NOP and a
		// SACK-permitted-like kind 5 header: a SACK block marker.
		b[20+20], b[20+21], b[20+22], b[20+23] = 1, 1, 5, 2
		return b
	}
	cases := []struct {
		name    string
		pkt     []byte
		payload int
		want    bool
	}{
		{"ACK", seg{src: src, dst: dst, flags: header.TCPFlagAck}.build(), 0, true},
		{"ACK with an option", seg{src: src, dst: dst, flags: header.TCPFlagAck, mss: 1400}.build(), 0, true},
		{"ACK with SACK", sack(seg{src: src, dst: dst, flags: header.TCPFlagAck, mss: 1400}.build()), 0, false},
		{"data", seg{src: src, dst: dst, flags: header.TCPFlagAck | header.TCPFlagPsh}.build(), 0, false},
		{"ACK with payload", seg{src: src, dst: dst, flags: header.TCPFlagAck}.build(), 10, false},
		{"FIN", seg{src: src, dst: dst, flags: header.TCPFlagAck | header.TCPFlagFin}.build(), 0, false},
		{"IPv6 ACK", seg{src: families[1].src, dst: families[1].dst, flags: header.TCPFlagAck}.build(), 0, true},
	}
	for _, c := range cases {
		_, _, pure, ok := pureACK(c.pkt, c.payload)
		if !ok || pure != c.want {
			t.Errorf("%s: pure %v ok %v, want %v true", c.name, pure, ok, c.want)
		}
	}
	if _, _, _, ok := pureACK([]byte{0x45}, 0); ok {
		t.Error("a truncated header parsed")
	}
}

// TestAckDelayerRules: a held ACK is dropped for a later packet of its
// flow that acknowledges more, written first when the later one is a pure
// ACK of the same byte (a window update or duplicate ACK), written at the
// deadline otherwise, and never after close.
func TestAckDelayerRules(t *testing.T) {
	written := make(chan string, 16)
	d := newAckDelayer(time.Hour, func(b []byte) error { written <- string(b); return nil })
	defer d.close()
	k := ackKey{sport: 1, dpt: 2}
	other := ackKey{sport: 3, dpt: 2}
	frame := func(s string) [][]byte { return [][]byte{[]byte(s[:1]), []byte(s[1:])} }
	none := func() {
		t.Helper()
		select {
		case w := <-written:
			t.Fatalf("wrote %q", w)
		default:
		}
	}

	if !d.packet(&k, 100, true, frame("ack100")) {
		t.Fatal("pure ACK not held")
	}
	if d.packet(&other, 7, false, nil) {
		t.Fatal("another flow's packet held")
	}
	none()
	if d.packet(&k, 164, false, nil) { // the response
		t.Fatal("data held")
	}
	none() // superseded: dropped
	if d.dropped.Load() != 1 {
		t.Fatalf("dropped %d, want 1", d.dropped.Load())
	}

	d.packet(&k, 200, true, frame("ack200"))
	if d.packet(&k, 200, true, nil) { // window update, same ack
		t.Fatal("second ACK held")
	}
	if w := <-written; w != "ack200" {
		t.Fatalf("wrote %q, want the held ACK first", w)
	}

	d.close()
	d = newAckDelayer(time.Millisecond, d.write)
	defer d.close()
	start := time.Now()
	d.packet(&k, 300, true, frame("ack300"))
	select {
	case w := <-written:
		if w != "ack300" || time.Since(start) < time.Millisecond {
			t.Fatalf("wrote %q after %v", w, time.Since(start))
		}
	case <-time.After(10 * time.Second):
		t.Fatal("held ACK never written")
	}
	if d.pending.Load() != 0 || len(d.held) != 0 {
		t.Fatalf("%d pending after the flush", d.pending.Load())
	}

	d.packet(&k, 400, true, frame("ack400"))
	d.close()
	if d.packet(&k, 500, true, frame("ack500")) {
		t.Fatal("held after close")
	}
	d.expire() // as the timer would, had close not stopped it
	none()
}
