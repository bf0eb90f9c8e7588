package stack

import (
	"encoding/binary"
	"os"

	"gvisor.dev/gvisor/pkg/tcpip/checksum"

	"github.com/meshtun/meshtun/tun"
)

// Verbatim UDP datagrams of one flow that the TUN queued back to back are
// written back as one UDP GSO super-packet (virtio-net GSO_UDP_L4, "USO"):
// one write, and one pass through the kernel's forwarding, for up to
// udpGSOMaxSegs datagrams instead of one each. The kernel cuts it into the
// same datagrams again where it must (an egress device without USO, the
// receiving socket), and a TUN with USO on the next node reads it whole.
//
// The classifier still judges every datagram as it is read; only the
// write-back is batched, and only for datagrams whose segmentation gives
// back the bytes that were read:
//
//   - a plain datagram (no GSO) with a partial checksum (NEEDS_CSUM at the
//     UDP checksum field, holding the pseudo-header sum): its checksum is
//     computed on the way out either way, so it is never made valid where
//     it was not; for IPv4 a valid header checksum (each segment gets a
//     new one);
//   - IPv4 without options and not a fragment, or IPv6 with UDP right after
//     the fixed header; the length fields agree with the packet;
//   - the same addresses, ports, TTL or hop limit, TOS or traffic class and
//     flow label, DF bit, as the batch's first datagram, and for IPv4 the
//     next IP ID (the kernel numbers the segments' IDs from the first);
//   - the same payload length as the first, except the last, which may be
//     shorter (GSO segments are gso_size long, the last one at most).
//
// Anything else, from any flow, first flushes the batch: no packet is
// written ahead of one read before it.

// noUDPGSO turns the coalescing off (MESHTUN_UDP_GSO=0): for A/B runs
// with one binary and as a way out should a kernel mishandle the
// super-packets.
var noUDPGSO = os.Getenv("MESHTUN_UDP_GSO") == "0"

const (
	// udpGSOMaxSegs bounds the datagrams in one super-packet (below the
	// kernel's UDP_MAX_SEGMENTS).
	udpGSOMaxSegs = 64
	udpHeaderLen  = 8
	protoUDP      = 17
	// udpGSOMaxLen bounds a super-packet's IP length fields (IPv4 total
	// length, IPv6 payload length, UDP length): 16 bits.
	udpGSOMaxLen = 0xffff
)

// udpCandidate reports whether pkt, a verbatim packet read with virtio-net
// header vh, is a datagram that may join a UDP GSO super-packet, and
// returns its IP header length.
func udpCandidate(pkt []byte, vh *tun.VnetHdr) (iphl int, ok bool) {
	if vh.GSOType != tun.GSONone || vh.Flags != tun.VnetNeedsCsum || vh.CsumOffset != 6 {
		return 0, false
	}
	if len(pkt) < 1 {
		return 0, false
	}
	switch pkt[0] >> 4 {
	case 4:
		iphl = 20
		if len(pkt) <= iphl+udpHeaderLen || pkt[0] != 0x45 || pkt[9] != protoUDP ||
			binary.BigEndian.Uint16(pkt[6:8])&0x3fff != 0 || // MF or an offset: a fragment
			int(binary.BigEndian.Uint16(pkt[2:4])) != len(pkt) {
			return 0, false
		}
	case 6:
		iphl = 40
		if len(pkt) <= iphl+udpHeaderLen || pkt[6] != protoUDP ||
			iphl+int(binary.BigEndian.Uint16(pkt[4:6])) != len(pkt) {
			return 0, false
		}
	default:
		return 0, false
	}
	udpLen := len(pkt) - iphl
	if int(vh.CsumStart) != iphl || int(binary.BigEndian.Uint16(pkt[iphl+4:iphl+6])) != udpLen {
		return 0, false
	}
	// The checksums the kernel recomputes for each segment must be the
	// ones read: a valid IPv4 header checksum, and the pseudo-header sum
	// in the partial UDP checksum (what the kernel leaves there).
	if iphl == 20 && checksum.Checksum(pkt[:20], 0) != 0xffff {
		return 0, false
	}
	if !onesEqual(binary.BigEndian.Uint16(pkt[iphl+6:]), pseudoSum(pkt, iphl, udpLen)) {
		return 0, false
	}
	return iphl, true
}

// pseudoSum is the folded ones' complement sum of the UDP pseudo-header of
// pkt (IP header length iphl) for a UDP length of udpLen.
func pseudoSum(pkt []byte, iphl, udpLen int) uint16 {
	var sum uint16
	if iphl == 20 {
		sum = checksum.Checksum(pkt[12:20], 0)
	} else {
		sum = checksum.Checksum(pkt[8:40], 0)
	}
	return checksum.Combine(checksum.Combine(sum, protoUDP), uint16(udpLen))
}

// onesEqual compares two ones' complement sums, in which 0 and 0xffff are
// both zero.
func onesEqual(a, b uint16) bool {
	return a == b || (a == 0 || a == 0xffff) && (b == 0 || b == 0xffff)
}

// udpBatch is a UDP GSO super-packet being gathered: the first datagram
// whole and the payloads of the others, all still in the read buffer.
type udpBatch struct {
	first   []byte // the first datagram's virtio-net header and IP packet
	iphl    int    // its IP header length
	gsoSize int    // its payload length: that of every datagram but the last
	n       int    // datagrams in the batch
	payload int    // their payload bytes
	closed  bool   // a shorter datagram came: it must be the last
	bufs    [][]byte
	hdr     [tun.VnetHdrLen]byte
}

// start begins a batch with frame (a virtio-net header of vnet bytes and a
// datagram that passed udpCandidate with iphl).
func (b *udpBatch) start(frame []byte, vnet, iphl int) {
	b.first, b.iphl = frame, iphl
	b.gsoSize = len(frame) - vnet - iphl - udpHeaderLen
	b.n, b.payload, b.closed = 1, b.gsoSize, false
	b.bufs = append(b.bufs[:0], nil, frame[vnet:])
}

// add appends pkt, a datagram that passed udpCandidate with iphl, if it may
// follow the batch's datagrams in one super-packet, and reports whether it
// did.
func (b *udpBatch) add(pkt []byte, vnet, iphl int) bool {
	first := b.first[vnet:]
	size := len(pkt) - iphl - udpHeaderLen
	if b.closed || iphl != b.iphl || size > b.gsoSize || b.n == udpGSOMaxSegs ||
		iphl+udpHeaderLen+b.payload+size > udpGSOMaxLen {
		return false
	}
	switch iphl {
	case 20:
		// Version and IHL, TOS; flags (DF); TTL, protocol; addresses;
		// ports. Not the lengths, the ID or the checksums.
		if pkt[0] != first[0] || pkt[1] != first[1] ||
			binary.BigEndian.Uint16(pkt[6:8]) != binary.BigEndian.Uint16(first[6:8]) ||
			pkt[8] != first[8] || pkt[9] != first[9] ||
			string(pkt[12:20]) != string(first[12:20]) ||
			string(pkt[20:24]) != string(first[20:24]) ||
			binary.BigEndian.Uint16(pkt[4:6]) != binary.BigEndian.Uint16(first[4:6])+uint16(b.n) {
			return false
		}
	default:
		// Version, traffic class, flow label; next header, hop limit;
		// addresses; ports.
		if string(pkt[0:4]) != string(first[0:4]) || pkt[6] != first[6] || pkt[7] != first[7] ||
			string(pkt[8:44]) != string(first[8:44]) {
			return false
		}
	}
	b.bufs = append(b.bufs, pkt[iphl+udpHeaderLen:])
	b.n++
	b.payload += size
	if size < b.gsoSize {
		b.closed = true
	}
	return true
}

// full reports whether no further datagram can join the batch.
func (b *udpBatch) full() bool {
	return b.closed || b.n == udpGSOMaxSegs || b.iphl+udpHeaderLen+b.payload+b.gsoSize > udpGSOMaxLen
}

// superPacket turns a batch of two datagrams or more into one UDP GSO
// packet and returns it as the buffers to write, the virtio-net header
// first: the first datagram's headers get the total lengths (and, for
// IPv4, a new header checksum), its UDP checksum field the pseudo-header
// sum over the total length (the partial checksum the kernel completes per
// segment), and the header describes segments of gsoSize payload bytes.
func (b *udpBatch) superPacket(vnet int) [][]byte {
	pkt := b.first[vnet:]
	iphl := b.iphl
	udpLen := udpHeaderLen + b.payload
	binary.BigEndian.PutUint16(pkt[iphl+4:], uint16(udpLen))
	if iphl == 20 {
		binary.BigEndian.PutUint16(pkt[2:4], uint16(iphl+udpLen))
		pkt[10], pkt[11] = 0, 0
		binary.BigEndian.PutUint16(pkt[10:12], ^checksum.Checksum(pkt[:iphl], 0))
	} else {
		binary.BigEndian.PutUint16(pkt[4:6], uint16(udpLen))
	}
	binary.BigEndian.PutUint16(pkt[iphl+6:], pseudoSum(pkt, iphl, udpLen))
	vh := tun.VnetHdr{
		Flags:      tun.VnetNeedsCsum,
		GSOType:    tun.GSOUDPL4,
		HdrLen:     uint16(iphl + udpHeaderLen),
		GSOSize:    uint16(b.gsoSize),
		CsumStart:  uint16(iphl),
		CsumOffset: 6,
	}
	vh.Encode(b.hdr[:])
	b.bufs[0] = b.hdr[:vnet]
	return b.bufs
}

// reset empties the batch, dropping its references to the read buffer.
func (b *udpBatch) reset() {
	clear(b.bufs)
	b.bufs = b.bufs[:0]
	b.first = nil
	b.n, b.payload, b.closed = 0, 0, false
}
