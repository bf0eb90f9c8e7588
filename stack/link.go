package stack

import (
	"errors"
	"os"
	"sync"
	"sync/atomic"

	"github.com/rs/zerolog"
	"gvisor.dev/gvisor/pkg/buffer"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/stack"

	"github.com/meshtun/meshtun/stack/classify"
)

// Device is the packet device the stack runs on: one IP packet per Read and
// per Write, no link-layer header. *tun.Device implements it.
type Device interface {
	Read(b []byte) (int, error)
	Write(pkt []byte) (int, error)
	MTU() int
}

// linkEndpoint is a gVisor link endpoint over a Device with the classifier
// in front of the netstack: only intercepted packets reach the dispatcher,
// the rest are written straight back.
type linkEndpoint struct {
	dev  Device
	cls  *classify.Classifier
	mtu  uint32
	log  zerolog.Logger
	wg   sync.WaitGroup
	stop atomic.Bool

	mu         sync.RWMutex
	dispatcher stack.NetworkDispatcher

	stats *Stats
}

var _ stack.LinkEndpoint = (*linkEndpoint)(nil)

func newLinkEndpoint(dev Device, cls *classify.Classifier, log zerolog.Logger, stats *Stats) *linkEndpoint {
	return &linkEndpoint{dev: dev, cls: cls, mtu: uint32(dev.MTU()), log: log, stats: stats}
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
	for {
		// The view comes from gVisor's chunk pool. An intercepted packet
		// is handed to the netstack in it without a copy; a verbatim one
		// is written back from it and the view returned to the pool.
		v := buffer.NewViewSize(size)
		n, err := e.dev.Read(v.AsSlice())
		if err != nil {
			v.Release()
			if e.stop.Load() || errors.Is(err, os.ErrClosed) {
				return
			}
			e.log.Error().Err(err).Msg("read from TUN failed; data path stopped")
			return
		}
		v.CapLength(n)
		pkt := v.AsSlice()
		verdict, reason := e.cls.Inbound(pkt)
		switch verdict {
		case classify.Verbatim:
			if _, err := e.dev.Write(pkt); err != nil {
				e.stats.VerbatimWriteErrors.Add(1)
				e.log.Debug().Err(err).Int("len", n).Msg("verbatim write-back failed")
			}
			v.Release()
		case classify.Intercept:
			e.deliver(v)
		default:
			e.stats.Drops.Add(1)
			e.log.Debug().Stringer("reason", reason).Int("len", n).Msg("packet dropped")
			v.Release()
		}
	}
}

func (e *linkEndpoint) deliver(v *buffer.View) {
	var proto tcpip.NetworkProtocolNumber
	switch header.IPVersion(v.AsSlice()) {
	case header.IPv4Version:
		proto = header.IPv4ProtocolNumber
	case header.IPv6Version:
		proto = header.IPv6ProtocolNumber
	default:
		// The classifier intercepts only well-formed IPv4 and IPv6.
		v.Release()
		return
	}
	e.mu.RLock()
	d := e.dispatcher
	e.mu.RUnlock()
	if d == nil {
		v.Release()
		return
	}
	pkt := stack.NewPacketBuffer(stack.PacketBufferOptions{Payload: buffer.MakeWithView(v)})
	d.DeliverNetworkPacket(proto, pkt)
	pkt.DecRef()
}

// WritePackets sends the netstack's packets into the TUN. The classifier
// sees each first, so that a flow the netstack originates is recognised
// when its replies arrive.
func (e *linkEndpoint) WritePackets(pkts stack.PacketBufferList) (int, tcpip.Error) {
	n := 0
	for _, pkt := range pkts.AsSlice() {
		v := pkt.ToView()
		b := v.AsSlice()
		e.cls.Outbound(b)
		_, err := e.dev.Write(b)
		v.Release()
		if err != nil {
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

// Capabilities: checksums are computed and verified by the netstack. The
// kernel computes them before a packet enters a TUN without offloads, and
// expects them complete on packets written into it.
func (e *linkEndpoint) Capabilities() stack.LinkEndpointCapabilities {
	return stack.CapabilityNone
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

func (e *linkEndpoint) Close() { e.stop.Store(true) }
