package proxy

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/stack"
)

// inbound terminates an HBONE connection to a local workload's port 15008:
// the handshake completes at once (TLS needs it) and the HBONE server takes
// over; its Handler is Connect.
func (p *Proxy) inbound(req *stack.TCPRequest, dst *registry.Workload) {
	c, err := req.Accept()
	if err != nil {
		p.access(req, nil, dst, "inbound", "hbone").Err(err).Msg("HBONE handshake failed")
		return
	}
	p.server.Load().ServeConn(p.ctx, c)
}

// InboundHandler returns the hbone.Handler that delivers inbound streams
// to local workloads.
func (p *Proxy) InboundHandler() hbone.Handler { return hbone.HandlerFunc(p.connect) }

// connect decides one inbound HBONE request and connects its upstream.
func (p *Proxy) connect(ctx context.Context, r *hbone.Request) (net.Conn, error) {
	start := time.Now()
	snap := p.cfg.Registry.Load()
	dst := snap.Workload(r.Target.Addr())
	srcAddr, src := p.inboundSource(snap, r)
	ev := func() *zerolog.Event {
		ev := p.log.Info().Str("src.addr", srcAddr.String()).Str("dst.addr", r.Target.String()).
			Str("dst.hbone_addr", r.LocalAddr.String()).Str("direction", "inbound").Str("route", "hbone").
			Str("src.identity", r.Peer.String())
		workloadFields(ev, "src", src)
		workloadFields(ev, "dst", dst)
		if r.Forwarded.Host != "" {
			ev.Str("dst.service", r.Forwarded.Host)
		}
		return ev
	}
	fail := func(kind error, format string, args ...any) (net.Conn, error) {
		err := fmt.Errorf("%w: %s", kind, fmt.Sprintf(format, args...))
		ev().Str("error", err.Error()).Msg("connection refused")
		return nil, err
	}
	if dst == nil || !dst.InMesh || dst.Node != p.cfg.Node {
		return fail(hbone.ErrBadRequest, "target %s is not a mesh workload on this node", r.Target)
	}
	if snap.Workload(r.LocalAddr.Addr()) != dst {
		return fail(hbone.ErrBadRequest, "target %s is not served by HBONE endpoint %s", r.Target, r.LocalAddr)
	}
	areq, err := p.authorize(snap, r.Peer, srcAddr.Addr(), r.Target)
	if err != nil {
		return fail(hbone.ErrDenied, "%v", err)
	}
	ns := p.netstack()
	if ns == nil {
		return fail(hbone.ErrUnreachable, "netstack not ready")
	}
	up, err := ns.DialTCP(ctx, srcAddr, r.Target)
	if err != nil && srcAddr.Port() != 0 && errors.Is(err, syscall.EADDRINUSE) {
		up, err = ns.DialTCP(ctx, netip.AddrPortFrom(srcAddr.Addr(), 0), r.Target)
	}
	if err != nil {
		return fail(hbone.ErrUnreachable, "connect %s from %s: %v", r.Target, srcAddr, err)
	}
	cc := &countedConn{Conn: up}
	t := p.open.add(areq, func() { cc.Abort() })
	cc.done = func(sent, recv int64, reset bool) {
		p.open.remove(t)
		e := ev()
		if reset {
			e = e.Str("error", "connection reset")
		}
		e.Int64("bytes_sent", sent).Int64("bytes_recv", recv).Dur("duration", time.Since(start)).
			Msg("connection complete")
	}
	return cc, nil
}

// inboundPlain handles a plaintext connection from outside the mesh to a
// local workload that STRICT mode or an authorization policy protects:
// authorized without an identity (STRICT always refuses), then delivered
// from the client's address.
func (p *Proxy) inboundPlain(snap *registry.Snapshot, req *stack.TCPRequest, src, dst *registry.Workload) {
	start := time.Now()
	ev := func() *zerolog.Event { return p.access(req, src, dst, "inbound", "plaintext") }
	areq, err := p.authorize(snap, spiffeid.ID{}, req.Src.Addr(), req.Dst)
	if err != nil {
		req.Reject()
		ev().Str("error", connectError(err)).Msg("connection refused")
		return
	}
	p.deliver(req, areq, req.Dst, ev, start)
}

// inboundSource returns the address the upstream connection is made from:
// the original client named in the forwarded header when that address
// belongs to a workload whose identity is the verified peer's, so that
// the application sees the real client; otherwise the tunnel's own peer
// address (a claim the peer cannot back is not repeated).
func (p *Proxy) inboundSource(snap *registry.Snapshot, r *hbone.Request) (netip.AddrPort, *registry.Workload) {
	if f := r.Forwarded.For; f.Addr().IsValid() && f.Addr().Is4() == r.Target.Addr().Is4() {
		if w := snap.Workload(f.Addr()); w != nil && w.Identity == r.Peer {
			return netip.AddrPortFrom(f.Addr().Unmap(), f.Port()), w
		}
		p.log.Debug().Str("forwarded_for", f.String()).Str("peer", r.Peer.String()).
			Msg("forwarded address does not belong to the peer's identity; using the tunnel's address")
	}
	return netip.AddrPortFrom(r.PeerAddr.Addr(), 0), snap.Workload(r.PeerAddr.Addr())
}

// countedConn counts the bytes of an upstream connection the HBONE server
// relays, and reports them when the server closes it. Writes go to the
// workload (sent by the client), reads come from it.
type countedConn struct {
	*stack.Conn
	sent, recv atomic.Int64
	reset      atomic.Bool
	closed     atomic.Bool
	done       func(sent, recv int64, reset bool)
}

func (c *countedConn) Read(b []byte) (int, error) {
	n, err := c.Conn.Read(b)
	c.recv.Add(int64(n))
	if err != nil && errors.Is(err, syscall.ECONNRESET) {
		c.reset.Store(true)
	}
	return n, err
}

func (c *countedConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	c.sent.Add(int64(n))
	return n, err
}

// Abort resets the workload's connection (the client reset its stream).
func (c *countedConn) Abort() error {
	c.reset.Store(true)
	err := c.Conn.Abort()
	c.finish()
	return err
}

func (c *countedConn) Close() error {
	err := c.Conn.Close()
	c.finish()
	return err
}

func (c *countedConn) finish() {
	if c.closed.CompareAndSwap(false, true) {
		c.done(c.sent.Load(), c.recv.Load(), c.reset.Load())
	}
}
