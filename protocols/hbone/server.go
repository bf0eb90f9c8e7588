package hbone

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/netip"
	"strings"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"golang.org/x/net/http2"
)

// Request is an HBONE CONNECT request as the server hands it to its Handler.
type Request struct {
	// Target is the :authority, the destination pod IP and target port.
	Target netip.AddrPort
	// Peer is the client's SPIFFE ID, verified by the TLS handshake.
	Peer spiffeid.ID
	// PeerAddr is the remote address of the HBONE connection.
	PeerAddr netip.AddrPort
	// LocalAddr is the address the client connected to, usually
	// <destination pod IP>:15008.
	LocalAddr netip.AddrPort
	// Forwarded is the parsed forwarded header; zero if absent.
	Forwarded Forwarded
	// Baggage is the parsed baggage header; nil if absent.
	Baggage Baggage
	// TraceParent is the traceparent header as sent, "" if absent.
	TraceParent string
	// Header holds all request headers. Read only.
	Header http.Header
}

// Handler decides HBONE requests. The Server relays the bytes; the Handler
// only authorizes and connects, so that 200 is sent exactly when the
// upstream is connected and half-close and reset are mapped the same way for
// every caller.
type Handler interface {
	// Connect authorizes req and dials its upstream. ctx ends when the
	// client cancels the stream or the connection closes. To refuse, return
	// an error wrapping ErrDenied (401), ErrUnreachable (503) or
	// ErrBadRequest (400); any other error answers 503. The response body
	// carries the error text. On success the Server owns the returned
	// connection: it calls CloseWrite on it (if it has that method) when
	// the client ends its half, aborts it (Aborter, or SO_LINGER 0 for a
	// *net.TCPConn) when the client resets the stream, and closes it.
	Connect(ctx context.Context, req *Request) (net.Conn, error)
}

// HandlerFunc adapts a function to Handler.
type HandlerFunc func(ctx context.Context, req *Request) (net.Conn, error)

// Connect calls f.
func (f HandlerFunc) Connect(ctx context.Context, req *Request) (net.Conn, error) { return f(ctx, req) }

// Aborter is implemented by connections that can be closed abortively, so
// that their peer sees a reset instead of an orderly end. *Conn implements
// it; a proxy can implement it for its own upstream connections (a gVisor
// endpoint's Abort, for instance).
type Aborter interface {
	Abort() error
}

// ServerConfig configures NewServer.
type ServerConfig struct {
	// TLS is the server's TLS configuration (identity.ServerTLS). It must
	// require client certificates. NewServer uses a copy limited to TLS
	// 1.3 and ALPN h2.
	TLS *tls.Config
	// Handler decides requests. Required.
	Handler Handler
	// HandshakeTimeout bounds the TLS handshake; 10 s if zero.
	HandshakeTimeout time.Duration
	// PingInterval and PingTimeout: a PING after PingInterval without
	// frames, the connection closed if unanswered after PingTimeout.
	// PingInterval and PingTimeout (the package constants) if zero.
	PingInterval, PingTimeout time.Duration
	// HalfCloseLinger is how long, after the upstream's EOF, the server
	// keeps a stream open for a client that has not ended its half and
	// is still sending: the stream ends (END_STREAM) once the client ends
	// its half or sent nothing for this long. DefaultHalfCloseLinger if
	// zero; negative ends the stream at once. See the package
	// documentation.
	HalfCloseLinger time.Duration
	// OnRefusedConn, if set, is called for every connection refused
	// before any request: a failed TLS handshake, no h2, no usable client
	// certificate. For metrics; it runs before the refusal is logged.
	OnRefusedConn func(local, remote net.Addr, err error)
	// Logger receives a line per refused request and failed handshake.
	Logger zerolog.Logger
}

// DefaultHalfCloseLinger is ServerConfig.HalfCloseLinger's default.
const DefaultHalfCloseLinger = 100 * time.Millisecond

// Server is an HBONE server. It is safe for concurrent use.
type Server struct {
	tls     *tls.Config
	handler Handler
	hsTime  time.Duration
	h2      *http2.Server
	base    *http.Server
	log     zerolog.Logger
	bufSize int
	linger  time.Duration
	refused func(local, remote net.Addr, err error)
	conns   atomic.Int64 // connections being served
}

// NewServer checks cfg and returns a Server.
func NewServer(cfg ServerConfig) (*Server, error) {
	if cfg.Handler == nil {
		return nil, errors.New("hbone: server needs a handler")
	}
	if cfg.TLS == nil {
		return nil, errors.New("hbone: server needs a TLS configuration")
	}
	if cfg.TLS.ClientAuth < tls.RequireAnyClientCert {
		return nil, fmt.Errorf("hbone: server TLS configuration must require client certificates (ClientAuth is %s)", cfg.TLS.ClientAuth)
	}
	tc := cfg.TLS.Clone()
	tc.MinVersion = tls.VersionTLS13
	tc.NextProtos = []string{"h2"}
	tc.SessionTicketsDisabled = true
	if cfg.HandshakeTimeout <= 0 {
		cfg.HandshakeTimeout = 10 * time.Second
	}
	if cfg.PingInterval <= 0 {
		cfg.PingInterval = PingInterval
	}
	if cfg.PingTimeout <= 0 {
		cfg.PingTimeout = PingTimeout
	}
	if cfg.HalfCloseLinger == 0 {
		cfg.HalfCloseLinger = DefaultHalfCloseLinger
	}
	s := &Server{
		refused: cfg.OnRefusedConn,
		linger:  cfg.HalfCloseLinger,
		tls:     tc,
		handler: cfg.Handler,
		hsTime:  cfg.HandshakeTimeout,
		log:     cfg.Logger,
		bufSize: 64 << 10,
		h2:      &http2.Server{},
	}
	s.base = &http.Server{
		// x/net/http2 reads its settings from here (net/http's
		// HTTP2Config takes precedence over the deprecated http2.Server
		// fields).
		HTTP2: &http.HTTP2Config{
			MaxConcurrentStreams:          MaxStreamsPerConn,
			MaxReadFrameSize:              MaxFrameSize,
			MaxReceiveBufferPerStream:     StreamWindow,
			MaxReceiveBufferPerConnection: ConnWindow,
			SendPingTimeout:               cfg.PingInterval,
			PingTimeout:                   cfg.PingTimeout,
		},
		MaxHeaderBytes: 64 << 10,
		ErrorLog:       log.New(cfg.Logger.With().Str("component", "http2").Logger(), "", 0),
	}
	// Registering the HTTP/2 server with its base server is what lets
	// Drain send GOAWAY on every connection ServeConn serves.
	if err := http2.ConfigureServer(s.base, s.h2); err != nil {
		return nil, fmt.Errorf("hbone: configure HTTP/2 server: %w", err)
	}
	return s, nil
}

// Serve accepts TCP connections from ln and serves each (ServeConn) until
// ctx ends, which closes ln and every connection. It returns nil after ctx
// ended, or the error that stopped accepting.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	var delay time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			var ne net.Error
			if errors.As(err, &ne) && ne.Timeout() {
				delay = min(max(2*delay, 5*time.Millisecond), time.Second)
				s.log.Warn().Err(err).Dur("retry_in", delay).Msg("hbone: accept failed")
				select {
				case <-time.After(delay):
					continue
				case <-ctx.Done():
					return nil
				}
			}
			return fmt.Errorf("hbone: accept on %s: %w", ln.Addr(), err)
		}
		delay = 0
		go s.ServeConn(ctx, c)
	}
}

// ServeConn serves one connection: the TLS handshake (unless c is a
// *tls.Conn whose handshake is done or still to do with a configuration of
// its own) and then HTTP/2 until the client goes away or ctx ends. It closes
// c before returning.
func (s *Server) ServeConn(ctx context.Context, c net.Conn) {
	s.conns.Add(1)
	defer s.conns.Add(-1)
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	defer c.Close()
	log := s.log.With().Str("peer_addr", c.RemoteAddr().String()).Str("local_addr", c.LocalAddr().String()).Logger()

	tc, ok := c.(*tls.Conn)
	if !ok {
		tc = tls.Server(c, s.tls)
	}
	hctx, cancel := context.WithTimeout(ctx, s.hsTime)
	err := tc.HandshakeContext(hctx)
	cancel()
	if err != nil {
		s.refuseConn(c, err)
		log.Warn().Err(err).Msg("hbone: TLS handshake failed")
		return
	}
	st := tc.ConnectionState()
	if st.NegotiatedProtocol != "h2" {
		s.refuseConn(c, fmt.Errorf("hbone: client negotiated %q, not h2", st.NegotiatedProtocol))
		log.Warn().Str("alpn", st.NegotiatedProtocol).Msg("hbone: client did not negotiate h2")
		return
	}
	// x/net/http2 sets Request.TLS only for requests with :scheme https,
	// which CONNECT has not: take the peer from the connection.
	if len(st.PeerCertificates) == 0 {
		s.refuseConn(c, errors.New("hbone: client presented no certificate"))
		log.Warn().Msg("hbone: client presented no certificate")
		return
	}
	ci := &connInfo{}
	if ci.peer, err = x509svid.IDFromCert(st.PeerCertificates[0]); err != nil {
		s.refuseConn(c, err)
		log.Warn().Err(err).Msg("hbone: client certificate has no SPIFFE ID")
		return
	}
	ci.local, _ = addrPort(tc.LocalAddr())
	ci.remote, _ = addrPort(tc.RemoteAddr())
	s.h2.ServeConn(tc, &http2.ServeConnOpts{
		Context:    ctx,
		BaseConfig: s.base,
		Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			s.serveHTTP(w, r, ci)
		}),
	})
}

// connInfo is what all streams of one connection share.
type connInfo struct {
	peer          spiffeid.ID
	local, remote netip.AddrPort
}

func addrPort(a net.Addr) (netip.AddrPort, bool) {
	var ap netip.AddrPort
	if ta, ok := a.(*net.TCPAddr); ok {
		ap = ta.AddrPort()
	} else if p, err := netip.ParseAddrPort(a.String()); err == nil {
		ap = p
	} else {
		return netip.AddrPort{}, false
	}
	return netip.AddrPortFrom(ap.Addr().Unmap(), ap.Port()), true
}

func (s *Server) refuseConn(c net.Conn, err error) {
	if s.refused != nil {
		s.refused(c.LocalAddr(), c.RemoteAddr(), err)
	}
}

// Drain sends GOAWAY on every connection being served, so that clients
// open no new streams on them; open streams go on. It returns at once.
func (s *Server) Drain(ctx context.Context) error {
	return s.base.Shutdown(ctx)
}

// OpenConns returns the number of connections being served.
func (s *Server) OpenConns() int { return int(s.conns.Load()) }

func (s *Server) serveHTTP(w http.ResponseWriter, r *http.Request, ci *connInfo) {
	log := s.log.With().Str("peer_addr", r.RemoteAddr).Str("peer", ci.peer.String()).Str("authority", r.Host).Logger()
	if r.Method != http.MethodConnect {
		s.refuse(w, log, http.StatusMethodNotAllowed,
			fmt.Errorf("hbone: method %s not allowed: HBONE takes CONNECT", r.Method))
		return
	}
	req, err := s.parse(r, ci)
	if err != nil {
		s.refuse(w, log, http.StatusBadRequest, err)
		return
	}
	up, err := s.handler.Connect(r.Context(), req)
	if err != nil {
		s.refuse(w, log, Status(err), err)
		return
	}
	w.WriteHeader(http.StatusOK)
	if err := http.NewResponseController(w).Flush(); err != nil {
		log.Debug().Err(err).Msg("hbone: client gone before 200 was sent")
		abort(up)
		return
	}
	s.relay(w, r, up, log)
}

func (s *Server) refuse(w http.ResponseWriter, log zerolog.Logger, status int, err error) {
	log.Info().Int("status", status).Err(err).Msg("hbone: request refused")
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.WriteHeader(status)
	io.WriteString(w, err.Error()+"\n")
}

func (s *Server) parse(r *http.Request, ci *connInfo) (*Request, error) {
	target, err := netip.ParseAddrPort(r.Host)
	if err != nil {
		return nil, fmt.Errorf("%w: :authority %q is not ip:port", ErrBadRequest, r.Host)
	}
	if target.Port() == 0 || target.Addr().IsUnspecified() {
		return nil, fmt.Errorf("%w: :authority %q is not a connectable address", ErrBadRequest, r.Host)
	}
	req := &Request{
		Target:      netip.AddrPortFrom(target.Addr().Unmap(), target.Port()),
		Peer:        ci.peer,
		PeerAddr:    ci.remote,
		LocalAddr:   ci.local,
		TraceParent: r.Header.Get(HeaderTraceParent),
		Header:      r.Header,
	}
	if v := r.Header.Values(HeaderForwarded); len(v) > 0 {
		if req.Forwarded, err = ParseForwarded(strings.Join(v, ",")); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrBadRequest, err)
		}
	}
	if v := r.Header.Values(HeaderBaggage); len(v) > 0 {
		if req.Baggage, err = ParseBaggage(strings.Join(v, ",")); err != nil {
			return nil, fmt.Errorf("%w: %v", ErrBadRequest, err)
		}
	}
	return req, nil
}

// relay copies between the stream and up until both directions ended or
// one side failed; see the package documentation for the mapping of
// half-close and reset.
func (s *Server) relay(w http.ResponseWriter, r *http.Request, up net.Conn, log zerolog.Logger) {
	rc := http.NewResponseController(w)
	var (
		upEOF       atomic.Bool  // the handler returns after the upstream's EOF
		clientReset atomic.Bool  // the stream failed: up was aborted for it
		lastData    atomic.Int64 // when data from the client last arrived, Unix ns
	)
	lastData.Store(time.Now().UnixNano())
	toUp := make(chan struct{})
	go func() {
		defer close(toUp)
		buf := make([]byte, s.bufSize)
		rerr, werr := pump(up, r.Body, nil, buf, func() { lastData.Store(time.Now().UnixNano()) })
		switch {
		case upEOF.Load():
			// The handler has returned (or is about to): its return
			// closed the request body. Nothing to propagate.
		case werr != nil:
			// The upstream refuses data (reset or closed): abort it.
			// Before its EOF the read side then fails and resets the
			// stream; after it the stream ends and x/net resets the
			// client's half.
			log.Debug().Err(werr).Msg("hbone: write to upstream failed")
			abort(up)
		case rerr == nil:
			// END_STREAM from the client.
			if err := closeWrite(up); err != nil {
				log.Debug().Err(err).Msg("hbone: half-close of upstream failed")
			}
		default:
			// RST_STREAM from the client or the connection died.
			log.Debug().Err(rerr).Msg("hbone: stream reset by client")
			clientReset.Store(true)
			abort(up)
		}
	}()

	buf := make([]byte, s.bufSize)
	rerr, werr := pump(w, up, rc.Flush, buf, nil)
	switch {
	case werr == nil && rerr == nil:
		// Upstream EOF. Returning sends END_STREAM, but x/net then also
		// resets the client's half if it is still open: linger while
		// the client keeps sending.
		if s.awaitClient(toUp, &lastData) {
			up.Close()
			if clientReset.Load() {
				panic(http.ErrAbortHandler)
			}
			return
		}
		upEOF.Store(true)
		go func() {
			// Returning closes the request body, which ends the copy.
			<-toUp
			up.Close()
		}()
		return
	case werr != nil:
		// The stream cannot take data: the client reset it or the
		// connection died. Reset the upstream too.
		clientReset.Store(true)
		abort(up)
	case clientReset.Load():
		// Our own abort of up, for a client reset, ended the read.
	default:
		// The upstream failed (TCP RST): reset the stream.
		log.Debug().Err(rerr).Msg("hbone: upstream read failed, resetting stream")
		abort(up)
	}
	// RST_STREAM. Returning would end the stream like an EOF. Returning
	// (or panicking) also closes the request body, which ends the copy
	// above.
	panic(http.ErrAbortHandler)
}

// awaitClient waits, after the upstream's EOF, for the client to end its
// half (done closes; it returns true) or to send nothing for the linger
// time (false).
func (s *Server) awaitClient(done <-chan struct{}, lastData *atomic.Int64) bool {
	select {
	case <-done:
		return true
	default:
	}
	if s.linger <= 0 {
		return false
	}
	eof := time.Now()
	t := time.NewTimer(s.linger)
	defer t.Stop()
	for {
		select {
		case <-done:
			return true
		case <-t.C:
			last := time.Unix(0, lastData.Load())
			if last.Before(eof) {
				last = eof
			}
			idle := time.Since(last)
			if idle >= s.linger {
				return false
			}
			t.Reset(s.linger - idle)
		}
	}
}

// pump copies from src to dst, calling flush and then progress after each
// write, until src ends. It returns the read error (nil at EOF) or the write
// error.
func pump(dst io.Writer, src io.Reader, flush func() error, buf []byte, progress func()) (rerr, werr error) {
	for {
		n, err := src.Read(buf)
		if n > 0 {
			if _, werr := dst.Write(buf[:n]); werr != nil {
				return nil, werr
			}
			if flush != nil {
				if werr := flush(); werr != nil {
					return nil, werr
				}
			}
			if progress != nil {
				progress()
			}
		}
		if err == io.EOF {
			return nil, nil
		}
		if err != nil {
			return err, nil
		}
	}
}

func closeWrite(c net.Conn) error {
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// abort closes c so that its peer sees a reset.
func abort(c net.Conn) {
	switch c := c.(type) {
	case Aborter:
		c.Abort()
		return
	case interface{ SetLinger(int) error }:
		c.SetLinger(0)
	}
	c.Close()
}
