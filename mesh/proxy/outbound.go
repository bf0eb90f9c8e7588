package proxy

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"syscall"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/stack"
)

// outbound carries a connection from a local mesh workload to a mesh
// workload on another node through an HBONE stream. The client's handshake
// completes only after the far end answered 200, i.e. after its upstream
// connect succeeded; a refusal of any kind resets the client.
//
// endpoint is the HBONE endpoint (the destination's, or its waypoint's,
// port 15008), target the CONNECT :authority and peer the identity the
// endpoint must present.
func (p *Proxy) outbound(req *stack.TCPRequest, rec *record, endpoint, target netip.AddrPort, peer spiffeid.ID) {
	rec.hboneAddr = endpoint.String()
	var from netip.Addr
	if p.cfg.HBONEFromPod != nil && p.cfg.HBONEFromPod(req.Src.Addr()) {
		from = req.Src.Addr()
	}
	ctx, cancel := context.WithTimeout(p.ctx, p.cfg.ConnectTimeout)
	up, err := p.cfg.HBONE.Dial(ctx, hbone.DialRequest{
		From:        from,
		Source:      rec.srcW.Identity,
		Destination: peer,
		Endpoint:    endpoint,
		Target:      target,
		Forwarded:   hbone.Forwarded{For: req.Src, Host: rec.service},
		Baggage:     baggage(rec.srcW),
		TraceParent: rec.trace.String(),
	})
	cancel()
	if err != nil {
		req.Reject()
		rec.refused(err)
		return
	}
	p.relayAccepted(rec, req, up, nil)
}

// viaWaypoint sends a connection of the local workload src that must
// cross waypoint wp (the waypoint of svc, the service at the connection's
// VIP, or of dst, the workload at its address) to the waypoint, as
// ztunnel does: over HBONE to one of the waypoint's workloads (its
// address, port 15008), whose identity it must present, with the original
// destination (the VIP and port, or the workload's address and port) as
// the CONNECT target. A waypoint that cannot be resolved refuses the
// connection (a reset, response_flags UH, the reason in the access log):
// it never goes to its destination another way.
func (p *Proxy) viaWaypoint(snap *registry.Snapshot, req *stack.TCPRequest, src, dst *registry.Workload, svc *registry.Service, wp *registry.Waypoint) {
	hop, err := snap.ResolveWaypoint(wp, src, req.Dst.Addr())
	to := hop.Workload
	if to == nil {
		to = dst
	}
	rec := p.newRecord(req.Src, req.Dst, src, to, "outbound", "waypoint").via(req.Dst, svc)
	switch {
	case err != nil:
	case p.cfg.HBONE == nil:
		err = &registry.WaypointError{Waypoint: wp, Reason: "this node has no HBONE client"}
	case p.uncertified(src):
		err = &noCertificateError{src}
	}
	if err != nil {
		req.Reject()
		rec.refused(err)
		return
	}
	p.outbound(req, rec, hop.Endpoint, req.Dst, hop.Workload.Identity)
}

// sameNode carries a connection between two mesh workloads of this node.
// It never leaves the proxy, so it needs no tunnel: the destination is
// authorized against the source's identity exactly as an inbound HBONE
// request would be, and then dialled through the netstack.
func (p *Proxy) sameNode(snap *registry.Snapshot, req *stack.TCPRequest, rec *record, target netip.AddrPort) {
	az, err := p.authorize(snap, rec.srcW.Identity, req.Src.Addr(), target)
	if err != nil {
		req.Reject()
		rec.refused(err)
		return
	}
	p.deliver(req, rec, az, target)
}

// deliver connects an authorized connection to a local workload through
// the netstack from the client's address (a fresh port: the original
// 4-tuple is the client leg's own), completes the client's handshake and
// relays. A connection from the node itself is delivered from a kernel
// socket bound to the node's address instead: the workload's replies to a
// local address are delivered by the node's kernel and never reach the
// TUN, so a netstack dial from it could not complete.
func (p *Proxy) deliver(req *stack.TCPRequest, rec *record, az *authorized, target netip.AddrPort) {
	var up net.Conn
	var err error
	if p.fromNode(req.Src.Addr()) {
		up, err = p.dialExempt(rec, req.Src.Addr(), target)
	} else {
		ns := p.netstack()
		if ns == nil {
			req.Reject()
			rec.refused(errNotReady)
			return
		}
		ctx, cancel := context.WithTimeout(p.ctx, p.cfg.ConnectTimeout)
		up, err = ns.DialTCP(ctx, netip.AddrPortFrom(req.Src.Addr(), 0), target)
		cancel()
	}
	if err != nil {
		rec.release()
		req.Reject()
		rec.refused(err)
		return
	}
	p.relayAccepted(rec, req, up, az)
}

// dialExempt connects a kernel socket from src (a port the kernel picks)
// to target. With Config.Exempt, the socket is bound first and its exact
// addresses and ports registered before the connect (rec.release ends
// the exemption); the kernel lets no other socket use the same four while
// this one lives, so no other process can borrow the exemption.
func (p *Proxy) dialExempt(rec *record, src netip.Addr, target netip.AddrPort) (net.Conn, error) {
	d := p.dialer
	if p.cfg.Exempt == nil {
		d.LocalAddr = net.TCPAddrFromAddrPort(netip.AddrPortFrom(src, 0))
		return d.DialContext(p.ctx, "tcp", target.String())
	}
	control := d.Control
	d.Control = func(network, address string, c syscall.RawConn) error {
		if control != nil {
			if err := control(network, address, c); err != nil {
				return err
			}
		}
		var local netip.AddrPort
		var serr error
		if err := c.Control(func(fd uintptr) { local, serr = bindAny(int(fd), src) }); err != nil {
			return err
		}
		if serr != nil {
			return fmt.Errorf("proxy: bind %s for %s: %w", src, address, serr)
		}
		rec.exempt = p.cfg.Exempt.AddConn(local, target)
		return nil
	}
	return d.DialContext(p.ctx, "tcp", target.String())
}

// bindAny binds socket fd to src with a port the kernel picks and returns
// the address and port bound.
func bindAny(fd int, src netip.Addr) (netip.AddrPort, error) {
	var sa unix.Sockaddr
	if src.Unmap().Is4() {
		sa = &unix.SockaddrInet4{Addr: src.Unmap().As4()}
	} else {
		sa = &unix.SockaddrInet6{Addr: src.As16()}
	}
	if err := unix.Bind(fd, sa); err != nil {
		return netip.AddrPort{}, err
	}
	got, err := unix.Getsockname(fd)
	if err != nil {
		return netip.AddrPort{}, err
	}
	switch a := got.(type) {
	case *unix.SockaddrInet4:
		return netip.AddrPortFrom(netip.AddrFrom4(a.Addr), uint16(a.Port)), nil
	case *unix.SockaddrInet6:
		return netip.AddrPortFrom(netip.AddrFrom16(a.Addr).Unmap(), uint16(a.Port)), nil
	}
	return netip.AddrPort{}, fmt.Errorf("unexpected socket address %T", got)
}
