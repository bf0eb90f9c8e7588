package classify

import "encoding/binary"

// IP protocol numbers and TCP flag bits the parser looks at.
const (
	protoHopByHop = 0
	protoTCP      = 6
	protoRouting  = 43
	protoFragment = 44
	protoDestOpts = 60

	tcpFIN = 0x01
	tcpSYN = 0x02
	tcpRST = 0x04
	tcpACK = 0x10

	// tcpOptWScale is the TCP window scale option's kind.
	tcpOptWScale = 3

	// maxExtHeaders bounds the IPv6 extension header walk.
	maxExtHeaders = 8

	ipv4MinHeader = 20
	ipv6Header    = 40
	tcpMinHeader  = 20
)

// parseResult says what parse found.
type parseResult uint8

const (
	parsedOther     parseResult = iota // valid, but not a trackable TCP segment
	parsedTCP                          // valid TCP segment, seg filled in
	parsedMalformed                    // drop, with a reason
)

// segment is what the classifier needs of a TCP segment. It lives on the
// caller's stack.
type segment struct {
	key    flowKey
	fromLo bool  // the source endpoint is key's low endpoint
	flags  uint8 // TCP flags byte
	v6     bool
	srcOff int // offset of the source address in the packet (dst follows)
	sport  uint16
	dport  uint16
	seq    uint32 // sequence number
	ack    uint32 // acknowledgment number
	plen   uint32 // payload length, from the IP length fields
	win    uint16 // window field, unscaled
	wscale int8   // window scale option of a SYN, -1 if absent
}

// parse inspects an IP packet. In strict mode (packets read from the TUN)
// the IP length fields must agree with len(pkt); otherwise (headers the
// netstack writes, possibly without their payload) only the headers need to
// be present.
func parse(pkt []byte, strict bool, seg *segment) (parseResult, DropReason) {
	if len(pkt) == 0 {
		return parsedMalformed, TooShort
	}
	switch pkt[0] >> 4 {
	case 4:
		return parse4(pkt, strict, seg)
	case 6:
		return parse6(pkt, strict, seg)
	}
	return parsedMalformed, BadVersion
}

func parse4(pkt []byte, strict bool, seg *segment) (parseResult, DropReason) {
	if len(pkt) < ipv4MinHeader {
		return parsedMalformed, TooShort
	}
	ihl := int(pkt[0]&0x0f) * 4
	if ihl < ipv4MinHeader {
		return parsedMalformed, BadHeaderLength
	}
	if ihl > len(pkt) {
		return parsedMalformed, HeaderTruncated
	}
	end := int(binary.BigEndian.Uint16(pkt[2:4]))
	if end < ihl {
		return parsedMalformed, BadTotalLength
	}
	if end > len(pkt) {
		if strict {
			return parsedMalformed, Truncated
		}
		end = len(pkt)
	}
	// MF flag or a non-zero fragment offset: a fragment.
	if binary.BigEndian.Uint16(pkt[6:8])&0x3fff != 0 {
		if pkt[9] == protoTCP {
			return parsedMalformed, FragmentedTCP
		}
		return parsedOther, NoDrop
	}
	if pkt[9] != protoTCP {
		return parsedOther, NoDrop
	}
	seg.v6 = false
	seg.srcOff = 12
	return parseTCP(pkt[ihl:end], pkt, int(binary.BigEndian.Uint16(pkt[2:4]))-ihl, seg)
}

func parse6(pkt []byte, strict bool, seg *segment) (parseResult, DropReason) {
	if len(pkt) < ipv6Header {
		return parsedMalformed, TooShort
	}
	declared := ipv6Header + int(binary.BigEndian.Uint16(pkt[4:6]))
	end := declared
	if end > len(pkt) {
		if strict {
			return parsedMalformed, Truncated
		}
		end = len(pkt)
	}
	next := pkt[6]
	off := ipv6Header
	for n := 0; ; n++ {
		switch next {
		case protoTCP:
			seg.v6 = true
			seg.srcOff = 8
			return parseTCP(pkt[off:end], pkt, declared-off, seg)
		case protoHopByHop, protoRouting, protoDestOpts:
			if n == maxExtHeaders {
				return parsedMalformed, TooManyExtHeaders
			}
			// Every one of these is at least 8 bytes: next header,
			// length in 8-byte units not counting the first, data.
			if end-off < 8 {
				return parsedMalformed, ExtHeaderTruncated
			}
			l := (int(pkt[off+1]) + 1) * 8
			if end-off < l {
				return parsedMalformed, ExtHeaderTruncated
			}
			next = pkt[off]
			off += l
		case protoFragment:
			// A fragment header is 8 bytes; its first byte is the
			// next header of the fragmented part.
			if end-off < 8 {
				return parsedMalformed, ExtHeaderTruncated
			}
			switch pkt[off] {
			case protoTCP, protoHopByHop, protoRouting, protoDestOpts:
				return parsedMalformed, FragmentedTCP
			}
			return parsedOther, NoDrop
		default:
			// No next header, ESP, AH, UDP, ICMPv6, ...
			return parsedOther, NoDrop
		}
	}
}

// parseTCP reads the TCP header at the start of l4 and the addresses of
// the enclosing IP header ip into seg. l4len is the length of the TCP
// segment the IP header declares (l4 may have been cut short of it).
func parseTCP(l4, ip []byte, l4len int, seg *segment) (parseResult, DropReason) {
	if len(l4) < tcpMinHeader {
		return parsedMalformed, TCPTruncated
	}
	doff := int(l4[12]>>4) * 4
	if doff < tcpMinHeader {
		return parsedMalformed, BadTCPDataOffset
	}
	if doff > len(l4) {
		return parsedMalformed, TCPTruncated
	}
	seg.sport = binary.BigEndian.Uint16(l4[0:2])
	seg.dport = binary.BigEndian.Uint16(l4[2:4])
	seg.flags = l4[13]
	seg.seq = binary.BigEndian.Uint32(l4[4:8])
	seg.ack = binary.BigEndian.Uint32(l4[8:12])
	seg.win = binary.BigEndian.Uint16(l4[14:16])
	seg.plen = 0
	if l4len > doff {
		seg.plen = uint32(l4len - doff)
	}
	seg.wscale = -1
	if seg.flags&tcpSYN != 0 {
		seg.wscale = windowScale(l4[tcpMinHeader:doff])
	}

	var sHi, sLo, dHi, dLo uint64
	if seg.v6 {
		sHi = binary.BigEndian.Uint64(ip[8:16])
		sLo = binary.BigEndian.Uint64(ip[16:24])
		dHi = binary.BigEndian.Uint64(ip[24:32])
		dLo = binary.BigEndian.Uint64(ip[32:40])
	} else {
		sLo = uint64(binary.BigEndian.Uint32(ip[12:16]))
		dLo = uint64(binary.BigEndian.Uint32(ip[16:20]))
	}
	seg.fromLo = endpointLE(sHi, sLo, seg.sport, dHi, dLo, seg.dport)
	k := &seg.key
	k.v6 = seg.v6
	if seg.fromLo {
		k.loHi, k.loLo, k.loPort = sHi, sLo, seg.sport
		k.hiHi, k.hiLo, k.hiPort = dHi, dLo, seg.dport
	} else {
		k.loHi, k.loLo, k.loPort = dHi, dLo, seg.dport
		k.hiHi, k.hiLo, k.hiPort = sHi, sLo, seg.sport
	}
	return parsedTCP, NoDrop
}

// endpointLE orders endpoints (address, port) lexicographically.
func endpointLE(aHi, aLo uint64, aPort uint16, bHi, bLo uint64, bPort uint16) bool {
	if aHi != bHi {
		return aHi < bHi
	}
	if aLo != bLo {
		return aLo < bLo
	}
	return aPort <= bPort
}

// windowScale returns the shift of the window scale option among the TCP
// options opts, or -1 if there is none (or the options are malformed).
func windowScale(opts []byte) int8 {
	for i := 0; i < len(opts); {
		switch kind := opts[i]; kind {
		case 0: // end of options
			return -1
		case 1: // no-op
			i++
			continue
		default:
			if i+1 >= len(opts) {
				return -1
			}
			l := int(opts[i+1])
			if l < 2 || i+l > len(opts) {
				return -1
			}
			if kind == tcpOptWScale && l == 3 {
				ws := opts[i+2]
				if ws > 14 {
					ws = 14 // RFC 7323 §2.3
				}
				return int8(ws)
			}
			i += l
		}
	}
	return -1
}
