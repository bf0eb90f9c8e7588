package caserver

import (
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
)

// Limits bound what a client can make the service hold. A zero field
// takes its Default* value.
type Limits struct {
	// HandshakeTimeout bounds the TLS handshake and the HTTP/2 preface of a
	// new connection; a client that stalls longer is disconnected.
	HandshakeTimeout time.Duration
	// MaxConnections bounds the open connections (handshaking or not); a
	// connection beyond it is closed as soon as it is accepted.
	MaxConnections int
	// MaxConnectionsPerSource bounds the open connections from one source
	// IP address, so that one host cannot take every connection.
	MaxConnectionsPerSource int
	// MaxConcurrentStreams bounds the requests in flight on a connection;
	// a client's further requests wait for one to finish.
	MaxConcurrentStreams uint32
	// MaxRecvMsgSize bounds a request message; a larger one is refused
	// with ResourceExhausted before it is decoded.
	MaxRecvMsgSize int
	// MaxHeaderListSize bounds a request's metadata (the bearer token).
	MaxHeaderListSize uint32
	// IdleTimeout closes (GOAWAY) a connection without a request for this
	// long; a node reconnects for its next certificate.
	IdleTimeout time.Duration
}

// Defaults of Limits.
const (
	DefaultHandshakeTimeout        = 5 * time.Second
	DefaultMaxConnections          = 1024
	DefaultMaxConnectionsPerSource = 32
	DefaultMaxConcurrentStreams    = 16
	// DefaultMaxRecvMsgSize is 5× the largest request a client can make
	// that the service would grant: an RSA-4096 CSR (PEM) whose URI SAN
	// is a SPIFFE ID of the maximum 2048 bytes, the same ID in
	// ImpersonatedIdentity: 6,482 bytes (TestLargestRequestFits measures
	// it). A P-256 CSR of a usual identity is about 600 bytes.
	DefaultMaxRecvMsgSize = 32 << 10
	// DefaultMaxHeaderListSize leaves room for a projected service-account
	// token (about 1 KiB; a few KiB with long names) and gRPC's headers.
	DefaultMaxHeaderListSize = 32 << 10
	DefaultIdleTimeout       = 5 * time.Minute
)

func (l Limits) withDefaults() Limits {
	if l.HandshakeTimeout <= 0 {
		l.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if l.MaxConnections <= 0 {
		l.MaxConnections = DefaultMaxConnections
	}
	if l.MaxConnectionsPerSource <= 0 {
		l.MaxConnectionsPerSource = DefaultMaxConnectionsPerSource
	}
	if l.MaxConcurrentStreams == 0 {
		l.MaxConcurrentStreams = DefaultMaxConcurrentStreams
	}
	if l.MaxRecvMsgSize <= 0 {
		l.MaxRecvMsgSize = DefaultMaxRecvMsgSize
	}
	if l.MaxHeaderListSize == 0 {
		l.MaxHeaderListSize = DefaultMaxHeaderListSize
	}
	if l.IdleTimeout <= 0 {
		l.IdleTimeout = DefaultIdleTimeout
	}
	return l
}

// limitListener closes, as soon as they are accepted, the connections
// beyond a total and a per-source-address bound. Refusals are counted and
// logged at most once per refusalLogInterval.
type limitListener struct {
	net.Listener
	total, perSource int
	log              zerolog.Logger

	mu       sync.Mutex
	open     int
	bySource map[string]int
	lastLog  time.Time
	unlogged uint64

	refused atomic.Uint64
}

const refusalLogInterval = 10 * time.Second

func newLimitListener(l net.Listener, total, perSource int, log zerolog.Logger) *limitListener {
	return &limitListener{Listener: l, total: total, perSource: perSource, log: log, bySource: map[string]int{}}
}

func sourceOf(a net.Addr) string {
	if t, ok := a.(*net.TCPAddr); ok {
		return t.IP.String()
	}
	host, _, err := net.SplitHostPort(a.String())
	if err != nil {
		return a.String()
	}
	return host
}

func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		src := sourceOf(c.RemoteAddr())
		l.mu.Lock()
		var reason string
		switch {
		case l.open >= l.total:
			reason = fmt.Sprintf("%d connections open, the maximum", l.open)
		case l.bySource[src] >= l.perSource:
			reason = fmt.Sprintf("%d connections open from %s, the maximum per source", l.bySource[src], src)
		}
		if reason == "" {
			l.open++
			l.bySource[src]++
			l.mu.Unlock()
			return &limitConn{Conn: c, l: l, src: src}, nil
		}
		l.refused.Add(1)
		now := time.Now()
		logIt := now.Sub(l.lastLog) >= refusalLogInterval
		var skipped uint64
		if logIt {
			l.lastLog, skipped, l.unlogged = now, l.unlogged, 0
		} else {
			l.unlogged++
		}
		l.mu.Unlock()
		if t, ok := c.(*net.TCPConn); ok {
			t.SetLinger(0) // a reset: nothing kept in TIME_WAIT for it
		}
		c.Close()
		if logIt {
			l.log.Warn().Str("from", src).Str("reason", reason).Uint64("refused_total", l.refused.Load()).
				Uint64("not_logged_since_last", skipped).Msg("connection refused")
		}
	}
}

// Open returns the number of open connections.
func (l *limitListener) Open() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.open
}

type limitConn struct {
	net.Conn
	l    *limitListener
	src  string
	once sync.Once
}

func (c *limitConn) Close() error {
	c.once.Do(func() {
		c.l.mu.Lock()
		c.l.open--
		if c.l.bySource[c.src]--; c.l.bySource[c.src] <= 0 {
			delete(c.l.bySource, c.src)
		}
		c.l.mu.Unlock()
	})
	return c.Conn.Close()
}

// maxLogged bounds a caller-supplied string in a log line.
const maxLogged = 256

// clip returns s, cut to maxLogged bytes (at a rune boundary) with the
// original length appended when longer: what a caller sends may be logged,
// not megabytes of it.
func clip(s string) string {
	if len(s) <= maxLogged {
		return s
	}
	n := maxLogged
	for n > 0 && s[n]&0xC0 == 0x80 { // do not split a UTF-8 sequence
		n--
	}
	return fmt.Sprintf("%s…(%d bytes)", s[:n], len(s))
}
