// Package proxy decides how each intercepted TCP connection travels on, and
// carries it there:
//
//   - outbound, from a local mesh workload to a mesh workload on another
//     node: an HBONE stream (mutual TLS, HTTP/2 CONNECT) to the
//     destination's pod IP, port 15008, presenting the source's SVID;
//   - outbound to a mesh workload on this node: handed over inside the
//     proxy, never leaving it (authorized as if it had crossed HBONE);
//   - to a service VIP: an endpoint is picked, then as above;
//   - inbound HBONE to a local workload: TLS terminated, the peer's
//     identity checked, authorized, and the stream delivered to the
//     workload from the original client's address through the netstack;
//   - plaintext to a local workload that STRICT mode or a policy protects:
//     authorized without an identity (refused under STRICT);
//   - anything else: passthrough to the original destination, dialled
//     through the netstack from the pod's own address and port.
//
// Every finished or refused connection is logged once, with ztunnel's
// access-log fields, and counted in Istio's TCP metrics.
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
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/metrics"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/stack"
	"github.com/meshtun/meshtun/stack/classify"
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
	// Metrics receives Istio's TCP metrics; nil disables them.
	Metrics *metrics.Metrics
	// Logger receives diagnostics; AccessLog one line per connection (at
	// info level: raise its level to turn the access log off).
	Logger, AccessLog zerolog.Logger
	ConnectTimeout    time.Duration // 0: DefaultConnectTimeout
	// FromNode reports whether an address is one of the node's own: a
	// connection from it was opened by the node itself, and is delivered
	// to the workload from a kernel socket (the workload's replies to the
	// node's address never cross the TUN). Nil: no address is.
	FromNode func(netip.Addr) bool
	// SocketControl, if set, is applied to every kernel socket the proxy
	// opens.
	SocketControl func(network, address string, c syscall.RawConn) error
	// Certified, if set, reports whether a local identity holds its
	// certificate. A local workload without one is blocked for mesh
	// connections: those it opens to mesh workloads are reset, and so are
	// those of local workloads to it (inbound HBONE to it is refused by
	// the TLS configuration). Nil: every identity does.
	Certified func(spiffeid.ID) bool
	// Exempt, if set, is told of the kernel connections the proxy opens
	// to a local workload (a connection from the node, delivered from the
	// node's address), before they connect: the node's rules route them
	// into the TUN like any node traffic, and the classifier lets exactly
	// these through verbatim instead of capturing them again.
	Exempt *classify.Exempt
}

// Proxy handles intercepted TCP connections.
type Proxy struct {
	cfg      Config
	log      zerolog.Logger
	access   zerolog.Logger
	dialer   net.Dialer
	ctx      context.Context
	netstk   atomic.Pointer[Dialer]
	server   atomic.Pointer[hbone.Server]
	draining atomic.Bool
	quiet    atomic.Bool       // access log off
	open     tracker           // relayed connections, for Drain and Reauthorize
	earlyLog *hbone.LogLimiter // access-log lines of connections refused before any request

	hboneKernel, hboneNetstack atomic.Uint64 // inbound HBONE connections accepted
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
		cfg:      cfg,
		log:      cfg.Logger,
		access:   cfg.AccessLog,
		dialer:   net.Dialer{Timeout: cfg.ConnectTimeout, Control: cfg.SocketControl},
		ctx:      ctx,
		earlyLog: hbone.NewLogLimiter(hbone.DefaultLogRate),
	}, nil
}

// SetDialer gives the proxy the netstack it originates connections through
// (the stack is built after the proxy, since it needs HandleTCP).
func (p *Proxy) SetDialer(d Dialer) { p.netstk.Store(&d) }

// SetServer gives the proxy the HBONE server that terminates inbound
// tunnels; its Handler must be InboundHandler (hence set after New).
func (p *Proxy) SetServer(s *hbone.Server) { p.server.Store(s) }

// SetAccessLog turns the access log on or off.
func (p *Proxy) SetAccessLog(on bool) { p.quiet.Store(!on) }

// AccessLog reports whether the access log is on.
func (p *Proxy) AccessLog() bool { return !p.quiet.Load() }

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

	if p.draining.Load() && !(p.local(dst) && req.Dst.Port() == hbone.Port) {
		req.Reject()
		p.newRecord(req.Src, req.Dst, src, dst, "outbound", "drain").refused(errDraining)
		return
	}
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
		p.passthrough(p.newRecord(req.Src, req.Dst, src, dst, "outbound", "passthrough"), req, req.Dst, false)
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
	if src.Refused != "" {
		req.Reject()
		p.newRecord(req.Src, req.Dst, src, dst, "outbound", "refused").refused(&refusedWorkloadError{src})
		return
	}
	svc, target, dst, ok := serviceTarget(snap, req.Dst, dst, p.cfg.Node)
	if !ok {
		req.Reject()
		p.newRecord(req.Src, req.Dst, src, nil, "outbound", "service").via(req.Dst, svc).refused(errNoEndpoint)
		return
	}
	switch {
	case dst != nil && dst.Refused != "":
		// A destination meshtun refuses (on any node: a remote one too,
		// e.g. an address claimed by pods of two nodes): neither
		// plaintext nor a tunnel to an identity the model cannot vouch for.
		req.Reject()
		p.newRecord(req.Src, req.Dst, src, dst, "outbound", "refused").via(target, svc).refused(&refusedWorkloadError{dst})
	case dst != nil && dst.InMesh && p.cfg.HBONE != nil && (p.uncertified(src) || dst.Node == p.cfg.Node && p.uncertified(dst)):
		// Never plaintext, never without the identity's certificate.
		req.Reject()
		blocked := src
		if !p.uncertified(src) {
			blocked = dst
		}
		p.newRecord(req.Src, req.Dst, src, dst, "outbound", "no-certificate").via(target, svc).refused(&noCertificateError{blocked})
	case dst != nil && dst.InMesh && p.cfg.HBONE != nil && dst.Node == p.cfg.Node:
		p.sameNode(snap, req, p.newRecord(req.Src, req.Dst, src, dst, "outbound", "local").via(target, svc), target)
	case dst != nil && dst.InMesh && p.cfg.HBONE != nil:
		p.outbound(req, p.newRecord(req.Src, req.Dst, src, dst, "outbound", "hbone").via(target, svc), target)
	default:
		p.passthrough(p.newRecord(req.Src, req.Dst, src, dst, "outbound", "passthrough").via(target, svc), req, target, true)
	}
}

// serviceTarget resolves an outbound connection to orig (whose workload
// is dst, or nil): to a service VIP, an endpoint chosen for node (the
// target address and its workload), or the original destination itself
// for a PASSTHROUGH service; anything else as it is. ok is false for a
// service without an endpoint.
func serviceTarget(snap *registry.Snapshot, orig netip.AddrPort, dst *registry.Workload, node string) (svc *registry.Service, target netip.AddrPort, to *registry.Workload, ok bool) {
	svc, port := snap.Service(orig)
	if svc == nil || svc.Passthrough {
		return svc, orig, dst, true
	}
	ep, ok := svc.Pick(orig.Addr(), node)
	if !ok {
		return svc, orig, nil, false
	}
	return svc, netip.AddrPortFrom(ep.Addr, port.Target()), ep.Workload, true
}

// uncertified reports whether w is a local workload that should hold a
// certificate (not refused) and does not hold one.
func (p *Proxy) uncertified(w *registry.Workload) bool {
	return p.cfg.Certified != nil && p.local(w) && w.Refused == "" && !p.cfg.Certified(w.Identity)
}

// passthrough connects to the original destination (or the chosen service
// endpoint) first, and only then completes the client's handshake, so that
// a refused or unreachable destination looks to the client as it would
// without meshtun: a reset. For a local pod (fromPod) it dials through the
// netstack from the pod's own address and port, so the destination sees
// the pod as it would without meshtun (its replies to the pod's address
// are captured back into the TUN); anything else is dialled from the node
// with a kernel socket.
func (p *Proxy) passthrough(rec *record, req *stack.TCPRequest, target netip.AddrPort, fromPod bool) {
	var up net.Conn
	var err error
	if ns := p.netstack(); fromPod && ns != nil {
		ctx, cancel := context.WithTimeout(p.ctx, p.cfg.ConnectTimeout)
		up, err = ns.DialTCP(ctx, req.Src, target)
		if err != nil && errors.Is(err, syscall.EADDRINUSE) {
			up, err = ns.DialTCP(ctx, netip.AddrPortFrom(req.Src.Addr(), 0), target)
		}
		cancel()
	} else {
		up, err = p.dialer.DialContext(p.ctx, "tcp", target.String())
	}
	if err != nil {
		req.Reject()
		rec.refused(err)
		return
	}
	p.relayAccepted(rec, req, up, nil)
}

// fromNode reports whether a is one of the node's own addresses.
func (p *Proxy) fromNode(a netip.Addr) bool {
	return p.cfg.FromNode != nil && p.cfg.FromNode(a)
}

// relayAccepted completes the client's handshake and starts the relay
// between it and up, which reports the connection when both directions are
// done; it returns at once, so that the goroutine that dialled (and grew
// its stack doing so) ends. authz, if not nil, is re-evaluated on policy
// changes.
func (p *Proxy) relayAccepted(rec *record, req *stack.TCPRequest, up net.Conn, authz *authorized) {
	// Tracked before the client's handshake completes, so that a drain
	// that starts the moment the client sees its connection open waits
	// for it. Resetting up is enough to abort: the relay then resets the
	// client's side too.
	var from netip.Addr
	if rec.direction == "outbound" && p.local(rec.srcW) {
		from = rec.src.Addr()
	}
	t := p.open.addFrom(authz, from, func() { reset(up) })
	down, err := req.Accept()
	if err != nil {
		reset(up)
		rec.release()
		if errors.Is(err, syscall.ECONNRESET) {
			// The client completed its handshake and reset the
			// connection before the netstack handed it over: a
			// connection that ended in a reset, not a refusal.
			rec.opened()
			rec.done(0, 0, true)
		} else {
			rec.refused(err)
		}
		p.open.remove(t)
		return
	}
	rec.opened()
	startRelay(down, up, rec.sent, rec.received, func(res relayResult) {
		rec.release() // both sides are closed
		rec.done(res.AToB, res.BToA, res.Reset)
		p.open.remove(t)
	})
}

func connectError(err error) string {
	var de *deniedError
	switch {
	case errors.As(err, &de):
		return de.Error()
	case errors.Is(err, syscall.ECONNREFUSED):
		return "connection refused"
	case errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return "unreachable"
	case errors.Is(err, context.DeadlineExceeded), errors.Is(err, syscall.ETIMEDOUT):
		return "timeout"
	}
	return err.Error()
}
