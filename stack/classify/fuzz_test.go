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
		n++
		if n%32 == 0 {
			c.Sweep(c.base.Add(time.Duration(n) * time.Second))
		}
		st := c.Stats()
		if st.Flows < 0 || st.Flows > 16 || st.FlowsInserted-st.FlowsExpired-st.FlowsReplaced != uint64(st.Flows) {
			t.Fatalf("inconsistent stats %+v", st)
		}
	})
}
