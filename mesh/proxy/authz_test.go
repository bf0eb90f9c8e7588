package proxy

import (
	"context"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// TestReauthorize: after a policy change, the open connections the new
// policies deny are aborted and counted; allowed ones and those not
// subject to authorization (passthrough, outbound) stay.
func TestReauthorize(t *testing.T) {
	ws := []*registry.Workload{
		{Name: "server", Namespace: "default", Node: "n1", InMesh: true, Addresses: []netip.Addr{server12}},
	}
	snap, err := registry.NewSnapshot(testTD, ws)
	if err != nil {
		t.Fatal(err)
	}
	reg := registry.New(snap)
	p, err := New(context.Background(), Config{Node: "n1", Registry: reg, Logger: zerolog.New(zerolog.NewTestWriter(t))})
	if err != nil {
		t.Fatal(err)
	}
	var aborted [3]atomic.Int32
	from := netip.MustParseAddr("198.18.9.9")
	for i, port := range []uint16{7666, 8080} {
		az, err := p.authorize(snap, snap.WorkloadByName("default", "server").Identity, from, netip.AddrPortFrom(server12, port))
		if err != nil {
			t.Fatalf("port %d denied before any policy: %v", port, err)
		}
		p.open.track(az, netip.Addr{}, nil, func() { aborted[i].Add(1) })
	}
	p.open.track(nil, netip.Addr{}, nil, func() { aborted[2].Add(1) }) // passthrough
	if got := p.Reauthorize(); got != 0 {
		t.Fatalf("Reauthorize with unchanged policies closed %d", got)
	}

	deny, err := policy.New(policy.Policy{Name: "no-7666", Namespace: "default", Action: policy.Deny,
		Rules: []policy.Rule{{To: []policy.Operation{{Ports: []uint16{7666}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	snap2, err := registry.Build(registry.Model{TrustDomain: testTD, Workloads: ws, Policies: []*policy.Policy{deny}})
	if err != nil {
		t.Fatal(err)
	}
	reg.Store(snap2)
	if got := p.Reauthorize(); got != 1 {
		t.Errorf("Reauthorize after denying port 7666 closed %d connections, want 1", got)
	}
	if a, b, c := aborted[0].Load(), aborted[1].Load(), aborted[2].Load(); a != 1 || b != 0 || c != 0 {
		t.Errorf("aborted: port 7666 %d, port 8080 %d, passthrough %d; want 1, 0, 0", a, b, c)
	}
}

// TestDrain: Drain refuses new connections, waits for the open ones to
// finish and returns 0 when they do; the ones still open when its
// context ends are aborted and counted.
func TestDrain(t *testing.T) {
	snap, err := registry.NewSnapshot(testTD, nil)
	if err != nil {
		t.Fatal(err)
	}
	p, err := New(context.Background(), Config{Node: "n1", Registry: registry.New(snap)})
	if err != nil {
		t.Fatal(err)
	}
	// Two connections that finish by themselves.
	a := p.open.track(nil, netip.Addr{}, nil, func() { t.Error("a connection that finished was aborted") })
	b := p.open.track(nil, netip.Addr{}, nil, func() { t.Error("a connection that finished was aborted") })
	done := make(chan int, 1)
	go func() { done <- p.Drain(context.Background()) }()
	p.open.remove(a)
	select {
	case n := <-done:
		t.Fatalf("Drain returned %d with a connection still open", n)
	case <-time.After(50 * time.Millisecond):
	}
	if p.Open() != 1 || !p.draining.Load() {
		t.Fatalf("while draining: %d open, draining %v; want 1, true", p.Open(), p.draining.Load())
	}
	p.open.remove(b)
	select {
	case n := <-done:
		if n != 0 {
			t.Errorf("Drain reset %d connections, want 0: all finished", n)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Drain did not return after the last connection finished")
	}

	// One that does not finish: aborted when the drain period ends.
	var aborted atomic.Int32
	c := p.open.track(nil, netip.Addr{}, nil, func() { aborted.Add(1) })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if n := p.Drain(ctx); n != 1 || aborted.Load() != 1 {
		t.Errorf("Drain past its deadline reset %d connections (aborted %d), want 1", n, aborted.Load())
	}
	p.open.remove(c)
}
