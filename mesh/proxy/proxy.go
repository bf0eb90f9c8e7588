// Package proxy decides how each intercepted TCP connection travels on, and
// carries it there:
//
//   - outbound, from a local mesh workload to a mesh workload on another
//     node: an HBONE stream (mutual TLS, HTTP/2 CONNECT) to the
//     destination's pod IP, port 15008, presenting the source's SVID;
//   - outbound to a mesh workload on this node: handed over inside the
//     proxy, never leaving it (authorized as if it had crossed HBONE);
//   - to a service VIP: an endpoint is picked, then as above;
//   - to a service with a waypoint, or to the address of a workload with
//     one: an HBONE stream to the waypoint (port 15008, its identity
//     required), the original destination as its target; reset if the
//     waypoint cannot be resolved (waypoint.go in package registry);
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
	"fmt"
	"math/rand/v2"
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
	"github.com/meshtun/meshtun/protocols/relay"
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
	// Netstack is the netstack the proxy originates connections through
	// (built before the proxy and started with its HandleTCP after New).
	// Nil: connections that need it are refused.
	Netstack Dialer
	// HBONEFromPod, if set, reports whether an outbound HBONE connection
	// of the local pod address src is dialled from src
	// (hbone.DialRequest.From, the HBONE client's DialFrom) rather than
	// from the node's address. Nil: the node's.
	HBONEFromPod func(src netip.Addr) bool
	// Inbound is the configuration of the HBONE server that terminates
	// inbound tunnels: New builds it with the proxy as its Handler and
	// OnRefusedConn (Server returns it). Without a TLS configuration there
	// is none, and SYNs to port 15008 are not inbound HBONE.
	Inbound hbone.ServerConfig
	// LookupHost resolves the DNS name of a service endpoint that has no
	// address (an Istio ServiceEntry with resolution DNS), on demand, as
	// ztunnel does. Nil: the system's resolver, its sockets under
	// SocketControl.
	LookupHost func(ctx context.Context, host string) ([]netip.Addr, error)
}

// Proxy handles intercepted TCP connections.
type Proxy struct {
	cfg      Config
	log      zerolog.Logger
	access   zerolog.Logger
	dialer   net.Dialer
	ctx      context.Context
	netstk   Dialer        // cfg.Netstack
	server   *hbone.Server // built from cfg.Inbound
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
	p := &Proxy{
		cfg:      cfg,
		log:      cfg.Logger,
		access:   cfg.AccessLog,
		dialer:   net.Dialer{Timeout: cfg.ConnectTimeout, Control: cfg.SocketControl},
		ctx:      ctx,
		netstk:   cfg.Netstack,
		earlyLog: hbone.NewLogLimiter(hbone.DefaultLogRate),
	}
	if cfg.Inbound.TLS != nil {
		sc := cfg.Inbound
		sc.Handler, sc.OnRefusedConn = p.InboundHandler(), p.TLSFailure
		srv, err := hbone.NewServer(sc)
		if err != nil {
			return nil, fmt.Errorf("proxy: %w", err)
		}
		p.server = srv
	}
	return p, nil
}

// Server is the HBONE server built from Config.Inbound; nil without one.
func (p *Proxy) Server() *hbone.Server { return p.server }

// SetAccessLog turns the access log on or off.
func (p *Proxy) SetAccessLog(on bool) { p.quiet.Store(!on) }

// AccessLog reports whether the access log is on.
func (p *Proxy) AccessLog() bool { return !p.quiet.Load() }

func (p *Proxy) netstack() Dialer { return p.netstk }

// HandleTCP is the stack.TCPHandler of the proxy: it classifies the
// connection by the registry and hands it to the path that carries it.
func (p *Proxy) HandleTCP(req *stack.TCPRequest) {
	snap := p.cfg.Registry.Load()
	flow, src, dst := Decide(snap, p.cfg.Node, req.Src, req.Dst, p.fromNode)

	if p.draining.Load() && flow != InboundHBONE {
		req.Reject()
		p.newRecord(req.Src, req.Dst, src, dst, "outbound", "drain").refused(errDraining)
		return
	}
	switch {
	case flow == InboundHBONE && p.server != nil:
		p.inbound(req, dst)
	case p.local(src):
		p.outboundFrom(snap, req, src, dst)
	case p.local(dst):
		// Plaintext to a local workload: one that STRICT mode or a
		// policy protects, or one whose model changed since the SYN was
		// taken (authorized all the same).
		p.inboundPlain(snap, req, src, dst)
	default:
		p.passthrough(p.newRecord(req.Src, req.Dst, src, dst, "outbound", "passthrough"), req, req.Dst, false)
	}
}

func (p *Proxy) local(w *registry.Workload) bool {
	return w.CapturedBy(p.cfg.Node)
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
	// To a service with a waypoint: to the waypoint, whatever the port
	// (ztunnel looks the service up by address alone), unless the client
	// is that waypoint.
	if svc := waypointService(snap, req.Dst, src.Namespace); svc != nil {
		if wp := svc.PickWaypoint(); !snap.IsWaypoint(wp, src, req.Src.Addr()) {
			p.viaWaypoint(snap, req, src, nil, svc, wp)
			return
		}
	}
	svc, target, dst, err := serviceTarget(snap, req.Dst, src, dst)
	if ue := (*unresolvedError)(nil); errors.As(err, &ue) {
		target, dst, err = p.resolveEndpoint(snap, ue, req.Dst.Addr(), target.Port())
	}
	if err != nil {
		req.Reject()
		p.newRecord(req.Src, req.Dst, src, dst, "outbound", "service").via(req.Dst, svc).refused(err)
		return
	}
	switch {
	case dst != nil && dst.Refused != "":
		// A destination meshtun refuses (on any node: a remote one too,
		// e.g. an address claimed by pods of two nodes): neither
		// plaintext nor a tunnel to an identity the model cannot vouch for.
		req.Reject()
		p.newRecord(req.Src, req.Dst, src, dst, "outbound", "refused").via(target, svc).refused(&refusedWorkloadError{dst})
	case svc == nil && dst != nil && dst.Waypoint != nil && !snap.IsWaypoint(dst.Waypoint, src, req.Src.Addr()):
		// To a workload's own address, one with a waypoint: to the
		// waypoint (not when the client is the waypoint itself, which
		// is sending the connection on).
		p.viaWaypoint(snap, req, src, dst, nil, dst.Waypoint)
	case dst != nil && dst.InMesh && p.cfg.HBONE != nil && (p.uncertified(src) || p.local(dst) && p.uncertified(dst)):
		// Never plaintext, never without the identity's certificate.
		req.Reject()
		blocked := src
		if !p.uncertified(src) {
			blocked = dst
		}
		p.newRecord(req.Src, req.Dst, src, dst, "outbound", "no-certificate").via(target, svc).refused(&noCertificateError{blocked})
	case p.local(dst) && p.cfg.HBONE != nil:
		p.sameNode(snap, req, p.newRecord(req.Src, req.Dst, src, dst, "outbound", "local").via(target, svc), target)
	case dst != nil && dst.InMesh && p.cfg.HBONE != nil:
		p.outbound(req, p.newRecord(req.Src, req.Dst, src, dst, "outbound", "hbone").via(target, svc),
			netip.AddrPortFrom(target.Addr(), hbone.Port), target, dst.Identity)
	default:
		p.passthrough(p.newRecord(req.Src, req.Dst, src, dst, "outbound", "passthrough").via(target, svc), req, target, true)
	}
}

// waypointService returns the service at dst's address for a client of
// namespace ns if it has a waypoint, else nil. Like ztunnel, it looks the
// service up by address alone: a port the service does not have goes to
// the waypoint too.
func waypointService(snap *registry.Snapshot, dst netip.AddrPort, ns string) *registry.Service {
	svc, _ := snap.ServiceFor(dst, ns)
	if svc == nil {
		svc = snap.ServiceByVIP(dst.Addr())
	}
	if svc == nil || !svc.HasWaypoint() {
		return nil
	}
	return svc
}

// serviceTarget resolves an outbound connection of the workload src to
// orig (whose workload is dst, or nil): to a service VIP (the service of
// src's namespace where several share it), an endpoint chosen for src
// (the target address and its workload), or the original destination
// itself for a PASSTHROUGH service; anything else as it is. It fails for
// a service without an endpoint for src (errNoEndpoint; under STRICT
// load balancing, none in src's locality), and for an endpoint known only
// by a DNS name (an *unresolvedError, with the target port: resolveEndpoint
// resolves it; the VIP itself must never be dialled in its place).
func serviceTarget(snap *registry.Snapshot, orig netip.AddrPort, src, dst *registry.Workload) (svc *registry.Service, target netip.AddrPort, to *registry.Workload, err error) {
	svc, port := snap.ServiceFor(orig, src.Namespace)
	if svc == nil || svc.Passthrough {
		return svc, orig, dst, nil
	}
	ep, ok := svc.Pick(orig.Addr(), src)
	switch {
	case !ok:
		return svc, orig, nil, errNoEndpoint
	case ep.Unresolved():
		return svc, netip.AddrPortFrom(netip.Addr{}, port.Target()), ep.Workload, &unresolvedError{svc: svc, w: ep.Workload}
	}
	return svc, netip.AddrPortFrom(ep.Addr, port.Target()), ep.Workload, nil
}

// resolveEndpoint resolves the DNS name of a service endpoint without an
// address (ue.w.Hostname) on demand, as ztunnel does: an address of
// vip's family if there is one, at random. The connection goes to that
// address and port: to the mesh workload that has it if there is one
// (over HBONE if it is in the mesh), else as the endpoint says (over
// HBONE to the address if the endpoint is in the mesh, else in
// plaintext). A lookup that fails, and a name that resolves to a service
// VIP or range (whose endpoints may be mesh workloads that plaintext must
// not reach), refuse the connection (an *unresolvedError: DF).
func (p *Proxy) resolveEndpoint(snap *registry.Snapshot, ue *unresolvedError, vip netip.Addr, port uint16) (netip.AddrPort, *registry.Workload, error) {
	ctx, cancel := context.WithTimeout(p.ctx, p.cfg.ConnectTimeout)
	defer cancel()
	lookup := p.cfg.LookupHost
	if lookup == nil {
		lookup = p.lookupHost
	}
	addrs, err := lookup(ctx, ue.w.Hostname)
	if err == nil && len(addrs) == 0 {
		err = errors.New("no address")
	}
	if err != nil {
		ue.err = fmt.Errorf("DNS lookup of %q: %w", ue.w.Hostname, err)
		return netip.AddrPort{}, ue.w, ue
	}
	same := 0
	for _, a := range addrs {
		if a.Unmap().Is4() == vip.Unmap().Is4() {
			same++
		}
	}
	var a netip.Addr
	if same > 0 {
		n := rand.IntN(same)
		for _, x := range addrs {
			if x.Unmap().Is4() == vip.Unmap().Is4() {
				if n == 0 {
					a = x
					break
				}
				n--
			}
		}
	} else {
		a = addrs[rand.IntN(len(addrs))]
	}
	a = a.Unmap()
	target := netip.AddrPortFrom(a, port)
	if svc, _ := snap.ServiceFor(target, ue.w.Namespace); svc != nil || snap.ServiceByVIP(a) != nil {
		if svc == nil {
			svc = snap.ServiceByVIP(a)
		}
		ue.err = fmt.Errorf("%q resolves to %s, a VIP of service %s: refused (its endpoints could be reached in plaintext)", ue.w.Hostname, a, svc)
		return netip.AddrPort{}, ue.w, ue
	}
	if w := snap.Workload(a); w != nil {
		return target, w, nil
	}
	return target, ue.w, nil
}

// lookupHost is the default Config.LookupHost: the system's resolver
// (Go's, so that its sockets take SocketControl like the proxy's own).
func (p *Proxy) lookupHost(ctx context.Context, host string) ([]netip.Addr, error) {
	r := &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, network, address string) (net.Conn, error) {
		d := net.Dialer{Control: p.cfg.SocketControl}
		return d.DialContext(ctx, network, address)
	}}
	return r.LookupNetIP(ctx, "ip", host)
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
	t := p.open.track(authz, from, rec, func() { relay.Abort(up) })
	down, err := req.Accept()
	if err != nil {
		relay.Abort(up)
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
	relay.Start(down, up, relay.Meter{AToB: rec.sent, BToA: rec.received, Done: func(res relay.Result) {
		rec.release() // both sides are closed
		rec.done(res.AToB, res.BToA, res.Reset)
		p.open.remove(t)
	}})
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
