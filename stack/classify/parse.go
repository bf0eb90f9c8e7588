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
	var h IPHeader
	r := BadVersion
	switch {
	case len(pkt) == 0:
		r = TooShort
	case pkt[0]>>4 == 4:
		r = parseIPv4(pkt, strict, &h)
	case pkt[0]>>4 == 6:
		r = parseIPv6(pkt, strict, &h)
	}
	if r != NoDrop {
		return parsedMalformed, r
	}
	if h.Fragment {
		switch h.Proto {
		case protoTCP:
			return parsedMalformed, FragmentedTCP
		case protoHopByHop, protoRouting, protoDestOpts:
			if h.V6 { // the fragmented part starts with more headers
				return parsedMalformed, FragmentedTCP
			}
		}
		return parsedOther, NoDrop
	}
	if h.Proto != protoTCP {
		return parsedOther, NoDrop
	}
	seg.v6 = h.V6
	seg.srcOff = h.addrOff
	return parseTCP(pkt[h.L4:h.End], pkt, h.Declared-h.L4, seg)
}

// IPHeader is where the parts of an IP packet are, as ParseIP found them.
// It is the one reading of the IPv4 and IPv6 headers in meshtun: the
// classifier, the link's checksum verification and the node's spoof sink
// all use it. It lives on the caller's stack; nothing is allocated.
type IPHeader struct {
	// V6 is set for an IPv6 packet.
	V6 bool
	// Proto is the transport protocol: IPv4's protocol field, or IPv6's
	// first next header that is not hop-by-hop, routing or destination
	// options. For a fragment it is the fragmented part's protocol.
	Proto uint8
	// Fragment is set for an IPv4 fragment (MF flag or a fragment
	// offset) or an IPv6 packet with a fragment header.
	Fragment bool
	// L4 is the offset of the transport header (after the IPv4 options
	// or the IPv6 extension headers, the fragment header included).
	L4 int
	// End is where the packet ends by its length field: len(pkt) at most,
	// as ParseIP's non-strict mode cuts it. Declared is where the length
	// field says it ends.
	End, Declared int

	addrOff int // offset of the source address (the destination follows); 0 if unknown
}

// Addrs returns the source and destination addresses of pkt (4 or 16
// bytes each, slices of pkt), or nil if ParseIP did not find a fixed IPv4
// or IPv6 header. They are known as soon as the fixed header is there,
// even when ParseIP reports a problem further on.
func (h *IPHeader) Addrs(pkt []byte) (src, dst []byte) {
	switch {
	case h.addrOff == 0:
		return nil, nil
	case h.V6:
		return pkt[8:24], pkt[24:40]
	}
	return pkt[12:16], pkt[16:20]
}

// ParseIP reads the IPv4 or IPv6 header of pkt into h and returns NoDrop,
// or the reason the packet is malformed. In strict mode (packets read
// from the TUN) the IP length field must not exceed len(pkt); otherwise
// (headers the netstack writes, possibly without their payload) End is
// cut to len(pkt). It walks at most maxExtHeaders IPv6 extension headers.
func ParseIP(pkt []byte, strict bool, h *IPHeader) DropReason {
	*h = IPHeader{}
	if len(pkt) == 0 {
		return TooShort
	}
	switch pkt[0] >> 4 {
	case 4:
		return parseIPv4(pkt, strict, h)
	case 6:
		return parseIPv6(pkt, strict, h)
	}
	return BadVersion
}

func parseIPv4(pkt []byte, strict bool, h *IPHeader) DropReason {
	if len(pkt) < ipv4MinHeader {
		return TooShort
	}
	h.addrOff = 12
	ihl := int(pkt[0]&0x0f) * 4
	if ihl < ipv4MinHeader {
		return BadHeaderLength
	}
	if ihl > len(pkt) {
		return HeaderTruncated
	}
	declared := int(binary.BigEndian.Uint16(pkt[2:4]))
	if declared < ihl {
		return BadTotalLength
	}
	end := declared
	if end > len(pkt) {
		if strict {
			return Truncated
		}
		end = len(pkt)
	}
	h.Proto = pkt[9]
	h.Fragment = binary.BigEndian.Uint16(pkt[6:8])&0x3fff != 0
	h.L4, h.End, h.Declared = ihl, end, declared
	return NoDrop
}

func parseIPv6(pkt []byte, strict bool, h *IPHeader) DropReason {
	if len(pkt) < ipv6Header {
		return TooShort
	}
	h.V6 = true
	h.addrOff = 8
	declared := ipv6Header + int(binary.BigEndian.Uint16(pkt[4:6]))
	end := declared
	if end > len(pkt) {
		if strict {
			return Truncated
		}
		end = len(pkt)
	}
	h.End, h.Declared = end, declared
	next := pkt[6]
	off := ipv6Header
	for n := 0; ; n++ {
		switch next {
		case protoHopByHop, protoRouting, protoDestOpts:
			if n == maxExtHeaders {
				return TooManyExtHeaders
			}
			// Every one of these is at least 8 bytes: next header,
			// length in 8-byte units not counting the first, data.
			if end-off < 8 {
				return ExtHeaderTruncated
			}
			l := (int(pkt[off+1]) + 1) * 8
			if end-off < l {
				return ExtHeaderTruncated
			}
			next = pkt[off]
			off += l
		case protoFragment:
			// A fragment header is 8 bytes; its first byte is the
			// next header of the fragmented part.
			if end-off < 8 {
				return ExtHeaderTruncated
			}
			h.Fragment = true
			h.Proto = pkt[off]
			h.L4 = off + 8
			return NoDrop
		default:
			// TCP, no next header, ESP, AH, UDP, ICMPv6, ...
			h.Proto = next
			h.L4 = off
			return NoDrop
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
