package proxy

import (
	"context"
	"net/netip"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/stack"
)

// outbound carries a connection from a local mesh workload to a mesh
// workload on another node through an HBONE stream. The client's handshake
// completes only after the far end answered 200, i.e. after its upstream
// connect succeeded; a refusal of any kind resets the client.
func (p *Proxy) outbound(req *stack.TCPRequest, src, dst *registry.Workload, target netip.AddrPort, host string) {
	start := time.Now()
	endpoint := netip.AddrPortFrom(target.Addr(), hbone.Port)
	ev := func() *zerolog.Event {
		return targetFields(p.access(req, src, dst, "outbound", "hbone").Str("dst.hbone_addr", endpoint.String()), req, target, host)
	}
	ctx, cancel := context.WithTimeout(p.ctx, p.cfg.ConnectTimeout)
	up, err := p.cfg.HBONE.Dial(ctx, hbone.DialRequest{
		Source:      src.Identity,
		Destination: dst.Identity,
		Endpoint:    endpoint,
		Target:      target,
		Forwarded:   hbone.Forwarded{For: req.Src, Host: host},
		Baggage:     baggage(src),
	})
	cancel()
	if err != nil {
		req.Reject()
		ev().Str("error", connectError(err)).Err(err).Msg("connection refused")
		return
	}
	down, err := req.Accept()
	if err != nil {
		up.Abort()
		ev().Err(err).Msg("client handshake failed")
		return
	}
	res := relay(down, up)
	p.done(ev(), res, start)
}

// sameNode carries a connection between two mesh workloads of this node.
// It never leaves the proxy, so it needs no tunnel: the destination is
// authorized against the source's identity exactly as an inbound HBONE
// request would be, and then dialled through the netstack from the
// source's address (a fresh port: the original 4-tuple is the client leg's
// own).
func (p *Proxy) sameNode(snap *registry.Snapshot, req *stack.TCPRequest, src, dst *registry.Workload, target netip.AddrPort, host string) {
	start := time.Now()
	ev := func() *zerolog.Event {
		return targetFields(p.access(req, src, dst, "outbound", "local"), req, target, host)
	}
	areq, err := p.authorize(snap, src.Identity, req.Src.Addr(), target)
	if err != nil {
		req.Reject()
		ev().Str("error", connectError(err)).Msg("connection refused")
		return
	}
	p.deliver(req, areq, target, ev, start)
}

// targetFields adds the chosen endpoint and service to an access-log event
// when the client connected to a service VIP.
func targetFields(ev *zerolog.Event, req *stack.TCPRequest, target netip.AddrPort, host string) *zerolog.Event {
	if target != req.Dst {
		ev.Str("dst.target", target.String())
	}
	if host != "" {
		ev.Str("dst.service", host)
	}
	return ev
}

// deliver connects an authorized connection to a local workload through
// the netstack from the client's address (a fresh port: the original
// 4-tuple is the client leg's own), completes the client's handshake and
// relays, tracked for re-authorization.
func (p *Proxy) deliver(req *stack.TCPRequest, areq policy.Request, target netip.AddrPort, ev func() *zerolog.Event, start time.Time) {
	ns := p.netstack()
	if ns == nil {
		req.Reject()
		ev().Str("error", "netstack not ready").Msg("connection refused")
		return
	}
	ctx, cancel := context.WithTimeout(p.ctx, p.cfg.ConnectTimeout)
	up, err := ns.DialTCP(ctx, netip.AddrPortFrom(req.Src.Addr(), 0), target)
	cancel()
	if err != nil {
		req.Reject()
		ev().Str("error", connectError(err)).Err(err).Msg("connection refused")
		return
	}
	down, err := req.Accept()
	if err != nil {
		up.Abort()
		ev().Err(err).Msg("client handshake failed")
		return
	}
	t := p.open.add(areq, func() { reset(down); reset(up) })
	res := relay(down, up)
	p.open.remove(t)
	p.done(ev(), res, start)
}

// baggage is the W3C baggage ztunnel sends about the source workload.
func baggage(w *registry.Workload) hbone.Baggage {
	return hbone.Baggage{
		"k8s.namespace.name": w.Namespace,
		"k8s.pod.name":       w.Name,
		"service.name":       w.Name,
	}
}
