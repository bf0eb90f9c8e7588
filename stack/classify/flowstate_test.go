package classify

import (
	"encoding/binary"
	"net/netip"
	"strconv"
	"testing"
	"time"
)

// withSeq sets the sequence and acknowledgment numbers of a packet built
// by tcp or tcpPayload (no extension headers).
func withSeq(pkt []byte, seq, ack uint32) []byte {
	off := 20
	if pkt[0]>>4 == 6 {
		off = 40
	}
	binary.BigEndian.PutUint32(pkt[off+4:], seq)
	binary.BigEndian.PutUint32(pkt[off+8:], ack)
	return pkt
}

// withWindow sets the window field of a packet built by tcp.
func withWindow(pkt []byte, win uint16) []byte {
	off := 20
	if pkt[0]>>4 == 6 {
		off = 40
	}
	binary.BigEndian.PutUint16(pkt[off+14:], win)
	return pkt
}

// established runs a handshake a → b through c (a's SYN from the TUN,
// the netstack's SYN-ACK) with initial sequence numbers 1000 (a) and 5000
// (b), and a's ACK; a then has sent nothing, b nothing.
func established(t *testing.T, c *Classifier, a, b netip.AddrPort) {
	t.Helper()
	expect(t, c, withSeq(tcp(a, b, tcpSYN), 1000, 0), Intercept, NoDrop)
	c.Outbound(withSeq(tcp(b, a, tcpSYN|tcpACK), 5000, 1001))
	expect(t, c, withSeq(tcp(a, b, tcpACK), 1001, 5001), Intercept, NoDrop)
	if f := c.flowOf(t, a, b); f.state != stateEstablished {
		t.Fatalf("state %d after the handshake, want established", f.state)
	}
}

// TestUnknownSegmentOfInterceptedFlow: a segment the table does not know
// (after a restart, an expiry, a RST) goes to the netstack, which resets
// it, when the connection would have been intercepted whichever side
// opened it; it is never forwarded verbatim. Where one side could have
// opened a verbatim connection (a node's probe, a client outside the
// mesh), the segment stays verbatim.
func TestUnknownSegmentOfInterceptedFlow(t *testing.T) {
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			a, b, out := fam.a, fam.b, fam.outside
			// Mesh model: a and b are mesh workloads; every connection
			// between them is intercepted, in both directions. out is
			// outside the mesh: its connections to b are verbatim, b's
			// to it are intercepted (passthrough).
			mesh := func(x netip.Addr) bool { return x == a.Addr() || x == b.Addr() }
			c := New(Config{Policy: PolicyFunc(func(src, dst netip.AddrPort) bool {
				return mesh(src.Addr())
			})})
			for _, flags := range []uint8{tcpACK, tcpACK | tcpFIN, tcpACK | tcpSYN, tcpACK | tcpRST, tcpRST} {
				expect(t, c, tcpPayload(a, b, flags, 100), Intercept, NoDrop)
				expect(t, c, tcpPayload(b, a, flags, 100), Intercept, NoDrop)
				expect(t, c, tcpPayload(b, out, flags, 100), Verbatim, NoDrop)
				expect(t, c, tcpPayload(out, b, flags, 100), Verbatim, NoDrop)
			}
			st := c.Stats()
			if st.UnknownIntercepted != 10 || st.Flows != 0 || st.FlowsInserted != 0 {
				t.Fatalf("Stats = %+v: want 10 unknown segments intercepted and no flow created", st)
			}
		})
	}
}

// TestRSTWindow: a RST ends a flow only when its sequence number is in the
// window (RFC 5961 §3); a blind one is dropped and the flow goes on.
func TestRSTWindow(t *testing.T) {
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			a, b := fam.a, fam.b
			c := New(Config{Policy: all})
			established(t, c, a, b)
			// a sends 3000 bytes; b advertised a 65535-byte window.
			expect(t, c, withSeq(tcpPayload(a, b, tcpACK, 3000), 1001, 5001), Intercept, NoDrop)
			for _, off := range []int64{65536, 1 << 30, -65536 - 1, -(1 << 31)} {
				seq := uint32(4001 + off)
				expect(t, c, withSeq(tcp(a, b, tcpRST), seq, 0), Drop, RSTOutOfWindow)
				expect(t, c, withSeq(tcp(b, a, tcpRST), uint32(5001+off), 0), Drop, RSTOutOfWindow)
			}
			if f := c.flowOf(t, a, b); f.state != stateEstablished {
				t.Fatalf("state %d after blind RSTs, want established", f.state)
			}
			expect(t, c, withSeq(tcpPayload(a, b, tcpACK, 10), 4001, 5001), Intercept, NoDrop)
			if st := c.Stats(); st.DropsByReason[RSTOutOfWindow] != 8 {
				t.Fatalf("Stats = %+v, want 8 rst-out-of-window drops", st)
			}
			// In the window: the flow ends.
			expect(t, c, withSeq(tcp(b, a, tcpRST), 5001+100, 0), Intercept, NoDrop)
			if f := c.flowOf(t, a, b); f.state != stateClosed {
				t.Fatalf("state %d after an in-window RST, want closed", f.state)
			}
		})
	}

	t.Run("scaled-window", func(t *testing.T) {
		a, b := podA4, podB4
		c := New(Config{Policy: all})
		// Both offer window scaling: b's shift 7, so its window field
		// 1000 means 128,000 bytes.
		syn := withSeq(tcpWithWScale(a, b, tcpSYN, 7), 1000, 0)
		expect(t, c, syn, Intercept, NoDrop)
		c.Outbound(withSeq(tcpWithWScale(b, a, tcpSYN|tcpACK, 7), 5000, 1001))
		expect(t, c, withSeq(tcp(a, b, tcpACK), 1001, 5001), Intercept, NoDrop)
		c.Outbound(withWindow(withSeq(tcp(b, a, tcpACK), 5001, 1001), 1000))
		expect(t, c, withSeq(tcp(a, b, tcpRST), 1001+100000, 0), Intercept, NoDrop)
		if f := c.flowOf(t, a, b); f.state != stateClosed {
			t.Fatalf("state %d after a RST inside the scaled window, want closed", f.state)
		}
	})

	t.Run("rst-answering-syn", func(t *testing.T) {
		a, b := podA4, podB4
		c := New(Config{Policy: all})
		c.Outbound(withSeq(tcp(a, b, tcpSYN), 1000, 0))
		expect(t, c, withSeq(tcp(b, a, tcpRST|tcpACK), 0, 999), Drop, RSTOutOfWindow)
		expect(t, c, withSeq(tcp(b, a, tcpRST|tcpACK), 0, 1001), Intercept, NoDrop)
		if f := c.flowOf(t, a, b); f.state != stateClosed {
			t.Fatalf("state %d after the refusal of the SYN, want closed", f.state)
		}
	})
}

// tcpWithWScale builds a TCP segment whose header carries a window scale
// option of shift ws.
func tcpWithWScale(src, dst netip.AddrPort, flags uint8, ws uint8) []byte {
	l4 := tcpHdr(src.Port(), dst.Port(), flags, 0)
	l4 = append(l4, 1, 3, 3, ws) // no-op, window scale
	l4[12] = 6 << 4
	if src.Addr().Is4() {
		return ipv4(src.Addr(), dst.Addr(), protoTCP, l4)
	}
	return ipv6(src.Addr(), dst.Addr(), protoTCP, l4)
}

// TestHalfOpen: a flow is established by the initiator's ACK of the
// responder's SYN, not by the SYN-ACK; half-open flows expire after
// SynTimeout (seconds).
func TestHalfOpen(t *testing.T) {
	a, b := podA4, podB4
	c := New(Config{Policy: all})
	if c.synTimeout != int64(5*time.Second) {
		t.Fatalf("default SynTimeout %v, want 5s", time.Duration(c.synTimeout))
	}
	expect(t, c, withSeq(tcp(a, b, tcpSYN), 1000, 0), Intercept, NoDrop)
	c.Outbound(withSeq(tcp(b, a, tcpSYN|tcpACK), 5000, 1001))
	// A blind ACK (a spoofed source cannot see the SYN-ACK) does not
	// establish the flow.
	expect(t, c, withSeq(tcp(a, b, tcpACK), 1001, 77777), Intercept, NoDrop)
	if f := c.flowOf(t, a, b); f.state != stateSyn {
		t.Fatalf("state %d after a blind ACK, want half-open", f.state)
	}
	if st := c.Stats(); st.HalfOpen != 1 {
		t.Fatalf("HalfOpen = %d, want 1", st.HalfOpen)
	}
	if n := sweepAt(c, 5*time.Second-1); n != 0 {
		t.Fatalf("swept %d before SynTimeout", n)
	}
	if n := sweepAt(c, 5*time.Second); n != 1 {
		t.Fatalf("swept %d at SynTimeout, want the half-open flow", n)
	}
	if st := c.Stats(); st.HalfOpen != 0 || st.Flows != 0 {
		t.Fatalf("Stats = %+v after expiry", st)
	}
}

// TestHalfOpenBounds: pending handshakes are bounded per source and in
// total, and a source with fewer takes a slot from one with more.
func TestHalfOpenBounds(t *testing.T) {
	server := podB4
	from := func(addr string, port int) netip.AddrPort {
		return netip.AddrPortFrom(netip.MustParseAddr(addr), uint16(port))
	}
	t.Run("per-source", func(t *testing.T) {
		c := New(Config{Policy: all, MaxHalfOpenPerSource: 3})
		for i := range 3 {
			expect(t, c, tcp(from("198.18.9.1", 1000+i), server, tcpSYN), Intercept, NoDrop)
		}
		expect(t, c, tcp(from("198.18.9.1", 1003), server, tcpSYN), Drop, HalfOpenPerSource)
		// Another source is not affected, nor are retransmissions.
		expect(t, c, tcp(from("198.18.9.2", 1000), server, tcpSYN), Intercept, NoDrop)
		expect(t, c, tcp(from("198.18.9.1", 1000), server, tcpSYN), Intercept, NoDrop)
		// A completed handshake frees the source's slot.
		a := from("198.18.9.1", 1000)
		c.Outbound(tcp(server, a, tcpSYN|tcpACK))
		expect(t, c, tcp(a, server, tcpACK), Intercept, NoDrop)
		expect(t, c, tcp(from("198.18.9.1", 1003), server, tcpSYN), Intercept, NoDrop)
	})
	t.Run("fair-share", func(t *testing.T) {
		// One shard, room for 8 half-open flows.
		c := New(Config{Policy: all, MaxFlows: 64, MaxHalfOpen: 8, MaxHalfOpenPerSource: 100})
		for i := range 8 {
			expect(t, c, tcp(from("198.18.9.1", 1000+i), server, tcpSYN), Intercept, NoDrop)
		}
		// The flooding source cannot take more...
		expect(t, c, tcp(from("198.18.9.1", 2000), server, tcpSYN), Drop, HalfOpenFull)
		// ...but a new source displaces one of its handshakes...
		legit := from("198.18.9.2", 1000)
		expect(t, c, tcp(legit, server, tcpSYN), Intercept, NoDrop)
		if st := c.Stats(); st.HalfOpen != 8 || st.FlowsReplaced != 1 {
			t.Fatalf("Stats = %+v, want 8 half-open, one replaced", st)
		}
		// ...and the flood cannot displace the newcomer's (it holds
		// fewer); the newcomer completes its handshake.
		for i := range 50 {
			c.Inbound(tcp(from("198.18.9.1", 3000+i), server, tcpSYN))
		}
		c.Outbound(tcp(server, legit, tcpSYN|tcpACK))
		expect(t, c, tcp(legit, server, tcpACK), Intercept, NoDrop)
		if f := c.flowOf(t, legit, server); f.state != stateEstablished {
			t.Fatalf("the newcomer's flow is in state %d, want established", f.state)
		}
	})
	t.Run("equal-shares-hold", func(t *testing.T) {
		c := New(Config{Policy: all, MaxFlows: 64, MaxHalfOpen: 4, MaxHalfOpenPerSource: 100})
		for i := range 2 {
			expect(t, c, tcp(from("198.18.9.1", 1000+i), server, tcpSYN), Intercept, NoDrop)
			expect(t, c, tcp(from("198.18.9.2", 1000+i), server, tcpSYN), Intercept, NoDrop)
		}
		// Neither source holds more than the other would: refused
		// cheaply, without churning the table.
		expect(t, c, tcp(from("198.18.9.1", 2000), server, tcpSYN), Drop, HalfOpenFull)
		expect(t, c, tcp(from("198.18.9.2", 2000), server, tcpSYN), Drop, HalfOpenFull)
	})
	t.Run("newcomers-rotate", func(t *testing.T) {
		// Spoofed sources with one SYN each fill the table; a source
		// with none pending still gets a slot (the oldest one's).
		c := New(Config{Policy: all, MaxFlows: 64, MaxHalfOpen: 4, MaxHalfOpenPerSource: 100})
		for i := range 4 {
			sweepAt(c, time.Duration(i)*time.Second)
			expect(t, c, tcp(from("198.18.9."+strconv.Itoa(10+i), 1000), server, tcpSYN), Intercept, NoDrop)
		}
		legit := from("198.18.9.2", 1000)
		expect(t, c, tcp(legit, server, tcpSYN), Intercept, NoDrop)
		if st := c.Stats(); st.HalfOpen != 4 || st.FlowsReplaced != 1 {
			t.Fatalf("Stats = %+v, want 4 half-open, one replaced", st)
		}
		// The oldest went.
		expect(t, c, tcp(from("198.18.9.10", 1000), server, tcpACK), Intercept, NoDrop)
		if st := c.Stats(); st.UnknownIntercepted != 1 {
			t.Fatalf("the oldest spoofed flow is still known: %+v", st)
		}
	})
}

// TestOwned: a flow the netstack holds lives as long as the netstack says
// (Own, Release), whatever packets or timeouts say.
func TestOwned(t *testing.T) {
	a, b := podA4, podB4
	const closeTO = 10 * time.Second
	c := New(Config{Policy: all, CloseTimeout: closeTO, IdleTimeout: time.Minute})
	expect(t, c, withSeq(tcp(a, b, tcpSYN), 1000, 0), Intercept, NoDrop)
	if !c.Own(b, a) {
		t.Fatal("Own failed")
	}
	if st := c.Stats(); st.HalfOpen != 0 {
		t.Fatalf("HalfOpen = %d for an owned flow, want 0", st.HalfOpen)
	}
	// Not expired while pending, nor when idle.
	if n := sweepAt(c, time.Hour); n != 0 {
		t.Fatalf("swept %d owned flows", n)
	}
	c.Outbound(withSeq(tcp(b, a, tcpSYN|tcpACK), 5000, 1001))
	expect(t, c, withSeq(tcp(a, b, tcpACK), 1001, 5001), Intercept, NoDrop)
	// FIN in both directions and an in-window RST go to the netstack but
	// do not end the flow: the netstack decides.
	expect(t, c, withSeq(tcp(a, b, tcpFIN|tcpACK), 1001, 5001), Intercept, NoDrop)
	c.Outbound(withSeq(tcp(b, a, tcpFIN|tcpACK), 5001, 1002))
	expect(t, c, withSeq(tcp(a, b, tcpRST), 1002, 0), Intercept, NoDrop)
	if n := sweepAt(c, 3*time.Hour); n != 0 {
		t.Fatalf("swept %d owned flows", n)
	}
	if f := c.flowOf(t, a, b); f.state == stateClosed {
		t.Fatal("owned flow closed by packets")
	}
	c.Release(a, b)
	if f := c.flowOf(t, a, b); f.state != stateClosed {
		t.Fatalf("state %d after Release, want closed", f.state)
	}
	expect(t, c, tcp(a, b, tcpACK), Intercept, NoDrop) // grace
	if n := sweepAt(c, 3*time.Hour+closeTO); n != 1 {
		t.Fatalf("swept %d at CloseTimeout after Release, want 1", n)
	}

	// Own before the SYN (a connection the netstack dials): the SYN
	// names the initiator.
	c.Own(b, a)
	c.Outbound(withSeq(tcp(b, a, tcpSYN), 9000, 0))
	expect(t, c, withSeq(tcp(a, b, tcpSYN|tcpACK), 100, 9001), Intercept, NoDrop)
	c.Outbound(withSeq(tcp(b, a, tcpACK), 9001, 101))
	if f := c.flowOf(t, a, b); f.state != stateEstablished || (f.flags&flagInitLo != 0) != endpointLess(b, a) {
		t.Fatalf("flow %+v, want established with b the initiator", f)
	}
	c.Release(b, a)
	c.Release(b, a) // idempotent
	if got := c.closedFlows(); got != 1 {
		t.Fatalf("closed flows %d, want 1", got)
	}

	// Two holds (a connection accepted and dialled on the same
	// addresses): the flow ends with the second release.
	d := netip.AddrPortFrom(b.Addr(), b.Port()+1)
	c.Own(a, d)
	c.Own(d, a)
	c.Release(a, d)
	if f := c.flowOf(t, a, d); f.state == stateClosed {
		t.Fatal("flow closed with one of its two holds left")
	}
	c.Release(d, a)
	if f := c.flowOf(t, a, d); f.state != stateClosed {
		t.Fatalf("state %d after both releases, want closed", f.state)
	}
}
