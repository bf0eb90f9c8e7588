package proxy

import (
	"bytes"
	"context"
	"errors"
	"net/netip"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/metrics"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/stack"
)

// blackholeDialer never connects: like a workload whose firewall drops
// the SYN. It returns when ctx ends.
type blackholeDialer struct{ deadline chan bool }

func (d *blackholeDialer) DialTCP(ctx context.Context, _, _ netip.AddrPort) (*stack.Conn, error) {
	_, ok := ctx.Deadline()
	d.deadline <- ok
	<-ctx.Done()
	return nil, ctx.Err()
}

// refusingDialer refuses every connection at once.
type refusingDialer struct{}

func (refusingDialer) DialTCP(context.Context, netip.AddrPort, netip.AddrPort) (*stack.Conn, error) {
	return nil, syscall.ECONNREFUSED
}

// lockedBuffer is a log sink shared by goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.String()
}

var testTD = spiffeid.RequireTrustDomainFromString("cluster.local")

// inboundProxy is a proxy of node n1 with one local workload, web at
// 198.18.1.20, a client workload at 198.18.2.10 and a service web (VIP
// 198.18.100.1, port 80 to 8080), counting Istio's metrics.
func inboundProxy(t *testing.T, d Dialer, timeout time.Duration) (*Proxy, *lockedBuffer) {
	t.Helper()
	snap, err := registry.Build(registry.Model{TrustDomain: testTD,
		Workloads: []*registry.Workload{
			{Name: "web", Namespace: "default", Node: "n1", InMesh: true, Addresses: []netip.Addr{netip.MustParseAddr("198.18.1.20")}, Labels: map[string]string{"app": "web"}},
			{Name: "client", Namespace: "default", ServiceAccount: "client", Node: "n2", InMesh: true, Addresses: []netip.Addr{netip.MustParseAddr("198.18.2.10")}},
		},
		Services: []*registry.Service{{Name: "web", Namespace: "default", VIPs: []netip.Addr{netip.MustParseAddr("198.18.100.1")},
			Ports: []registry.ServicePort{{Port: 80, TargetPort: 8080}}, Selector: map[string]string{"app": "web"}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	log := &lockedBuffer{}
	p, err := New(context.Background(), Config{Node: "n1", Registry: registry.New(snap), ConnectTimeout: timeout,
		Metrics: metrics.New(), Logger: zerolog.New(log), AccessLog: zerolog.New(log), Netstack: d})
	if err != nil {
		t.Fatal(err)
	}
	return p, log
}

func inboundRequest(host string) *hbone.Request {
	return &hbone.Request{
		Target:    netip.MustParseAddrPort("198.18.1.20:8080"),
		Peer:      spiffeid.RequireFromSegments(testTD, "ns", "default", "sa", "client"),
		PeerAddr:  netip.MustParseAddrPort("198.18.2.10:40000"),
		LocalAddr: netip.MustParseAddrPort("198.18.1.20:15008"),
		Forwarded: hbone.Forwarded{For: netip.MustParseAddrPort("198.18.2.10:40000"), Host: host},
	}
}

// TestInboundConnectTimeout: the spoofed dial to a local workload that
// never answers ends after ConnectTimeout with 503, even when the HBONE
// stream's context has no deadline.
func TestInboundConnectTimeout(t *testing.T) {
	d := &blackholeDialer{deadline: make(chan bool, 2)}
	p, _ := inboundProxy(t, d, 200*time.Millisecond)
	done := make(chan error, 1)
	go func() {
		_, err := p.connect(context.Background(), inboundRequest(""))
		done <- err
	}()
	select {
	case err := <-done:
		if !errors.Is(err, hbone.ErrUnreachable) || !errors.Is(err, context.DeadlineExceeded) {
			t.Errorf("connect: %v, want ErrUnreachable after the connect timeout", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("connect still dialling after 5 s with a 200 ms connect timeout")
	}
	if !<-d.deadline {
		t.Error("the dial had no deadline")
	}
}

// TestForwardedHostLabel: the forwarded host a peer sends reaches the log
// (and the dst.service metric label) only when it is a known service's
// hostname; any other value is "unknown".
func TestForwardedHostLabel(t *testing.T) {
	p, log := inboundProxy(t, refusingDialer{}, 0)
	for _, tc := range []struct{ host, want string }{
		{"web.default.svc.cluster.local", `"dst.service":"web.default.svc.cluster.local"`},
		{"attacker-" + strings.Repeat("x", 200) + ".example", `"dst.service":"unknown"`},
	} {
		if _, err := p.connect(context.Background(), inboundRequest(tc.host)); err == nil {
			t.Fatal("connect succeeded through a dialer that never connects")
		}
		out := log.String()
		if !strings.Contains(out, tc.want) || strings.Contains(out, "attacker-") {
			t.Errorf("forwarded host %.20q…: log %s, want %s and no attacker value", tc.host, out, tc.want)
		}
	}
	if got := serviceName(p.cfg.Registry.Load(), ""); got != "" {
		t.Errorf("serviceName of no host = %q, want empty", got)
	}
}

// TestReauthorizeStrict: an open plaintext connection the proxy relays is
// reset when a reload makes its destination, or only its port, STRICT;
// one to another port stays.
func TestReauthorizeStrict(t *testing.T) {
	build := func(mode registry.PeerAuth, ports map[uint16]registry.PeerAuth) *registry.Snapshot {
		snap, err := registry.Build(registry.Model{TrustDomain: testTD, Workloads: []*registry.Workload{
			{Name: "web", Namespace: "default", Node: "n1", InMesh: true, PeerAuth: mode, PortPeerAuth: ports,
				Addresses: []netip.Addr{netip.MustParseAddr("198.18.1.20")}},
		}})
		if err != nil {
			t.Fatal(err)
		}
		return snap
	}
	for _, tc := range []struct {
		name     string
		snap     *registry.Snapshot
		reset80  bool
		reset443 bool
	}{
		{"workload STRICT", build(registry.Strict, nil), true, true},
		{"port 80 STRICT", build(registry.Permissive, map[uint16]registry.PeerAuth{80: registry.Strict}), true, false},
		{"still PERMISSIVE", build(registry.Permissive, nil), false, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			reg := registry.New(build(registry.Permissive, nil))
			p, err := New(context.Background(), Config{Node: "n1", Registry: reg, Logger: zerolog.Nop()})
			if err != nil {
				t.Fatal(err)
			}
			var reset80, reset443 bool
			for _, port := range []uint16{80, 443} {
				reset := &reset80
				if port == 443 {
					reset = &reset443
				}
				az, err := p.authorize(reg.Load(), spiffeid.ID{}, netip.MustParseAddr("198.18.9.9"), netip.AddrPortFrom(netip.MustParseAddr("198.18.1.20"), port))
				if err != nil {
					t.Fatalf("plaintext to a PERMISSIVE workload: %v", err)
				}
				p.open.track(az, netip.Addr{}, nil, func() { *reset = true })
			}
			reg.Store(tc.snap)
			p.Reauthorize()
			if reset80 != tc.reset80 || reset443 != tc.reset443 {
				t.Errorf("reset: port 80 %v, port 443 %v; want %v, %v", reset80, reset443, tc.reset80, tc.reset443)
			}
		})
	}
}
