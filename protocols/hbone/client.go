package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"net/url"
	"sync"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"golang.org/x/net/http2"
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
	// Target is the :authority, <destination pod IP>:<target port>.
	Target netip.AddrPort
	// Forwarded, Baggage and TraceParent are sent when not empty.
	Forwarded   Forwarded
	Baggage     Baggage
	TraceParent string
}

// Client opens HBONE streams over pooled connections. A pool is keyed by
// (source identity, destination identity, endpoint); a connection carries at
// most MaxStreamsPerConn streams at a time and a new one is opened when all
// are full. It is safe for concurrent use.
type Client struct {
	cfg ClientConfig
	h2  *http2.Transport
	log zerolog.Logger

	mu     sync.Mutex
	conns  map[poolKey][]*poolConn
	dials  map[poolKey]*dialCall
	closed bool
}

type poolKey struct {
	src, dst spiffeid.ID
	endpoint netip.AddrPort
}

type poolConn struct {
	key  poolKey
	cc   *http2.ClientConn
	tls  *tls.Conn
	peer spiffeid.ID

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
	// x/net/http2.Transport reads its window sizes only from a linked
	// net/http Transport's HTTP2Config (it has no fields for them), so
	// link one. Nothing ever dials through t1.
	t1 := &http.Transport{
		DisableCompression: true,
		HTTP2: &http.HTTP2Config{
			MaxReadFrameSize:          MaxFrameSize,
			MaxReceiveBufferPerStream: StreamWindow,
			// The transport adds this to the initial 65535 of RFC 9113.
			MaxReceiveBufferPerConnection: ConnWindow - 65535,
			SendPingTimeout:               cfg.PingInterval,
			PingTimeout:                   cfg.PingTimeout,
		},
	}
	t2, err := http2.ConfigureTransports(t1)
	if err != nil {
		return nil, fmt.Errorf("hbone: configure HTTP/2 transport: %w", err)
	}
	t2.DisableCompression = true
	t2.MaxReadFrameSize = MaxFrameSize
	t2.ReadIdleTimeout = cfg.PingInterval
	t2.PingTimeout = cfg.PingTimeout
	return &Client{
		cfg:   cfg,
		h2:    t2,
		log:   cfg.Logger,
		conns: make(map[poolKey][]*poolConn),
		dials: make(map[poolKey]*dialCall),
	}, nil
}

// Dial opens a stream to r.Target through r.Endpoint and returns it once the
// server answered 200. A refusal is a *StatusError. ctx bounds the dial only,
// not the stream's lifetime.
func (c *Client) Dial(ctx context.Context, r DialRequest) (*Conn, error) {
	switch {
	case !r.Target.Addr().IsValid() || r.Target.Port() == 0:
		return nil, fmt.Errorf("hbone: dial: target %s is not ip:port", r.Target)
	case !r.Endpoint.Addr().IsValid() || r.Endpoint.Port() == 0:
		return nil, fmt.Errorf("hbone: dial %s: endpoint %s is not ip:port", r.Target, r.Endpoint)
	case r.Source.IsZero() || r.Destination.IsZero():
		return nil, fmt.Errorf("hbone: dial %s: source and destination identities are required", r.Target)
	}
	if err := r.Baggage.validate(); err != nil {
		return nil, fmt.Errorf("hbone: dial %s: %w", r.Target, err)
	}
	key := poolKey{src: r.Source, dst: r.Destination, endpoint: r.Endpoint}
	pc, err := c.reserve(ctx, key)
	if err != nil {
		return nil, err
	}
	return c.open(ctx, pc, r)
}

// reserve returns a pooled connection for key with a stream reserved on it,
// opening a connection when none has room.
func (c *Client) reserve(ctx context.Context, key poolKey) (*poolConn, error) {
	for {
		c.mu.Lock()
		if c.closed {
			c.mu.Unlock()
			return nil, errors.New("hbone: client is closed")
		}
		for _, pc := range c.conns[key] {
			if c.reserveLocked(pc) {
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
			pc.cc.Close()
			err = errors.New("hbone: client is closed")
		}
		if err == nil {
			c.conns[key] = append(c.conns[key], pc)
		}
		d.err = err
		close(d.done)
		c.mu.Unlock()
		if err != nil {
			return nil, err
		}
	}
}

func isContextError(err error) bool {
	return errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded)
}

func (c *Client) reserveLocked(pc *poolConn) bool {
	if pc.dead || pc.streams >= c.cfg.MaxStreamsPerConn {
		return false
	}
	if !pc.cc.ReserveNewRequest() {
		// Closed, going away, or at the server's stream limit.
		if st := pc.cc.State(); st.Closed || st.Closing {
			c.removeLocked(pc)
		}
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
	if pc.streams > 0 || pc.dead {
		return
	}
	if st := pc.cc.State(); st.Closed || st.Closing {
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
		go pc.cc.Close()
	} else {
		// Let open streams finish; no new ones are reserved on pc.
		go pc.cc.Shutdown(context.Background())
	}
}

// connect opens and handshakes a new connection for key.
func (c *Client) connect(ctx context.Context, key poolKey) (*poolConn, error) {
	cfg, err := c.cfg.TLS(key.src, key.dst)
	if err != nil {
		return nil, fmt.Errorf("hbone: TLS configuration for %s calling %s: %w", key.src, key.dst, err)
	}
	cfg = cfg.Clone()
	cfg.NextProtos = []string{"h2"}
	raw, err := c.cfg.Dial(ctx, "tcp", key.endpoint.String())
	if err != nil {
		return nil, fmt.Errorf("hbone: connect to %s: %w", key.endpoint, err)
	}
	tc := tls.Client(raw, cfg)
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
	cc, err := c.h2.NewClientConn(tc)
	if err != nil {
		tc.Close()
		return nil, fmt.Errorf("hbone: HTTP/2 connection to %s: %w", key.endpoint, err)
	}
	c.log.Debug().Str("endpoint", key.endpoint.String()).Str("source", key.src.String()).
		Str("peer", peer.String()).Msg("hbone: connection opened")
	return &poolConn{key: key, cc: cc, tls: tc, peer: peer}, nil
}

// open sends the CONNECT request on pc, on which a stream is reserved.
func (c *Client) open(ctx context.Context, pc *poolConn, r DialRequest) (*Conn, error) {
	authority := r.Target.String()
	h := http.Header{"User-Agent": {""}} // an empty value suppresses Go's default
	if !r.Forwarded.IsZero() {
		h.Set(HeaderForwarded, r.Forwarded.String())
	}
	if len(r.Baggage) > 0 {
		h.Set(HeaderBaggage, r.Baggage.String())
	}
	if r.TraceParent != "" {
		h.Set(HeaderTraceParent, r.TraceParent)
	}
	// The stream lives until Close or Abort, beyond ctx: cancelling its
	// context resets it.
	sctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	pr, pw := io.Pipe()
	conn := &Conn{
		client: c,
		pc:     pc,
		target: r.Target,
		pw:     pw,
		cancel: cancel,
	}
	body := &requestBody{pr: pr, conn: conn}
	req := (&http.Request{
		Method:        http.MethodConnect,
		URL:           &url.URL{Host: authority},
		Host:          authority,
		Header:        h,
		Body:          body,
		ContentLength: -1,
		Proto:         "HTTP/2.0",
		ProtoMajor:    2,
	}).WithContext(sctx)

	stop := context.AfterFunc(ctx, cancel)
	resp, err := pc.cc.RoundTrip(req)
	if !stop() {
		if err == nil {
			resp.Body.Close()
		}
		pw.CloseWithError(ctx.Err())
		conn.finish()
		return nil, fmt.Errorf("hbone: CONNECT %s via %s: %w", authority, pc.key.endpoint, ctx.Err())
	}
	if err != nil {
		pw.CloseWithError(err)
		conn.finish()
		return nil, fmt.Errorf("hbone: CONNECT %s via %s: %w", authority, pc.key.endpoint, err)
	}
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 1024))
		resp.Body.Close()
		pw.CloseWithError(errors.New("refused"))
		conn.finish()
		return nil, &StatusError{Code: resp.StatusCode, Message: trimMessage(msg), Target: r.Target}
	}
	conn.body = resp.Body
	return conn, nil
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
		pc.cc.Close()
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
