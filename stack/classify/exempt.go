package classify

import (
	"net/netip"
	"sync"
	"sync/atomic"
)

// Exempt holds meshtun's own kernel-socket connections and listeners
// whose packets cross the TUN (the node's rules capture everything to a
// local mesh pod, meshtun's sockets included) and must go out verbatim:
// the policy's yes is overridden for a segment whose source is one of
// them. It replaces a socket mark, which any process with CAP_NET_RAW
// or CAP_NET_ADMIN in the node's namespace could set too:
//
//   - a connection is registered by its exact addresses and ports
//     (AddConn), after its socket is bound and before it connects; the
//     kernel lets no other socket have the same four while it lives;
//   - a listener by its bound address and port (AddListener); an
//     unspecified address stands for every address Local reports (the
//     node's own). No other socket can bind the address and port while
//     the listener holds it.
//
// When meshtun is gone, so is the TUN: nothing is exempt then, the
// captured traffic meets the blocking routes. Safe for concurrent use;
// Has does not allocate.
type Exempt struct {
	local func(netip.Addr) bool

	nConns atomic.Int64 // connections; 0 skips their map
	// ports has bit p set while a listener holds port p: a segment from
	// any other port skips the listeners' map.
	ports     [1 << 16 / 64]atomic.Uint64
	mu        sync.RWMutex
	conns     map[[2]netip.AddrPort]int
	listeners map[netip.AddrPort]int
}

// NewExempt returns an empty registry; local reports whether an address
// is the node's own (for listeners on an unspecified address; nil: none).
func NewExempt(local func(netip.Addr) bool) *Exempt {
	return &Exempt{local: local, conns: map[[2]netip.AddrPort]int{}, listeners: map[netip.AddrPort]int{}}
}

func unmap(ap netip.AddrPort) netip.AddrPort {
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port())
}

// AddConn exempts the TCP connection from local to remote (meshtun's end
// first) until release is called. Register it before the connect, release
// it after the socket is closed.
func (e *Exempt) AddConn(local, remote netip.AddrPort) (release func()) {
	k := [2]netip.AddrPort{unmap(local), unmap(remote)}
	e.mu.Lock()
	e.conns[k]++
	e.mu.Unlock()
	e.nConns.Add(1)
	var once sync.Once
	return func() {
		once.Do(func() {
			e.mu.Lock()
			if e.conns[k]--; e.conns[k] <= 0 {
				delete(e.conns, k)
			}
			e.mu.Unlock()
			e.nConns.Add(-1)
		})
	}
}

// AddListener exempts what a listener bound to local sends (its accepted
// connections' packets) until release is called; an unspecified address
// (0.0.0.0 or ::) covers the node's addresses, in both families.
func (e *Exempt) AddListener(local netip.AddrPort) (release func()) {
	k := unmap(local)
	if k.Addr().IsUnspecified() {
		k = netip.AddrPortFrom(netip.Addr{}, k.Port())
	}
	e.mu.Lock()
	e.listeners[k]++
	e.setPort(k.Port())
	e.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			e.mu.Lock()
			if e.listeners[k]--; e.listeners[k] <= 0 {
				delete(e.listeners, k)
			}
			e.setPort(k.Port())
			e.mu.Unlock()
		})
	}
}

// setPort makes port's bit say whether a listener holds it (e.mu held).
func (e *Exempt) setPort(port uint16) {
	held := false
	for k, n := range e.listeners {
		if k.Port() == port && n > 0 {
			held = true
			break
		}
	}
	w, bit := &e.ports[port/64], uint64(1)<<(port%64)
	if held {
		w.Or(bit)
	} else {
		w.And(^bit)
	}
}

// Has reports whether a TCP segment from src to dst belongs to an exempt
// connection or listener (src is meshtun's end).
func (e *Exempt) Has(src, dst netip.AddrPort) bool {
	if e == nil {
		return false
	}
	conns := e.nConns.Load() > 0
	listener := e.ports[src.Port()/64].Load()&(1<<(src.Port()%64)) != 0
	if !conns && !listener {
		return false // without a lock: the common case, a flood included
	}
	src, dst = unmap(src), unmap(dst)
	e.mu.RLock()
	ok := conns && e.conns[[2]netip.AddrPort{src, dst}] > 0 || listener && e.listeners[src] > 0
	any := !ok && listener && e.listeners[netip.AddrPortFrom(netip.Addr{}, src.Port())] > 0
	e.mu.RUnlock()
	return ok || any && e.local != nil && e.local(src.Addr())
}
