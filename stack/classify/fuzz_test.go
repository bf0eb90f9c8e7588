package classify

import (
	"encoding/binary"
	"net/netip"
	"testing"
	"time"
)

// FuzzClassify feeds arbitrary bytes to Inbound and Outbound. Besides not
// panicking, it checks that verdicts and reasons agree, that classifying
// the same packet twice gives the same answer, and that the flow table
// stays within bounds with consistent counters.
func FuzzClassify(f *testing.F) {
	a6, b6 := podA6.Addr(), podB6.Addr()
	syn := tcpHdr(40000, 8080, tcpSYN, 0)
	seeds := [][]byte{
		tcp(podA4, podB4, tcpSYN),
		tcp(podB4, podA4, tcpSYN|tcpACK),
		tcpPayload(podA4, podB4, tcpACK|0x08, 32),
		tcp(podA4, podB4, tcpFIN|tcpACK),
		tcp(podA4, podB4, tcpRST),
		tcp(podA6, podB6, tcpSYN),
		tcpPayload(podB6, podA6, tcpACK, 16),
		udp(podA4, podB4, 8),
		udp(podA6, podB6, 8),
		ipv4(podA4.Addr(), podB4.Addr(), protoICMP, []byte{8, 0, 0, 0, 0, 1, 0, 1}),
		ipv6(a6, b6, protoTCP, syn, ext6{protoHopByHop, 8}, ext6{protoRouting, 24}, ext6{protoDestOpts, 16}),
		ipv6(a6, b6, protoTCP, syn, ext6{protoFragment, 8}),
		ipv6(a6, b6, protoNoNext, nil),
		{0x45},
		{},
	}
	frag := tcp(podA4, podB4, tcpSYN)
	binary.BigEndian.PutUint16(frag[6:], 0x2000)
	seeds = append(seeds, frag)
	for _, s := range seeds {
		f.Add(s)
	}

	// One classifier per fuzzing process, so inputs build on each
	// other's flows; small, so the full-table paths run too.
	c := New(Config{MaxFlows: 16, Policy: PolicyFunc(func(src, dst netip.AddrPort) bool {
		if !src.IsValid() || !dst.IsValid() {
			panic("policy got an invalid address")
		}
		return dst.Port()%4 != 3
	})})
	var n int
	f.Fuzz(func(t *testing.T, pkt []byte) {
		v, r := c.Inbound(pkt)
		if v > Drop || r >= numDropReasons || (v == Drop) != (r != NoDrop) {
			t.Fatalf("Inbound = %v/%v", v, r)
		}
		if v2, r2 := c.Inbound(pkt); v2 != v || r2 != r {
			t.Fatalf("Inbound twice: %v/%v then %v/%v", v, r, v2, r2)
		}
		c.Outbound(pkt)
		if len(pkt) > 0 {
			c.Outbound(pkt[:len(pkt)-1])
		}
		// The netstack takes and lets go of the packet's flow now and
		// then (as a connection request and its close would).
		var seg segment
		if res, _ := parse(pkt, false, &seg); res == parsedTCP && len(pkt) > 0 {
			src, dst := addrsOf(pkt, &seg)
			switch pkt[len(pkt)-1] % 4 {
			case 0:
				c.Own(dst, src)
			case 1:
				c.Release(src, dst)
			}
		}
		n++
		if n%32 == 0 {
			c.Sweep(c.base.Add(time.Duration(n) * time.Second))
			// The per-source counters add up to the half-open total.
			var sum int64
			for i := range c.halfBySrc {
				v := c.halfBySrc[i].Load()
				if v < 0 {
					t.Fatalf("per-source half-open counter %d is %d", i, v)
				}
				sum += int64(v)
			}
			if sum != c.halfTotal.Load() {
				t.Fatalf("per-source half-open counters sum to %d, total %d", sum, c.halfTotal.Load())
			}
		}
		st := c.Stats()
		if st.Flows < 0 || st.Flows > 16 || st.FlowsInserted-st.FlowsExpired-st.FlowsReplaced != uint64(st.Flows) {
			t.Fatalf("inconsistent stats %+v", st)
		}
		if st.HalfOpen < 0 || st.HalfOpen > st.Flows {
			t.Fatalf("half-open count %d of %d flows", st.HalfOpen, st.Flows)
		}
	})
}

// addrsOf returns the source and destination of a TCP segment parsed
// from pkt.
func addrsOf(pkt []byte, seg *segment) (src, dst netip.AddrPort) {
	if seg.v6 {
		return netip.AddrPortFrom(netip.AddrFrom16([16]byte(pkt[8:24])), seg.sport),
			netip.AddrPortFrom(netip.AddrFrom16([16]byte(pkt[24:40])), seg.dport)
	}
	return netip.AddrPortFrom(netip.AddrFrom4([4]byte(pkt[12:16])), seg.sport),
		netip.AddrPortFrom(netip.AddrFrom4([4]byte(pkt[16:20])), seg.dport)
}
