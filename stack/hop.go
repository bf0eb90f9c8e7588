package stack

import "encoding/binary"

// restoreHop gives back the hop that the kernel takes a second time from
// a verbatim packet. The kernel forwards such a packet twice on this node,
// into the TUN and, after the write-back, out of it, and decrements its
// TTL (IPv4) or hop limit (IPv6) each time; the node must count as one
// hop, as it does without meshtun, or a packet that had just enough hops
// left would die here. pkt is an IP packet the classifier passed; the IPv4
// header checksum is updated incrementally (RFC 1624). A TTL of 255 is
// left alone.
func restoreHop(pkt []byte) {
	if len(pkt) < 1 {
		return
	}
	switch pkt[0] >> 4 {
	case 4:
		if len(pkt) < 20 || pkt[8] == 255 {
			return
		}
		// The TTL is the high byte of the 16-bit word at offset 8, so the
		// word grows by 0x0100: HC' = ~(~HC + ~m + m') = ~(~HC + 0x0100)
		// in ones' complement arithmetic.
		pkt[8]++
		sum := uint32(^binary.BigEndian.Uint16(pkt[10:12])) + 0x0100
		sum = (sum & 0xffff) + (sum >> 16)
		binary.BigEndian.PutUint16(pkt[10:12], ^uint16(sum))
	case 6:
		if len(pkt) < 40 || pkt[7] == 255 {
			return
		}
		pkt[7]++
	}
}
