package stack

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv4"
	"gvisor.dev/gvisor/pkg/tcpip/network/ipv6"
	"gvisor.dev/gvisor/pkg/tcpip/stack"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/waiter"

	"github.com/meshtun/meshtun/stack/classify"
)

const nicID tcpip.NICID = 1

// Tuning of the netstack's TCP. The buffers bound what one connection can
// have in flight; receive-buffer moderation grows the window from the
// default up to the maximum as the flow's bandwidth-delay product demands.
const (
	tcpBufMin        = 4 << 10
	tcpBufDefault    = 1 << 20
	tcpBufMax        = 8 << 20
	forwarderWindow  = 0 // 0: the stack's default receive buffer
	forwarderPending = 4096
	// pendingPerSource bounds the connection requests (handshakes the
	// proxy is deciding or completing) of one source address; when more
	// than half of forwarderPending are in use, a source may hold at most
	// its fair share of them (forwarderPending / sources, at least
	// pendingFloor).
	pendingPerSource = forwarderPending / 8
	pendingFloor     = 16
)

// TCPHandler is called, on its own goroutine, for every new TCP connection
// the classifier intercepted. The handshake with the client is still
// pending: the handler decides, typically after connecting upstream, by
// calling Accept or Reject exactly once.
type TCPHandler func(req *TCPRequest)

// Config configures a Stack.
type Config struct {
	Device     Device
	Classifier *classify.Classifier
	// AckDelay, if positive, holds the netstack's pure ACKs on flows
	// whose both ends are the netstack's back for up to this long, so
	// that a reply within that time carries the acknowledgment instead
	// (see ackDelayer). 0 writes every ACK at once.
	AckDelay time.Duration
	Logger   zerolog.Logger
}

// linkStats are the link endpoint's counters, read through Stack.Stats.
type linkStats struct {
	Drops               atomic.Uint64 // packets the classifier dropped
	VerbatimWriteErrors atomic.Uint64 // verbatim packets the TUN refused
	UDPCoalesced        atomic.Uint64 // verbatim UDP datagrams written back in a GSO super-packet with others
	BadChecksums        atomic.Uint64 // intercepted packets dropped for a wrong checksum
	PendingDrops        atomic.Uint64 // SYNs dropped: their source had its share of pending requests
}

// Stack is a gVisor netstack behind the classifier on a TUN device.
type Stack struct {
	s       *stack.Stack
	link    *linkEndpoint
	cls     *classify.Classifier
	log     zerolog.Logger
	stats   linkStats
	pending pendingSources

	handleTCP TCPHandler // set by Start
}

// pendingSources counts the pending connection requests per source
// address, to bound them per source with a fair share for each.
type pendingSources struct {
	mu    sync.Mutex
	n     map[netip.Addr]int
	total int
}

// admit counts a new request from src, or reports false if src already
// has its share.
func (p *pendingSources) admit(src netip.Addr) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n == nil {
		p.n = map[netip.Addr]int{}
	}
	have := p.n[src]
	limit := pendingPerSource
	if p.total >= forwarderPending/2 {
		sources := len(p.n)
		if have == 0 {
			sources++
		}
		limit = min(limit, max(pendingFloor, forwarderPending/sources))
	}
	if have >= limit {
		return false
	}
	p.n[src] = have + 1
	p.total++
	return true
}

// done ends a request admitted for src.
func (p *pendingSources) done(src netip.Addr) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.n[src] <= 1 {
		delete(p.n, src)
	} else {
		p.n[src]--
	}
	p.total--
}

// New builds the netstack on cfg.Device; Start starts it. Built before the
// proxy that dials through it, started with the proxy's handler: each
// part is constructed in order, none is patched in afterwards.
func New(cfg Config) (*Stack, error) {
	if cfg.Device == nil || cfg.Classifier == nil {
		return nil, errors.New("stack: Device and Classifier are required")
	}
	st := &Stack{log: cfg.Logger, cls: cfg.Classifier}
	st.s = stack.New(stack.Options{
		NetworkProtocols:   []stack.NetworkProtocolFactory{ipv4.NewProtocol, ipv6.NewProtocol},
		TransportProtocols: []stack.TransportProtocolFactory{tcp.NewProtocol},
	})
	if err := st.tune(); err != nil {
		st.s.Destroy()
		return nil, err
	}
	st.link = newLinkEndpoint(cfg.Device, cfg.Classifier, cfg.Logger, &st.stats, cfg.AckDelay)
	if err := st.s.CreateNIC(nicID, st.link); err != nil {
		st.s.Destroy()
		return nil, fmt.Errorf("stack: create NIC: %s", err)
	}
	// Promiscuous: accept packets for any destination address. Spoofing:
	// send from any source address, so connections keep the addresses of
	// the hosts they stand in for.
	if err := st.s.SetPromiscuousMode(nicID, true); err != nil {
		st.s.Destroy()
		return nil, fmt.Errorf("stack: promiscuous mode: %s", err)
	}
	if err := st.s.SetSpoofing(nicID, true); err != nil {
		st.s.Destroy()
		return nil, fmt.Errorf("stack: spoofing: %s", err)
	}
	st.s.SetRouteTable([]tcpip.Route{
		{Destination: header.IPv4EmptySubnet, NIC: nicID},
		{Destination: header.IPv6EmptySubnet, NIC: nicID},
	})
	fwd := tcp.NewForwarder(st.s, forwarderWindow, forwarderPending, func(r *tcp.ForwarderRequest) {
		req := st.newRequest(r)
		if !st.pending.admit(req.Src.Addr()) {
			// Silently: the client retransmits its SYN.
			st.stats.PendingDrops.Add(1)
			r.Complete(false)
			return
		}
		// From here the netstack holds the flow, until the request
		// is refused or the connection it becomes is closed.
		st.cls.Own(req.Dst, req.Src)
		st.handleTCP(req)
	})
	st.s.SetTransportProtocolHandler(tcp.ProtocolNumber, fwd.HandlePacket)
	return st, nil
}

// Start starts reading packets from the device; h receives the
// intercepted TCP connections. Call it once.
func (st *Stack) Start(h TCPHandler) error {
	if h == nil {
		return errors.New("stack: Start needs a TCP handler")
	}
	if st.handleTCP != nil {
		return errors.New("stack: started twice")
	}
	st.handleTCP = h
	st.link.start()
	return nil
}

func (st *Stack) tune() error {
	opts := []struct {
		name string
		opt  tcpip.SettableTransportProtocolOption
	}{
		{"SACK", ptr(tcpip.TCPSACKEnabled(true))},
		{"RACK loss detection", ptr(tcpip.TCPRACKLossDetection)},
		{"receive buffer moderation", ptr(tcpip.TCPModerateReceiveBufferOption(true))},
		{"receive buffer sizes", &tcpip.TCPReceiveBufferSizeRangeOption{Min: tcpBufMin, Default: tcpBufDefault, Max: tcpBufMax}},
		{"send buffer sizes", &tcpip.TCPSendBufferSizeRangeOption{Min: tcpBufMin, Default: tcpBufDefault, Max: tcpBufMax}},
		{"congestion control", ptr(tcpip.CongestionControlOption("cubic"))},
		// No TIME_WAIT. Every endpoint here mirrors one of a pod that
		// keeps its own, and its segments cross only this node's TUN and
		// veth, where no delayed duplicate can be in flight. A lingering
		// copy would only refuse a tuple that the pod's own kernel lets
		// its client reuse (tcp_tw_reuse), turning that client's next
		// connection into a reset (TestClientReusesItsPort).
		{"TIME_WAIT timeout", ptr(tcpip.TCPTimeWaitTimeoutOption(0))},
	}
	for _, o := range opts {
		if err := st.s.SetTransportProtocolOption(tcp.ProtocolNumber, o.opt); err != nil {
			return fmt.Errorf("stack: set TCP %s: %s", o.name, err)
		}
	}
	return nil
}

func ptr[T any](v T) *T { return &v }

// Close stops the stack. The Device must be closed by its owner first (or
// right after), which ends the dispatch loop.
func (st *Stack) Close() {
	st.link.Close()
	st.s.Close()
	st.link.Wait()
	st.s.Destroy()
}

// Counters is a snapshot of a Stack's counters.
type Counters struct {
	Drops               uint64 // packets the classifier dropped
	VerbatimWriteErrors uint64 // verbatim packets the TUN refused
	UDPCoalesced        uint64 // verbatim UDP datagrams written back in a UDP GSO super-packet with others
	BadChecksums        uint64 // intercepted packets dropped for a wrong checksum
	TCPRetransmits      uint64 // segments the netstack's TCP retransmitted
	ForwarderDrops      uint64 // SYNs dropped: too many connections pending
	PendingDrops        uint64 // SYNs dropped: their source had its share of pending connections
	AcksElided          uint64 // pure ACKs held back and then superseded by a later packet (AckDelay)
	AcksDelayed         uint64 // pure ACKs held back and written later (AckDelay)
}

// Stats returns a snapshot of the stack's counters.
func (st *Stack) Stats() Counters {
	tcp := st.s.Stats().TCP
	c := Counters{
		Drops:               st.stats.Drops.Load(),
		VerbatimWriteErrors: st.stats.VerbatimWriteErrors.Load(),
		UDPCoalesced:        st.stats.UDPCoalesced.Load(),
		BadChecksums:        st.stats.BadChecksums.Load(),
		TCPRetransmits:      tcp.Retransmits.Value(),
		ForwarderDrops:      tcp.ForwardMaxInFlightDrop.Value(),
		PendingDrops:        st.stats.PendingDrops.Load(),
	}
	if a := st.link.acks; a != nil {
		c.AcksElided = a.dropped.Load()
		c.AcksDelayed = a.flushed.Load()
	}
	return c
}

// DialTCP opens a TCP connection from src to dst through the netstack: the
// packets leave through the TUN with src as their source address, whether
// or not src belongs to this host. A zero src port picks an ephemeral one.
func (st *Stack) DialTCP(ctx context.Context, src, dst netip.AddrPort) (*Conn, error) {
	if src.Addr().Is4() != dst.Addr().Is4() {
		return nil, fmt.Errorf("stack: dial %s from %s: address families differ", dst, src)
	}
	proto := header.IPv4ProtocolNumber
	if dst.Addr().Is6() {
		proto = header.IPv6ProtocolNumber
	}
	var wq waiter.Queue
	ep, terr := st.s.NewEndpoint(tcp.ProtocolNumber, proto, &wq)
	if terr != nil {
		return nil, fmt.Errorf("stack: dial %s from %s: %s", dst, src, terr)
	}
	// Bind to the tuple, not the port: the same source address and port
	// may be in use (or in TIME_WAIT) towards another destination, as the
	// spoofed clients' own kernels allow.
	ep.SocketOptions().SetReuseAddress(true)
	if terr := ep.Bind(fullAddr(src)); terr != nil {
		ep.Close()
		return nil, fmt.Errorf("stack: dial %s: bind %s: %w", dst, src, tcpipError(terr))
	}
	local := src
	if src.Port() == 0 {
		if a, err := ep.GetLocalAddress(); err == nil {
			local = netip.AddrPortFrom(src.Addr(), a.Port)
		}
	}
	// The flow is the netstack's from its first SYN to the endpoint's
	// close: it never expires under a connection that is merely idle.
	st.cls.Own(local, dst)
	// Keepalive finds a peer that went away silently (it is the
	// netstack's endpoint that ends the flow, not a timer).
	ep.SocketOptions().SetKeepAlive(true)
	// Connect and wait, honouring ctx.
	entry, notify := waiter.NewChannelEntry(waiter.EventOut | waiter.EventHUp | waiter.EventErr)
	wq.EventRegister(&entry)
	defer wq.EventUnregister(&entry)
	terr = ep.Connect(fullAddr(dst))
	if _, ok := terr.(*tcpip.ErrConnectStarted); ok {
		select {
		case <-ctx.Done():
			ep.Abort()
			ep.Close()
			st.cls.Release(local, dst)
			return nil, fmt.Errorf("stack: dial %s from %s: %w", dst, local, ctx.Err())
		case <-notify:
		}
		terr = ep.LastError()
	}
	if terr != nil {
		ep.Close()
		st.cls.Release(local, dst)
		return nil, &net.OpError{Op: "dial", Net: "tcp", Source: net.TCPAddrFromAddrPort(local), Addr: net.TCPAddrFromAddrPort(dst), Err: tcpipError(terr)}
	}
	return st.newConn(&wq, ep, local, dst), nil
}

func fullAddr(ap netip.AddrPort) tcpip.FullAddress {
	return tcpip.FullAddress{NIC: nicID, Addr: tcpip.AddrFromSlice(ap.Addr().AsSlice()), Port: ap.Port()}
}

func addrPort(a tcpip.Address, port uint16) netip.AddrPort {
	ip, _ := netip.AddrFromSlice(a.AsSlice())
	return netip.AddrPortFrom(ip, port)
}
