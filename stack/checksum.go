package stack

import (
	"encoding/binary"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"
)

// checksumsValid verifies the IPv4 header checksum and the TCP checksum of
// pkt, an IPv4 or IPv6 TCP segment the classifier accepted (so its
// headers are present and its length fields agree with len(pkt)). It
// reports false for anything it cannot verify.
func checksumsValid(pkt []byte) bool {
	var src, dst tcpip.Address
	var seg []byte
	switch header.IPVersion(pkt) {
	case header.IPv4Version:
		if len(pkt) < header.IPv4MinimumSize {
			return false
		}
		ihl := int(pkt[0]&0x0f) * 4
		total := int(binary.BigEndian.Uint16(pkt[2:4]))
		if ihl < header.IPv4MinimumSize || total < ihl || total > len(pkt) {
			return false
		}
		if checksum.Checksum(pkt[:ihl], 0) != 0xffff {
			return false
		}
		if pkt[9] != uint8(header.TCPProtocolNumber) {
			return false
		}
		src, dst = tcpip.AddrFrom4Slice(pkt[12:16]), tcpip.AddrFrom4Slice(pkt[16:20])
		seg = pkt[ihl:total]
	case header.IPv6Version:
		if len(pkt) < header.IPv6MinimumSize {
			return false
		}
		end := header.IPv6MinimumSize + int(binary.BigEndian.Uint16(pkt[4:6]))
		if end > len(pkt) {
			return false
		}
		off, next := header.IPv6MinimumSize, pkt[6]
		// Walk the extension headers the classifier lets through to
		// TCP (hop-by-hop, routing, destination options).
		for i := 0; next != uint8(header.TCPProtocolNumber); i++ {
			switch next {
			case 0, 43, 60:
			default:
				return false
			}
			if i == 8 || end-off < 8 {
				return false
			}
			l := (int(pkt[off+1]) + 1) * 8
			if end-off < l {
				return false
			}
			next = pkt[off]
			off += l
		}
		src, dst = tcpip.AddrFrom16Slice(pkt[8:24]), tcpip.AddrFrom16Slice(pkt[24:40])
		seg = pkt[off:end]
	default:
		return false
	}
	if len(seg) < header.TCPMinimumSize || len(seg) > 0xffff {
		return false
	}
	xsum := header.PseudoHeaderChecksum(header.TCPProtocolNumber, src, dst, uint16(len(seg)))
	return checksum.Checksum(seg, xsum) == 0xffff
}
