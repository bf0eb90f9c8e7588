package proxy

import (
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

// authorize applies the destination's authorization policies (and its
// peer-authentication mode) to a connection from peer (zero if
// unauthenticated) at src to dst, the workload's address and target port.
// It returns the request, to be re-evaluated on policy changes.
func (p *Proxy) authorize(snap *registry.Snapshot, peer spiffeid.ID, src netip.Addr, dst netip.AddrPort) (policy.Request, error) {
	r := policy.Request{Peer: peer, Source: src, Dest: dst}
	if d := snap.Authorize(&r); !d.Allowed {
		return r, &deniedError{d}
	}
	return r, nil
}

// tracker holds the authorized connections that are open, so that a policy
// change can close those it no longer allows.
type tracker struct {
	mu    sync.Mutex
	conns map[*tracked]struct{}
}

type tracked struct {
	req   policy.Request
	abort func()
}

func (t *tracker) add(req policy.Request, abort func()) *tracked {
	c := &tracked{req: req, abort: abort}
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
	t.mu.Unlock()
}

// Reauthorize evaluates every open connection this node authorized
// against the current policies and resets those no longer allowed. It
// returns how many it closed.
func (p *Proxy) Reauthorize() int {
	snap := p.cfg.Registry.Load()
	var denied []*tracked
	p.open.mu.Lock()
	for c := range p.open.conns {
		if d := snap.Authorize(&c.req); !d.Allowed {
			denied = append(denied, c)
			p.log.Info().Str("src.addr", c.req.Source.String()).Str("dst.addr", c.req.Dest.String()).
				Str("src.identity", c.req.Peer.String()).Str("error", d.String()).
				Msg("open connection no longer allowed; closing it")
		}
	}
	p.open.mu.Unlock()
	for _, c := range denied {
		c.abort()
	}
	return len(denied)
}
