package proxy

import (
	"context"
	"fmt"
	"net"
	"net/netip"

	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/protocols/relay"
)

// ServeHBONE accepts the HBONE connections that the kernel delivers to a
// node socket (tun.LocalDelivery: a transparent listener on port 15008
// receives what is addressed to a local pod's port 15008) and hands each
// to the HBONE server, until ctx ends; it closes ln then. The local
// address of such a connection is the pod's: one that is not a local mesh
// workload's port 15008 (the node's own address, a pod that left the
// mesh) is reset before any TLS byte, and logged as refused (within the
// rate of refusals before any request, see record.refusedEarly). The
// bounds on pending handshakes and connections are the HBONE server's, in
// ServeConn, shared with the netstack's listeners.
func (p *Proxy) ServeHBONE(ctx context.Context, ln net.Listener) error {
	return hbone.AcceptLoop(ctx, ln, p.log, p.serveKernelConn)
}

// serveKernelConn checks the address c was sent to and serves it.
func (p *Proxy) serveKernelConn(c net.Conn) {
	local, _ := netip.ParseAddrPort(c.LocalAddr().String())
	remote, _ := netip.ParseAddrPort(c.RemoteAddr().String())
	local = netip.AddrPortFrom(local.Addr().Unmap(), local.Port())
	remote = netip.AddrPortFrom(remote.Addr().Unmap(), remote.Port())
	snap := p.cfg.Registry.Load()
	dst := snap.Workload(local.Addr())
	srv := p.server
	if !p.local(dst) || local.Port() != hbone.Port || srv == nil {
		relay.Abort(c) // a reset: nothing listens here for this client
		if srv != nil {
			srv.CountRefused(hbone.RefusedNotLocal)
		}
		p.newRecord(remote, local, snap.Workload(remote.Addr()), dst, "inbound", "hbone").
			refusedEarly(fmt.Errorf("%w: HBONE connection to %s, which is not a mesh workload on this node", hbone.ErrBadRequest, local))
		return
	}
	p.serveHBONE(c, true)
}

// HBONEAccepted returns how many inbound HBONE connections were accepted
// on a kernel socket (ServeHBONE) and on the netstack.
func (p *Proxy) HBONEAccepted() (kernel, netstack uint64) {
	return p.hboneKernel.Load(), p.hboneNetstack.Load()
}
