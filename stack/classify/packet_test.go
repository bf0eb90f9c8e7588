package classify

import (
	"encoding/binary"
	"net/netip"
)

// Hand-written packet builders for the tests: the classifier must cope with
// packets that no well-behaved library would produce, so the tests build
// the bytes themselves (one test cross-checks against gVisor's encoders).

const (
	protoUDP    = 17
	protoICMP   = 1
	protoICMPv6 = 58
	protoNoNext = 59
)

// tcpHdr returns a 20-byte TCP header followed by payload zero bytes.
func tcpHdr(sport, dport uint16, flags uint8, payload int) []byte {
	b := make([]byte, tcpMinHeader+payload)
	binary.BigEndian.PutUint16(b[0:], sport)
	binary.BigEndian.PutUint16(b[2:], dport)
	// Both ends start at sequence number 1000 and acknowledge the
	// other's SYN (1001): enough for the handshake to complete.
	binary.BigEndian.PutUint32(b[4:], 1000) // seq
	if flags&tcpACK != 0 {
		binary.BigEndian.PutUint32(b[8:], 1001)
	}
	b[12] = 5 << 4
	b[13] = flags
	binary.BigEndian.PutUint16(b[14:], 65535)
	return b
}

// udpHdr returns an 8-byte UDP header followed by payload zero bytes.
func udpHdr(sport, dport uint16, payload int) []byte {
	b := make([]byte, 8+payload)
	binary.BigEndian.PutUint16(b[0:], sport)
	binary.BigEndian.PutUint16(b[2:], dport)
	binary.BigEndian.PutUint16(b[4:], uint16(len(b)))
	return b
}

// ipv4 wraps l4 in a 20-byte IPv4 header with a valid checksum.
func ipv4(src, dst netip.Addr, proto uint8, l4 []byte) []byte {
	b := make([]byte, 20+len(l4))
	b[0] = 0x45
	binary.BigEndian.PutUint16(b[2:], uint16(len(b)))
	binary.BigEndian.PutUint16(b[4:], 0x1234) // id
	b[6] = 0x40                               // DF
	b[8] = 64
	b[9] = proto
	s, d := src.As4(), dst.As4()
	copy(b[12:], s[:])
	copy(b[16:], d[:])
	var sum uint32
	for i := 0; i < 20; i += 2 {
		sum += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	for sum > 0xffff {
		sum = sum>>16 + sum&0xffff
	}
	binary.BigEndian.PutUint16(b[10:], ^uint16(sum))
	copy(b[20:], l4)
	return b
}

// ext6 is an IPv6 extension header to put before the upper layer: typ is its
// protocol number, size its total length (a multiple of 8; the fragment
// header is always 8).
type ext6 struct {
	typ  uint8
	size int
}

// ipv6 wraps l4 in an IPv6 header and the extension headers exts.
func ipv6(src, dst netip.Addr, proto uint8, l4 []byte, exts ...ext6) []byte {
	n := 40 + len(l4)
	for _, e := range exts {
		n += e.size
	}
	b := make([]byte, n)
	b[0] = 0x60
	binary.BigEndian.PutUint16(b[4:], uint16(n-40))
	b[7] = 64
	s, d := src.As16(), dst.As16()
	copy(b[8:], s[:])
	copy(b[24:], d[:])
	next := &b[6]
	off := 40
	for _, e := range exts {
		*next = e.typ
		next = &b[off]
		if e.typ != protoFragment {
			b[off+1] = uint8(e.size/8 - 1)
		}
		off += e.size
	}
	*next = proto
	copy(b[off:], l4)
	return b
}

// tcp builds an IPv4 or IPv6 TCP packet (by the family of src).
func tcp(src, dst netip.AddrPort, flags uint8, exts ...ext6) []byte {
	return tcpPayload(src, dst, flags, 0, exts...)
}

func tcpPayload(src, dst netip.AddrPort, flags uint8, payload int, exts ...ext6) []byte {
	l4 := tcpHdr(src.Port(), dst.Port(), flags, payload)
	if src.Addr().Is4() {
		return ipv4(src.Addr(), dst.Addr(), protoTCP, l4)
	}
	return ipv6(src.Addr(), dst.Addr(), protoTCP, l4, exts...)
}

// udp builds an IPv4 or IPv6 UDP packet.
func udp(src, dst netip.AddrPort, payload int) []byte {
	l4 := udpHdr(src.Port(), dst.Port(), payload)
	if src.Addr().Is4() {
		return ipv4(src.Addr(), dst.Addr(), protoUDP, l4)
	}
	return ipv6(src.Addr(), dst.Addr(), protoUDP, l4)
}

// Addresses from the benchmarking ranges the project's tests use.
var (
	podA4  = netip.MustParseAddrPort("198.18.1.10:40000")
	podB4  = netip.MustParseAddrPort("198.18.2.20:8080")
	ext4   = netip.MustParseAddrPort("198.19.0.1:443")
	podA6  = netip.MustParseAddrPort("[fd00:1::10]:40000")
	podB6  = netip.MustParseAddrPort("[fd00:2::20]:8080")
	ext6ep = netip.MustParseAddrPort("[fd00:99::1]:443")
)

// family gives the two pods and an outsider of one address family.
type family struct {
	name          string
	a, b, outside netip.AddrPort
}

var families = []family{
	{"ipv4", podA4, podB4, ext4},
	{"ipv6", podA6, podB6, ext6ep},
}

// toPort is a policy intercepting SYNs to one destination port.
func toPort(port uint16) Policy {
	return PolicyFunc(func(_, dst netip.AddrPort) bool { return dst.Port() == port })
}

// all intercepts every SYN.
var all = PolicyFunc(func(_, _ netip.AddrPort) bool { return true })
