package classify

import (
	"context"
	"encoding/binary"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"
)

// expect classifies pkt with Inbound and fails the test unless the verdict
// and reason are the wanted ones.
func expect(t *testing.T, c *Classifier, pkt []byte, want Verdict, wantReason DropReason) {
	t.Helper()
	v, r := c.Inbound(pkt)
	if v != want || r != wantReason {
		t.Fatalf("Inbound(% x) = %v/%v, want %v/%v", pkt, v, r, want, wantReason)
	}
}

// sweepAt runs Sweep at d after the classifier's clock origin.
func sweepAt(c *Classifier, d time.Duration) int { return c.Sweep(c.base.Add(d)) }

func TestStrings(t *testing.T) {
	seen := map[string]bool{}
	for v := Verbatim; v <= Drop; v++ {
		s := v.String()
		if s == "" || seen[s] {
			t.Errorf("Verdict(%d).String() = %q: empty or duplicate", v, s)
		}
		seen[s] = true
	}
	if got := Verdict(9).String(); got != "verdict(9)" {
		t.Errorf("Verdict(9).String() = %q", got)
	}
	for r := DropReason(0); r < numDropReasons; r++ {
		s := r.String()
		if s == "" || seen[s] {
			t.Errorf("DropReason(%d).String() = %q: empty or duplicate", r, s)
		}
		seen[s] = true
	}
	if got := TableFull.String(); got != "table-full" {
		t.Errorf("TableFull.String() = %q", got)
	}
	if got := DropReason(200).String(); got != "drop-reason(200)" {
		t.Errorf("DropReason(200).String() = %q", got)
	}
}

func TestDefaults(t *testing.T) {
	c := New(Config{})
	if c.maxFlows != DefaultMaxFlows || c.synTimeout != int64(DefaultSynTimeout) ||
		c.idleTimeout != int64(DefaultIdleTimeout) || c.closeTimeout != int64(DefaultCloseTimeout) {
		t.Fatalf("defaults not applied: %+v", c)
	}
	capacity := 0
	for i := range c.shards {
		capacity += c.shards[i].limit
	}
	if capacity < DefaultMaxFlows {
		t.Fatalf("shards hold %d flows, want >= %d", capacity, DefaultMaxFlows)
	}
	// Nil policy: nothing is intercepted.
	expect(t, c, tcp(podA4, podB4, tcpSYN), Verbatim, NoDrop)
	if c.Len() != 0 {
		t.Fatalf("Len = %d after an unselected SYN", c.Len())
	}
}

// TestVerbatim covers everything that is forwarded without tracking, with a
// policy that would intercept any SYN.
func TestVerbatim(t *testing.T) {
	a4, b4 := podA4.Addr(), podB4.Addr()
	a6, b6 := podA6.Addr(), podB6.Addr()

	fragUDP4 := func(flagsOff uint16) []byte {
		p := udp(podA4, podB4, 100)
		binary.BigEndian.PutUint16(p[6:], flagsOff)
		return p
	}
	cases := []struct {
		name string
		pkt  []byte
	}{
		{"udp4", udp(podA4, podB4, 100)},
		{"udp6", udp(podA6, podB6, 100)},
		{"icmp4", ipv4(a4, b4, protoICMP, []byte{8, 0, 0, 0, 0, 1, 0, 1})},
		{"icmp6", ipv6(a6, b6, protoICMPv6, []byte{128, 0, 0, 0, 0, 1, 0, 1})},
		{"proto253-v4", ipv4(a4, b4, 253, []byte{1, 2, 3})},
		{"proto253-v6", ipv6(a6, b6, 253, []byte{1, 2, 3})},
		{"v4-udp-first-fragment-MF", fragUDP4(0x2000)},
		{"v4-udp-later-fragment", fragUDP4(0x0010)},
		{"v6-udp-fragment", ipv6(a6, b6, protoUDP, udpHdr(1, 2, 0), ext6{protoFragment, 8})},
		{"v6-hbh-then-udp-fragment", ipv6(a6, b6, protoUDP, udpHdr(1, 2, 0), ext6{protoHopByHop, 8}, ext6{protoFragment, 8})},
		{"v6-no-next-header", ipv6(a6, b6, protoNoNext, nil)},
		{"v6-hbh-udp", ipv6(a6, b6, protoUDP, udpHdr(1, 2, 0), ext6{protoHopByHop, 8})},
		{"v6-esp", ipv6(a6, b6, 50, make([]byte, 16))},
		{"v6-ah-tcp", ipv6(a6, b6, 51, make([]byte, 24))},
		// TCP that is not the start of a flow and belongs to none.
		{"synack-to-node-probe", tcp(podB4, podA4, tcpSYN|tcpACK)},
		{"ack-no-flow", tcp(podA4, podB4, tcpACK)},
		{"rst-no-flow-v6", tcp(podA6, podB6, tcpRST)},
		{"fin-no-flow", tcp(podA4, podB4, tcpFIN|tcpACK)},
		{"syn-fin", tcp(podA4, podB4, tcpSYN|tcpFIN)},
		{"syn-rst", tcp(podA4, podB4, tcpSYN|tcpRST)},
	}
	// Connections from A to B's port are intercepted, those from B to
	// A's port are not: a segment of no flow between them may belong to
	// a verbatim connection B opened.
	c := New(Config{Policy: toPort(podB4.Port())})
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			expect(t, c, tc.pkt, Verbatim, NoDrop)
		})
	}
	if c.Len() != 0 {
		t.Fatalf("Len = %d, want 0", c.Len())
	}
	if st := c.Stats(); st.Verbatim != uint64(len(cases)) || st.Intercepted != 0 || st.Dropped != 0 {
		t.Fatalf("Stats = %+v, want %d verbatim", st, len(cases))
	}
}

// TestFragmentedTCP: TCP fragments are dropped, never verbatim, because a
// later fragment's ports are invisible and the pod would reassemble them
// into a connection that bypassed interception.
func TestFragmentedTCP(t *testing.T) {
	a4, b4 := podA4.Addr(), podB4.Addr()
	a6, b6 := podA6.Addr(), podB6.Addr()
	syn := tcpHdr(40000, 8080, tcpSYN, 0)
	frag4 := func(flagsOff uint16) []byte {
		p := ipv4(a4, b4, protoTCP, syn)
		binary.BigEndian.PutUint16(p[6:], flagsOff)
		return p
	}
	cases := []struct {
		name string
		pkt  []byte
	}{
		{"v4-first-fragment-MF", frag4(0x2000)},
		{"v4-later-fragment", frag4(0x0010)},
		{"v4-last-fragment", frag4(0x0001)},
		{"v6-fragment-header", ipv6(a6, b6, protoTCP, syn, ext6{protoFragment, 8})},
		{"v6-hbh-then-fragment", ipv6(a6, b6, protoTCP, syn, ext6{protoHopByHop, 8}, ext6{protoFragment, 8})},
		{"v6-fragment-then-destopts", ipv6(a6, b6, protoTCP, syn, ext6{protoFragment, 8}, ext6{protoDestOpts, 8})},
	}
	c := New(Config{Policy: all})
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			expect(t, c, tc.pkt, Drop, FragmentedTCP)
		})
	}
	if got := c.Stats().DropsByReason[FragmentedTCP]; got != uint64(len(cases)) {
		t.Fatalf("DropsByReason[FragmentedTCP] = %d, want %d", got, len(cases))
	}
}

func TestMalformed(t *testing.T) {
	a4, b4 := podA4.Addr(), podB4.Addr()
	a6, b6 := podA6.Addr(), podB6.Addr()
	syn := tcpHdr(40000, 8080, tcpSYN, 0)

	mod := func(p []byte, f func(p []byte)) []byte { f(p); return p }
	v4 := func() []byte { return ipv4(a4, b4, protoTCP, syn) }
	v6 := func() []byte { return ipv6(a6, b6, protoTCP, syn) }
	tcpDoff := func(p []byte, off int, doff uint8) []byte {
		p[off+12] = doff << 4
		return p
	}
	dstOpts := func(n int) []ext6 {
		e := make([]ext6, n)
		for i := range e {
			e[i] = ext6{protoDestOpts, 8}
		}
		return e
	}
	cases := []struct {
		name string
		pkt  []byte
		want DropReason
	}{
		{"nil", nil, TooShort},
		{"empty", []byte{}, TooShort},
		{"one-byte-v4", []byte{0x45}, TooShort},
		{"v4-19-bytes", v4()[:19], TooShort},
		{"v6-39-bytes", v6()[:39], TooShort},
		{"version-0", mod(v4(), func(p []byte) { p[0] = 0x05 }), BadVersion},
		{"version-5", mod(v4(), func(p []byte) { p[0] = 0x55 }), BadVersion},
		{"version-15", []byte{0xff}, BadVersion},
		{"ihl-4", mod(v4(), func(p []byte) { p[0] = 0x44 }), BadHeaderLength},
		{"ihl-0", mod(v4(), func(p []byte) { p[0] = 0x40 }), BadHeaderLength},
		{"ihl-15-beyond-packet", mod(v4()[:40], func(p []byte) { p[0] = 0x4f }), HeaderTruncated},
		{"total-length-below-header", mod(v4(), func(p []byte) { binary.BigEndian.PutUint16(p[2:], 19) }), BadTotalLength},
		{"total-length-below-ihl", mod(append(v4(), 0, 0, 0, 0), func(p []byte) {
			p[0] = 0x46
			binary.BigEndian.PutUint16(p[2:], 20)
		}), BadTotalLength},
		{"total-length-beyond-packet", mod(v4(), func(p []byte) { binary.BigEndian.PutUint16(p[2:], 41) }), Truncated},
		{"v4-cut-short", v4()[:30], Truncated},
		{"v6-payload-beyond-packet", mod(v6(), func(p []byte) { binary.BigEndian.PutUint16(p[4:], 21) }), Truncated},
		{"v6-cut-short", v6()[:50], Truncated},
		{"v6-ext-less-than-8", mod(ipv6(a6, b6, protoTCP, syn, ext6{protoHopByHop, 8})[:44], func(p []byte) {
			binary.BigEndian.PutUint16(p[4:], 4)
		}), ExtHeaderTruncated},
		{"v6-ext-length-beyond", mod(ipv6(a6, b6, protoTCP, syn, ext6{protoRouting, 8}), func(p []byte) {
			p[41] = 3 // 32 bytes; only 28 in the payload
		}), ExtHeaderTruncated},
		{"v6-payload-length-zero-hbh", mod(ipv6(a6, b6, protoTCP, syn, ext6{protoHopByHop, 8}), func(p []byte) {
			binary.BigEndian.PutUint16(p[4:], 0) // jumbogram: not on a TUN
		}), ExtHeaderTruncated},
		{"v6-nine-ext-headers", ipv6(a6, b6, protoTCP, syn, dstOpts(9)...), TooManyExtHeaders},
		{"v4-tcp-10-bytes", ipv4(a4, b4, protoTCP, syn[:10]), TCPTruncated},
		{"v4-tcp-no-bytes", ipv4(a4, b4, protoTCP, nil), TCPTruncated},
		{"v6-tcp-19-bytes", ipv6(a6, b6, protoTCP, syn[:19]), TCPTruncated},
		{"v6-tcp-after-ext-truncated", ipv6(a6, b6, protoTCP, syn[:8], ext6{protoDestOpts, 16}), TCPTruncated},
		{"v4-tcp-beyond-total-length", mod(append(v4(), make([]byte, 20)...), func(p []byte) {
			binary.BigEndian.PutUint16(p[2:], 30) // TCP header runs past the IP datagram
		}), TCPTruncated},
		{"v4-doff-4", tcpDoff(v4(), 20, 4), BadTCPDataOffset},
		{"v4-doff-0", tcpDoff(v4(), 20, 0), BadTCPDataOffset},
		{"v6-doff-4", tcpDoff(v6(), 40, 4), BadTCPDataOffset},
		{"v4-doff-15-beyond", tcpDoff(v4(), 20, 15), TCPTruncated},
		{"v6-doff-6-beyond", tcpDoff(v6(), 40, 6), TCPTruncated},
	}
	c := New(Config{Policy: all})
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			expect(t, c, tc.pkt, Drop, tc.want)
		})
	}
	st := c.Stats()
	if st.Dropped != uint64(len(cases)) || c.Len() != 0 {
		t.Fatalf("Stats = %+v, Len = %d; want %d drops, no flows", st, c.Len(), len(cases))
	}
	var perReason [numDropReasons]uint64
	for _, tc := range cases {
		perReason[tc.want]++
	}
	if st.DropsByReason != perReason {
		t.Fatalf("DropsByReason = %v, want %v", st.DropsByReason, perReason)
	}

	// Outbound takes the same packets. Headers whose IP length exceeds
	// the bytes given are fine there (the netstack may pass headers
	// only), so those SYNs register flows; the rest are malformed.
	out := New(Config{})
	for _, tc := range cases {
		out.Outbound(tc.pkt)
	}
	ost := out.Stats()
	const headersOnly = 2 // total-length-beyond-packet, v6-payload-beyond-packet
	if ost.OutboundMalformed != uint64(len(cases)-headersOnly) || ost.Flows != headersOnly {
		t.Fatalf("Outbound stats = %+v, want %d malformed, %d flows", ost, len(cases)-headersOnly, headersOnly)
	}
}

// TestWellFormedEdges covers valid packets near the malformed ones.
func TestWellFormedEdges(t *testing.T) {
	a4, b4 := podA4.Addr(), podB4.Addr()
	a6, b6 := podA6.Addr(), podB6.Addr()
	syn := tcpHdr(40000, 8080, tcpSYN, 0)
	dstOpts := func(n int) []ext6 {
		e := make([]ext6, n)
		for i := range e {
			e[i] = ext6{protoDestOpts, 8}
		}
		return e
	}

	withOptions := func() []byte {
		// IHL 6: four bytes of IPv4 options (NOPs).
		p := ipv4(a4, b4, protoTCP, append([]byte{1, 1, 1, 1}, syn...))
		p[0] = 0x46
		return p
	}
	tcpOptions := func() []byte {
		l4 := append(tcpHdr(40000, 8080, tcpSYN, 0), 2, 4, 0x05, 0xb4) // MSS 1460
		l4[12] = 6 << 4
		return ipv4(a4, b4, protoTCP, l4)
	}
	cases := []struct {
		name string
		pkt  []byte
	}{
		{"v4-options", withOptions()},
		{"v4-tcp-options", tcpOptions()},
		{"v4-trailing-bytes", append(ipv4(a4, b4, protoTCP, syn), 0xde, 0xad)},
		{"v6-hbh-routing-dstopts", ipv6(a6, b6, protoTCP, syn,
			ext6{protoHopByHop, 8}, ext6{protoRouting, 24}, ext6{protoDestOpts, 16})},
		{"v6-eight-ext-headers", ipv6(a6, b6, protoTCP, syn, dstOpts(8)...)},
		{"v6-trailing-bytes", append(ipv6(a6, b6, protoTCP, syn), 1, 2, 3)},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := New(Config{Policy: all})
			expect(t, c, tc.pkt, Intercept, NoDrop)
			if c.Len() != 1 {
				t.Fatalf("Len = %d, want 1", c.Len())
			}
		})
	}
}

// TestPolicy checks which SYNs start flows, what the policy sees, and that
// the later packets of intercepted flows are intercepted in both directions
// while those of other flows are not.
func TestPolicy(t *testing.T) {
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			var gotSrc, gotDst netip.AddrPort
			var calls atomic.Int32
			c := New(Config{Policy: PolicyFunc(func(src, dst netip.AddrPort) bool {
				calls.Add(1)
				gotSrc, gotDst = src, dst
				return dst.Port() == fam.b.Port()
			})})
			a, b := fam.a, fam.b
			expect(t, c, tcp(a, b, tcpSYN), Intercept, NoDrop)
			if gotSrc != a || gotDst != b {
				t.Fatalf("policy saw %v -> %v, want %v -> %v", gotSrc, gotDst, a, b)
			}
			if c.Len() != 1 {
				t.Fatalf("Len = %d, want 1", c.Len())
			}
			// Later packets, both directions.
			expect(t, c, tcp(b, a, tcpSYN|tcpACK), Intercept, NoDrop)
			expect(t, c, tcp(a, b, tcpACK), Intercept, NoDrop)
			expect(t, c, tcpPayload(a, b, tcpACK|0x08, 1000), Intercept, NoDrop)
			expect(t, c, tcpPayload(b, a, tcpACK, 1000), Intercept, NoDrop)
			if n := calls.Load(); n != 1 {
				t.Fatalf("policy called %d times, want once", n)
			}

			// Same hosts, another destination port: not selected.
			other := netip.AddrPortFrom(b.Addr(), b.Port()+1)
			expect(t, c, tcp(a, other, tcpSYN), Verbatim, NoDrop)
			expect(t, c, tcp(other, a, tcpSYN|tcpACK), Verbatim, NoDrop)
			expect(t, c, tcp(a, other, tcpACK), Verbatim, NoDrop)
			// Another source port to the selected one is a new flow.
			a2 := netip.AddrPortFrom(a.Addr(), a.Port()+1)
			expect(t, c, tcp(a2, b, tcpACK), Verbatim, NoDrop)
			expect(t, c, tcp(a2, b, tcpSYN), Intercept, NoDrop)
			if c.Len() != 2 {
				t.Fatalf("Len = %d, want 2", c.Len())
			}
			// The outside host answering a probe the node sent.
			expect(t, c, tcp(fam.outside, a, tcpSYN|tcpACK), Verbatim, NoDrop)

			st := c.Stats()
			if st.Intercepted != 6 || st.Verbatim != 5 || st.FlowsInserted != 2 {
				t.Fatalf("Stats = %+v", st)
			}
		})
	}
}

func TestSetPolicy(t *testing.T) {
	c := New(Config{Policy: toPort(podB4.Port())})
	expect(t, c, tcp(podA4, podB4, tcpSYN), Intercept, NoDrop)
	c.SetPolicy(nil)
	// The flow stays intercepted, also a retransmitted SYN of it.
	expect(t, c, tcp(podA4, podB4, tcpSYN), Intercept, NoDrop)
	expect(t, c, tcp(podA4, podB4, tcpACK), Intercept, NoDrop)
	// New flows follow the new policy.
	a2 := netip.AddrPortFrom(podA4.Addr(), 40001)
	expect(t, c, tcp(a2, podB4, tcpSYN), Verbatim, NoDrop)
	c.SetPolicy(all)
	expect(t, c, tcp(a2, ext4, tcpSYN), Intercept, NoDrop)
	if c.Len() != 2 {
		t.Fatalf("Len = %d, want 2", c.Len())
	}
}

// TestOutboundOriginated covers flows the netstack opens itself: the
// replies arriving from the TUN must be intercepted.
func TestOutboundOriginated(t *testing.T) {
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			c := New(Config{}) // the policy plays no part here
			client, server := fam.outside, fam.b
			syn := tcp(client, server, tcpSYN)
			// Only the headers, with the IP length of a full segment.
			hdr := tcpPayload(client, server, tcpSYN, 1200)
			hdr = hdr[:len(hdr)-1200]
			c.Outbound(hdr)
			if c.Len() != 1 {
				t.Fatalf("Len = %d after outbound SYN, want 1", c.Len())
			}
			c.Outbound(syn) // retransmission
			if c.Len() != 1 {
				t.Fatalf("Len = %d after retransmitted SYN, want 1", c.Len())
			}
			expect(t, c, tcp(server, client, tcpSYN|tcpACK), Intercept, NoDrop)
			c.Outbound(tcp(client, server, tcpACK))
			expect(t, c, tcpPayload(server, client, tcpACK, 500), Intercept, NoDrop)
			// A different client port is not the netstack's.
			other := netip.AddrPortFrom(client.Addr(), client.Port()+1)
			expect(t, c, tcp(server, other, tcpSYN|tcpACK), Verbatim, NoDrop)

			c.Outbound(udp(client, server, 10))    // ignored
			c.Outbound(tcp(other, server, tcpACK)) // no flow
			st := c.Stats()
			if st.Outbound != 5 || st.OutboundNoFlow != 1 || st.FlowsInserted != 1 || st.OutboundMalformed != 0 {
				t.Fatalf("Stats = %+v", st)
			}
			if f := c.flowOf(t, client, server); f.state != stateEstablished || f.flags&flagInitLo == 0 != (endpointLess(server, client)) {
				t.Fatalf("flow = %+v", f)
			}
		})
	}
}

// endpointLess orders endpoints as the flow key does.
func endpointLess(a, b netip.AddrPort) bool {
	if c := a.Addr().Compare(b.Addr()); c != 0 {
		return c < 0
	}
	return a.Port() < b.Port()
}

// closedFlows counts the flows in stateClosed, checking the per-shard
// bookkeeping against the slots.
func (c *Classifier) closedFlows() int {
	n := 0
	for i := range c.shards {
		s := &c.shards[i]
		s.mu.Lock()
		m := 0
		for j := range s.slots {
			if s.slots[j].state == stateClosed {
				m++
			}
		}
		if m != s.closed {
			panic("shard closed count out of sync")
		}
		n += m
		s.mu.Unlock()
	}
	return n
}

// flowOf returns a copy of the flow between a and b, failing if absent.
func (c *Classifier) flowOf(t *testing.T, a, b netip.AddrPort) flow {
	t.Helper()
	var seg segment
	if res, r := parse(tcp(a, b, tcpACK), true, &seg); res != parsedTCP {
		t.Fatalf("parse: %v", r)
	}
	h := seg.key.hash(&c.seed)
	s := c.shardFor(h)
	s.mu.Lock()
	defer s.mu.Unlock()
	i, ok := s.lookup(&seg.key, uint32(h))
	if !ok {
		t.Fatalf("no flow %v <-> %v", a, b)
	}
	return s.slots[i]
}

func TestStateTransitions(t *testing.T) {
	a, b := podA4, podB4
	type step struct {
		out   bool // via Outbound instead of Inbound
		src   netip.AddrPort
		flags uint8
	}
	cases := []struct {
		name  string
		steps []step
		want  uint8
	}{
		{"syn", []step{{false, a, tcpSYN}}, stateSyn},
		{"syn-retransmit", []step{{false, a, tcpSYN}, {false, a, tcpSYN}}, stateSyn},
		{"syn-then-client-ack", []step{{false, a, tcpSYN}, {false, a, tcpACK}}, stateEstablished},
		{"syn-then-netstack-synack", []step{{false, a, tcpSYN}, {true, b, tcpSYN | tcpACK}}, stateSyn},
		{"syn-synack-ack", []step{{false, a, tcpSYN}, {true, b, tcpSYN | tcpACK}, {false, a, tcpACK}}, stateEstablished},
		{"syn-synack-ack-from-responder", []step{{false, a, tcpSYN}, {true, b, tcpSYN | tcpACK}, {true, b, tcpACK}}, stateSyn},
		{"syn-then-netstack-rst", []step{{false, a, tcpSYN}, {true, b, tcpRST | tcpACK}}, stateClosed},
		{"syn-then-client-rst", []step{{false, a, tcpSYN}, {false, a, tcpRST}}, stateClosed},
		{"one-fin-is-half-close", []step{{false, a, tcpSYN}, {false, a, tcpACK}, {false, a, tcpFIN | tcpACK}}, stateEstablished},
		{"fin-twice-same-side", []step{{false, a, tcpSYN}, {false, a, tcpFIN | tcpACK}, {false, a, tcpFIN | tcpACK}}, stateEstablished},
		{"fin-fin-inbound", []step{{false, a, tcpSYN}, {false, a, tcpFIN | tcpACK}, {false, b, tcpFIN | tcpACK}}, stateClosed},
		{"fin-in-fin-out", []step{{false, a, tcpSYN}, {false, a, tcpFIN | tcpACK}, {true, b, tcpFIN | tcpACK}}, stateClosed},
		{"fin-out-fin-in", []step{{false, a, tcpSYN}, {true, b, tcpFIN | tcpACK}, {false, a, tcpFIN | tcpACK}}, stateClosed},
		{"rst-outbound-after-established", []step{{false, a, tcpSYN}, {true, b, tcpSYN | tcpACK}, {true, b, tcpRST}}, stateClosed},
		{"closed-stays-closed", []step{{false, a, tcpSYN}, {false, a, tcpRST}, {false, a, tcpACK}, {true, b, tcpACK}}, stateClosed},
		{"outbound-syn", []step{{true, b, tcpSYN}}, stateSyn},
		{"outbound-syn-inbound-synack", []step{{true, b, tcpSYN}, {false, a, tcpSYN | tcpACK}}, stateSyn},
		{"outbound-syn-inbound-synack-outbound-ack", []step{{true, b, tcpSYN}, {false, a, tcpSYN | tcpACK}, {true, b, tcpACK}}, stateEstablished},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := New(Config{Policy: all})
			for _, s := range tc.steps {
				dst := b
				if s.src == b {
					dst = a
				}
				p := tcp(s.src, dst, s.flags)
				if s.out {
					c.Outbound(p)
				} else {
					expect(t, c, p, Intercept, NoDrop)
				}
			}
			if f := c.flowOf(t, a, b); f.state != tc.want {
				t.Fatalf("state = %d, want %d", f.state, tc.want)
			}
			wantClosed := 0
			if tc.want == stateClosed {
				wantClosed = 1
			}
			if got := c.closedFlows(); got != wantClosed {
				t.Fatalf("closed count = %d, want %d", got, wantClosed)
			}
		})
	}
}

// TestLifecycle walks flows through their timeouts with synthetic time.
func TestLifecycle(t *testing.T) {
	const (
		synTO   = 30 * time.Second
		idleTO  = 10 * time.Minute
		closeTO = 10 * time.Second
	)
	newC := func() *Classifier {
		return New(Config{Policy: all, SynTimeout: synTO, IdleTimeout: idleTO, CloseTimeout: closeTO})
	}
	a, b := podA6, podB6

	t.Run("syn-timeout", func(t *testing.T) {
		c := newC()
		sweepAt(c, time.Second)
		expect(t, c, tcp(a, b, tcpSYN), Intercept, NoDrop)
		if n := sweepAt(c, time.Second+synTO-1); n != 0 {
			t.Fatalf("swept %d before SynTimeout", n)
		}
		// A retransmitted SYN does not establish but refreshes.
		expect(t, c, tcp(a, b, tcpSYN), Intercept, NoDrop)
		if n := sweepAt(c, 2*synTO); n != 0 {
			t.Fatalf("swept %d after retransmission", n)
		}
		if n := sweepAt(c, time.Second+2*synTO-1); n != 1 {
			t.Fatalf("swept %d at SynTimeout after the last SYN, want 1", n)
		}
		// The flow is gone, but the policy intercepts it either way:
		// a late segment goes to the netstack (which resets it).
		expect(t, c, tcp(a, b, tcpACK), Intercept, NoDrop)
		if st := c.Stats(); st.FlowsExpired != 1 || st.Flows != 0 || st.UnknownIntercepted != 1 {
			t.Fatalf("Stats = %+v", st)
		}
	})

	t.Run("idle-timeout", func(t *testing.T) {
		c := newC()
		expect(t, c, tcp(a, b, tcpSYN), Intercept, NoDrop)
		c.Outbound(tcp(b, a, tcpSYN|tcpACK))
		expect(t, c, tcp(a, b, tcpACK), Intercept, NoDrop)
		if n := sweepAt(c, synTO+time.Minute); n != 0 {
			t.Fatalf("established flow swept at SynTimeout")
		}
		expect(t, c, tcp(a, b, tcpACK), Intercept, NoDrop) // refresh at synTO+1m
		if n := sweepAt(c, synTO+time.Minute+idleTO-1); n != 0 {
			t.Fatalf("swept %d before IdleTimeout", n)
		}
		if n := sweepAt(c, synTO+time.Minute+idleTO); n != 1 {
			t.Fatalf("swept %d at IdleTimeout, want 1", n)
		}
		expect(t, c, tcp(a, b, tcpACK), Intercept, NoDrop)
	})

	for _, out := range []bool{false, true} {
		name := "rst-inbound"
		if out {
			name = "rst-outbound"
		}
		t.Run(name, func(t *testing.T) {
			c := newC()
			expect(t, c, tcp(a, b, tcpSYN), Intercept, NoDrop)
			c.Outbound(tcp(b, a, tcpSYN|tcpACK))
			expect(t, c, tcp(a, b, tcpACK), Intercept, NoDrop)
			sweepAt(c, time.Minute)
			if out {
				c.Outbound(tcp(b, a, tcpRST))
			} else {
				expect(t, c, tcp(a, b, tcpRST|tcpACK), Intercept, NoDrop)
			}
			// Grace: in-flight packets still reach the netstack, and
			// do not extend the grace.
			sweepAt(c, time.Minute+closeTO/2)
			expect(t, c, tcpPayload(a, b, tcpACK, 100), Intercept, NoDrop)
			if n := sweepAt(c, time.Minute+closeTO-1); n != 0 {
				t.Fatalf("swept %d before CloseTimeout", n)
			}
			if n := sweepAt(c, time.Minute+closeTO); n != 1 {
				t.Fatalf("swept %d at CloseTimeout, want 1", n)
			}
			expect(t, c, tcpPayload(a, b, tcpACK, 100), Intercept, NoDrop)
		})
	}

	t.Run("fin-fin", func(t *testing.T) {
		c := newC()
		expect(t, c, tcp(a, b, tcpSYN), Intercept, NoDrop)
		c.Outbound(tcp(b, a, tcpSYN|tcpACK))
		expect(t, c, tcp(a, b, tcpACK), Intercept, NoDrop)
		sweepAt(c, time.Minute)
		expect(t, c, tcp(a, b, tcpFIN|tcpACK), Intercept, NoDrop)
		if n := sweepAt(c, time.Minute+closeTO); n != 0 {
			t.Fatalf("half-closed flow swept after CloseTimeout")
		}
		sweepAt(c, 2*time.Minute)
		c.Outbound(tcp(b, a, tcpFIN|tcpACK))
		expect(t, c, tcp(a, b, tcpACK), Intercept, NoDrop) // the last ACK
		if n := sweepAt(c, 2*time.Minute+closeTO-1); n != 0 {
			t.Fatalf("swept %d before CloseTimeout", n)
		}
		if n := sweepAt(c, 2*time.Minute+closeTO); n != 1 {
			t.Fatalf("swept %d at CloseTimeout, want 1", n)
		}
	})

	t.Run("clock-does-not-go-back", func(t *testing.T) {
		c := newC()
		sweepAt(c, time.Hour)
		sweepAt(c, time.Minute)
		if got := c.clock.Load(); got != int64(time.Hour) {
			t.Fatalf("clock = %v after an earlier Sweep, want 1h", time.Duration(got))
		}
	})
}

// TestReuseClosed covers a new SYN on the addresses and ports of a flow in
// its close grace period.
func TestReuseClosed(t *testing.T) {
	a, b := podA4, podB4
	closed := func(p Policy) *Classifier {
		c := New(Config{Policy: all})
		expect(t, c, tcp(a, b, tcpSYN), Intercept, NoDrop)
		expect(t, c, tcp(a, b, tcpRST), Intercept, NoDrop)
		c.SetPolicy(p)
		return c
	}
	t.Run("selected", func(t *testing.T) {
		c := closed(all)
		expect(t, c, tcp(a, b, tcpSYN), Intercept, NoDrop)
		if f := c.flowOf(t, a, b); f.state != stateSyn || c.Len() != 1 || c.closedFlows() != 0 {
			t.Fatalf("flow %+v, Len %d, closed %d", f, c.Len(), c.closedFlows())
		}
	})
	t.Run("not-selected", func(t *testing.T) {
		c := closed(nil)
		expect(t, c, tcp(a, b, tcpSYN), Verbatim, NoDrop)
		expect(t, c, tcp(a, b, tcpACK), Verbatim, NoDrop)
		if c.Len() != 0 {
			t.Fatalf("Len = %d, want 0", c.Len())
		}
	})
	t.Run("outbound", func(t *testing.T) {
		c := closed(nil)
		c.Outbound(tcp(b, a, tcpSYN))
		if f := c.flowOf(t, a, b); f.state != stateSyn || (f.flags&flagInitLo != 0) != endpointLess(b, a) {
			t.Fatalf("flow %+v", f)
		}
		st := c.Stats()
		if st.FlowsInserted != 2 || st.FlowsReplaced != 1 || st.Flows != 1 {
			t.Fatalf("Stats = %+v", st)
		}
	})
}

func TestTableFull(t *testing.T) {
	const max = 4
	c := New(Config{MaxFlows: max, MaxHalfOpen: 100, Policy: toPort(80), IdleTimeout: time.Minute})
	client := func(i int) netip.AddrPort { return netip.AddrPortFrom(podA4.Addr(), uint16(50000+i)) }
	server := netip.AddrPortFrom(podB4.Addr(), 80)
	for i := range max {
		expect(t, c, tcp(client(i), server, tcpSYN), Intercept, NoDrop)
	}
	// Fail closed: a selected SYN is dropped, not forwarded.
	expect(t, c, tcp(client(max), server, tcpSYN), Drop, TableFull)
	expect(t, c, tcp(client(max), server, tcpACK), Verbatim, NoDrop)
	// Unselected traffic and existing flows are unaffected.
	expect(t, c, tcp(client(max), podB4, tcpSYN), Verbatim, NoDrop)
	expect(t, c, tcp(client(0), server, tcpACK), Intercept, NoDrop)
	// Netstack-originated flows cannot be registered either.
	c.Outbound(tcp(ext4, podB4, tcpSYN))
	expect(t, c, tcp(podB4, ext4, tcpSYN|tcpACK), Verbatim, NoDrop)
	if st := c.Stats(); st.OutboundTableFull != 1 || st.DropsByReason[TableFull] != 1 || st.Flows != max {
		t.Fatalf("Stats = %+v", st)
	}

	// A closed flow makes room: the oldest closed one is evicted.
	sweepAt(c, time.Second)
	expect(t, c, tcp(client(2), server, tcpRST), Intercept, NoDrop)
	sweepAt(c, 2*time.Second)
	expect(t, c, tcp(client(1), server, tcpRST), Intercept, NoDrop)
	expect(t, c, tcp(client(max), server, tcpSYN), Intercept, NoDrop)
	expect(t, c, tcp(client(2), server, tcpACK), Verbatim, NoDrop)  // evicted
	expect(t, c, tcp(client(1), server, tcpACK), Intercept, NoDrop) // still in grace
	expect(t, c, tcp(client(max+1), server, tcpSYN), Intercept, NoDrop)
	expect(t, c, tcp(client(max+2), server, tcpSYN), Drop, TableFull)
	if st := c.Stats(); st.FlowsReplaced != 2 || st.Flows != max ||
		st.FlowsInserted-st.FlowsExpired-st.FlowsReplaced != uint64(st.Flows) {
		t.Fatalf("Stats = %+v", st)
	}

	// Expiry makes room too.
	if n := sweepAt(c, time.Hour); n != max {
		t.Fatalf("swept %d, want %d", n, max)
	}
	expect(t, c, tcp(client(max+2), server, tcpSYN), Intercept, NoDrop)
}

// TestShardTable exercises the open-addressing table directly with
// colliding hashes and wrap-around against a map model.
func TestShardTable(t *testing.T) {
	var s shard
	s.init(New(Config{}), 32, 8)
	model := map[flowKey]uint32{}
	key := func(i int) flowKey { return flowKey{loLo: uint64(i), hiLo: uint64(i * 7), loPort: uint16(i)} }
	// Hashes crowd the end of the table so chains wrap around.
	hashOf := func(i int) uint32 { return uint32(28 + i%5) }
	rng := uint64(1)
	next := func(n int) int {
		rng ^= rng << 13
		rng ^= rng >> 7
		rng ^= rng << 17
		return int(rng % uint64(n))
	}
	check := func(step int) {
		t.Helper()
		if s.n != len(model) {
			t.Fatalf("step %d: n = %d, model %d", step, s.n, len(model))
		}
		for i := range 60 {
			k := key(i)
			_, want := model[k]
			if _, got := s.lookup(&k, hashOf(i)); got != want {
				t.Fatalf("step %d: lookup(%d) = %v, want %v", step, i, got, want)
			}
		}
	}
	for step := range 5000 {
		i := next(60)
		k := key(i)
		slot, ok := s.lookup(&k, hashOf(i))
		switch {
		case ok:
			s.remove(slot)
			delete(model, k)
		case s.n < s.limit:
			s.put(slot, &k, hashOf(i), nil, int64(step))
			model[k] = hashOf(i)
		}
		check(step)
	}

	// Sweep removes exactly the expired entries, even across the wrap and
	// when expired entries follow each other.
	for i := range 60 {
		k := key(i)
		if slot, ok := s.lookup(&k, hashOf(i)); ok {
			s.remove(slot)
		}
	}
	model = map[flowKey]uint32{}
	for i := range s.limit {
		k := key(i)
		slot, _ := s.lookup(&k, hashOf(i))
		last := int64(0) // two of three expire
		if i%3 == 0 {
			last = 5
			model[k] = hashOf(i)
		}
		s.put(slot, &k, hashOf(i), nil, last)
		s.slots[slot].state = stateEstablished
	}
	if n := s.sweep(10, 10, 10, 10); n != s.limit-len(model) {
		t.Fatalf("sweep removed %d, want %d", n, s.limit-len(model))
	}
	check(-1)
}

// TestRun checks that Run advances the clock and sweeps, and returns when
// its context ends.
func TestRun(t *testing.T) {
	c := New(Config{Policy: all, SynTimeout: time.Millisecond})
	expect(t, c, tcp(podA4, podB4, tcpSYN), Intercept, NoDrop)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		c.Run(ctx, time.Millisecond)
	}()
	// Nothing signals a sweep; poll the table until the flow is gone.
	deadline := time.Now().Add(10 * time.Second)
	for c.Len() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("flow not expired by Run after 10s; Stats %+v", c.Stats())
		}
		time.Sleep(time.Millisecond)
	}
	if st := c.Stats(); st.FlowsExpired != 1 {
		t.Fatalf("Stats = %+v, want 1 expired", st)
	}
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context was cancelled")
	}
}

// TestStatsByProto: verbatim and intercepted packets and bytes are counted
// by protocol class.
func TestStatsByProto(t *testing.T) {
	c := New(Config{Policy: all})
	u := udp(podA4, podB4, 100)
	ic := ipv4(podA4.Addr(), podB4.Addr(), protoICMP, []byte{8, 0, 0, 0, 0, 1, 0, 1})
	o := ipv6(podA6.Addr(), podB6.Addr(), 253, []byte{1, 2, 3})
	syn := tcp(podA4, podB4, tcpSYN)
	for _, p := range [][]byte{u, u, ic, o, syn} {
		c.Inbound(p)
	}
	st := c.Stats()
	for _, tc := range []struct {
		name      string
		got, want uint64
	}{
		{"verbatim udp packets", st.VerbatimPackets[ProtoUDP], 2},
		{"verbatim udp bytes", st.VerbatimBytes[ProtoUDP], uint64(2 * len(u))},
		{"verbatim icmp packets", st.VerbatimPackets[ProtoICMP], 1},
		{"verbatim other bytes", st.VerbatimBytes[ProtoOther], uint64(len(o))},
		{"intercepted tcp packets", st.InterceptedPackets[ProtoTCP], 1},
		{"intercepted tcp bytes", st.InterceptedBytes[ProtoTCP], uint64(len(syn))},
		{"verbatim tcp packets", st.VerbatimPackets[ProtoTCP], 0},
	} {
		if tc.got != tc.want {
			t.Errorf("%s = %d, want %d", tc.name, tc.got, tc.want)
		}
	}
	if ProtoICMP.String() != "icmp" {
		t.Errorf("ProtoICMP.String() = %q", ProtoICMP.String())
	}
}

// TestOutboundAck: OutboundAck reports how far the netstack's
// acknowledgment moved since its previous ACK on the flow, and nothing for
// the first ACK (a dial's handshake ACK), a SYN, or a packet of no flow.
func TestOutboundAck(t *testing.T) {
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			c := New(Config{})
			client, server := fam.outside, fam.b
			l3 := 20
			if client.Addr().Is6() {
				l3 = 40
			}
			ackOf := func(n uint32) []byte {
				p := tcp(client, server, tcpACK)
				binary.BigEndian.PutUint32(p[l3+8:], n)
				return p
			}
			if _, known, _ := c.OutboundAck(tcp(client, server, tcpSYN)); known {
				t.Fatal("SYN: known")
			}
			expect(t, c, tcp(server, client, tcpSYN|tcpACK), Intercept, NoDrop)
			if _, known, _ := c.OutboundAck(ackOf(5001)); known {
				t.Fatal("handshake ACK: known")
			}
			if adv, known, _ := c.OutboundAck(ackOf(5065)); !known || adv != 64 {
				t.Fatalf("second ACK: advance %d known %v, want 64 true", adv, known)
			}
			if adv, known, _ := c.OutboundAck(ackOf(5065)); !known || adv != 0 {
				t.Fatalf("same ACK again: advance %d known %v, want 0 true", adv, known)
			}
			// The netstack at the other end too (passthrough): its
			// ACKs are counted apart.
			back := tcp(server, client, tcpACK)
			binary.BigEndian.PutUint32(back[l3+8:], 9000)
			if _, known, _ := c.OutboundAck(back); known {
				t.Fatal("first ACK from the other end: known")
			}
			if adv, known, _ := c.OutboundAck(ackOf(5100)); !known || adv != 35 {
				t.Fatalf("after the other end's ACK: advance %d known %v, want 35 true", adv, known)
			}
			other := netip.AddrPortFrom(client.Addr(), client.Port()+1)
			if _, known, _ := c.OutboundAck(tcp(other, server, tcpACK)); known {
				t.Fatal("no flow: known")
			}
		})
	}
}
