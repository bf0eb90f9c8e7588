// Package proxy decides how each intercepted TCP connection travels on, and
// carries it there:
//
//   - outbound, from a local mesh workload to a mesh workload on another
//     node: an HBONE stream (mutual TLS, HTTP/2 CONNECT) to the
//     destination's pod IP, port 15008, presenting the source's SVID;
//   - outbound to a mesh workload on this node: handed over inside the
//     proxy, never leaving it (authorized as if it had crossed HBONE);
//   - inbound HBONE to a local workload: TLS terminated, the peer's
//     identity checked, and the stream delivered to the workload from the
//     original client's address through the netstack;
//   - plaintext to a STRICT workload: refused with a reset;
//   - anything else: passthrough to the original destination over a
//     kernel socket.
//
// Every finished connection is logged once, with ztunnel's access-log
// fields.
package proxy

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/stack"
)

// DefaultConnectTimeout bounds the upstream connect of a connection. The
// client's own SYN is held pending meanwhile.
const DefaultConnectTimeout = 10 * time.Second

// Dialer opens TCP connections from any source address through the
// netstack. *stack.Stack is one.
type Dialer interface {
	DialTCP(ctx context.Context, src, dst netip.AddrPort) (*stack.Conn, error)
}

// Config configures a Proxy.
type Config struct {
	// Node is the name of this node; workloads whose Node equals it are
	// local.
	Node string
	// Registry is the model of the mesh. Required.
	Registry *registry.Registry
	// HBONE opens outbound tunnels. Required for mesh traffic.
	HBONE *hbone.Client
	// Logger receives the access log (info) and diagnostics.
	Logger         zerolog.Logger
	ConnectTimeout time.Duration // 0: DefaultConnectTimeout
}

// Proxy handles intercepted TCP connections.
type Proxy struct {
	cfg    Config
	log    zerolog.Logger
	dialer net.Dialer
	ctx    context.Context
	netstk atomic.Pointer[Dialer]
	server atomic.Pointer[hbone.Server]
	open   tracker // authorized connections, for Reauthorize
}

// New returns a Proxy whose connections live until ctx is done.
func New(ctx context.Context, cfg Config) (*Proxy, error) {
	if cfg.Registry == nil {
		return nil, errors.New("proxy: a registry is required")
	}
	if cfg.ConnectTimeout == 0 {
		cfg.ConnectTimeout = DefaultConnectTimeout
	}
	return &Proxy{
		cfg:    cfg,
		log:    cfg.Logger,
		dialer: net.Dialer{Timeout: cfg.ConnectTimeout},
		ctx:    ctx,
	}, nil
}

// SetDialer gives the proxy the netstack it originates connections through
// (the stack is built after the proxy, since it needs HandleTCP).
func (p *Proxy) SetDialer(d Dialer) { p.netstk.Store(&d) }

// SetServer gives the proxy the HBONE server that terminates inbound
// tunnels; its Handler must be InboundHandler (hence set after New).
func (p *Proxy) SetServer(s *hbone.Server) { p.server.Store(s) }

func (p *Proxy) netstack() Dialer {
	if d := p.netstk.Load(); d != nil {
		return *d
	}
	return nil
}

// HandleTCP is the stack.TCPHandler of the proxy: it classifies the
// connection by the registry and hands it to the path that carries it.
func (p *Proxy) HandleTCP(req *stack.TCPRequest) {
	snap := p.cfg.Registry.Load()
	src := snap.Workload(req.Src.Addr())
	dst := snap.Workload(req.Dst.Addr())

	switch {
	case p.local(dst) && req.Dst.Port() == hbone.Port && p.server.Load() != nil:
		p.inbound(req, dst)
	case p.local(src):
		p.outboundFrom(snap, req, src, dst)
	case p.local(dst):
		// Plaintext from outside the mesh to a local workload that STRICT
		// mode or a policy protects (the others are not intercepted).
		p.inboundPlain(snap, req, src, dst)
	default:
		p.passthrough(req, src, dst, req.Dst, "")
	}
}

func (p *Proxy) local(w *registry.Workload) bool {
	return w != nil && w.InMesh && w.Node == p.cfg.Node
}

// outboundFrom routes a connection opened by a local mesh workload: to a
// service VIP, it picks an endpoint first; a mesh destination on another
// node is reached through HBONE, one on this node inside the proxy, and
// anything else by passthrough.
func (p *Proxy) outboundFrom(snap *registry.Snapshot, req *stack.TCPRequest, src, dst *registry.Workload) {
	target, host := req.Dst, ""
	if svc, port := snap.Service(req.Dst); svc != nil {
		ep, ok := svc.Pick(req.Dst.Addr(), p.cfg.Node)
		if !ok {
			req.Reject()
			p.access(req, src, nil, "outbound", "service").Str("dst.service", svc.Hostname).
				Str("error", "no endpoint").Msg("connection refused")
			return
		}
		target, host, dst = netip.AddrPortFrom(ep.Addr, port.Target()), svc.Hostname, ep.Workload
	}
	switch {
	case dst != nil && dst.InMesh && p.cfg.HBONE != nil && dst.Node == p.cfg.Node:
		p.sameNode(snap, req, src, dst, target, host)
	case dst != nil && dst.InMesh && p.cfg.HBONE != nil:
		p.outbound(req, src, dst, target, host)
	default:
		p.passthrough(req, src, dst, target, host)
	}
}

// passthrough connects to the original destination with a kernel socket
// first, and only then completes the client's handshake, so that a refused
// or unreachable destination looks to the client as it would without
// meshtun: a reset.
func (p *Proxy) passthrough(req *stack.TCPRequest, src, dst *registry.Workload, target netip.AddrPort, host string) {
	start := time.Now()
	ev := func() *zerolog.Event {
		ev := p.access(req, src, dst, "outbound", "passthrough")
		if target != req.Dst {
			ev.Str("dst.target", target.String())
		}
		if host != "" {
			ev.Str("dst.service", host)
		}
		return ev
	}
	up, err := p.dialer.DialContext(p.ctx, "tcp", target.String())
	if err != nil {
		req.Reject()
		ev().Str("error", connectError(err)).Err(err).Msg("connection refused")
		return
	}
	down, err := req.Accept()
	if err != nil {
		reset(up)
		ev().Err(err).Msg("client handshake failed")
		return
	}
	res := relay(down, up)
	p.done(ev(), res, start)
}

// access starts an access-log event with ztunnel's field names.
func (p *Proxy) access(req *stack.TCPRequest, src, dst *registry.Workload, direction, route string) *zerolog.Event {
	ev := p.log.Info().Str("src.addr", req.Src.String()).Str("dst.addr", req.Dst.String()).
		Str("direction", direction).Str("route", route)
	workloadFields(ev, "src", src)
	workloadFields(ev, "dst", dst)
	return ev
}

func workloadFields(ev *zerolog.Event, side string, w *registry.Workload) {
	if w == nil {
		return
	}
	ev.Str(side+".workload", w.Name).Str(side+".namespace", w.Namespace)
	if w.InMesh {
		ev.Str(side+".identity", w.Identity.String())
	}
}

// done finishes an access-log event for a relayed connection. Bytes are
// counted from the client's point of view: sent by it, received by it.
func (p *Proxy) done(ev *zerolog.Event, res relayResult, start time.Time) {
	if res.Reset {
		ev = ev.Str("error", "connection reset")
	}
	ev.Int64("bytes_sent", res.AToB).Int64("bytes_recv", res.BToA).
		Dur("duration", time.Since(start)).Msg("connection complete")
}

func connectError(err error) string {
	switch {
	case errors.Is(err, syscall.ECONNREFUSED):
		return "connection refused"
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return "unreachable"
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, syscall.ETIMEDOUT):
		return "timeout"
	case errors.Is(err, hbone.ErrDenied):
		return "denied by policy"
	}
	var de *deniedError
	if errors.As(err, &de) {
		return de.Error()
	}
	return err.Error()
}
