package stack

import (
	"bytes"
	"encoding/binary"
	"io"
	"net/netip"
	"os"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/meshtun/meshtun/stack/classify"
	"github.com/meshtun/meshtun/test/fixture"
	"github.com/meshtun/meshtun/tun"
)

// fakeDev is test/fixture's OffloadDevice in memory: the test feeds
// packets to Read with send and takes everything written with recv (or
// from Out), virtio-net header encoded and decoded.
type fakeDev struct{ *fixture.MemDevice }

func newFakeDev(vnet int) *fakeDev { return &fakeDev{fixture.NewMemDevice(vnet, 4096)} }

func (d *fakeDev) close() { d.Close() }

// send hands the link endpoint one packet with virtio-net header vh.
func (d *fakeDev) send(t *testing.T, vh tun.VnetHdr, pkt []byte) {
	t.Helper()
	vnet := d.VnetHdrLen()
	b := make([]byte, vnet+len(pkt))
	if vnet > 0 {
		vh.Encode(b)
	}
	copy(b[vnet:], pkt)
	d.Send(t, b)
}

// recv returns the next packet written and its virtio-net header.
func (d *fakeDev) recv(t *testing.T) (tun.VnetHdr, []byte) {
	t.Helper()
	b := d.Recv(t)
	var vh tun.VnetHdr
	vnet := d.VnetHdrLen()
	if vnet > 0 {
		if err := vh.Decode(b); err != nil {
			t.Fatal(err)
		}
	}
	return vh, b[vnet:]
}

// seg describes a TCP segment for build.
type seg struct {
	src, dst netip.AddrPort
	seq, ack uint32
	flags    header.TCPFlags
	mss      uint16 // MSS option, 0 for none
	payload  []byte
	partial  bool // checksum field holds only the pseudo-header sum
}

// build returns the IPv4 or IPv6 packet of s.
func (s seg) build() []byte {
	var opts []byte
	if s.mss != 0 {
		opts = make([]byte, 4)
		header.EncodeMSSOption(uint32(s.mss), opts)
	}
	l3 := header.IPv4MinimumSize
	if s.src.Addr().Is6() {
		l3 = header.IPv6MinimumSize
	}
	tcpLen := header.TCPMinimumSize + len(opts) + len(s.payload)
	b := make([]byte, l3+tcpLen)
	var src, dst tcpip.Address
	if s.src.Addr().Is4() {
		src, dst = tcpip.AddrFrom4(s.src.Addr().As4()), tcpip.AddrFrom4(s.dst.Addr().As4())
		ip := header.IPv4(b)
		ip.Encode(&header.IPv4Fields{
			TotalLength: uint16(len(b)), TTL: 64, Protocol: uint8(header.TCPProtocolNumber),
			Flags: header.IPv4FlagDontFragment, SrcAddr: src, DstAddr: dst,
		})
		ip.SetChecksum(^ip.CalculateChecksum())
	} else {
		src, dst = tcpip.AddrFrom16(s.src.Addr().As16()), tcpip.AddrFrom16(s.dst.Addr().As16())
		header.IPv6(b).Encode(&header.IPv6Fields{
			PayloadLength: uint16(tcpLen), TransportProtocol: header.TCPProtocolNumber,
			HopLimit: 64, SrcAddr: src, DstAddr: dst,
		})
	}
	th := header.TCP(b[l3:])
	th.Encode(&header.TCPFields{
		SrcPort: s.src.Port(), DstPort: s.dst.Port(), SeqNum: s.seq, AckNum: s.ack,
		DataOffset: uint8(header.TCPMinimumSize + len(opts)), Flags: s.flags, WindowSize: 65535,
	})
	copy(th[header.TCPMinimumSize:], opts)
	copy(th[header.TCPMinimumSize+len(opts):], s.payload)
	xsum := header.PseudoHeaderChecksum(header.TCPProtocolNumber, src, dst, uint16(tcpLen))
	if s.partial {
		th.SetChecksum(xsum)
	} else {
		th.SetChecksum(^checksum.Checksum(th, xsum))
	}
	return b
}

// parsed is a TCP segment the netstack wrote.
type parsed struct {
	l3             int
	flags          header.TCPFlags
	seq, ack       uint32
	payload        []byte
	checksumStored uint16
}

// parseOut parses a packet written by the netstack and checks its
// checksums: complete ones as they are; partial ones (as flagged in vh)
// after completing them the way the kernel would.
func parseOut(t *testing.T, vh tun.VnetHdr, p []byte) parsed {
	t.Helper()
	var l3, end int
	var src, dst tcpip.Address
	switch header.IPVersion(p) {
	case 4:
		ip := header.IPv4(p)
		if !ip.IsValid(len(p)) || !ip.IsChecksumValid() {
			t.Fatalf("netstack wrote an invalid IPv4 header: % x", p[:20])
		}
		l3, end, src, dst = int(ip.HeaderLength()), int(ip.TotalLength()), ip.SourceAddress(), ip.DestinationAddress()
	case 6:
		ip := header.IPv6(p)
		l3, end, src, dst = header.IPv6MinimumSize, header.IPv6MinimumSize+int(ip.PayloadLength()), ip.SourceAddress(), ip.DestinationAddress()
	default:
		t.Fatalf("netstack wrote a packet of IP version %d", header.IPVersion(p))
	}
	if end != len(p) {
		t.Fatalf("IP length %d, packet %d bytes", end, len(p))
	}
	th := header.TCP(p[l3:])
	pseudo := header.PseudoHeaderChecksum(header.TCPProtocolNumber, src, dst, uint16(len(th)))
	if vh.Flags&tun.VnetNeedsCsum != 0 {
		if int(vh.CsumStart) != l3 || vh.CsumOffset != header.TCPChecksumOffset {
			t.Fatalf("partial checksum at start %d offset %d, want %d %d", vh.CsumStart, vh.CsumOffset, l3, header.TCPChecksumOffset)
		}
		if th.Checksum() != pseudo {
			t.Fatalf("partial checksum field %#04x, want the pseudo-header sum %#04x", th.Checksum(), pseudo)
		}
		// Complete it as the kernel does: sum from CsumStart, field
		// included, and store the complement.
		th.SetChecksum(^checksum.Checksum(th, 0))
	}
	if checksum.Checksum(th, pseudo) != 0xffff {
		t.Fatalf("netstack's TCP checksum is wrong (vnet header %+v)", vh)
	}
	return parsed{l3: l3, flags: th.Flags(), seq: th.SequenceNumber(), ack: th.AckNumber(), payload: th.Payload(), checksumStored: th.Checksum()}
}

var families = []struct {
	name     string
	src, dst netip.AddrPort
	gso      uint8
}{
	{"IPv4", netip.MustParseAddrPort("198.18.1.11:40000"), netip.MustParseAddrPort("198.18.2.11:80"), tun.GSOTCPv4},
	{"IPv6", netip.MustParseAddrPort("[fd00:6d74:1::11]:40000"), netip.MustParseAddrPort("[fd00:6d74:2::11]:80"), tun.GSOTCPv6},
}

// newTestStack runs a Stack on dev that intercepts TCP to port 80 and
// hands the accepted connections to the returned channel.
func newTestStack(t *testing.T, dev Device) (*Stack, <-chan *Conn) {
	t.Helper()
	conns := make(chan *Conn, 1)
	cls := classify.New(classify.Config{Policy: classify.PolicyFunc(func(_, dst netip.AddrPort) bool { return dst.Port() == 80 })})
	st, err := newStarted(startedConfig{
		Device: dev, Classifier: cls, Logger: zerolog.Nop(),
		HandleTCP: func(req *TCPRequest) {
			c, err := req.Accept()
			if err != nil {
				t.Error(err)
				return
			}
			conns <- c
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	return st, conns
}

// TestVerbatimGSO: a GSO super-packet of a flow that is not intercepted
// passes the classifier (its IP length is far above the MTU) and goes back
// into the TUN byte for byte but for the hop given back (restoreHop),
// virtio-net header unchanged.
func TestVerbatimGSO(t *testing.T) {
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			dev := newFakeDev(tun.VnetHdrLen)
			st, _ := newTestStack(t, dev)
			defer func() { dev.close(); st.Close() }()
			dst := netip.AddrPortFrom(fam.dst.Addr(), 8080) // not intercepted
			payload := bytes.Repeat([]byte("0123456789abcdef"), (65535-80)/16)
			pkt := seg{src: fam.src, dst: dst, seq: 1, ack: 1, flags: header.TCPFlagAck, payload: payload, partial: true}.build()
			if len(pkt) <= 60000 {
				t.Fatalf("test packet is only %d bytes", len(pkt))
			}
			l3 := header.IPv4MinimumSize
			if fam.src.Addr().Is6() {
				l3 = header.IPv6MinimumSize
			}
			vh := tun.VnetHdr{Flags: tun.VnetNeedsCsum, GSOType: fam.gso, HdrLen: uint16(l3 + 20), GSOSize: 1448, CsumStart: uint16(l3), CsumOffset: 16}
			dev.send(t, vh, pkt)
			gotVH, got := dev.recv(t)
			if gotVH != vh {
				t.Fatalf("virtio-net header written back as %+v, want %+v", gotVH, vh)
			}
			want := bytes.Clone(pkt)
			restoreHop(want)
			if bytes.Equal(want, pkt) {
				t.Fatal("restoreHop left the test packet unchanged: the test cannot tell")
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("packet written back differs from the one sent with a hop given back (%d bytes, sent %d)", len(got), len(pkt))
			}
			if c := st.Stats(); c.Drops != 0 || c.VerbatimWriteErrors != 0 {
				t.Fatalf("counters %+v", c)
			}
		})
	}
}

// handshake opens an intercepted connection from fam.src to fam.dst on dev
// and returns the netstack's end and the next sequence numbers.
func handshake(t *testing.T, dev *fakeDev, conns <-chan *Conn, src, dst netip.AddrPort) (c *Conn, seq, ack uint32) {
	t.Helper()
	seq = 1000
	dev.send(t, tun.VnetHdr{}, seg{src: src, dst: dst, seq: seq, flags: header.TCPFlagSyn, mss: 1400}.build())
	vh, p := dev.recv(t)
	sa := parseOut(t, vh, p)
	if sa.flags != header.TCPFlagSyn|header.TCPFlagAck || sa.ack != seq+1 {
		t.Fatalf("got flags %v ack %d, want SYN-ACK acking %d", sa.flags, sa.ack, seq+1)
	}
	seq, ack = seq+1, sa.seq+1
	dev.send(t, tun.VnetHdr{}, seg{src: src, dst: dst, seq: seq, ack: ack, flags: header.TCPFlagAck}.build())
	select {
	case c = <-conns:
	case <-time.After(10 * time.Second):
		t.Fatal("connection not accepted")
	}
	return c, seq, ack
}

// TestInterceptGSO: intercepted GSO super-packets with partial checksums
// are accepted whole by the netstack; complete checksums are verified, a
// wrong one dropped; and the netstack sends GSO packets of up to 64 KiB
// with a partial checksum for the kernel to complete and segment.
func TestInterceptGSO(t *testing.T) {
	for _, fam := range families {
		t.Run(fam.name, func(t *testing.T) {
			dev := newFakeDev(tun.VnetHdrLen)
			st, conns := newTestStack(t, dev)
			defer func() { dev.close(); st.Close() }()
			c, seq, ack := handshake(t, dev, conns, fam.src, fam.dst)
			defer c.Close()
			l3 := header.IPv4MinimumSize
			if fam.src.Addr().Is6() {
				l3 = header.IPv6MinimumSize
			}

			// In: one GSO packet of 60000 payload bytes (43 MSS), its
			// checksum partial as the kernel hands it over.
			big := make([]byte, 60000)
			for i := range big {
				big[i] = byte(i * 7)
			}
			vh := tun.VnetHdr{Flags: tun.VnetNeedsCsum, GSOType: fam.gso, HdrLen: uint16(l3 + 20), GSOSize: 1400, CsumStart: uint16(l3), CsumOffset: 16}
			dev.send(t, vh, seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck | header.TCPFlagPsh, payload: big, partial: true}.build())
			seq += uint32(len(big))
			got := make([]byte, len(big))
			c.SetReadDeadline(time.Now().Add(10 * time.Second))
			if _, err := io.ReadFull(c, got); err != nil {
				t.Fatalf("read the GSO packet's payload: %v", err)
			}
			if !bytes.Equal(got, big) {
				t.Fatal("payload of the GSO packet differs")
			}

			// A complete checksum that is wrong: dropped by the link
			// endpoint. Then the same sequence range with other,
			// correctly summed bytes: only those arrive.
			bad := seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck | header.TCPFlagPsh, payload: bytes.Repeat([]byte("B"), 100)}.build()
			bad[len(bad)-1] ^= 0x20 // corrupt after summing
			dev.send(t, tun.VnetHdr{}, bad)
			good := bytes.Repeat([]byte("G"), 100)
			dev.send(t, tun.VnetHdr{}, seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck | header.TCPFlagPsh, payload: good}.build())
			seq += uint32(len(good))
			got = got[:len(good)]
			if _, err := io.ReadFull(c, got); err != nil {
				t.Fatalf("read after the corrupted segment: %v", err)
			}
			if !bytes.Equal(got, good) {
				t.Fatalf("read %q: a segment with a wrong checksum was accepted", got[:8])
			}
			if n := st.Stats().BadChecksums; n != 1 {
				t.Fatalf("BadChecksums = %d, want 1", n)
			}

			// Out: 200000 bytes from the netstack. Acknowledge what
			// arrives; collect the payload.
			const total = 200000
			want := make([]byte, total)
			for i := range want {
				want[i] = byte(i*13 + 1)
			}
			werr := make(chan error, 1)
			go func() { _, err := c.Write(want); werr <- err }()
			var out []byte
			var gsoPackets, maxLen int
			for len(out) < total {
				vh, p := dev.recv(t)
				s := parseOut(t, vh, p)
				if len(s.payload) == 0 {
					continue
				}
				if s.seq != ack+uint32(len(out)) {
					t.Fatalf("segment at %d, want %d", s.seq-ack, len(out))
				}
				if len(s.payload) > 1400 {
					if vh.GSOType != fam.gso || vh.GSOSize != 1400 || int(vh.HdrLen) != s.l3+20 {
						t.Fatalf("%d-byte segment with virtio-net header %+v, want GSO type %d, size 1400, hdr_len %d", len(s.payload), vh, fam.gso, s.l3+20)
					}
					gsoPackets++
				} else if vh.GSOType != tun.GSONone {
					t.Fatalf("%d-byte segment marked GSO: %+v", len(s.payload), vh)
				}
				maxLen = max(maxLen, len(p))
				out = append(out, s.payload...)
				dev.send(t, tun.VnetHdr{}, seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack + uint32(len(out)), flags: header.TCPFlagAck}.build())
			}
			if err := <-werr; err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(out, want) {
				t.Fatal("bytes from the netstack differ")
			}
			if gsoPackets == 0 || maxLen < 32<<10 {
				t.Fatalf("netstack sent %d GSO packets, largest %d bytes: want GSO packets of tens of KiB", gsoPackets, maxLen)
			}
			t.Logf("%d GSO packets from the netstack, largest %d bytes", gsoPackets, maxLen)
		})
	}
}

// TestNoVnetChecksums: without a virtio-net header the netstack verifies
// checksums itself and sends them complete, one MSS per packet.
func TestNoVnetChecksums(t *testing.T) {
	fam := families[0]
	dev := newFakeDev(0)
	st, conns := newTestStack(t, dev)
	defer func() { dev.close(); st.Close() }()
	c, seq, ack := handshake(t, dev, conns, fam.src, fam.dst)
	defer c.Close()
	bad := seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck | header.TCPFlagPsh, payload: bytes.Repeat([]byte("B"), 100)}.build()
	bad[len(bad)-1] ^= 0x20
	dev.send(t, tun.VnetHdr{}, bad)
	good := bytes.Repeat([]byte("G"), 100)
	dev.send(t, tun.VnetHdr{}, seg{src: fam.src, dst: fam.dst, seq: seq, ack: ack, flags: header.TCPFlagAck | header.TCPFlagPsh, payload: good}.build())
	got := make([]byte, len(good))
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, good) {
		t.Fatalf("read %q, %v: want the correctly summed segment only", got, err)
	}
	go c.Write(make([]byte, 5000))
	for n := 0; n < 5000; {
		vh, p := dev.recv(t)
		s := parseOut(t, vh, p) // complete checksum: vh is zero
		if len(s.payload) > 1400 {
			t.Fatalf("%d-byte segment without GSO", len(s.payload))
		}
		n += len(s.payload)
	}
}

// TestChecksumsValid checks the link endpoint's own verification against
// gVisor-built packets, including IPv6 extension headers and a bad IPv4
// header checksum.
func TestChecksumsValid(t *testing.T) {
	for _, fam := range families {
		p := seg{src: fam.src, dst: fam.dst, seq: 1, flags: header.TCPFlagSyn, payload: []byte("hello")}.build()
		if !checksumsValid(p) {
			t.Fatalf("%s: valid packet rejected", fam.name)
		}
		for i := range p {
			q := bytes.Clone(p)
			q[i] ^= 0x01
			if header.IPVersion(q) != header.IPVersion(p) {
				continue
			}
			if fam.src.Addr().Is6() && (i < 4 || i == 7) {
				continue // traffic class, flow label, hop limit: not summed in IPv6
			}
			if checksumsValid(q) {
				t.Fatalf("%s: bit flip at byte %d not detected", fam.name, i)
			}
		}
	}
	// IPv6 with a hop-by-hop header in front of TCP.
	ext := header.IPv6ExtHdrSerializer{header.IPv6SerializableHopByHopExtHdr{&header.IPv6RouterAlertOption{Value: header.IPv6RouterAlertMLD}}}
	tcpLen := header.TCPMinimumSize + 3
	b := make([]byte, header.IPv6MinimumSize+ext.Length()+tcpLen)
	src, dst := tcpip.AddrFrom16(families[1].src.Addr().As16()), tcpip.AddrFrom16(families[1].dst.Addr().As16())
	header.IPv6(b).Encode(&header.IPv6Fields{PayloadLength: uint16(len(b) - header.IPv6MinimumSize), TransportProtocol: header.TCPProtocolNumber, HopLimit: 1, SrcAddr: src, DstAddr: dst, ExtensionHeaders: ext})
	th := header.TCP(b[header.IPv6MinimumSize+ext.Length():])
	th.Encode(&header.TCPFields{SrcPort: 1, DstPort: 80, DataOffset: 20, Flags: header.TCPFlagSyn})
	copy(th[20:], "abc")
	th.SetChecksum(^checksum.Checksum(th, header.PseudoHeaderChecksum(header.TCPProtocolNumber, src, dst, uint16(tcpLen))))
	if b[6] != 0 || !checksumsValid(b) {
		t.Fatal("IPv6 packet with a hop-by-hop header rejected")
	}
	binary.BigEndian.PutUint16(th[16:], th.Checksum()+1)
	if checksumsValid(b) {
		t.Fatal("IPv6 packet with a hop-by-hop header and a wrong checksum accepted")
	}
}

// quietDev is a Device that neither allocates nor keeps packets: Read
// returns the packets sent on in, Write copies into last and signals.
type quietDev struct {
	in      chan []byte
	written chan int
	last    []byte
	done    chan struct{}
}

func (d *quietDev) Read(b []byte) (int, error) {
	select {
	case p := <-d.in:
		return copy(b, p), nil
	case <-d.done:
		return 0, os.ErrClosed
	}
}
func (d *quietDev) Write(p []byte) (int, error)       { d.written <- copy(d.last, p); return len(p), nil }
func (d *quietDev) Writev(bufs [][]byte) (int, error) { return 0, nil }
func (d *quietDev) MTU() int                          { return 1500 }
func (d *quietDev) VnetHdrLen() int                   { return tun.VnetHdrLen }

// TestVerbatimNoAlloc: the verbatim path (read, classify, write back)
// allocates nothing per packet, for a GSO packet of a tracked-but-not-
// intercepted TCP flow and for UDP.
func TestVerbatimNoAlloc(t *testing.T) {
	dev := &quietDev{in: make(chan []byte), written: make(chan int), last: make([]byte, 1<<17), done: make(chan struct{})}
	st, _ := newTestStack(t, dev)
	defer func() { close(dev.done); st.Close() }()
	fam := families[0]
	vh := tun.VnetHdr{Flags: tun.VnetNeedsCsum, GSOType: tun.GSOTCPv4, HdrLen: 40, GSOSize: 1448, CsumStart: 20, CsumOffset: 16}
	tcp := seg{src: fam.src, dst: netip.AddrPortFrom(fam.dst.Addr(), 8080), seq: 1, ack: 1, flags: header.TCPFlagAck, payload: make([]byte, 60000), partial: true}.build()
	udp := bytes.Clone(tcp[:28+512])
	udp[9] = uint8(header.UDPProtocolNumber)
	binary.BigEndian.PutUint16(udp[2:], uint16(len(udp)))
	for _, c := range []struct {
		name string
		pkt  []byte
	}{{"TCP GSO", tcp}, {"UDP", udp}} {
		b := make([]byte, tun.VnetHdrLen+len(c.pkt))
		vh.Encode(b)
		copy(b[tun.VnetHdrLen:], c.pkt)
		pass := func() {
			dev.in <- b
			if n := <-dev.written; n != len(b) {
				t.Fatalf("%s: %d bytes written back, want %d", c.name, n, len(b))
			}
		}
		pass()
		want := bytes.Clone(b)
		restoreHop(want[tun.VnetHdrLen:])
		if !bytes.Equal(dev.last[:len(b)], want) {
			t.Fatalf("%s: written back changed beyond the hop given back", c.name)
		}
		if a := testing.AllocsPerRun(500, pass); a != 0 {
			t.Fatalf("%s: %.1f allocations per verbatim packet, want 0", c.name, a)
		}
	}
}

// TestHeadersEnd: where deliver splits headers from payload.
func TestHeadersEnd(t *testing.T) {
	for _, fam := range families {
		p := seg{src: fam.src, dst: fam.dst, seq: 1, flags: header.TCPFlagSyn, mss: 1400, payload: []byte("hello")}.build()
		l3 := header.IPv4MinimumSize
		if fam.src.Addr().Is6() {
			l3 = header.IPv6MinimumSize
		}
		if got, want := headersEnd(p), l3+24; got != want {
			t.Errorf("%s: headersEnd = %d, want %d (IP + TCP with MSS option)", fam.name, got, want)
		}
		p[l3+12] = 0x40 // data offset 16 bytes: malformed
		if got := headersEnd(p); got != 0 {
			t.Errorf("%s: headersEnd of a bad data offset = %d, want 0", fam.name, got)
		}
	}
	udp := seg{src: families[0].src, dst: families[0].dst, payload: make([]byte, 10)}.build()
	udp[9] = uint8(header.UDPProtocolNumber)
	if got := headersEnd(udp); got != 0 {
		t.Errorf("headersEnd of UDP = %d, want 0", got)
	}
}
