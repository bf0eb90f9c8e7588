package proxy

import (
	"context"
	"net/netip"
	"sync"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// deniedError is an authorization refusal; its text names the deciding
// policy ("denied by policy ns/name").
type deniedError struct{ d policy.Decision }

func (e *deniedError) Error() string { return e.d.String() }

// AuditMessage is the log message of a connection an AUDIT policy
// matched; the policy's namespace/name is its "policy" field.
const AuditMessage = "audit policy matched"

// DryRunMessage is the log message of a connection a dry-run policy
// matched: "policy" names it, "dry_run_action" says what it would have
// done (ALLOW or DENY), "allowed" what the enforced policies decided.
const DryRunMessage = "dry-run policy matched"

// authorized is a connection the destination's policies allowed.
type authorized struct{ req policy.Request }

// authorize applies the destination's authorization policies (and its
// peer-authentication mode) to a connection from peer (zero if
// unauthenticated) at src to dst, the workload's address and target port.
// The result is re-evaluated on policy changes.
func (p *Proxy) authorize(snap *registry.Snapshot, peer spiffeid.ID, src netip.Addr, dst netip.AddrPort) (*authorized, error) {
	r := policy.Request{Peer: peer, Source: src, Dest: dst}
	d := snap.Authorize(&r)
	if d.Audit != nil {
		ev := p.log.Info().Str("policy", d.Audit.ID()).Str("src.addr", src.String()).Str("dst.addr", dst.String()).
			Str("src.identity", peer.String()).Bool("allowed", d.Allowed)
		if d.Audit.DryRun {
			ev.Str("dry_run_action", d.Audit.Action.String()).Msg(DryRunMessage)
		} else {
			ev.Msg(AuditMessage)
		}
	}
	if !d.Allowed {
		return nil, &deniedError{d}
	}
	return &authorized{req: r}, nil
}

// tracker holds the open connections, so that a drain can wait for them
// and a policy change can close the authorized ones it no longer allows.
type tracker struct {
	mu      sync.Mutex
	conns   map[*tracked]struct{}
	removed chan struct{} // closed and replaced on every remove
}

type tracked struct {
	az    *authorized // nil: not subject to authorization (passthrough, outbound)
	abort func()
	// from is the local workload that opened the connection (outbound),
	// if any: closed if it becomes refused.
	from netip.Addr
	// rec describes the connection for the admin views (OpenConns); nil
	// for connections tracked without one.
	rec *record
}

// track adds an open connection: authorized by az (nil: no
// authorization to re-check), opened by the local workload address from
// (if any), described by rec for the admin views (nil: not listed), and
// ended by abort.
func (t *tracker) track(az *authorized, from netip.Addr, rec *record, abort func()) *tracked {
	c := &tracked{az: az, abort: abort, from: from, rec: rec}
	t.mu.Lock()
	if t.conns == nil {
		t.conns = make(map[*tracked]struct{})
	}
	t.conns[c] = struct{}{}
	t.mu.Unlock()
	return c
}

func (t *tracker) remove(c *tracked) {
	t.mu.Lock()
	delete(t.conns, c)
	if t.removed != nil {
		close(t.removed)
		t.removed = nil
	}
	t.mu.Unlock()
}

// len returns the number of open connections and a channel closed at the
// next remove.
func (t *tracker) len() (int, <-chan struct{}) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.removed == nil {
		t.removed = make(chan struct{})
	}
	return len(t.conns), t.removed
}

// abortAll resets every open connection and returns how many.
func (t *tracker) abortAll() int {
	t.mu.Lock()
	var all []*tracked
	for c := range t.conns {
		all = append(all, c)
	}
	t.mu.Unlock()
	for _, c := range all {
		c.abort()
	}
	return len(all)
}

// Reauthorize evaluates every open connection this node authorized
// against the current policies and resets those no longer allowed, and
// those a local workload opened that meshtun now refuses. It
// returns how many it closed.
func (p *Proxy) Reauthorize() int {
	snap := p.cfg.Registry.Load()
	var denied []*tracked
	p.open.mu.Lock()
	for c := range p.open.conns {
		if w := snap.Workload(c.from); w != nil && w.Refused != "" {
			// What a workload opened before meshtun refused it.
			denied = append(denied, c)
			p.log.Info().Str("src.addr", c.from.String()).Str("error", (&refusedWorkloadError{w}).Error()).
				Msg("open connection no longer allowed; closing it")
			continue
		}
		if c.az == nil {
			continue
		}
		req := &c.az.req
		if d := snap.Authorize(req); !d.Allowed {
			denied = append(denied, c)
			p.log.Info().Str("src.addr", req.Source.String()).Str("dst.addr", req.Dest.String()).
				Str("src.identity", req.Peer.String()).Str("error", d.String()).
				Msg("open connection no longer allowed; closing it")
		}
	}
	p.open.mu.Unlock()
	for _, c := range denied {
		c.abort()
	}
	return len(denied)
}

// Drain makes the proxy refuse new connections (a reset, or 503 over
// HBONE) and waits for the open ones to finish. When ctx ends first it
// resets those still open. It returns how many it had to reset.
func (p *Proxy) Drain(ctx context.Context) int {
	p.StopNew()
	for {
		n, removed := p.open.len()
		if n == 0 {
			return 0
		}
		select {
		case <-removed:
		case <-ctx.Done():
			return p.open.abortAll()
		}
	}
}

// StopNew makes the proxy refuse new connections from now on.
func (p *Proxy) StopNew() { p.draining.Store(true) }

// Open returns the number of connections the proxy relays now.
func (p *Proxy) Open() int {
	n, _ := p.open.len()
	return n
}

// OpenConn is one open relayed connection, as the admin views list it
// (ztunnel's workloadState connections).
type OpenConn struct {
	Direction string         // "inbound" or "outbound"
	Src       netip.AddrPort // the client
	Dst       netip.AddrPort // the address the client connected to (a service VIP, or the workload)
	// Actual is where the connection was carried: the HBONE endpoint of
	// an outbound connection through HBONE, the endpoint chosen for a
	// VIP, else Dst.
	Actual   string
	Protocol string // "HBONE" (mutual TLS, or in-proxy between two mesh workloads) or "TCP"
	// SrcWorkload and DstWorkload are the ends as the model knew them
	// when the connection opened (nil if unknown).
	SrcWorkload, DstWorkload *registry.Workload
}

// OpenConns lists the open relayed connections (at most max; 0: all).
func (p *Proxy) OpenConns(max int) []OpenConn {
	p.open.mu.Lock()
	defer p.open.mu.Unlock()
	var out []OpenConn
	for c := range p.open.conns {
		if c.rec == nil {
			continue
		}
		if max > 0 && len(out) >= max {
			break
		}
		r := c.rec
		oc := OpenConn{Direction: r.direction, Src: r.src, Dst: r.dst, Actual: r.dst.String(), Protocol: "TCP",
			SrcWorkload: r.srcW, DstWorkload: r.dstW}
		switch {
		case r.direction == "outbound" && r.hboneAddr != "":
			oc.Actual = r.hboneAddr
		case r.target != "":
			oc.Actual = r.target
		}
		if r.secure {
			oc.Protocol = "HBONE"
		}
		out = append(out, oc)
	}
	return out
}
