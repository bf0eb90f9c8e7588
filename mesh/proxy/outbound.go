package proxy

import (
	"context"
	"net/netip"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/stack"
)

// outbound carries a connection from a local mesh workload to a mesh
// workload on another node through an HBONE stream. The client's handshake
// completes only after the far end answered 200, i.e. after its upstream
// connect succeeded; a refusal of any kind resets the client.
func (p *Proxy) outbound(req *stack.TCPRequest, src, dst *registry.Workload) {
	start := time.Now()
	endpoint := netip.AddrPortFrom(req.Dst.Addr(), hbone.Port)
	ev := func() *zerolog.Event {
		return p.access(req, src, dst, "outbound", "hbone").Str("dst.hbone_addr", endpoint.String())
	}
	ctx, cancel := context.WithTimeout(p.ctx, p.cfg.ConnectTimeout)
	up, err := p.cfg.HBONE.Dial(ctx, hbone.DialRequest{
		Source:      src.Identity,
		Destination: dst.Identity,
		Endpoint:    endpoint,
		Target:      req.Dst,
		Forwarded:   hbone.Forwarded{For: req.Src},
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
func (p *Proxy) sameNode(req *stack.TCPRequest, src, dst *registry.Workload) {
	start := time.Now()
	ev := func() *zerolog.Event { return p.access(req, src, dst, "outbound", "local") }
	if err := p.authorize(src.Identity, req.Src.Addr(), dst, req.Dst.Port()); err != nil {
		req.Reject()
		ev().Str("error", connectError(err)).Err(err).Msg("connection refused")
		return
	}
	ns := p.netstack()
	if ns == nil {
		req.Reject()
		ev().Str("error", "netstack not ready").Msg("connection refused")
		return
	}
	ctx, cancel := context.WithTimeout(p.ctx, p.cfg.ConnectTimeout)
	up, err := ns.DialTCP(ctx, netip.AddrPortFrom(req.Src.Addr(), 0), req.Dst)
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

// baggage is the W3C baggage ztunnel sends about the source workload.
func baggage(w *registry.Workload) hbone.Baggage {
	return hbone.Baggage{
		"k8s.namespace.name": w.Namespace,
		"k8s.pod.name":       w.Name,
		"service.name":       w.Name,
	}
}
