package classify

import (
	"bytes"
	"net/netip"
	"testing"
)

// TestParseIP: the exported header parser finds the transport header past
// IPv6 extension headers, marks fragments, cuts End only when not strict,
// and reports the addresses even when the rest of the header is bad (the
// spoof sink logs them).
func TestParseIP(t *testing.T) {
	s4, d4 := netip.MustParseAddrPort("198.18.0.1:1000"), netip.MustParseAddrPort("198.18.0.2:80")
	s6, d6 := netip.MustParseAddrPort("[fd00::1]:1000"), netip.MustParseAddrPort("[fd00::2]:80")
	var h IPHeader
	check := func(name string, pkt []byte, strict bool, want DropReason, v6 bool, proto uint8, frag bool, l4, end int) {
		t.Helper()
		if r := ParseIP(pkt, strict, &h); r != want {
			t.Errorf("%s: ParseIP = %v, want %v", name, r, want)
			return
		}
		if want != NoDrop {
			return
		}
		if h.V6 != v6 || h.Proto != proto || h.Fragment != frag || h.L4 != l4 || h.End != end {
			t.Errorf("%s: %+v; want v6 %v proto %d fragment %v L4 %d End %d", name, h, v6, proto, frag, l4, end)
		}
	}
	p4 := tcp(s4, d4, tcpSYN)
	check("v4 tcp", p4, true, NoDrop, false, protoTCP, false, 20, 40)
	p6 := tcp(s6, d6, tcpSYN, ext6{protoHopByHop, 8}, ext6{protoDestOpts, 16})
	check("v6 tcp after two extension headers", p6, true, NoDrop, true, protoTCP, false, 64, 84)
	check("v6 fragment", tcp(s6, d6, tcpSYN, ext6{protoFragment, 8}), true, NoDrop, true, protoTCP, true, 48, 68)
	f4 := append([]byte(nil), p4...)
	f4[6] = 0x20 // MF
	check("v4 fragment", f4, true, NoDrop, false, protoTCP, true, 20, 40)
	check("v4 cut, strict", p4[:30], true, Truncated, false, 0, false, 0, 0)
	check("v4 cut, not strict", p4[:30], false, NoDrop, false, protoTCP, false, 20, 30)
	if h.Declared != 40 {
		t.Errorf("v4 cut: Declared %d, want 40", h.Declared)
	}

	bad := append([]byte(nil), p4...)
	bad[0] = 0x41 // IHL 4: malformed, but the addresses are there
	check("v4 bad IHL", bad, true, BadHeaderLength, false, 0, false, 0, 0)
	if s, d := h.Addrs(bad); !bytes.Equal(s, bad[12:16]) || !bytes.Equal(d, bad[16:20]) {
		t.Errorf("addresses of a bad IHL packet: %v %v", s, d)
	}
	check("v6 tcp again", p6, true, NoDrop, true, protoTCP, false, 64, 84)
	if s, d := h.Addrs(p6); netip.AddrFrom16([16]byte(s)) != s6.Addr() || netip.AddrFrom16([16]byte(d)) != d6.Addr() {
		t.Errorf("v6 addresses: %v %v", s, d)
	}
	check("too short", p4[:19], true, TooShort, false, 0, false, 0, 0)
	if s, d := h.Addrs(p4[:19]); s != nil || d != nil {
		t.Errorf("addresses of a packet without a fixed header: %v %v", s, d)
	}
	check("empty", nil, true, TooShort, false, 0, false, 0, 0)
	if n := testing.AllocsPerRun(100, func() { ParseIP(p6, true, &h); h.Addrs(p6) }); n != 0 {
		t.Errorf("ParseIP allocates %v times", n)
	}
}
