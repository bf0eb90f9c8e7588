package stack

import (
	"errors"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"gvisor.dev/gvisor/pkg/buffer"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/stack"

	"github.com/meshtun/meshtun/stack/classify"
	"github.com/meshtun/meshtun/tun"
)

// Device is the packet device the stack runs on: one IP packet per Read and
// per Write, no link-layer header. *tun.Device implements it.
//
// A Device that also implements [OffloadDevice] with a non-zero
// VnetHdrLen carries a virtio-net header in front of every packet, and the
// stack uses its offloads: GSO super-packets in both directions, partial
// checksums.
type Device interface {
	Read(b []byte) (int, error)
	Write(pkt []byte) (int, error)
	MTU() int
}

// OffloadDevice is a Device that can gather a packet from several buffers
// and may carry a virtio-net header ([tun.VnetHdr]) in front of each packet.
// *tun.Device implements it.
type OffloadDevice interface {
	Device
	// VnetHdrLen is the length of the virtio-net header in front of each
	// packet read or written: tun.VnetHdrLen, or 0 for none.
	VnetHdrLen() int
	// Writev writes one packet gathered from bufs.
	Writev(bufs [][]byte) (int, error)
}

// BatchDevice is an OffloadDevice that can take a queued packet without
// waiting and write UDP GSO packets: with it, verbatim UDP datagrams of one
// flow read back to back are written back as one super-packet (see
// udpBatch). *tun.Device implements it.
type BatchDevice interface {
	OffloadDevice
	// TryRead reads one packet like Read if one is queued, else returns
	// 0 and no error at once.
	TryRead(b []byte) (int, error)
	// USO reports whether UDP GSO packets may be written.
	USO() bool
}

// gsoMaxSize is the largest packet the netstack hands the link endpoint
// with GSO, and the largest the kernel hands a TUN with TSO (its default
// gso_max_size): an IP packet of up to 64 KiB.
const gsoMaxSize = 1 << 16

// maxReadSize is the largest packet read from an offload TUN (its virtio-
// net header excluded): a GSO packet of gso_max_size bytes, or an MTU of up
// to 65535.
const maxReadSize = gsoMaxSize

// linkEndpoint is a gVisor link endpoint over a Device with the classifier
// in front of the netstack: only intercepted packets reach the dispatcher,
// the rest are written straight back.
//
// With a virtio-net header (vnet), the endpoint reads and writes GSO
// super-packets: verbatim ones go back with their header unchanged, so the
// kernel keeps them whole; intercepted ones reach the netstack whole (its
// TCP accepts segments larger than the MSS), and the netstack's TCP sends
// up to 64 KiB per packet, which the kernel segments (see GSOMaxSize).
type linkEndpoint struct {
	dev     Device
	vdev    OffloadDevice // nil if dev is not one
	vnet    int           // length of the virtio-net header: 0 or tun.VnetHdrLen
	bdev    BatchDevice   // non-nil: verbatim UDP is coalesced (udpBatch)
	cls     *classify.Classifier
	mtu     uint32
	log     zerolog.Logger
	wg      sync.WaitGroup
	stop    atomic.Bool
	scratch sync.Pool // of *writeScratch
	stats   *linkStats
	acks    *ackDelayer // nil: every ACK is written at once

	mu         sync.RWMutex
	dispatcher stack.NetworkDispatcher
}

var (
	_ stack.LinkEndpoint = (*linkEndpoint)(nil)
	_ stack.GSOEndpoint  = (*linkEndpoint)(nil)
)

func newLinkEndpoint(dev Device, cls *classify.Classifier, log zerolog.Logger, stats *linkStats, ackDelay time.Duration) *linkEndpoint {
	e := &linkEndpoint{dev: dev, cls: cls, mtu: uint32(dev.MTU()), log: log, stats: stats}
	if ackDelay > 0 {
		e.acks = newAckDelayer(ackDelay, func(frame []byte) error {
			_, err := dev.Write(frame)
			return err
		})
	}
	if od, ok := dev.(OffloadDevice); ok {
		e.vdev = od
		e.vnet = od.VnetHdrLen()
		if bd, ok := dev.(BatchDevice); ok && e.vnet > 0 && bd.USO() && !noUDPGSO {
			e.bdev = bd
		}
	}
	if e.vnet == 0 {
		log.Info().Msg("TUN without offloads: one packet per read and write, no GSO")
	}
	return e
}

// start runs the dispatch loop until the device is closed.
func (e *linkEndpoint) start() {
	e.wg.Add(1)
	go func() {
		defer e.wg.Done()
		e.dispatchLoop()
	}()
}

func (e *linkEndpoint) dispatchLoop() {
	size := int(e.mtu)
	if e.vnet > 0 {
		size = maxReadSize
	}
	// One buffer for the loop's life: a verbatim packet is written back
	// from it, an intercepted one copied out of it into a view of its own
	// size for the netstack. Nothing is allocated per packet. With UDP
	// coalescing the buffer also holds the batch being gathered (up to
	// 64 KiB of datagrams) in front of the next read.
	bufLen := e.vnet + size
	if e.bdev != nil {
		bufLen = 2*(e.vnet+size) + udpGSOMaxSegs*(e.vnet+40+udpHeaderLen)
	}
	buf := make([]byte, bufLen)
	var (
		vh  tun.VnetHdr
		ub  udpBatch
		off int // where the next packet is read: after the batch
	)
	for {
		var n int
		var err error
		if ub.n > 0 {
			// The batch waits for more of its flow, but only for
			// what is queued already.
			n, err = e.bdev.TryRead(buf[off:])
			if err == nil && n == 0 {
				e.flushUDP(&ub)
				off = 0
				continue
			}
		} else {
			n, err = e.dev.Read(buf)
		}
		if err != nil {
			e.flushUDP(&ub)
			if e.stop.Load() || errors.Is(err, os.ErrClosed) {
				return
			}
			e.log.Error().Err(err).Msg("read from TUN failed; data path stopped")
			return
		}
		frame := buf[off : off+n]
		if n < e.vnet {
			e.stats.Drops.Add(1)
			continue
		}
		if e.vnet > 0 {
			vh.Decode(frame) // n >= e.vnet == tun.VnetHdrLen
		}
		pkt := frame[e.vnet:]
		verdict, reason := e.cls.Inbound(pkt)
		if verdict == classify.Verbatim {
			restoreHop(pkt)
			if e.bdev != nil {
				if iphl, ok := udpCandidate(pkt, &vh); ok {
					if ub.n > 0 && ub.add(pkt, e.vnet, iphl) {
						off += n
					} else {
						if ub.n > 0 {
							// Another flow: the batch goes first,
							// and this datagram starts the next
							// one at the front of the buffer.
							e.flushUDP(&ub)
							frame = buf[:copy(buf, frame)]
						}
						ub.start(frame, e.vnet, iphl)
						off = n
					}
					if ub.full() || off+e.vnet+size > len(buf) {
						e.flushUDP(&ub)
						off = 0
					}
					continue
				}
				e.flushUDP(&ub) // frame lies after it in buf: untouched
				off = 0
			}
			// Header and all: a GSO packet stays one, a partial
			// checksum stays partial, for the kernel to finish.
			if _, err := e.dev.Write(frame); err != nil {
				e.stats.VerbatimWriteErrors.Add(1)
				e.log.Debug().Err(err).Int("len", n).Msg("verbatim write-back failed")
			}
			continue
		}
		e.flushUDP(&ub)
		off = 0
		switch verdict {
		case classify.Intercept:
			e.deliver(pkt, &vh)
		default:
			e.stats.Drops.Add(1)
			e.log.Debug().Stringer("reason", reason).Int("len", n).Msg("packet dropped")
		}
	}
}

// flushUDP writes the pending UDP batch, if any: a lone datagram as it was
// read, two or more as one UDP GSO super-packet.
func (e *linkEndpoint) flushUDP(ub *udpBatch) {
	if ub.n == 0 {
		return
	}
	var err error
	if ub.n == 1 {
		_, err = e.dev.Write(ub.first)
	} else {
		_, err = e.bdev.Writev(ub.superPacket(e.vnet))
		if err == nil {
			e.stats.UDPCoalesced.Add(uint64(ub.n))
		}
	}
	if err != nil {
		e.stats.VerbatimWriteErrors.Add(uint64(ub.n))
		e.log.Debug().Err(err).Int("datagrams", ub.n).Msg("verbatim UDP write-back failed")
	}
	ub.reset()
}

// deliver hands an intercepted packet to the netstack, in a view of its
// own (buf is reused for the next read).
func (e *linkEndpoint) deliver(pkt []byte, vh *tun.VnetHdr) {
	var proto tcpip.NetworkProtocolNumber
	switch header.IPVersion(pkt) {
	case header.IPv4Version:
		proto = header.IPv4ProtocolNumber
	case header.IPv6Version:
		proto = header.IPv6ProtocolNumber
	default:
		// The classifier intercepts only well-formed IPv4 and IPv6.
		return
	}
	if e.vnet > 0 && vh.Flags&(tun.VnetNeedsCsum|tun.VnetDataValid) == 0 {
		// The netstack skips checksum verification on this endpoint
		// (see Capabilities), so a packet whose checksums are complete
		// but unverified is verified here. A partial checksum
		// (NEEDS_CSUM) cannot be verified: the packet was built on this
		// host and never crossed a wire.
		if !checksumsValid(pkt) {
			e.stats.BadChecksums.Add(1)
			return
		}
	}
	e.mu.RLock()
	d := e.dispatcher
	e.mu.RUnlock()
	if d == nil {
		return
	}
	// Headers and payload go into views of their own. gVisor's IP layer
	// keeps a reference to the network header's view while it takes
	// the header again, and taking it from a shared view copies that
	// view whole: with one view, every packet (up to 64 KiB with GSO)
	// would be copied a second time; with a view of headers only, a
	// hundred bytes are.
	var buf buffer.Buffer
	if h := headersEnd(pkt); h > 0 && h < len(pkt) {
		buf = buffer.MakeWithView(buffer.NewViewWithData(pkt[:h]))
		buf.Append(buffer.NewViewWithData(pkt[h:]))
	} else {
		buf = buffer.MakeWithView(buffer.NewViewWithData(pkt))
	}
	pb := stack.NewPacketBuffer(stack.PacketBufferOptions{Payload: buf})
	d.DeliverNetworkPacket(proto, pb)
	pb.DecRef()
}

// WritePackets sends the netstack's packets into the TUN. The classifier
// sees each first, so that a flow the netstack originates is recognised
// when its replies arrive.
func (e *linkEndpoint) WritePackets(pkts stack.PacketBufferList) (int, tcpip.Error) {
	n := 0
	for _, pkt := range pkts.AsSlice() {
		if err := e.writePacket(pkt); err != nil {
			if n == 0 {
				if e.stop.Load() || errors.Is(err, os.ErrClosed) {
					return 0, &tcpip.ErrClosedForSend{}
				}
				return 0, &tcpip.ErrAborted{}
			}
			break
		}
		n++
	}
	return n, nil
}

func (e *linkEndpoint) writePacket(pkt *stack.PacketBuffer) error {
	if e.vdev == nil {
		v := pkt.ToView()
		b := v.AsSlice()
		advance, known, both := e.cls.OutboundAck(b)
		if e.holdACK(pkt, b, advance, known && both, [][]byte{b}) {
			v.Release()
			return nil
		}
		_, err := e.dev.Write(b)
		v.Release()
		return err
	}
	w, _ := e.scratch.Get().(*writeScratch)
	if w == nil {
		w = new(writeScratch)
	}
	bufs, skip := w.bufs[:0], 0
	if e.vnet > 0 {
		vh := vnetHdrFor(pkt)
		vh.Encode(w.hdr[:])
		bufs, skip = append(bufs, w.hdr[:e.vnet]), 1
	}
	bufs = appendPacketSlices(bufs, pkt)
	hdr := headersOf(pkt, bufs[skip:])
	advance, known, both := e.cls.OutboundAck(hdr)
	var err error
	if !e.holdACK(pkt, hdr, advance, known && both, bufs) {
		_, err = e.vdev.Writev(bufs)
	}
	clear(bufs)
	w.bufs = bufs[:0]
	e.scratch.Put(w)
	return err
}

// holdACK offers an outbound TCP packet to the ACK delayer (see
// ackDelayer) and reports whether it was held. hdr holds the packet's
// headers, frame the whole packet as it would be written; advance and known
// are the classifier's (OutboundAck).
func (e *linkEndpoint) holdACK(pkt *stack.PacketBuffer, hdr []byte, advance uint32, known bool, frame [][]byte) bool {
	if e.acks == nil {
		return false
	}
	k, ack, pure, ok := pureACK(hdr, pkt.Data().Size())
	if !ok {
		return false
	}
	mss := uint32(pkt.GSOOptions.MSS)
	if mss == 0 {
		mss = defaultMSS
	}
	if !pure || !known || advance <= 1 || advance >= 2*mss {
		frame = nil
	}
	return e.acks.packet(&k, ack, pure, frame)
}

// writeScratch is a packet's Writev argument list and virtio-net header,
// pooled so that writing does not allocate.
type writeScratch struct {
	bufs [][]byte
	hdr  [tun.VnetHdrLen]byte
}

// appendPacketSlices appends the packet's bytes, headers first, as the
// slices of its views, without copying or allocating.
func appendPacketSlices(bufs [][]byte, pkt *stack.PacketBuffer) [][]byte {
	vl, off := pkt.AsViewList()
	for v := vl.Front(); v != nil; v = v.Next() {
		s := v.AsSlice()
		if off >= len(s) {
			off -= len(s)
			continue
		}
		bufs = append(bufs, s[off:])
		off = 0
	}
	return bufs
}

// headersOf returns the packet's network and transport headers as one
// slice for the classifier: the first slice of the packet when it holds
// them all (the netstack builds them in one place), else a copy.
func headersOf(pkt *stack.PacketBuffer, slices [][]byte) []byte {
	hs := pkt.HeaderSize()
	if len(slices) > 0 && len(slices[0]) >= hs {
		return slices[0][:hs]
	}
	h := make([]byte, 0, hs)
	for _, s := range slices {
		if len(h)+len(s) >= hs {
			return append(h, s[:hs-len(h)]...)
		}
		h = append(h, s...)
	}
	return h
}

// vnetHdrFor builds the virtio-net header for a packet of the netstack.
// Packets of a connection with host GSO (all of its data and ACKs) carry a
// partial checksum: the netstack stored only the pseudo-header sum, and the
// kernel completes it. Those longer than one MSS are GSO packets for the
// kernel to cut into MSS-sized TCP segments. Everything else (SYN, RST, the
// forwarder's replies) has complete checksums and needs no header fields.
func vnetHdrFor(pkt *stack.PacketBuffer) tun.VnetHdr {
	var vh tun.VnetHdr
	gso := &pkt.GSOOptions
	if gso.Type == stack.GSONone || !gso.NeedsCsum {
		return vh
	}
	l3 := len(pkt.NetworkHeader().Slice())
	vh.Flags = tun.VnetNeedsCsum
	vh.CsumStart = uint16(l3)
	vh.CsumOffset = gso.CsumOffset
	if pkt.Data().Size() > int(gso.MSS) {
		switch gso.Type {
		case stack.GSOTCPv4:
			vh.GSOType = tun.GSOTCPv4
		case stack.GSOTCPv6:
			vh.GSOType = tun.GSOTCPv6
		default:
			return tun.VnetHdr{} // not asked for: SupportedGSO is host GSO
		}
		vh.GSOSize = gso.MSS
		vh.HdrLen = uint16(pkt.HeaderSize())
	}
	return vh
}

func (e *linkEndpoint) MTU() uint32                             { return e.mtu }
func (e *linkEndpoint) SetMTU(mtu uint32)                       { e.mtu = mtu }
func (e *linkEndpoint) MaxHeaderLength() uint16                 { return 0 }
func (e *linkEndpoint) LinkAddress() tcpip.LinkAddress          { return "" }
func (e *linkEndpoint) SetLinkAddress(tcpip.LinkAddress)        {}
func (e *linkEndpoint) ARPHardwareType() header.ARPHardwareType { return header.ARPHardwareNone }
func (e *linkEndpoint) AddHeader(*stack.PacketBuffer)           {}
func (e *linkEndpoint) ParseHeader(*stack.PacketBuffer) bool    { return true }
func (e *linkEndpoint) SetOnCloseAction(func())                 {}
func (e *linkEndpoint) Wait()                                   { e.wg.Wait() }

// Capabilities: without a virtio-net header, checksums are computed and
// verified by the netstack: the kernel completes them before a packet
// enters a TUN without offloads and expects them complete on packets
// written into it.
//
// With the header, the netstack is told not to verify received checksums
// (gVisor decides that per endpoint, not per packet): the endpoint itself
// verifies those that are complete and not marked valid, and skips those
// the kernel left partial (see deliver). It still computes the checksums
// it sends, except the partial ones of GSO-capable connections.
func (e *linkEndpoint) Capabilities() stack.LinkEndpointCapabilities {
	if e.vnet > 0 {
		return stack.CapabilityRXChecksumOffload
	}
	return stack.CapabilityNone
}

// GSOMaxSize is the largest packet the netstack may hand WritePackets:
// 64 KiB with a virtio-net header, else 0.
func (e *linkEndpoint) GSOMaxSize() uint32 {
	if e.vnet > 0 {
		return gsoMaxSize
	}
	return 0
}

// SupportedGSO is host GSO with a virtio-net header: the netstack's TCP
// sends large segments with partial checksums and the kernel segments them.
func (e *linkEndpoint) SupportedGSO() stack.SupportedGSO {
	if e.vnet > 0 {
		return stack.HostGSOSupported
	}
	return stack.GSONotSupported
}

func (e *linkEndpoint) Attach(d stack.NetworkDispatcher) {
	e.mu.Lock()
	e.dispatcher = d
	e.mu.Unlock()
}

func (e *linkEndpoint) IsAttached() bool {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return e.dispatcher != nil
}

func (e *linkEndpoint) Close() {
	e.stop.Store(true)
	if e.acks != nil {
		e.acks.close()
	}
}
