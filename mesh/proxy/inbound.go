package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"syscall"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/protocols/relay"
	"github.com/meshtun/meshtun/stack"
)

var errNotReady = errors.New("netstack not ready")

// inbound terminates an HBONE connection to a local workload's port 15008
// that reached the netstack's forwarder (no listener holds that address):
// the handshake completes at once (TLS needs it) and the HBONE server
// takes over; its Handler is connect.
func (p *Proxy) inbound(req *stack.TCPRequest, dst *registry.Workload) {
	c, err := req.Accept()
	if err != nil {
		p.log.Debug().Err(err).Str("src.addr", req.Src.String()).Str("dst.addr", req.Dst.String()).
			Msg("HBONE connection: handshake failed")
		return
	}
	p.serveHBONE(c, false)
}

// ServeNetstackHBONE serves an HBONE connection that the netstack accepted
// on a local workload's port 15008 (a stack.Listener, which answers SYN
// floods with SYN cookies); the HBONE server takes over, as for inbound.
func (p *Proxy) ServeNetstackHBONE(c *stack.Conn) { p.serveHBONE(c, false) }

// serveHBONE hands an inbound HBONE connection to the HBONE server: the
// one way in for the three places one arrives (the netstack's forwarder
// and listeners, serving it on the caller's goroutine, and a kernel
// socket, on a goroutine of its own once within the server's bounds). It
// resets c if no server is set.
func (p *Proxy) serveHBONE(c net.Conn, kernel bool) {
	srv := p.server
	switch {
	case srv == nil:
		relay.Abort(c)
	case kernel:
		p.hboneKernel.Add(1)
		srv.Go(p.ctx, c)
	default:
		p.hboneNetstack.Add(1)
		srv.ServeConn(p.ctx, c)
	}
}

// InboundHandler returns the hbone.Handler that delivers inbound streams
// to local workloads.
func (p *Proxy) InboundHandler() hbone.Handler { return hbone.HandlerFunc(p.connect) }

// connect decides one inbound HBONE request and connects its upstream.
func (p *Proxy) connect(ctx context.Context, r *hbone.Request) (net.Conn, error) {
	snap := p.cfg.Registry.Load()
	dst := snap.Workload(r.Target.Addr())
	srcAddr, src := p.inboundSource(snap, r)
	rec := p.newRecord(srcAddr, r.Target, src, dst, "inbound", "hbone")
	rec.srcID, rec.hboneAddr = r.Peer.String(), r.LocalAddr.String()
	rec.service, rec.svc = serviceName(snap, r.Forwarded.Host), snap.ServiceByHostname(r.Forwarded.Host)
	if !r.Trace.IsZero() {
		rec.trace = r.Trace // the connection keeps its trace id across nodes
	}
	if ev := p.log.Debug(); ev.Enabled() {
		ev.Str("trace_id", rec.trace.TraceIDString()).Str("peer", r.Peer.String()).Str("target", r.Target.String()).
			Str("traceparent", r.TraceParent).Str("baggage", r.Baggage.String()).Msg(InboundRequestMessage)
	}
	if src == nil && r.Baggage != nil {
		d, err := deriveSource(r.Baggage, r.Peer)
		if err != nil {
			p.log.Debug().Err(err).Str("peer", r.Peer.String()).Str("trace_id", rec.trace.TraceIDString()).
				Msg("ignoring the peer's baggage")
		}
		rec.derived = d
	}
	fail := func(kind error, err error) (net.Conn, error) {
		err = fmt.Errorf("%w: %w", kind, err)
		rec.refused(err)
		return nil, err
	}
	if p.draining.Load() {
		return fail(hbone.ErrUnreachable, errDraining)
	}
	if !dst.CapturedBy(p.cfg.Node) {
		return fail(hbone.ErrBadRequest, fmt.Errorf("target %s is not a mesh workload on this node", r.Target))
	}
	if snap.Workload(r.LocalAddr.Addr()) != dst {
		return fail(hbone.ErrBadRequest, fmt.Errorf("target %s is not served by HBONE endpoint %s", r.Target, r.LocalAddr))
	}
	az, err := p.authorize(snap, r.Peer, srcAddr.Addr(), r.Target)
	if err != nil {
		return fail(hbone.ErrDenied, err)
	}
	ns := p.netstack()
	if ns == nil {
		return fail(hbone.ErrUnreachable, errNotReady)
	}
	// The workload may never answer (a SYN dropped by its firewall): the
	// dial, and the stream waiting for its 200, end after ConnectTimeout.
	dctx, cancel := context.WithTimeout(ctx, p.cfg.ConnectTimeout)
	defer cancel()
	up, err := ns.DialTCP(dctx, srcAddr, r.Target)
	if err != nil && srcAddr.Port() != 0 && errors.Is(err, syscall.EADDRINUSE) {
		up, err = ns.DialTCP(dctx, netip.AddrPortFrom(srcAddr.Addr(), 0), r.Target)
	}
	if err != nil {
		return fail(hbone.ErrUnreachable, err)
	}
	rec.opened()
	// The HBONE server relays up and reports what moved to its meter
	// (relay.Metered), also when it never relays it (relay.Abandon).
	t := p.open.track(az, netip.Addr{}, rec, func() { up.Abort() })
	return &inboundConn{Conn: up, meter: relay.Meter{AToB: rec.sent, BToA: rec.received, Done: func(r relay.Result) {
		p.open.remove(t)
		rec.done(r.AToB, r.BToA, r.Reset)
	}}}, nil
}

// InboundRequestMessage is the debug-level log line of an inbound HBONE
// request: its trace id, peer, target, and the traceparent and baggage
// it carried (as parsed; empty if absent or malformed).
const InboundRequestMessage = "inbound HBONE request"

// UnknownService is the dst.service (log and metric label) of an inbound
// request whose forwarded host is no service the mesh knows.
const UnknownService = "unknown"

// serviceName returns the service name an inbound request's forwarded
// host may put in logs and metric labels: the peer chooses the host, so
// only a hostname of a known service is repeated (else UnknownService),
// which bounds the label's values to the mesh's services.
func serviceName(snap *registry.Snapshot, host string) string {
	switch {
	case host == "":
		return ""
	case snap.ServiceByHostname(host) != nil:
		return host
	}
	return UnknownService
}

// TLSFailure reports an HBONE connection refused before any request (a
// failed handshake, no usable certificate): Istio's TLS_FAILURE.
func (p *Proxy) TLSFailure(local, remote net.Addr, err error) {
	l, _ := netip.ParseAddrPort(local.String())
	r, _ := netip.ParseAddrPort(remote.String())
	snap := p.cfg.Registry.Load()
	rec := p.newRecord(r, l, snap.Workload(r.Addr()), snap.Workload(l.Addr()), "inbound", "hbone")
	rec.refusedEarly(&tlsFailure{err})
}

// tlsFailure is a refusal at the HBONE connection's TLS layer.
type tlsFailure struct{ err error }

func (e *tlsFailure) Error() string { return "TLS: " + e.err.Error() }
func (e *tlsFailure) Unwrap() error { return e.err }

// inboundSource returns the address the upstream connection is made from
// and the source workload, as the peer's identity backs them:
//
//   - the tunnel's own peer address, when the model ties it to a
//     workload of the verified peer identity (a client pod that dialled
//     from its own address, as ztunnel and meshtun do), with the port
//     forwarded names for that same address;
//   - else the original client named in the forwarded header, when the
//     model ties that address to the peer identity (a node that dials
//     from its own address and carries the client in forwarded);
//   - else the tunnel's peer address, as the TCP connection came from it
//     (port 0), with no source workload unless the model ties it to the
//     peer identity: a claim the peer cannot back is not repeated.
//
// The address is also what source-IP rules (ipBlocks) are evaluated on.
func (p *Proxy) inboundSource(snap *registry.Snapshot, r *hbone.Request) (netip.AddrPort, *registry.Workload) {
	peer := r.PeerAddr.Addr().Unmap()
	pw := snap.Workload(peer)
	if pw != nil && pw.Identity != r.Peer {
		pw = nil
	}
	f := r.Forwarded.For
	fa := f.Addr().Unmap()
	if pw != nil {
		if fa == peer {
			return netip.AddrPortFrom(peer, f.Port()), pw
		}
		return netip.AddrPortFrom(peer, 0), pw
	}
	if fa.IsValid() && fa.Is4() == r.Target.Addr().Unmap().Is4() {
		if w := snap.Workload(fa); w != nil && w.Identity == r.Peer {
			return netip.AddrPortFrom(fa, f.Port()), w
		}
		p.log.Debug().Str("forwarded_for", f.String()).Str("peer", r.Peer.String()).
			Msg("forwarded address does not belong to the peer's identity; using the tunnel's address")
	}
	return netip.AddrPortFrom(peer, 0), nil
}

// inboundPlain handles a plaintext connection from outside the mesh to a
// local workload that STRICT mode or an authorization policy protects:
// authorized without an identity (STRICT always refuses), then delivered
// from the client's address.
func (p *Proxy) inboundPlain(snap *registry.Snapshot, req *stack.TCPRequest, src, dst *registry.Workload) {
	rec := p.newRecord(req.Src, req.Dst, src, dst, "inbound", "plaintext")
	az, err := p.authorize(snap, spiffeid.ID{}, req.Src.Addr(), req.Dst)
	if err != nil {
		req.Reject()
		rec.refused(err)
		return
	}
	p.deliver(req, rec, az, req.Dst)
}

// inboundConn is the upstream connection of an inbound HBONE request: the
// HBONE server's relay counts its bytes (relay.Metered) for the record:
// bytes written to it were sent by the client, bytes read from it are
// received.
type inboundConn struct {
	*stack.Conn
	meter relay.Meter
}

// RelayMeter implements relay.Metered.
func (c *inboundConn) RelayMeter() relay.Meter { return c.meter }
