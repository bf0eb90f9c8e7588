package stack

import (
	"encoding/binary"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"
)

// tcpSegment locates the TCP segment in pkt, an IPv4 or IPv6 packet: the
// addresses for the pseudo-header and the segment's bounds [off, end). It
// walks the IPv6 extension headers the classifier lets through to TCP
// (hop-by-hop, routing, destination options). ok is false if pkt is not a
// well-formed TCP packet.
func tcpSegment(pkt []byte) (src, dst tcpip.Address, off, end int, ok bool) {
	switch header.IPVersion(pkt) {
	case header.IPv4Version:
		if len(pkt) < header.IPv4MinimumSize {
			return
		}
		off = int(pkt[0]&0x0f) * 4
		end = int(binary.BigEndian.Uint16(pkt[2:4]))
		if off < header.IPv4MinimumSize || end < off || end > len(pkt) || pkt[9] != uint8(header.TCPProtocolNumber) {
			return
		}
		src, dst = tcpip.AddrFrom4Slice(pkt[12:16]), tcpip.AddrFrom4Slice(pkt[16:20])
	case header.IPv6Version:
		if len(pkt) < header.IPv6MinimumSize {
			return
		}
		end = header.IPv6MinimumSize + int(binary.BigEndian.Uint16(pkt[4:6]))
		if end > len(pkt) {
			return
		}
		next := pkt[6]
		off = header.IPv6MinimumSize
		for i := 0; next != uint8(header.TCPProtocolNumber); i++ {
			switch next {
			case 0, 43, 60:
			default:
				return
			}
			if i == 8 || end-off < 8 {
				return
			}
			l := (int(pkt[off+1]) + 1) * 8
			if end-off < l {
				return
			}
			next = pkt[off]
			off += l
		}
		src, dst = tcpip.AddrFrom16Slice(pkt[8:24]), tcpip.AddrFrom16Slice(pkt[24:40])
	default:
		return
	}
	if end-off < header.TCPMinimumSize || end-off > 0xffff {
		return
	}
	return src, dst, off, end, true
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
