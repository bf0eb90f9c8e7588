package stack

import (
	"fmt"
	"net/netip"
	"sync"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/header"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/waiter"
)

// ListenBacklog is the number of handshakes a Listener keeps state for;
// beyond it the netstack answers SYNs with SYN cookies (no state until the
// client's ACK proves its address), so a SYN flood holds no memory and
// does not crowd out real clients. Connections opened by a cookie have no
// window scaling (the cookie cannot carry it).
const ListenBacklog = 512

// Listener accepts TCP connections to one address in the netstack, rather
// than through the forwarder: a listening endpoint has SYN cookies, the
// forwarder does not.
type Listener struct {
	st     *Stack
	ep     tcpip.Endpoint
	wq     waiter.Queue
	addr   netip.AddrPort
	handle func(*Conn)
	stop   chan struct{}
	done   chan struct{}
	once   sync.Once
}

// Listen accepts TCP connections to addr (any address: the netstack
// stands in for it) and calls handle on a goroutine of its own for each,
// its handshake complete. SYNs to addr reach the listener instead of the
// HandleTCP callback. Close stops it.
func (st *Stack) Listen(addr netip.AddrPort, handle func(*Conn)) (*Listener, error) {
	proto := header.IPv4ProtocolNumber
	if addr.Addr().Is6() {
		proto = header.IPv6ProtocolNumber
	}
	l := &Listener{st: st, addr: addr, handle: handle, stop: make(chan struct{}), done: make(chan struct{})}
	ep, terr := st.s.NewEndpoint(tcp.ProtocolNumber, proto, &l.wq)
	if terr != nil {
		return nil, fmt.Errorf("stack: listen on %s: %s", addr, terr)
	}
	ep.SocketOptions().SetReuseAddress(true)
	if addr.Addr().Is6() {
		ep.SocketOptions().SetV6Only(true)
	}
	if terr := ep.Bind(fullAddr(addr)); terr != nil {
		ep.Close()
		return nil, fmt.Errorf("stack: listen on %s: bind: %w", addr, tcpipError(terr))
	}
	if terr := ep.Listen(ListenBacklog); terr != nil {
		ep.Close()
		return nil, fmt.Errorf("stack: listen on %s: %w", addr, tcpipError(terr))
	}
	l.ep = ep
	go l.acceptLoop()
	return l, nil
}

// Addr returns the address the listener accepts connections to.
func (l *Listener) Addr() netip.AddrPort { return l.addr }

func (l *Listener) acceptLoop() {
	defer close(l.done)
	entry, notify := waiter.NewChannelEntry(waiter.ReadableEvents)
	l.wq.EventRegister(&entry)
	defer l.wq.EventUnregister(&entry)
	for {
		var peer tcpip.FullAddress
		ep, wq, terr := l.ep.Accept(&peer)
		if _, ok := terr.(*tcpip.ErrWouldBlock); ok {
			select {
			case <-notify:
				continue
			case <-l.stop:
				return
			}
		}
		if terr != nil {
			select {
			case <-l.stop:
			default:
				l.st.log.Error().Str("addr", l.addr.String()).Str("error", terr.String()).Msg("netstack listener failed")
			}
			return
		}
		remote := addrPort(peer.Addr, peer.Port)
		// The connection, and its flow, are the netstack's until closed.
		l.st.cls.Own(l.addr, remote)
		ep.SocketOptions().SetKeepAlive(true)
		c := l.st.newConn(wq, ep, l.addr, remote)
		go l.handle(c)
	}
}

// Close stops accepting; connections already accepted are not affected.
func (l *Listener) Close() error {
	l.once.Do(func() {
		close(l.stop)
		l.ep.Close()
		<-l.done
	})
	return nil
}
