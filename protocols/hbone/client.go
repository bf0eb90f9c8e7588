package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// DefaultIdleTimeout is how long a pooled connection without streams stays
// open when ClientConfig.IdleTimeout is zero.
const DefaultIdleTimeout = 60 * time.Second

// ClientConfig configures NewClient.
type ClientConfig struct {
	// TLS returns the TLS configuration for a connection on which the
	// local workload src calls the workload dst, typically
	// identity.ClientTLS(source.Workload(src), dst). Required. The Client
	// uses a copy limited to ALPN h2.
	TLS func(src, dst spiffeid.ID) (*tls.Config, error)
	// Dial opens TCP connections to HBONE endpoints; a net.Dialer if nil.
	Dial func(ctx context.Context, network, addr string) (net.Conn, error)
	// DialFrom opens a TCP connection to an HBONE endpoint from a given
	// local address (the client pod's), for a DialRequest with From set;
	// such a request fails if it is nil.
	DialFrom func(ctx context.Context, from netip.Addr, endpoint netip.AddrPort) (net.Conn, error)
	// MaxStreamsPerConn caps the streams of one pooled connection;
	// MaxStreamsPerConn (100) if zero. The server's own limit applies too.
	MaxStreamsPerConn int
	// IdleTimeout closes pooled connections that had no stream for this
	// long; DefaultIdleTimeout if zero.
	IdleTimeout time.Duration
	// PingInterval and PingTimeout: a PING after PingInterval without
	// frames, the connection closed if unanswered after PingTimeout.
	// PingInterval and PingTimeout (the package constants) if zero.
	PingInterval, PingTimeout time.Duration
	// Logger receives connection opens, closes and failures.
	Logger zerolog.Logger
}

// DialRequest says which stream to open.
type DialRequest struct {
	// Source is the local workload the stream speaks for; its SVID is
	// presented to the server.
	Source spiffeid.ID
	// Destination is the identity the server must present.
	Destination spiffeid.ID
	// Endpoint is the HBONE endpoint, <destination pod IP>:15008.
	Endpoint netip.AddrPort
	// From, if valid, is the address the connection to Endpoint is
	// dialled from (ClientConfig.DialFrom): the client pod's, as ztunnel
	// does, so that the peer sees the client as the TCP source. It is
	// part of the pool key.
	From netip.Addr
	// Target is the :authority, <destination pod IP>:<target port>.
	Target netip.AddrPort
	// Forwarded, Baggage and TraceParent are sent when not empty;
	// TraceParent must be a valid traceparent (TraceParent.String).
	Forwarded   Forwarded
	Baggage     Baggage
	TraceParent string
}

// Client opens HBONE streams over pooled connections. A pool is keyed by
// (source identity, destination identity, local address, endpoint); a connection carries at
// most MaxStreamsPerConn streams at a time (fewer if the server's
// SETTINGS_MAX_CONCURRENT_STREAMS says so) and a new one is opened when all
// are full. It is safe for concurrent use.
type Client struct {
	cfg ClientConfig
	log zerolog.Logger

	mu     sync.Mutex
	conns  map[poolKey][]*poolConn
	dials  map[poolKey]*dialCall
	closed bool
}

type poolKey struct {
	src, dst spiffeid.ID
	from     netip.Addr
	endpoint netip.AddrPort
}

// poolConn is a pooled connection; it is the client role of its h2conn.
type poolConn struct {
	client *Client
	key    poolKey
	h      *h2conn
	tls    *tls.Conn
	peer   spiffeid.ID

	// Guarded by Client.mu.
	streams int
	idle    *time.Timer
	dead    bool
}

type dialCall struct {
	done chan struct{}
	err  error
}

// NewClient checks cfg and returns a Client.
func NewClient(cfg ClientConfig) (*Client, error) {
	if cfg.TLS == nil {
		return nil, errors.New("hbone: client needs a TLS configuration function")
	}
	if cfg.Dial == nil {
		d := &net.Dialer{}
		cfg.Dial = d.DialContext
	}
	if cfg.MaxStreamsPerConn <= 0 {
		cfg.MaxStreamsPerConn = MaxStreamsPerConn
	}
	if cfg.IdleTimeout <= 0 {
		cfg.IdleTimeout = DefaultIdleTimeout
	}
	if cfg.PingInterval <= 0 {
		cfg.PingInterval = PingInterval
	}
	if cfg.PingTimeout <= 0 {
		cfg.PingTimeout = PingTimeout
	}
	return &Client{
		cfg:   cfg,
		log:   cfg.Logger,
		conns: make(map[poolKey][]*poolConn),
		dials: make(map[poolKey]*dialCall),
	}, nil
}

// Dial opens a stream to r.Target through r.Endpoint and returns it once the
// server answered 200. A refusal is a *StatusError. ctx bounds the dial only,
// not the stream's lifetime. A stream the server did not process (GOAWAY,
// REFUSED_STREAM) is retried once on another connection.
func (c *Client) Dial(ctx context.Context, r DialRequest) (*Conn, error) {
	switch {
	case !r.Target.Addr().IsValid() || r.Target.Port() == 0:
		return nil, fmt.Errorf("hbone: dial: target %s is not ip:port", r.Target)
	case !r.Endpoint.Addr().IsValid() || r.Endpoint.Port() == 0:
		return nil, fmt.Errorf("hbone: dial %s: endpoint %s is not ip:port", r.Target, r.Endpoint)
	case r.Source.IsZero() || r.Destination.IsZero():
		return nil, fmt.Errorf("hbone: dial %s: source and destination identities are required", r.Target)
	case r.From.IsValid() && r.From.Unmap().Is4() != r.Endpoint.Addr().Unmap().Is4():
		return nil, fmt.Errorf("hbone: dial %s: endpoint %s and local address %s are of different families", r.Target, r.Endpoint, r.From)
	case r.From.IsValid() && c.cfg.DialFrom == nil:
		return nil, fmt.Errorf("hbone: dial %s from %s: the client cannot dial from an address", r.Target, r.From)
	}
	if err := r.Baggage.validate(); err != nil {
		return nil, fmt.Errorf("hbone: dial %s: %w", r.Target, err)
	}
	if r.TraceParent != "" {
		if _, err := ParseTraceParent(r.TraceParent); err != nil {
			return nil, fmt.Errorf("hbone: dial %s: %w", r.Target, err)
		}
	}
	fields := requestFields(r)
	key := poolKey{src: r.Source, dst: r.Destination, from: r.From.Unmap(), endpoint: r.Endpoint}
	var avoid *poolConn
	for attempt := 0; ; attempt++ {
		pc, err := c.reserve(ctx, key, avoid)
		if err != nil {
			return nil, err
		}
		conn, err := c.open(ctx, pc, r.Target, fields)
		if err != nil && attempt == 0 && errors.Is(err, errUnprocessed) {
			c.log.Debug().Err(err).Str("endpoint", key.endpoint.String()).Msg("hbone: stream not processed, retrying on another connection")
			avoid = pc
			continue
		}
		return conn, err
	}
}

// requestFields is the CONNECT request's header list.
func requestFields(r DialRequest) []hpack.HeaderField {
	f := []hpack.HeaderField{
		{Name: ":method", Value: http.MethodConnect},
		{Name: ":authority", Value: r.Target.String()},
	}
	if !r.Forwarded.IsZero() {
		f = append(f, hpack.HeaderField{Name: "forwarded", Value: r.Forwarded.String()})
	}
	if len(r.Baggage) > 0 {
		f = append(f, hpack.HeaderField{Name: "baggage", Value: r.Baggage.String()})
	}
	if r.TraceParent != "" {
		f = append(f, hpack.HeaderField{Name: "traceparent", Value: r.TraceParent})
	}
	return f
}

// reserve returns a pooled connection for key, other than avoid, with a
// stream reserved on it, opening a connection when none has room.
func (c *Client) reserve(ctx context.Context, key poolKey, avoid *poolConn) (*poolConn, error) {
	for {
		c.mu.Lock()
		if c.closed {
			c.mu.Unlock()
			return nil, errors.New("hbone: client is closed")
		}
		for _, pc := range c.conns[key] {
			if pc != avoid && c.reserveLocked(pc) {
				c.mu.Unlock()
				return pc, nil
			}
		}
		if d := c.dials[key]; d != nil {
			// Another Dial is opening a connection for this key: wait
			// for it rather than opening one each.
			c.mu.Unlock()
			select {
			case <-d.done:
				if d.err != nil && !isContextError(d.err) {
					return nil, d.err
				}
				continue
			case <-ctx.Done():
				return nil, fmt.Errorf("hbone: dial %s: %w", key.endpoint, ctx.Err())
			}
		}
		d := &dialCall{done: make(chan struct{})}
		c.dials[key] = d
		c.mu.Unlock()

		pc, err := c.connect(ctx, key)

		c.mu.Lock()
		delete(c.dials, key)
		if err == nil && c.closed {
			pc.h.close(nil)
			err = errors.New("hbone: client is closed")
		}
		reserved := false
		if err == nil {
			// A connection whose read loop already ended is not pooled:
			// removeLocked has run for it and would not run again, so it
			// would stay in the list for good.
			if !pc.dead {
				c.conns[key] = append(c.conns[key], pc)
			}
			// Take the first stream of the new connection now: looping
			// back to the pool would find it gone if the server closed it
			// right after the handshake (TLS 1.3 servers refuse a client
			// certificate after the client has finished), and dial again,
			// making a refused client knock twice.
			if reserved = c.reserveLocked(pc); !reserved && !pc.h.usable.Load() {
				err = pc.closedErr(key)
			}
		}
		d.err = err
		close(d.done)
		c.mu.Unlock()
		if err != nil {
			return nil, err
		}
		if reserved {
			return pc, nil
		}
	}
}

// closedErr is the error of a connection that closed before its first
// stream.
func (pc *poolConn) closedErr(key poolKey) error {
	h := pc.h
	h.mu.Lock()
	err := h.closeErr
	h.mu.Unlock()
	if err == nil {
		err = errors.New("connection closed")
	}
	return fmt.Errorf("hbone: connection to %s closed before its first stream: %w", key.endpoint, err)
}

func isContextError(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

// limit is how many streams pc may carry at once.
func (c *Client) limit(pc *poolConn) int {
	n := c.cfg.MaxStreamsPerConn
	if m := pc.h.peerMaxStreams.Load(); m > 0 && int(m) < n {
		n = int(m)
	}
	return n
}

func (c *Client) reserveLocked(pc *poolConn) bool {
	if pc.dead {
		return false
	}
	if !pc.h.usable.Load() {
		// Closed or going away.
		c.removeLocked(pc)
		return false
	}
	if pc.streams >= c.limit(pc) {
		return false
	}
	pc.streams++
	if pc.idle != nil {
		pc.idle.Stop()
		pc.idle = nil
	}
	return true
}

// release returns a stream slot of pc.
func (c *Client) release(pc *poolConn) {
	c.mu.Lock()
	defer c.mu.Unlock()
	pc.streams--
	if pc.streams > 0 {
		return
	}
	if pc.dead {
		go pc.h.close(nil)
		return
	}
	if !pc.h.usable.Load() {
		c.removeLocked(pc)
		return
	}
	pc.idle = time.AfterFunc(c.cfg.IdleTimeout, func() {
		c.mu.Lock()
		defer c.mu.Unlock()
		if pc.streams == 0 && !pc.dead {
			c.log.Debug().Str("endpoint", pc.key.endpoint.String()).Str("peer", pc.peer.String()).
				Msg("hbone: closing idle connection")
			c.removeLocked(pc)
		}
	})
}

// removeLocked drops pc from the pool and closes it once its streams ended.
func (c *Client) removeLocked(pc *poolConn) {
	if pc.dead {
		return
	}
	pc.dead = true
	if pc.idle != nil {
		pc.idle.Stop()
		pc.idle = nil
	}
	list := c.conns[pc.key]
	for i, x := range list {
		if x == pc {
			list = append(list[:i:i], list[i+1:]...)
			break
		}
	}
	if len(list) == 0 {
		delete(c.conns, pc.key)
	} else {
		c.conns[pc.key] = list
	}
	if pc.streams == 0 {
		go pc.h.close(nil)
	}
	// Otherwise open streams finish first; no new ones are reserved on
	// pc, and release closes it after the last.
}

// connect opens and handshakes a new connection for key.
func (c *Client) connect(ctx context.Context, key poolKey) (*poolConn, error) {
	cfg, err := c.cfg.TLS(key.src, key.dst)
	if err != nil {
		return nil, fmt.Errorf("hbone: TLS configuration for %s calling %s: %w", key.src, key.dst, err)
	}
	cfg = cfg.Clone()
	cfg.NextProtos = []string{"h2"}
	var raw net.Conn
	if key.from.IsValid() {
		raw, err = c.cfg.DialFrom(ctx, key.from, key.endpoint)
	} else {
		raw, err = c.cfg.Dial(ctx, "tcp", key.endpoint.String())
	}
	if err != nil {
		if key.from.IsValid() {
			return nil, fmt.Errorf("hbone: connect to %s from %s: %w", key.endpoint, key.from, err)
		}
		return nil, fmt.Errorf("hbone: connect to %s: %w", key.endpoint, err)
	}
	batch := newBatchConn(raw)
	tc := tls.Client(batch, cfg)
	if err := tc.HandshakeContext(ctx); err != nil {
		raw.Close()
		return nil, fmt.Errorf("hbone: TLS handshake with %s as %s, expecting %s: %w", key.endpoint, key.src, key.dst, err)
	}
	st := tc.ConnectionState()
	if st.NegotiatedProtocol != "h2" {
		tc.Close()
		return nil, fmt.Errorf("hbone: %s negotiated ALPN %q, want h2", key.endpoint, st.NegotiatedProtocol)
	}
	var peer spiffeid.ID
	if len(st.PeerCertificates) > 0 {
		peer, _ = x509svid.IDFromCert(st.PeerCertificates[0])
	}
	pc := &poolConn{client: c, key: key, tls: tc, peer: peer}
	log := c.log.With().Str("endpoint", key.endpoint.String()).Str("peer", peer.String()).Logger()
	pc.h = newH2Conn(tc, batch, true, pc, log, c.cfg.PingInterval, c.cfg.PingTimeout)
	if err := pc.h.start(); err != nil {
		pc.h.close(err)
		return nil, fmt.Errorf("hbone: HTTP/2 connection to %s: %w", key.endpoint, err)
	}
	go func() {
		pc.h.readLoop()
		c.mu.Lock()
		c.removeLocked(pc)
		c.mu.Unlock()
	}()
	log.Debug().Str("source", key.src.String()).Msg("hbone: connection opened")
	return pc, nil
}

// open sends the CONNECT request on pc, on which a stream is reserved, and
// waits for the response.
func (c *Client) open(ctx context.Context, pc *poolConn, target netip.AddrPort, fields []hpack.HeaderField) (*Conn, error) {
	h := pc.h
	h.mu.Lock()
	if h.closed || h.goAwayRecv || h.nextID > maxWindow {
		// Only a connection going away is retried elsewhere: a closed
		// one may have been refused (a client certificate the server
		// rejected after the handshake), and a retry would repeat that.
		err := fmt.Errorf("%w: connection going away", errUnprocessed)
		if h.closed {
			err = h.closeErr
		}
		h.usable.Store(false)
		h.mu.Unlock()
		c.release(pc)
		return nil, fmt.Errorf("hbone: CONNECT %s via %s: %w", target, pc.key.endpoint, err)
	}
	id := h.nextID
	h.nextID += 2
	s := h.newStreamLocked(id)
	s.ready = make(chan struct{})
	err := h.writeHeadersLocked(id, fields, false, h.peerMaxFrame)
	h.mu.Unlock()
	if err != nil {
		// Only an encoding bug gets here; the HPACK state may be off.
		h.close(err)
		return nil, fmt.Errorf("hbone: CONNECT %s via %s: %w", target, pc.key.endpoint, err)
	}
	h.kick()

	select {
	case <-s.ready:
	case <-ctx.Done():
		s.reset(http2.ErrCodeCancel, net.ErrClosed)
		return nil, fmt.Errorf("hbone: CONNECT %s via %s: %w", target, pc.key.endpoint, ctx.Err())
	}
	h.mu.Lock()
	status, got, rerr := s.status, s.status != 0, s.rstErr
	h.mu.Unlock()
	if !got {
		// Drop what the server sent before it reset the stream, giving
		// it back to the connection window.
		s.reset(http2.ErrCodeCancel, rerr)
		return nil, fmt.Errorf("hbone: CONNECT %s via %s: %w", target, pc.key.endpoint, rerr)
	}
	conn := &Conn{s: s, pc: pc, target: target}
	if status != http.StatusOK {
		// The body is the refusal's reason; ctx bounds reading it.
		stop := context.AfterFunc(ctx, func() { conn.Abort() })
		defer stop()
		var msg [1024]byte
		n := 0
		for n < len(msg) {
			k, err := s.read(msg[n:])
			n += k
			if err != nil {
				break
			}
		}
		conn.Abort()
		return nil, &StatusError{Code: status, Message: trimMessage(msg[:n]), Target: target}
	}
	return conn, nil
}

// onHeaders handles the response HEADERS of a stream.
func (pc *poolConn) onHeaders(f *http2.MetaHeadersFrame) error {
	h := pc.h
	h.mu.Lock()
	s, err := h.streamOrUnlock(f.StreamID, "HEADERS")
	if s == nil {
		return err
	}
	defer func() { h.unlock(); h.kickAsync() }()
	if s.gotResponse {
		// Trailers: only their END_STREAM means something here.
		if !f.StreamEnded() {
			h.log.Info().Uint32("stream", s.id).Msg("hbone: second HEADERS without END_STREAM from server, resetting stream")
			s.resetLocked(http2.ErrCodeProtocol, fmt.Errorf("%w: malformed response from server", ErrReset))
			return nil
		}
		s.recvEnded = true
		s.wakeLocked()
		s.finishLocked()
		return nil
	}
	status, err := strconv.Atoi(f.PseudoValue("status"))
	if err != nil || status < 100 || status > 999 || f.Truncated {
		h.log.Info().Uint32("stream", s.id).Str("status", f.PseudoValue("status")).Msg("hbone: malformed response from server, resetting stream")
		s.resetLocked(http2.ErrCodeProtocol, fmt.Errorf("%w: malformed response from server (:status %q)", ErrReset, f.PseudoValue("status")))
		return nil
	}
	if status < 200 {
		if f.StreamEnded() {
			s.resetLocked(http2.ErrCodeProtocol, fmt.Errorf("%w: informational response ends the stream", ErrReset))
		}
		return nil // informational: the final response follows
	}
	s.status = status
	s.gotResponse = true
	close(s.ready)
	if f.StreamEnded() {
		s.recvEnded = true
		s.wakeLocked()
		s.finishLocked()
	}
	return nil
}

func (pc *poolConn) onStreamDone(*stream) { pc.client.release(pc) }

func (pc *poolConn) onGoAway() {
	c := pc.client
	c.mu.Lock()
	c.removeLocked(pc)
	c.mu.Unlock()
}

func trimMessage(b []byte) string {
	for len(b) > 0 && (b[len(b)-1] == '\n' || b[len(b)-1] == '\r' || b[len(b)-1] == ' ') {
		b = b[:len(b)-1]
	}
	return string(b)
}

// Close closes every pooled connection, which ends all open streams, and
// makes further Dials fail.
func (c *Client) Close() error {
	c.mu.Lock()
	c.closed = true
	var all []*poolConn
	for _, list := range c.conns {
		all = append(all, list...)
	}
	c.conns = make(map[poolKey][]*poolConn)
	for _, pc := range all {
		pc.dead = true
		if pc.idle != nil {
			pc.idle.Stop()
		}
	}
	c.mu.Unlock()
	for _, pc := range all {
		pc.h.close(errors.New("hbone: client closed"))
	}
	return nil
}

// PoolStats counts a Client's pooled connections and their streams.
type PoolStats struct {
	Keys    int // distinct (source, destination, endpoint) keys
	Conns   int // open pooled connections
	Streams int // open streams
}

// Stats returns the current pool counts.
func (c *Client) Stats() PoolStats {
	c.mu.Lock()
	defer c.mu.Unlock()
	var s PoolStats
	s.Keys = len(c.conns)
	for _, list := range c.conns {
		s.Conns += len(list)
		for _, pc := range list {
			s.Streams += pc.streams
		}
	}
	return s
}
