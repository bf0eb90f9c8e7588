package stack

import (
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/meshtun/meshtun/stack/classify"
)

// tcpSegment locates the TCP segment in pkt, an IPv4 or IPv6 packet: the
// addresses for the pseudo-header and the segment's bounds [off, end). The
// IP header is read by the classifier's parser (classify.ParseIP, strict:
// the length field must fit in pkt), which walks the IPv6 extension
// headers the classifier lets through to TCP. ok is false if pkt is not a
// well-formed, unfragmented TCP packet.
func tcpSegment(pkt []byte) (src, dst tcpip.Address, off, end int, ok bool) {
	var h classify.IPHeader
	if classify.ParseIP(pkt, true, &h) != classify.NoDrop || h.Fragment || h.Proto != uint8(header.TCPProtocolNumber) {
		return
	}
	off, end = h.L4, h.End
	if end-off < header.TCPMinimumSize || end-off > 0xffff {
		return
	}
	s, d := h.Addrs(pkt)
	return tcpip.AddrFromSlice(s), tcpip.AddrFromSlice(d), off, end, true
}

// checksumsValid verifies the IPv4 header checksum and the TCP checksum of
// pkt, an IPv4 or IPv6 TCP packet. It reports false for anything it cannot
// verify.
func checksumsValid(pkt []byte) bool {
	src, dst, off, end, ok := tcpSegment(pkt)
	if !ok {
		return false
	}
	if header.IPVersion(pkt) == header.IPv4Version && checksum.Checksum(pkt[:off], 0) != 0xffff {
		return false
	}
	seg := pkt[off:end]
	xsum := header.PseudoHeaderChecksum(header.TCPProtocolNumber, src, dst, uint16(len(seg)))
	return checksum.Checksum(seg, xsum) == 0xffff
}

// headersEnd returns the length of pkt's IP and TCP headers, or 0 if pkt is
// not a well-formed TCP packet.
func headersEnd(pkt []byte) int {
	_, _, off, end, ok := tcpSegment(pkt)
	if !ok {
		return 0
	}
	doff := int(pkt[off+12]>>4) * 4
	if doff < header.TCPMinimumSize || off+doff > end {
		return 0
	}
	return off + doff
}
