package gate

import (
	"context"
	"net"
	"net/netip"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/cni"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/test/fixture"
)

type pods struct {
	mu       sync.Mutex
	m        map[string]Pod
	rebuilds chan struct{}
}

func (p *pods) Pod(ns, name string) (Pod, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	x, ok := p.m[ns+"/"+name]
	return x, ok
}
func (p *pods) Rebuild() {
	select {
	case p.rebuilds <- struct{}{}:
	default:
	}
}
func (p *pods) Exempt() []string { return []string{"plain"} }

func (p *pods) set(key string, x Pod) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.m[key] = x
}

func serve(t *testing.T, cfg Config) (*Gate, *pods) {
	t.Helper()
	ps := &pods{m: map[string]Pod{}, rebuilds: make(chan struct{}, 1)}
	cfg.Pods, cfg.Logger = ps, zerolog.New(zerolog.NewTestWriter(t))
	cfg.Socket = filepath.Join(t.TempDir(), "cni.sock")
	g := New(cfg)
	l, err := g.Listen()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { g.ServeListener(ctx, l); close(done) }()
	t.Cleanup(func() { cancel(); <-done })
	return g, ps
}

func ask(t *testing.T, g *Gate, req cni.Request) *cni.Response {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	resp, err := cni.Ask(ctx, g.cfg.Socket, &req)
	if err != nil {
		t.Fatal(err)
	}
	return resp
}

func addReq(name, container string, addr string) cni.Request {
	return cni.Request{Command: cni.CommandAdd, ContainerID: container, Namespace: "mesh", Name: name,
		Addresses: []netip.Addr{netip.MustParseAddr(addr)}}
}

// TestPendingBound: the gate holds at most MaxPending announcements; one
// more pod is refused, not announced.
func TestPendingBound(t *testing.T) {
	fixture.RequireRoot(t, "the gate answers only root peers: the plugin runs as root")
	g, ps := serve(t, Config{Node: "n1", MaxPending: 2, Timeout: 200 * time.Millisecond})
	for _, n := range []string{"a", "b", "c"} {
		ps.set("mesh/"+n, Pod{UID: n, Node: "n1", InMesh: true})
	}
	// a and b are announced and captured; the API server never shows
	// them, so their announcements stay.
	for i, n := range []string{"a", "b"} {
		addr := netip.AddrFrom4([4]byte{10, 0, 0, byte(i + 1)})
		go func() {
			<-ps.rebuilds
			g.Captured([]*registry.Workload{{Namespace: "mesh", Name: n, Addresses: []netip.Addr{addr}}})
		}()
		if r := ask(t, g, addReq(n, "s-"+n, addr.String())); r.Verdict != cni.Captured {
			t.Fatalf("ADD %s: %+v", n, r)
		}
	}
	if g.Pending() != 2 {
		t.Fatalf("pending %d, want 2", g.Pending())
	}
	r := ask(t, g, addReq("c", "s-c", "10.0.0.3"))
	if r.Verdict != cni.Refused || g.Pending() != 2 {
		t.Errorf("third ADD: %+v, pending %d; want refused with 2 held", r, g.Pending())
	}
}

// TestExpire: an announcement goes when the pod runs with its IPs in its
// status (the model took over), when the pod is replaced or gone, and
// with its own sandbox's DEL only.
func TestExpire(t *testing.T) {
	fixture.RequireRoot(t, "the gate answers only root peers: the plugin runs as root")
	g, ps := serve(t, Config{Node: "n1", Timeout: time.Second})
	ps.set("mesh/a", Pod{UID: "u1", Node: "n1", InMesh: true})
	addr := netip.MustParseAddr("10.0.0.1")
	go func() {
		<-ps.rebuilds
		g.Captured([]*registry.Workload{{Namespace: "mesh", Name: "a", Addresses: []netip.Addr{addr}}})
	}()
	if r := ask(t, g, addReq("a", "s1", "10.0.0.1")); r.Verdict != cni.Captured {
		t.Fatalf("ADD: %+v", r)
	}
	// A DEL of another sandbox of the pod leaves it.
	ask(t, g, cni.Request{Command: cni.CommandDel, ContainerID: "s0", Namespace: "mesh", Name: "a"})
	if got := g.Announced("mesh", "a", "u1"); len(got) != 1 {
		t.Fatalf("announcement after another sandbox's DEL: %v", got)
	}
	// Pending with IPs (init containers): kept.
	ps.set("mesh/a", Pod{UID: "u1", Node: "n1", InMesh: true, Addresses: []netip.Addr{addr}})
	g.Captured(nil)
	if g.Pending() != 1 {
		t.Fatal("announcement dropped while the pod is pending")
	}
	// Running with its IPs: the model has it.
	ps.set("mesh/a", Pod{UID: "u1", Node: "n1", InMesh: true, Running: true, Addresses: []netip.Addr{addr}})
	g.Captured(nil)
	if g.Pending() != 0 {
		t.Error("announcement kept after the pod ran with its IPs")
	}
}

// TestPeerAndBadRequest: a malformed or oversized request is refused with
// a reason, and the connection limit refuses more at once.
func TestPeerAndBadRequest(t *testing.T) {
	g, _ := serve(t, Config{Node: "n1", MaxConns: 1, Timeout: 200 * time.Millisecond})
	c, err := net.Dial("unix", g.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	// The first connection holds the only slot while it sends nothing.
	c2, err := net.Dial("unix", g.cfg.Socket)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	var resp cni.Response
	if err := cni.ReadMessage(c2, &resp); err != nil || resp.Verdict != cni.Refused {
		t.Errorf("second connection: %+v, %v; want refused (busy)", resp, err)
	}
	c.Write(append(make([]byte, cni.MaxMessage+10), '\n'))
	if err := cni.ReadMessage(c, &resp); err != nil || resp.Verdict != cni.Refused {
		t.Errorf("oversized request: %+v, %v; want refused", resp, err)
	}
}
