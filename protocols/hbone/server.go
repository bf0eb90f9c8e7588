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
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/meshtun/meshtun/protocols/relay"
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
	// Baggage is the parsed baggage header; nil if absent or malformed
	// (ParseBaggage: then ignored, as ztunnel does).
	Baggage Baggage
	// TraceParent is the traceparent header as sent and Trace the same
	// parsed; "" and zero if absent, sent twice or malformed
	// (ParseTraceParent).
	TraceParent string
	Trace       TraceParent
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
	// connection and relays it with a relay.Pump: it calls CloseWrite on
	// it (if it has that method; Close if that fails) when the client
	// ends its half, aborts it (Aborter, or SO_LINGER 0 for a
	// *net.TCPConn) when the client resets the stream, and closes it. If
	// it is a relay.Metered, its meter is told what moved (the client's
	// bytes as AToB), also when the stream is reset before the relay
	// starts (relay.Abandon).
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
type Aborter = relay.Aborter

// ServerConfig configures NewServer.
type ServerConfig struct {
	// TLS is the server's TLS configuration (identity.ServerTLS). It must
	// require client certificates. NewServer uses a copy limited to TLS
	// 1.3 and ALPN h2.
	TLS *tls.Config
	// Handler decides requests. Required.
	Handler Handler
	// HandshakeTimeout bounds the TLS handshake, and then the client's
	// HTTP/2 preface; DefaultHandshakeTimeout if zero.
	HandshakeTimeout time.Duration
	// MaxHandshakes bounds the connections whose handshake is pending, in
	// all, and MaxHandshakesPerSource those from one source address; a
	// connection beyond is reset at once, except that when all are taken
	// a source holding fewer than another takes the slot of that other's
	// oldest (see handshakeGate). MaxConnsPerPeer bounds one peer
	// identity's authenticated connections; one beyond is reset after its
	// handshake. DefaultMaxHandshakes, DefaultMaxHandshakesPerSource and
	// DefaultMaxConnsPerPeer if zero; negative means no bound.
	MaxHandshakes, MaxHandshakesPerSource, MaxConnsPerPeer int
	// LogRate bounds the lines a second logged for connections refused
	// before any request (failed handshakes, bounds); the rest are only
	// counted (Refused). DefaultLogRate if zero; negative means no bound.
	LogRate int
	// PingInterval and PingTimeout: a PING after PingInterval without
	// frames, the connection closed if unanswered after PingTimeout.
	// PingInterval and PingTimeout (the package constants) if zero.
	PingInterval, PingTimeout time.Duration
	// MaxStreamsPerPeer bounds the streams one peer identity has open on
	// this server over all its connections, and MaxConnectingPerPeer those
	// whose Handler.Connect (the upstream dial) runs; a stream past either
	// is refused (REFUSED_STREAM). DefaultMaxStreamsPerPeer and
	// DefaultMaxConnectingPerPeer if zero; negative means no bound.
	MaxStreamsPerPeer, MaxConnectingPerPeer int
	// OnRefusedConn, if set, is called for every connection refused
	// before any request: a failed TLS handshake, no h2, no usable client
	// certificate. For metrics; it runs before the refusal is logged.
	OnRefusedConn func(local, remote net.Addr, err error)
	// Logger receives a line per refused request, failed handshake and
	// protocol error.
	Logger zerolog.Logger
}

// Server is an HBONE server. It is safe for concurrent use.
type Server struct {
	tls          *tls.Config
	handler      Handler
	hsTime       time.Duration
	pingInterval time.Duration
	pingTimeout  time.Duration
	log          zerolog.Logger
	refused      func(local, remote net.Addr, err error)
	conns        atomic.Int64 // connections being served

	gate         *handshakeGate
	refusedN     refusals
	logLim       *LogLimiter
	maxPeerConns int

	maxPeerStreams, maxPeerConnecting int

	peerMu sync.Mutex
	peers  map[spiffeid.ID]*peerLoad

	mu       sync.Mutex
	live     map[*serverConn]struct{}
	draining bool
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
		cfg.HandshakeTimeout = DefaultHandshakeTimeout
	}
	if cfg.MaxHandshakes == 0 {
		cfg.MaxHandshakes = DefaultMaxHandshakes
	}
	if cfg.MaxHandshakesPerSource == 0 {
		cfg.MaxHandshakesPerSource = DefaultMaxHandshakesPerSource
	}
	if cfg.MaxConnsPerPeer == 0 {
		cfg.MaxConnsPerPeer = DefaultMaxConnsPerPeer
	}
	if cfg.LogRate == 0 {
		cfg.LogRate = DefaultLogRate
	}
	if cfg.PingInterval <= 0 {
		cfg.PingInterval = PingInterval
	}
	if cfg.PingTimeout <= 0 {
		cfg.PingTimeout = PingTimeout
	}
	if cfg.MaxStreamsPerPeer == 0 {
		cfg.MaxStreamsPerPeer = DefaultMaxStreamsPerPeer
	}
	if cfg.MaxConnectingPerPeer == 0 {
		cfg.MaxConnectingPerPeer = DefaultMaxConnectingPerPeer
	}
	return &Server{
		gate:              newHandshakeGate(cfg.MaxHandshakes, cfg.MaxHandshakesPerSource),
		logLim:            NewLogLimiter(cfg.LogRate),
		maxPeerConns:      cfg.MaxConnsPerPeer,
		maxPeerStreams:    cfg.MaxStreamsPerPeer,
		maxPeerConnecting: cfg.MaxConnectingPerPeer,
		peers:             make(map[spiffeid.ID]*peerLoad),
		refused:           cfg.OnRefusedConn,
		tls:               tc,
		handler:           cfg.Handler,
		hsTime:            cfg.HandshakeTimeout,
		pingInterval:      cfg.PingInterval,
		pingTimeout:       cfg.PingTimeout,
		log:               cfg.Logger,
		live:              make(map[*serverConn]struct{}),
	}, nil
}

// Defaults of ServerConfig's per-peer bounds. A peer identity is shared by
// every pod of a service account; the bounds are per destination node. One
// client pod may hold ten thousand idle connections to a service (meshtun
// bench does), so the stream bound is well above that; at ~18 KiB per
// idle stream it holds one identity to about 300 MiB on a node.
const (
	DefaultMaxStreamsPerPeer    = 16384
	DefaultMaxConnectingPerPeer = 200
)

// peerLoad is what one peer identity holds on the server.
type peerLoad struct{ conns, streams, connecting int }

// admitPeerConn counts a new authenticated connection of peer; it reports
// false, counting nothing, if peer has its bound.
func (s *Server) admitPeerConn(peer spiffeid.ID) bool {
	s.peerMu.Lock()
	defer s.peerMu.Unlock()
	l := s.peers[peer]
	if l == nil {
		l = &peerLoad{}
		s.peers[peer] = l
	}
	if s.maxPeerConns > 0 && l.conns >= s.maxPeerConns {
		s.dropPeerLocked(peer, l)
		return false
	}
	l.conns++
	return true
}

// peerConnDone ends one of peer's connections.
func (s *Server) peerConnDone(peer spiffeid.ID) {
	s.peerMu.Lock()
	if l := s.peers[peer]; l != nil {
		l.conns--
		s.dropPeerLocked(peer, l)
	}
	s.peerMu.Unlock()
}

// dropPeerLocked forgets peer once it holds nothing.
func (s *Server) dropPeerLocked(peer spiffeid.ID, l *peerLoad) {
	if l.conns <= 0 && l.streams <= 0 && l.connecting <= 0 {
		delete(s.peers, peer)
	}
}

// admitPeer counts a new stream, connecting, for peer; it returns why it
// refuses the stream instead, or "".
func (s *Server) admitPeer(peer spiffeid.ID) string {
	s.peerMu.Lock()
	defer s.peerMu.Unlock()
	l := s.peers[peer]
	if l == nil {
		l = &peerLoad{}
		s.peers[peer] = l
	}
	switch {
	case s.maxPeerStreams > 0 && l.streams >= s.maxPeerStreams:
		return fmt.Sprintf("peer has %d streams open on this server, the limit", l.streams)
	case s.maxPeerConnecting > 0 && l.connecting >= s.maxPeerConnecting:
		return fmt.Sprintf("peer has %d requests being connected on this server, the limit", l.connecting)
	}
	l.streams++
	l.connecting++
	return ""
}

// peerConnected ends the connecting phase of one of peer's streams.
func (s *Server) peerConnected(peer spiffeid.ID) {
	s.peerMu.Lock()
	if l := s.peers[peer]; l != nil {
		l.connecting--
	}
	s.peerMu.Unlock()
}

// peerStreamDone ends one of peer's streams.
func (s *Server) peerStreamDone(peer spiffeid.ID) {
	s.peerMu.Lock()
	if l := s.peers[peer]; l != nil {
		l.streams--
		s.dropPeerLocked(peer, l)
	}
	s.peerMu.Unlock()
}

// PeerConns returns the authenticated connections peer has open on the
// server.
func (s *Server) PeerConns(peer spiffeid.ID) int {
	s.peerMu.Lock()
	defer s.peerMu.Unlock()
	if l := s.peers[peer]; l != nil {
		return l.conns
	}
	return 0
}

// PendingHandshakes returns the connections whose handshake is pending,
// in all and per source address.
func (s *Server) PendingHandshakes() (total int, perSource map[netip.Addr]int) {
	return s.gate.load()
}

// Refused returns the connections refused before any request, by reason
// (the Refused* constants), every reason present.
func (s *Server) Refused() map[string]uint64 { return s.refusedN.snapshot() }

// CountRefused counts, in Refused, a connection its caller refused before
// handing it to the server (RefusedNotLocal).
func (s *Server) CountRefused(reason string) { s.refusedN.add(reason) }

// PeerLoad returns the streams peer has open on the server and how many
// of them are being connected.
func (s *Server) PeerLoad(peer spiffeid.ID) (streams, connecting int) {
	s.peerMu.Lock()
	defer s.peerMu.Unlock()
	if l := s.peers[peer]; l != nil {
		return l.streams, l.connecting
	}
	return 0, 0
}

// Serve accepts TCP connections from ln and serves each (ServeConn) until
// ctx ends, which closes ln and every connection. It returns nil after ctx
// ended, or the error that stopped accepting.
func (s *Server) Serve(ctx context.Context, ln net.Listener) error {
	return AcceptLoop(ctx, ln, s.log, func(c net.Conn) { s.Go(ctx, c) })
}

// AcceptLoop accepts connections from ln and hands each to serve, on the
// accepting goroutine, until ctx ends, which closes ln. A temporary accept
// error (a timeout; out of descriptors, EMFILE or ENFILE; out of buffers
// or memory) is logged and retried with a backoff of up to 1 s, so that a
// flood that exhausts descriptors does not end the listener. It returns
// nil after ctx ended, or the error that stopped accepting.
func AcceptLoop(ctx context.Context, ln net.Listener, log zerolog.Logger, serve func(net.Conn)) error {
	stop := context.AfterFunc(ctx, func() { ln.Close() })
	defer stop()
	var delay time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			if ctx.Err() != nil {
				return nil
			}
			if temporaryAccept(err) {
				delay = min(max(2*delay, 5*time.Millisecond), time.Second)
				log.Warn().Err(err).Str("listener", ln.Addr().String()).Dur("retry_in", delay).Msg("hbone: accept failed")
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
		serve(c)
	}
}

// ServeConn serves one connection: the TLS handshake (unless c is a
// *tls.Conn whose handshake is done or still to do with a configuration of
// its own) and then HTTP/2 until the client goes away or ctx ends. It closes
// c before returning. A connection beyond the server's bounds (pending
// handshakes in all and from its source, connections of its peer
// identity) is reset (see ServerConfig).
func (s *Server) ServeConn(ctx context.Context, c net.Conn) {
	if hs := s.admit(c); hs != nil {
		s.serve(ctx, c, hs)
	}
}

// Go is ServeConn on a goroutine of its own, started only if c is within
// the bounds: a connection beyond is reset before Go returns, so that an
// accept loop that calls it holds no descriptor or goroutine for it.
func (s *Server) Go(ctx context.Context, c net.Conn) {
	if hs := s.admit(c); hs != nil {
		go s.serve(ctx, c, hs)
	}
}

// admit takes a handshake slot for c, or resets c and returns nil.
func (s *Server) admit(c net.Conn) *pending {
	remote, _ := addrPort(c.RemoteAddr())
	hs, reason := s.gate.admit(remote.Addr(), func() { abort(c) })
	if hs == nil {
		abort(c)
		s.refuseConn(c, reason, nil, nil)
	}
	return hs
}

// serve is ServeConn once c holds the handshake slot hs.
func (s *Server) serve(ctx context.Context, c net.Conn, hs *pending) {
	s.conns.Add(1)
	defer s.conns.Add(-1)
	defer s.gate.release(hs)
	stop := context.AfterFunc(ctx, func() { c.Close() })
	defer stop()
	defer c.Close()
	log := s.log.With().Str("peer_addr", c.RemoteAddr().String()).Str("local_addr", c.LocalAddr().String()).Logger()

	tc, ok := c.(*tls.Conn)
	var batch *batchConn // nil: counted above TLS, not batched
	if !ok {
		batch = newBatchConn(c)
		tc = tls.Server(batch, s.tls)
	}
	hctx, cancel := context.WithTimeout(ctx, s.hsTime)
	err := tc.HandshakeContext(hctx)
	timedOut := hctx.Err() == context.DeadlineExceeded
	cancel()
	evicted := s.gate.release(hs)
	if err != nil && ctx.Err() != nil {
		return // the server stops
	}
	if err != nil {
		reason := RefusedHandshakeFailed
		switch {
		case evicted:
			reason = RefusedEvicted
		case timedOut:
			reason = RefusedHandshakeTimeout
		}
		s.refuseConn(c, reason, err, &log)
		return
	}
	st := tc.ConnectionState()
	if st.NegotiatedProtocol != "h2" {
		s.refuseConn(c, RefusedNoH2, fmt.Errorf("hbone: client negotiated %q, not h2", st.NegotiatedProtocol), &log)
		return
	}
	if len(st.PeerCertificates) == 0 {
		s.refuseConn(c, RefusedHandshakeFailed, errors.New("hbone: client presented no certificate"), &log)
		return
	}
	sc := &serverConn{srv: s, ctx: ctx}
	if sc.peer, err = x509svid.IDFromCert(st.PeerCertificates[0]); err != nil {
		s.refuseConn(c, RefusedNoIdentity, fmt.Errorf("hbone: client certificate has no SPIFFE ID: %w", err), &log)
		return
	}
	log = log.With().Str("peer", sc.peer.String()).Logger()
	if !s.admitPeerConn(sc.peer) {
		abort(c)
		s.refuseConn(c, RefusedPeerLimit, fmt.Errorf("hbone: peer %s has %d connections on this server, the limit", sc.peer, s.maxPeerConns), &log)
		return
	}
	defer s.peerConnDone(sc.peer)
	sc.local, _ = addrPort(tc.LocalAddr())
	sc.remote, _ = addrPort(tc.RemoteAddr())
	sc.log = log

	// The client's preface, within the handshake timeout.
	tc.SetReadDeadline(time.Now().Add(s.hsTime))
	var preface [len(http2.ClientPreface)]byte
	if _, err := io.ReadFull(tc, preface[:]); err != nil || string(preface[:]) != http2.ClientPreface {
		reason := RefusedNoH2
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			reason = RefusedHandshakeTimeout
		}
		s.refusedN.add(reason)
		if ok, n := s.logLim.Allow(); ok {
			log.Warn().Err(err).Str("got", string(preface[:])).Uint64("suppressed", n).Msg("hbone: no HTTP/2 client preface")
		}
		return
	}
	tc.SetReadDeadline(time.Time{})

	sc.h = newH2Conn(tc, batch, false, sc, log, s.pingInterval, s.pingTimeout)
	s.mu.Lock()
	s.live[sc] = struct{}{}
	draining := s.draining
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		delete(s.live, sc)
		s.mu.Unlock()
	}()
	if err := sc.h.start(); err != nil {
		sc.h.close(err)
		return
	}
	if draining {
		// The client may read the GOAWAY before it sends a request, and
		// then no stream is refused here: say that this connection was.
		sc.log.Info().Str("reason", "draining").Msg("hbone: new connection refused (GOAWAY)")
		sc.h.sendGoAway()
	}
	sc.h.readLoop()
}

// temporaryAccept reports whether an accept error passes: a timeout, or a
// lack of descriptors or memory that closing connections gives back.
func temporaryAccept(err error) bool {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return true
	}
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM, syscall.ECONNABORTED} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
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

// refuseConn counts c as refused for reason and logs it, within the log
// rate (log nil: the logger of the server, with the connection's
// addresses). A connection that failed its handshake or has no usable
// certificate (err not nil) is reported to OnRefusedConn too.
func (s *Server) refuseConn(c net.Conn, reason string, err error, log *zerolog.Logger) {
	s.refusedN.add(reason)
	if err != nil && s.refused != nil {
		s.refused(c.LocalAddr(), c.RemoteAddr(), err)
	}
	ok, n := s.logLim.Allow()
	if !ok {
		return
	}
	if log == nil {
		l := s.log.With().Str("peer_addr", c.RemoteAddr().String()).Str("local_addr", c.LocalAddr().String()).Logger()
		log = &l
	}
	e := log.Warn().Str("reason", reason).Uint64("suppressed", n)
	if err != nil {
		e = e.Err(err)
	}
	e.Msg("hbone: connection refused before any request")
}

// Drain sends GOAWAY on every connection being served, and on every one
// accepted from now on, so that clients open no new streams on them; open
// streams go on, and a connection closes once it has none left. It returns
// at once.
func (s *Server) Drain(ctx context.Context) error {
	s.mu.Lock()
	s.draining = true
	conns := make([]*serverConn, 0, len(s.live))
	for sc := range s.live {
		conns = append(conns, sc)
	}
	s.mu.Unlock()
	for _, sc := range conns {
		sc.h.sendGoAway()
	}
	return nil
}

// OpenConns returns the number of connections being served.
func (s *Server) OpenConns() int { return int(s.conns.Load()) }

// serverConn is the server role of one connection.
type serverConn struct {
	srv           *Server
	ctx           context.Context
	h             *h2conn
	log           zerolog.Logger
	peer          spiffeid.ID
	local, remote netip.AddrPort
}

// onHeaders opens a stream for a request and, unless it is refused at
// once, starts a goroutine that connects and relays it.
func (sc *serverConn) onHeaders(f *http2.MetaHeadersFrame) error {
	h := sc.h
	id := f.StreamID
	if id%2 == 0 {
		return connErrorf(http2.ErrCodeProtocol, "HEADERS on even stream %d from client", id)
	}
	h.mu.Lock()
	if s := h.streams[id]; s != nil {
		sc.log.Info().Uint32("stream", id).Msg("hbone: second HEADERS (trailers) on a CONNECT stream, resetting stream")
		s.resetLocked(http2.ErrCodeProtocol, fmt.Errorf("%w: trailers on a CONNECT stream", ErrReset))
		s.closeReadLocked()
		h.unlock()
		h.kickAsync()
		return nil
	}
	if id <= h.lastPeerID {
		h.mu.Unlock()
		return connErrorf(http2.ErrCodeStreamClosed, "HEADERS on closed stream %d", id)
	}
	h.lastPeerID = id
	var refuse string
	switch {
	case h.goAwaySent:
		refuse = "draining"
	case len(h.streams) >= MaxStreamsPerConn:
		refuse = fmt.Sprintf("%d streams open, the limit", len(h.streams))
	case h.connecting >= MaxStreamsPerConn:
		refuse = fmt.Sprintf("%d requests being connected, the limit", h.connecting)
	default:
		refuse = sc.srv.admitPeer(sc.peer)
	}
	if refuse != "" {
		var err error
		if !h.goAwaySent {
			err = h.earlyResetLocked()
		}
		h.mu.Unlock()
		if err != nil {
			return err
		}
		sc.log.Info().Uint32("stream", id).Str("reason", refuse).Msg("hbone: stream refused (REFUSED_STREAM)")
		if err := h.queue(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, http2.ErrCodeRefusedStream) }); err != nil {
			return err
		}
		h.kickAsync()
		return nil
	}
	h.mu.Unlock()

	req, status, perr := sc.parse(f)

	h.mu.Lock()
	if h.closed {
		// The connection closed while the headers were parsed: its
		// streams are failed and gone; this one is never made.
		h.mu.Unlock()
		sc.srv.peerConnected(sc.peer)
		sc.srv.peerStreamDone(sc.peer)
		return nil
	}
	s := h.newStreamLocked(id)
	s.recvEnded = f.StreamEnded()
	s.peerCounted = true
	var ctx context.Context
	if perr == nil {
		s.connecting = true
		h.connecting++
		ctx, s.cancel = context.WithCancel(sc.ctx)
	}
	h.mu.Unlock()
	if perr != nil {
		sc.srv.peerConnected(sc.peer)
		sc.respond(s, status, perr, req.Target, h.kickAsync)
		return nil
	}
	go sc.serve(ctx, s, req)
	return nil
}

// connection-specific header fields, not allowed in HTTP/2 (RFC 9113
// section 8.2.2).
var connHeaders = map[string]bool{"connection": true, "keep-alive": true, "proxy-connection": true, "transfer-encoding": true, "upgrade": true}

// parse checks a request's headers. On failure it returns the status to
// answer and the error for the body.
func (sc *serverConn) parse(f *http2.MetaHeadersFrame) (*Request, int, error) {
	req := &Request{Peer: sc.peer, PeerAddr: sc.remote, LocalAddr: sc.local, Header: make(http.Header, len(f.Fields))}
	if f.Truncated {
		return req, http.StatusRequestHeaderFieldsTooLarge, fmt.Errorf("%w: header list over %d bytes", ErrBadRequest, maxHeaderListSize)
	}
	var method, authority string
	var hasPath bool
	for _, hf := range f.Fields {
		switch {
		case hf.Name == ":method":
			method = hf.Value
		case hf.Name == ":authority":
			authority = hf.Value
		case hf.Name == ":path" || hf.Name == ":scheme" || hf.Name == ":protocol":
			hasPath = true
		case hf.IsPseudo():
		case connHeaders[hf.Name] || (hf.Name == "te" && hf.Value != "trailers"):
			return req, http.StatusBadRequest, fmt.Errorf("%w: connection-specific header %q", ErrBadRequest, hf.Name)
		default:
			req.Header.Add(hf.Name, hf.Value) // Add canonicalizes the key
		}
	}
	if method != http.MethodConnect {
		return req, http.StatusMethodNotAllowed, fmt.Errorf("hbone: method %s not allowed: HBONE takes CONNECT", method)
	}
	if hasPath {
		return req, http.StatusBadRequest, fmt.Errorf("%w: CONNECT with :path, :scheme or :protocol", ErrBadRequest)
	}
	target, err := netip.ParseAddrPort(authority)
	if err != nil {
		return req, http.StatusBadRequest, fmt.Errorf("%w: :authority %q is not ip:port", ErrBadRequest, authority)
	}
	if target.Port() == 0 || target.Addr().IsUnspecified() {
		return req, http.StatusBadRequest, fmt.Errorf("%w: :authority %q is not a connectable address", ErrBadRequest, authority)
	}
	req.Target = netip.AddrPortFrom(target.Addr().Unmap(), target.Port())
	if v := req.Header.Values(HeaderForwarded); len(v) > 0 {
		if req.Forwarded, err = ParseForwarded(strings.Join(v, ",")); err != nil {
			return req, http.StatusBadRequest, fmt.Errorf("%w: %v", ErrBadRequest, err)
		}
	}
	sc.parseTelemetry(req)
	return req, 0, nil
}

// parseTelemetry reads a request's baggage and traceparent. They are the
// peer's telemetry claims, not part of the request's meaning: malformed
// or oversized ones are ignored (logged at debug level), never a reason
// to refuse the connection, as ztunnel ignores them.
func (sc *serverConn) parseTelemetry(req *Request) {
	if v := req.Header.Values(HeaderTraceParent); len(v) == 1 {
		tp, err := ParseTraceParent(v[0])
		if err != nil {
			sc.log.Debug().Err(err).Str("authority", req.Target.String()).Msg("hbone: ignoring a malformed traceparent")
		} else {
			req.TraceParent = v[0]
			req.Trace = tp
		}
	} else if len(v) > 1 {
		sc.log.Debug().Int("count", len(v)).Str("authority", req.Target.String()).Msg("hbone: ignoring traceparent sent more than once")
	}
	if v := req.Header.Values(HeaderBaggage); len(v) > 0 {
		b, err := ParseBaggage(strings.Join(v, ","))
		if err != nil {
			sc.log.Debug().Err(err).Str("authority", req.Target.String()).Msg("hbone: ignoring malformed baggage")
		} else {
			req.Baggage = b
		}
	}
}

// respond answers status with err's text as the body, ends the stream and
// resets the client's half if it is still open (RST_STREAM NO_ERROR: the
// request is not read).
func (sc *serverConn) respond(s *stream, status int, err error, target netip.AddrPort, kick func()) {
	sc.log.Info().Uint32("stream", s.id).Str("authority", target.String()).Int("status", status).Err(err).Msg("hbone: request refused")
	h := sc.h
	body := []byte(err.Error() + "\n")
	h.mu.Lock()
	defer func() { h.unlock(); kick() }()
	if s.rst {
		return
	}
	fields := []hpack.HeaderField{
		{Name: ":status", Value: strconv.Itoa(status)},
		{Name: "content-type", Value: "text/plain; charset=utf-8"},
	}
	h.writeHeadersLocked(s.id, fields, false, h.peerMaxFrame)
	n := int(min(int64(len(body)), s.sendWindow, h.sendWindow, int64(h.peerMaxFrame)))
	body = body[:max(n, 0)]
	s.sendWindow -= int64(len(body))
	h.sendWindow -= int64(len(body))
	id := s.id
	h.queue(func(fr *http2.Framer) error { return fr.WriteData(id, true, body) })
	s.sentEnded = true
	s.closeReadLocked()
	if s.recvEnded {
		s.finishLocked()
	} else {
		s.resetLocked(http2.ErrCodeNo, fmt.Errorf("%w: refused", ErrReset))
	}
}

// serve connects a request's upstream, answers, and relays.
func (sc *serverConn) serve(ctx context.Context, s *stream, req *Request) {
	h := sc.h
	up, err := sc.srv.handler.Connect(ctx, req)
	sc.srv.peerConnected(sc.peer)
	h.mu.Lock()
	s.connecting = false
	h.connecting--
	reset := s.rst
	if reset {
		// Nobody reads what the client sent before its reset: give it
		// back to the connection window.
		s.closeReadLocked()
	}
	h.mu.Unlock()
	if reset {
		h.kick()
	}
	switch {
	case err != nil && reset:
		sc.log.Debug().Uint32("stream", s.id).Err(err).Msg("hbone: stream reset by client while connecting")
		return
	case err != nil:
		sc.respond(s, Status(err), err, req.Target, h.kick)
		return
	}
	h.mu.Lock()
	if s.rst {
		s.closeReadLocked()
		h.mu.Unlock()
		h.kick()
		sc.log.Debug().Uint32("stream", s.id).Msg("hbone: stream reset by client while connecting")
		relay.Abandon(up)
		return
	}
	p := sc.newPump(s, up, req.Target)
	s.abortUp = p.Reset
	h.writeHeadersLocked(s.id, []hpack.HeaderField{{Name: ":status", Value: "200"}}, false, h.peerMaxFrame)
	h.mu.Unlock()
	h.kick()
	p.Start()
}

// newPump returns the relay between s (its a side) and up: see the
// package documentation for the mapping of half-close and reset. Its
// bytes are reported to up's meter if up is a relay.Metered.
func (sc *serverConn) newPump(s *stream, up net.Conn, target netip.AddrPort) *relay.Pump {
	var m relay.Meter
	if mc, ok := up.(relay.Metered); ok {
		m = mc.RelayMeter()
	}
	done := m.Done
	m.Done = func(r relay.Result) {
		if r.Err != nil {
			sc.log.Debug().Uint32("stream", s.id).Stringer("authority", target).Err(r.Err).Msg("hbone: stream relay reset")
		}
		if done != nil {
			done(r)
		}
	}
	return relay.New(&serverStream{s: s}, up, m)
}

// serverStream is a server stream as the relay sees it: a
// relay.BufferedSource whose reset is RST_STREAM(INTERNAL_ERROR) and whose
// Close does nothing (the stream ends when both halves ended or it was
// reset, which the relay does before it closes).
type serverStream struct{ s *stream }

func (c *serverStream) Read(p []byte) (int, error)  { return c.s.read(p) }
func (c *serverStream) Write(p []byte) (int, error) { return c.s.write(p) }
func (c *serverStream) CloseWrite() error           { return c.s.closeWrite() }
func (c *serverStream) Close() error                { return nil }
func (c *serverStream) WhenReadable(f func()) bool  { return c.s.whenReadable(f) }

func (c *serverStream) Abort() error {
	c.s.reset(http2.ErrCodeInternal, fmt.Errorf("%w: relay to the upstream failed", ErrReset))
	return nil
}

func (c *serverStream) WriteBufferedTo(w io.Writer) (int64, bool, error) {
	n, done, rerr, werr := c.s.drainTo(w)
	switch {
	case werr != nil:
		return n, false, werr
	case rerr != nil:
		return n, false, rerr
	}
	return n, done, nil
}

func (sc *serverConn) onStreamDone(s *stream) {
	if s.cancel != nil {
		s.cancel()
	}
	if s.peerCounted {
		s.peerCounted = false
		sc.srv.peerStreamDone(sc.peer)
	}
	if s.rst && s.abortUp != nil {
		// Reset either way or the connection failed: abort the upstream
		// now, even if the relay is blocked writing to it.
		s.abortUp()
	}
	h := sc.h
	h.mu.Lock()
	idle := h.goAwaySent && len(h.streams) == 0 && !h.closed
	h.mu.Unlock()
	if idle {
		h.closeIdleLater()
	}
}

func (sc *serverConn) onGoAway() {}

// abort closes c so that its peer sees a reset.
func abort(c net.Conn) { relay.Abort(c) }
