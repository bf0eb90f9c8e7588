package hbone

import (
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// Defaults of ServerConfig's connection bounds. A pending handshake holds
// a goroutine, the TLS state and, once a client announces a record, up to
// one 16 KiB record buffer: 36 KiB of RSS on a kernel socket, 56 KiB on
// the netstack (test/e2e TestHBONEHandshakeFlood with the bounds
// removed), so DefaultMaxHandshakes holds the handshakes of all sources
// together to 36-56 MiB. A mesh client
// completes its handshake in milliseconds; only a flood keeps many
// pending. A client node pools one connection per source identity,
// destination identity and destination pod (more past 100 streams), so an
// identity's connections to a node number about its client nodes times
// the destination pods here: DefaultMaxConnsPerPeer leaves room for 400
// client nodes each reaching 10 pods of this node, and holds one identity
// to the order of memory its stream bound allows (DefaultMaxStreamsPerPeer).
const (
	DefaultHandshakeTimeout       = 5 * time.Second
	DefaultMaxHandshakes          = 1024
	DefaultMaxHandshakesPerSource = 64
	DefaultMaxConnsPerPeer        = 4096
)

// Reasons an inbound HBONE connection is refused before any request, the
// values of the reason label of meshtun_hbone_connections_refused_total.
const (
	// RefusedHandshakeLimit: every handshake slot taken, none to take
	// back (the new source would hold as many as the one holding the
	// most and, for a source holding none, none is older than
	// handshakeMinAge).
	RefusedHandshakeLimit = "handshake_limit"
	// RefusedSourceLimit: the source address has its bound of pending
	// handshakes.
	RefusedSourceLimit = "source_limit"
	// RefusedEvicted: a pending handshake reset to make room for a source
	// holding fewer.
	RefusedEvicted = "evicted"
	// RefusedHandshakeTimeout: the TLS handshake (or the HTTP/2 preface
	// after it) did not complete within the handshake timeout.
	RefusedHandshakeTimeout = "handshake_timeout"
	// RefusedHandshakeFailed: the TLS handshake failed (bad certificate,
	// not TLS 1.3, garbage, the client went away).
	RefusedHandshakeFailed = "handshake_failed"
	// RefusedNoH2: ALPN did not select h2, or no HTTP/2 preface followed.
	RefusedNoH2 = "no_h2"
	// RefusedNoIdentity: the client certificate carries no SPIFFE ID.
	RefusedNoIdentity = "no_identity"
	// RefusedPeerLimit: the peer identity has its bound of connections.
	RefusedPeerLimit = "peer_limit"
	// RefusedNotLocal: a kernel-socket connection to an address that is
	// no local mesh workload's port 15008 (counted by the proxy).
	RefusedNotLocal = "not_local"
)

// refusedReasons are the reasons the counters are kept for, in a fixed
// order.
var refusedReasons = []string{RefusedHandshakeLimit, RefusedSourceLimit, RefusedEvicted, RefusedHandshakeTimeout,
	RefusedHandshakeFailed, RefusedNoH2, RefusedNoIdentity, RefusedPeerLimit, RefusedNotLocal}

// refusals counts refused connections by reason.
type refusals struct{ n [9]atomic.Uint64 }

func (r *refusals) add(reason string) {
	for i, s := range refusedReasons {
		if s == reason {
			r.n[i].Add(1)
			return
		}
	}
}

func (r *refusals) snapshot() map[string]uint64 {
	m := make(map[string]uint64, len(refusedReasons))
	for i, s := range refusedReasons {
		m[s] = r.n[i].Load()
	}
	return m
}

// handshakeMinAge: when every handshake slot is taken and the sources hold
// them evenly, a new connection still takes the slot of the oldest pending
// handshake once that one has waited this long (a mesh client's handshake
// takes milliseconds; a flood's waits for the timeout).
const handshakeMinAge = time.Second

// pending is one handshake in a handshakeGate.
type pending struct {
	src          *hsSource
	prev, next   *pending // the source's, oldest first
	gprev, gnext *pending // the gate's, oldest first
	start        time.Time
	abort        func()
	// evicted and released are guarded by the gate's mu.
	evicted, released bool
}

// hsSource is the pending handshakes of one source address.
type hsSource struct {
	addr       netip.Addr
	n          int
	head, tail *pending
}

// handshakeGate bounds pending handshakes, in all and per source address,
// sharing the slots fairly: when all are taken, a new connection from a
// source that holds fewer than the source holding the most takes the slot
// of that source's oldest pending handshake (which is reset), so a flood
// from some sources cannot lock others out; if the sources hold them
// evenly, a source holding none takes the slot of the oldest one if that
// has waited over handshakeMinAge; the connection is refused otherwise.
type handshakeGate struct {
	max, perSource int // 0 or less: no bound
	now            func() time.Time

	mu         sync.Mutex
	total      int
	srcs       map[netip.Addr]*hsSource
	byCount    []map[*hsSource]struct{} // sources by how many they hold
	top        int                      // the most any source holds
	head, tail *pending                 // all, oldest first
}

func newHandshakeGate(max, perSource int) *handshakeGate {
	return &handshakeGate{max: max, perSource: perSource, now: time.Now, srcs: map[netip.Addr]*hsSource{}}
}

// admit counts a new handshake from addr, whose abort resets it. It
// returns the handshake, or the reason it is refused. A handshake evicted
// to make room is aborted before admit returns.
func (g *handshakeGate) admit(addr netip.Addr, abort func()) (*pending, string) {
	g.mu.Lock()
	s := g.srcs[addr]
	n := 0
	if s != nil {
		n = s.n
	}
	if g.perSource > 0 && n >= g.perSource {
		g.mu.Unlock()
		return nil, RefusedSourceLimit
	}
	var victim *pending
	if g.max > 0 && g.total >= g.max {
		switch {
		case g.top > n+1:
			// Some source holds at least two more than this one: its
			// oldest makes room.
			for top := range g.byCount[g.top] {
				victim = top.head
				break
			}
		case n == 0 && g.head != nil && g.now().Sub(g.head.start) >= handshakeMinAge:
			// A source holding none, with the slots spread evenly
			// (many sources of one each): the oldest makes room
			// once it is stale. Only a new source: sources that hold
			// some would churn every slot, each new connection
			// starting a handshake to evict another.
			victim = g.head
		default:
			g.mu.Unlock()
			return nil, RefusedHandshakeLimit
		}
		victim.evicted = true
		g.removeLocked(victim)
		if s != nil && s.n == 0 {
			s = nil // removeLocked dropped it
		}
	}
	if s == nil {
		s = &hsSource{addr: addr}
		g.srcs[addr] = s
	}
	p := &pending{src: s, start: g.now(), abort: abort}
	g.setCountLocked(s, s.n+1)
	if s.tail == nil {
		s.head, s.tail = p, p
	} else {
		p.prev, s.tail.next, s.tail = s.tail, p, p
	}
	if g.tail == nil {
		g.head, g.tail = p, p
	} else {
		p.gprev, g.tail.gnext, g.tail = g.tail, p, p
	}
	g.total++
	g.mu.Unlock()
	if victim != nil {
		victim.abort()
	}
	return p, ""
}

// release ends p (its handshake completed or failed) and reports whether
// it had been evicted. It may be called more than once.
func (g *handshakeGate) release(p *pending) (evicted bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !p.released {
		g.removeLocked(p)
	}
	return p.evicted
}

func (g *handshakeGate) removeLocked(p *pending) {
	p.released = true
	s := p.src
	if p.prev != nil {
		p.prev.next = p.next
	} else {
		s.head = p.next
	}
	if p.next != nil {
		p.next.prev = p.prev
	} else {
		s.tail = p.prev
	}
	if p.gprev != nil {
		p.gprev.gnext = p.gnext
	} else {
		g.head = p.gnext
	}
	if p.gnext != nil {
		p.gnext.gprev = p.gprev
	} else {
		g.tail = p.gprev
	}
	p.prev, p.next, p.gprev, p.gnext = nil, nil, nil, nil
	g.total--
	g.setCountLocked(s, s.n-1)
	if s.n == 0 {
		delete(g.srcs, s.addr)
	}
}

// setCountLocked moves s to the bucket of n and keeps top.
func (g *handshakeGate) setCountLocked(s *hsSource, n int) {
	if s.n > 0 {
		delete(g.byCount[s.n], s)
	}
	s.n = n
	if n > 0 {
		for len(g.byCount) <= n {
			g.byCount = append(g.byCount, map[*hsSource]struct{}{})
		}
		g.byCount[n][s] = struct{}{}
	}
	if n > g.top {
		g.top = n
	}
	for g.top > 0 && len(g.byCount[g.top]) == 0 {
		g.top--
	}
}

// load returns the pending handshakes in all and per source, for tests
// and the metrics.
func (g *handshakeGate) load() (total int, perSource map[netip.Addr]int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	perSource = make(map[netip.Addr]int, len(g.srcs))
	for a, s := range g.srcs {
		perSource[a] = s.n
	}
	return g.total, perSource
}

// LogLimiter lets through at most a burst of log lines and then a steady
// rate (a token bucket); the lines it holds back are counted, and the
// next line let through says how many. The zero value lets everything
// through; NewLogLimiter makes a limiting one. Safe for concurrent use.
type LogLimiter struct {
	rate  float64 // lines per second
	burst float64

	mu         sync.Mutex
	tokens     float64
	last       time.Time
	suppressed uint64
	now        func() time.Time
}

// DefaultLogRate is the lines per second (and the burst) a Server lets
// through for connections refused before any request.
const DefaultLogRate = 10

// NewLogLimiter returns a LogLimiter of perSecond lines a second, with a
// burst of as many.
func NewLogLimiter(perSecond int) *LogLimiter {
	return &LogLimiter{rate: float64(perSecond), burst: float64(perSecond), tokens: float64(perSecond), now: time.Now}
}

// Allow reports whether a line may be logged now and, if so, how many were
// held back since the last one let through.
func (l *LogLimiter) Allow() (ok bool, suppressed uint64) {
	if l == nil || l.rate <= 0 {
		return true, 0
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	now := l.now()
	if !l.last.IsZero() {
		l.tokens = min(l.burst, l.tokens+now.Sub(l.last).Seconds()*l.rate)
	}
	l.last = now
	if l.tokens < 1 {
		l.suppressed++
		return false, 0
	}
	l.tokens--
	suppressed, l.suppressed = l.suppressed, 0
	return true, suppressed
}
