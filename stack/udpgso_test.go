package stack

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"net/netip"
	"os"
	"testing"
	"time"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/meshtun/meshtun/tun"
)

// dgram describes a UDP datagram for build.
type dgram struct {
	src, dst netip.AddrPort
	id       uint16 // IPv4 ID
	ttl      uint8
	tos      uint8
	noDF     bool
	payload  []byte
}

// build returns the IPv4 or IPv6 datagram of d with a partial checksum (the
// pseudo-header sum), as the kernel hands it to the TUN with NEEDS_CSUM.
func (d dgram) build() []byte {
	l3 := header.IPv4MinimumSize
	if d.src.Addr().Is6() {
		l3 = header.IPv6MinimumSize
	}
	ttl := d.ttl
	if ttl == 0 {
		ttl = 63
	}
	udpLen := header.UDPMinimumSize + len(d.payload)
	b := make([]byte, l3+udpLen)
	var src, dst tcpip.Address
	if d.src.Addr().Is4() {
		src, dst = tcpip.AddrFrom4(d.src.Addr().As4()), tcpip.AddrFrom4(d.dst.Addr().As4())
		flags := uint8(header.IPv4FlagDontFragment)
		if d.noDF {
			flags = 0
		}
		ip := header.IPv4(b)
		ip.Encode(&header.IPv4Fields{
			TOS: d.tos, TotalLength: uint16(len(b)), ID: d.id, TTL: ttl, Protocol: uint8(header.UDPProtocolNumber),
			Flags: flags, SrcAddr: src, DstAddr: dst,
		})
		ip.SetChecksum(^ip.CalculateChecksum())
	} else {
		src, dst = tcpip.AddrFrom16(d.src.Addr().As16()), tcpip.AddrFrom16(d.dst.Addr().As16())
		header.IPv6(b).Encode(&header.IPv6Fields{
			TrafficClass: d.tos, PayloadLength: uint16(udpLen), TransportProtocol: header.UDPProtocolNumber,
			HopLimit: ttl, SrcAddr: src, DstAddr: dst,
		})
	}
	u := header.UDP(b[l3:])
	u.Encode(&header.UDPFields{SrcPort: d.src.Port(), DstPort: d.dst.Port(), Length: uint16(udpLen)})
	copy(u[header.UDPMinimumSize:], d.payload)
	u.SetChecksum(header.PseudoHeaderChecksum(header.UDPProtocolNumber, src, dst, uint16(udpLen)))
	return b
}

// partialUDP is the virtio-net header of a datagram with a partial
// checksum, as the kernel writes it.
func partialUDP(l3 int) tun.VnetHdr {
	return tun.VnetHdr{Flags: tun.VnetNeedsCsum, CsumStart: uint16(l3), CsumOffset: 6}
}

var udpFamilies = []struct {
	name     string
	src, dst netip.AddrPort
	l3       int
}{
	{"IPv4", netip.MustParseAddrPort("198.18.1.11:40000"), netip.MustParseAddrPort("198.18.2.11:5201"), 20},
	{"IPv6", netip.MustParseAddrPort("[fd00:6d74:1::11]:40000"), netip.MustParseAddrPort("[fd00:6d74:2::11]:5201"), 40},
}

// fill returns n bytes of a pattern that depends on seed.
func fill(n, seed int) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7 + seed*13)
	}
	return b
}

// frameOf prepends the virtio-net header vh to pkt.
func frameOf(vh tun.VnetHdr, pkt []byte) []byte {
	b := make([]byte, tun.VnetHdrLen+len(pkt))
	vh.Encode(b)
	copy(b[tun.VnetHdrLen:], pkt)
	return b
}

// segmentUDP cuts a UDP GSO packet the way the kernel does (virtio-net
// header vh): each segment repeats the headers with its own lengths, the
// IPv4 ID counts up from the first, the IPv4 header checksum is
// recomputed, and the UDP checksum field, partial, is the pseudo-header
// sum adjusted from the total length to the segment's. It fails the test
// if the super-packet's own fields are not what the kernel expects.
func segmentUDP(t *testing.T, vh tun.VnetHdr, pkt []byte) [][]byte {
	t.Helper()
	l3 := int(vh.CsumStart)
	if vh.GSOType != tun.GSOUDPL4 || vh.Flags != tun.VnetNeedsCsum || vh.CsumOffset != 6 || int(vh.HdrLen) != l3+8 {
		t.Fatalf("virtio-net header %+v: want GSO_UDP_L4, NEEDS_CSUM at offset 6, hdr_len %d", vh, l3+8)
	}
	udpLen := int(binary.BigEndian.Uint16(pkt[l3+4:]))
	if udpLen != len(pkt)-l3 {
		t.Fatalf("UDP length %d, packet holds %d", udpLen, len(pkt)-l3)
	}
	var src, dst tcpip.Address
	if l3 == 20 {
		if binary.BigEndian.Uint16(pkt[2:]) != uint16(len(pkt)) || checksum.Checksum(pkt[:20], 0) != 0xffff {
			t.Fatalf("IPv4 header of the super-packet: total length %d (packet %d), checksum valid %v",
				binary.BigEndian.Uint16(pkt[2:]), len(pkt), checksum.Checksum(pkt[:20], 0) == 0xffff)
		}
		src, dst = tcpip.AddrFrom4Slice(pkt[12:16]), tcpip.AddrFrom4Slice(pkt[16:20])
	} else {
		if int(binary.BigEndian.Uint16(pkt[4:])) != udpLen {
			t.Fatalf("IPv6 payload length %d, want %d", binary.BigEndian.Uint16(pkt[4:]), udpLen)
		}
		src, dst = tcpip.AddrFrom16Slice(pkt[8:24]), tcpip.AddrFrom16Slice(pkt[24:40])
	}
	if got, want := binary.BigEndian.Uint16(pkt[l3+6:]), header.PseudoHeaderChecksum(header.UDPProtocolNumber, src, dst, uint16(udpLen)); got != want {
		t.Fatalf("UDP checksum field %#04x, want the pseudo-header sum %#04x", got, want)
	}
	var segs [][]byte
	payload := pkt[l3+8:]
	for i := 0; len(payload) > 0; i++ {
		n := min(int(vh.GSOSize), len(payload))
		s := make([]byte, l3+8+n)
		copy(s, pkt[:l3+8])
		copy(s[l3+8:], payload[:n])
		payload = payload[n:]
		binary.BigEndian.PutUint16(s[l3+4:], uint16(8+n))
		if l3 == 20 {
			binary.BigEndian.PutUint16(s[2:], uint16(len(s)))
			binary.BigEndian.PutUint16(s[4:], binary.BigEndian.Uint16(pkt[4:])+uint16(i))
			s[10], s[11] = 0, 0
			binary.BigEndian.PutUint16(s[10:], ^checksum.Checksum(s[:20], 0))
		} else {
			binary.BigEndian.PutUint16(s[4:], uint16(8+n))
		}
		// csum16_add(csum16_sub(check, old len), new len)
		c := checksum.Combine(binary.BigEndian.Uint16(pkt[l3+6:]), ^uint16(udpLen))
		binary.BigEndian.PutUint16(s[l3+6:], checksum.Combine(c, uint16(8+n)))
		segs = append(segs, s)
	}
	return segs
}

// TestUDPSuperPacket: datagrams of one flow gathered by udpBatch become one
// GSO packet whose segmentation by the kernel gives back the datagrams
// byte for byte, partial checksums included, a shorter last one too.
func TestUDPSuperPacket(t *testing.T) {
	for _, fam := range udpFamilies {
		for _, sizes := range [][]int{{1200, 1200}, {1200, 1200, 1200, 700}, {1, 1, 1}, {1472, 1472, 1472, 1472, 1472, 9}} {
			t.Run(fmt.Sprintf("%s/%v", fam.name, sizes), func(t *testing.T) {
				var want [][]byte
				var b udpBatch
				for i, n := range sizes {
					p := dgram{src: fam.src, dst: fam.dst, id: 0xfffe + uint16(i), payload: fill(n, i)}.build()
					want = append(want, bytes.Clone(p))
					vh := partialUDP(fam.l3)
					l3, ok := udpCandidate(p, &vh)
					if !ok || l3 != fam.l3 {
						t.Fatalf("datagram %d: candidate %v, IP header %d", i, ok, l3)
					}
					if i == 0 {
						b.start(frameOf(vh, p), tun.VnetHdrLen, l3)
					} else if !b.add(p, tun.VnetHdrLen, l3) {
						t.Fatalf("datagram %d (%d bytes) not added", i, n)
					}
				}
				if b.n != len(sizes) {
					t.Fatalf("%d datagrams in the batch, want %d", b.n, len(sizes))
				}
				if last := sizes[len(sizes)-1]; last < sizes[0] && !b.full() {
					t.Fatal("a batch ending in a shorter datagram is not full")
				}
				super := bytes.Join(b.superPacket(tun.VnetHdrLen), nil)
				var vh tun.VnetHdr
				if err := vh.Decode(super); err != nil {
					t.Fatal(err)
				}
				if int(vh.GSOSize) != sizes[0] {
					t.Fatalf("gso_size %d, want %d", vh.GSOSize, sizes[0])
				}
				segs := segmentUDP(t, vh, super[tun.VnetHdrLen:])
				if len(segs) != len(want) {
					t.Fatalf("%d segments, want %d", len(segs), len(want))
				}
				for i := range segs {
					if !bytes.Equal(segs[i], want[i]) {
						t.Fatalf("segment %d differs from datagram %d:\n got %x\nwant %x", i, i, segs[i][:min(64, len(segs[i]))], want[i][:min(64, len(want[i]))])
					}
				}
				b.reset()
				if b.n != 0 || b.first != nil || len(b.bufs) != 0 {
					t.Fatal("reset left state behind")
				}
			})
		}
	}
}

// TestUDPCandidate: only plain datagrams with a partial checksum and
// consistent lengths may join a batch; anything short, malformed or
// different is refused, without panicking on any prefix.
func TestUDPCandidate(t *testing.T) {
	for _, fam := range udpFamilies {
		good := dgram{src: fam.src, dst: fam.dst, payload: fill(100, 0)}.build()
		vh := partialUDP(fam.l3)
		if _, ok := udpCandidate(good, &vh); !ok {
			t.Fatalf("%s: well-formed datagram refused", fam.name)
		}
		for n := range len(good) {
			if _, ok := udpCandidate(good[:n], &vh); ok {
				t.Fatalf("%s: %d-byte prefix accepted", fam.name, n)
			}
		}
		mut := func(name string, vh tun.VnetHdr, f func(p []byte) []byte) {
			p := f(bytes.Clone(good))
			if _, ok := udpCandidate(p, &vh); ok {
				t.Errorf("%s: %s accepted", fam.name, name)
			}
		}
		same := func(p []byte) []byte { return p }
		mut("complete checksum (no flags)", tun.VnetHdr{}, same)
		mut("checksum already verified", tun.VnetHdr{Flags: tun.VnetDataValid}, same)
		mut("GSO packet", tun.VnetHdr{Flags: tun.VnetNeedsCsum, GSOType: tun.GSOUDPL4, GSOSize: 50, CsumStart: uint16(fam.l3), CsumOffset: 6}, same)
		mut("checksum elsewhere", tun.VnetHdr{Flags: tun.VnetNeedsCsum, CsumStart: uint16(fam.l3), CsumOffset: 16}, same)
		mut("checksum start elsewhere", tun.VnetHdr{Flags: tun.VnetNeedsCsum, CsumStart: uint16(fam.l3 + 4), CsumOffset: 6}, same)
		mut("UDP length too short", vh, func(p []byte) []byte { p[fam.l3+5]--; return p })
		mut("UDP length too long", vh, func(p []byte) []byte { p[fam.l3+5]++; return p })
		mut("empty payload", vh, func(p []byte) []byte {
			p = p[:fam.l3+8]
			binary.BigEndian.PutUint16(p[fam.l3+4:], 8)
			if fam.l3 == 20 {
				binary.BigEndian.PutUint16(p[2:], uint16(len(p)))
			} else {
				binary.BigEndian.PutUint16(p[4:], 8)
			}
			return p
		})
		mut("trailing bytes", vh, func(p []byte) []byte { return append(p, 0) })
		mut("version 5", vh, func(p []byte) []byte { p[0] = 0x50 | p[0]&0x0f; return p })
		mut("UDP checksum field not the pseudo-header sum", vh, func(p []byte) []byte { p[fam.l3+7]++; return p })
		if fam.l3 == 20 {
			mut("bad IPv4 header checksum", vh, func(p []byte) []byte { p[11]++; return p })
			mut("TCP", vh, func(p []byte) []byte { p[9] = 6; return p })
			mut("IP options", vh, func(p []byte) []byte { p[0] = 0x46; return p })
			mut("more fragments", vh, func(p []byte) []byte { p[6] |= 0x20; return p })
			mut("fragment offset", vh, func(p []byte) []byte { p[7] = 1; return p })
			mut("total length too short", vh, func(p []byte) []byte { p[3]--; return p })
		} else {
			mut("extension header", vh, func(p []byte) []byte { p[6] = 0; return p })
			mut("payload length too short", vh, func(p []byte) []byte { p[5]--; return p })
		}
	}
}

// TestUDPBatchRefuses: a datagram joins only the batch of its own flow with
// the same IP fields, the next IPv4 ID and no larger payload, and only
// while the super-packet stays within its limits.
func TestUDPBatchRefuses(t *testing.T) {
	for _, fam := range udpFamilies {
		base := dgram{src: fam.src, dst: fam.dst, id: 7, payload: fill(1000, 0)}
		next := base
		next.id++
		try := func(name string, d dgram, wantOK bool) {
			t.Helper()
			var b udpBatch
			vh := partialUDP(fam.l3)
			first := base.build()
			b.start(frameOf(vh, first), tun.VnetHdrLen, fam.l3)
			p := d.build()
			l3, ok := udpCandidate(p, &vh)
			if !ok {
				t.Fatalf("%s: %s: not a candidate", fam.name, name)
			}
			if got := b.add(p, tun.VnetHdrLen, l3); got != wantOK {
				t.Errorf("%s: %s: added %v, want %v", fam.name, name, got, wantOK)
			}
		}
		try("the next datagram", next, true)
		d := next
		d.payload = fill(999, 1)
		try("a shorter one", d, true)
		d.payload = fill(1001, 1)
		try("a longer one", d, false)
		d = next
		d.src = netip.AddrPortFrom(fam.src.Addr(), fam.src.Port()+1)
		try("another source port", d, false)
		d = next
		d.dst = netip.AddrPortFrom(fam.dst.Addr(), fam.dst.Port()+1)
		try("another destination port", d, false)
		d = next
		d.dst = netip.AddrPortFrom(fam.dst.Addr().Next(), fam.dst.Port())
		try("another destination", d, false)
		d = next
		d.ttl = 62
		try("another TTL", d, false)
		d = next
		d.tos = 0x10
		try("another TOS", d, false)
		if fam.l3 == 20 {
			d = next
			d.noDF = true
			try("without DF", d, false)
			d = next
			d.id += 1
			try("an ID out of sequence", d, false)
			d = next
			d.id = base.id
			try("the same ID", d, false)
		}

		// After a shorter datagram nothing more joins.
		var b udpBatch
		vh := partialUDP(fam.l3)
		b.start(frameOf(vh, base.build()), tun.VnetHdrLen, fam.l3)
		short := next
		short.payload = fill(10, 2)
		if !b.add(short.build(), tun.VnetHdrLen, fam.l3) || !b.full() {
			t.Fatalf("%s: the shorter datagram: not added or batch not full", fam.name)
		}
		third := next
		third.id++
		if b.add(third.build(), tun.VnetHdrLen, fam.l3) {
			t.Errorf("%s: a datagram after a shorter one was added", fam.name)
		}

		// Limits: 16-bit lengths and udpGSOMaxSegs.
		for _, c := range []struct {
			size, fit int
		}{{1400, (0xffff - fam.l3 - 8) / 1400}, {100, udpGSOMaxSegs}} {
			var b udpBatch
			d := base
			d.payload = fill(c.size, 0)
			b.start(frameOf(vh, d.build()), tun.VnetHdrLen, fam.l3)
			for i := 1; ; i++ {
				d.id++
				ok := b.add(d.build(), tun.VnetHdrLen, fam.l3)
				if ok != (i < c.fit) {
					t.Fatalf("%s: %d-byte datagram %d: added %v, want %d to fit", fam.name, c.size, i+1, ok, c.fit)
				}
				if !ok {
					break
				}
				if b.full() != (i+1 == c.fit) {
					t.Fatalf("%s: %d datagrams of %d bytes: full %v, want %d to fit", fam.name, i+1, c.size, b.full(), c.fit)
				}
			}
		}
	}
}

// batchDev is a BatchDevice in memory whose packets are all queued before
// the link endpoint starts: Read takes the next, TryRead too or reports
// none. It records every write.
type batchDev struct {
	fakeDev
	writes chan [][]byte // every write's buffers, copied
}

func newBatchDev(queue [][]byte) *batchDev {
	d := &batchDev{fakeDev: *newFakeDev(tun.VnetHdrLen), writes: make(chan [][]byte, 4096)}
	d.In = make(chan []byte, len(queue))
	for _, p := range queue {
		d.In <- p
	}
	return d
}

func (d *batchDev) TryRead(b []byte) (int, error) {
	select {
	case p := <-d.In:
		return copy(b, p), nil
	case <-d.Done():
		return 0, os.ErrClosed
	default:
		return 0, nil
	}
}
func (d *batchDev) USO() bool { return true }
func (d *batchDev) Write(p []byte) (int, error) {
	d.writes <- [][]byte{bytes.Clone(p)}
	return len(p), nil
}
func (d *batchDev) Writev(bufs [][]byte) (int, error) {
	var c [][]byte
	n := 0
	for _, b := range bufs {
		c = append(c, bytes.Clone(b))
		n += len(b)
	}
	d.writes <- c
	return n, nil
}

// TestUDPCoalescing: the link endpoint writes queued datagrams of one flow
// back as one super-packet, in the order read: another flow's packet in
// between, a shorter datagram or an empty queue ends the batch, and a lone
// datagram goes back as it came. The classifier counts every datagram.
func TestUDPCoalescing(t *testing.T) {
	fam := udpFamilies[0]
	other := netip.AddrPortFrom(fam.dst.Addr(), 5202)
	var queue [][]byte
	var want []string // the writes expected, in order
	id := uint16(100)
	add := func(dst netip.AddrPort, size int) []byte {
		id++
		p := dgram{src: fam.src, dst: dst, id: id, payload: fill(size, int(id))}.build()
		queue = append(queue, frameOf(partialUDP(20), p))
		return p
	}
	for range 3 {
		add(fam.dst, 1200)
	}
	want = append(want, "super 3×1200")
	add(other, 1200)
	want = append(want, "single 1228")
	add(fam.dst, 1200)
	add(fam.dst, 1200)
	add(fam.dst, 500)
	want = append(want, "super 2×1200+500")
	add(fam.dst, 1200)
	want = append(want, "single 1228")
	// A TCP segment: flushes nothing (no batch), goes back verbatim.
	tcp := seg{src: fam.src, dst: netip.AddrPortFrom(fam.dst.Addr(), 8080), seq: 1, ack: 1, flags: header.TCPFlagAck, payload: fill(100, 0)}.build()
	queue = append(queue, frameOf(tun.VnetHdr{}, tcp))
	want = append(want, "single 140")

	dev := newBatchDev(queue)
	st, _ := newTestStack(t, dev)
	defer func() { dev.close(); st.Close() }()
	var got []string
	for range want {
		var w [][]byte
		select {
		case w = <-dev.writes:
		case <-time.After(10 * time.Second):
			t.Fatalf("writes so far %q, want %q", got, want)
		}
		frame := bytes.Join(w, nil)
		var vh tun.VnetHdr
		if err := vh.Decode(frame); err != nil {
			t.Fatal(err)
		}
		pkt := frame[tun.VnetHdrLen:]
		if vh.GSOType != tun.GSOUDPL4 {
			got = append(got, fmt.Sprintf("single %d", len(pkt)))
			continue
		}
		segs := segmentUDP(t, vh, pkt)
		s := fmt.Sprintf("super %d×%d", len(segs), len(segs[0])-28)
		if last := len(segs[len(segs)-1]) - 28; last != len(segs[0])-28 {
			s = fmt.Sprintf("super %d×%d+%d", len(segs)-1, len(segs[0])-28, last)
		}
		got = append(got, s)
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("writes %q, want %q", got, want)
	}
	if c := st.Stats().UDPCoalesced; c != 6 {
		t.Errorf("UDPCoalesced %d, want 6", c)
	}
	if n := st.cls.Stats().Verbatim; n != uint64(len(queue)) {
		t.Errorf("classifier judged %d packets verbatim, want every one of %d", n, len(queue))
	}
}

// FuzzUDPBatch: for any two packets, udpCandidate and add never panic, and
// whenever both join one batch, the kernel's segmentation of the
// super-packet gives back both packets byte for byte.
func FuzzUDPBatch(f *testing.F) {
	for _, fam := range udpFamilies {
		a := dgram{src: fam.src, dst: fam.dst, id: 9, payload: fill(300, 1)}.build()
		b := dgram{src: fam.src, dst: fam.dst, id: 10, payload: fill(120, 2)}.build()
		f.Add(a, b, byte(tun.VnetNeedsCsum))
		f.Add(a, a, byte(tun.VnetNeedsCsum))
		f.Add(a[:len(a)-1], b, byte(0))
	}
	f.Fuzz(func(t *testing.T, a, b []byte, flags byte) {
		l3 := 40
		if len(a) > 0 && a[0]>>4 == 4 {
			l3 = 20
		}
		vh := tun.VnetHdr{Flags: flags, CsumStart: uint16(l3), CsumOffset: 6}
		wantA, wantB := bytes.Clone(a), bytes.Clone(b)
		la, okA := udpCandidate(a, &vh)
		lb, okB := udpCandidate(b, &vh)
		if !okA || !okB {
			return
		}
		var batch udpBatch
		batch.start(frameOf(vh, a), tun.VnetHdrLen, la)
		if !batch.add(b, tun.VnetHdrLen, lb) {
			return
		}
		super := bytes.Join(batch.superPacket(tun.VnetHdrLen), nil)
		var sh tun.VnetHdr
		if err := sh.Decode(super); err != nil {
			t.Fatal(err)
		}
		segs := segmentUDP(t, sh, super[tun.VnetHdrLen:])
		if len(segs) != 2 || !bytes.Equal(segs[0], wantA) || !bytes.Equal(segs[1], wantB) {
			t.Fatalf("segments %x\nwant %x\n     %x", segs, wantA, wantB)
		}
	})
}
