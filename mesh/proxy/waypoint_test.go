package proxy

import (
	"crypto/tls"
	"errors"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
)

// TestOutboundViaWaypoint: through the proxy, a local client's connection
// to a service with a waypoint, or to the address of a workload with one,
// goes over HBONE to the waypoint's workload (port 15008), with the
// waypoint's identity required of the peer, never to the destination; a
// waypoint that cannot be resolved resets the client (response_flags UH,
// the waypoint and the reason in the access log) and nothing is dialled;
// a connection from the waypoint itself goes to the destination.
func TestOutboundViaWaypoint(t *testing.T) {
	a := netip.MustParseAddr
	wpPod := &registry.Workload{Name: "wp", Namespace: "infra", ServiceAccount: "waypoint", Node: "n2", InMesh: true,
		Addresses: []netip.Addr{a("198.18.2.5")}, Labels: map[string]string{"gateway": "wp"}}
	wpLocal := &registry.Workload{Name: "wp-local", Namespace: "infra", ServiceAccount: "waypoint", Node: "n1", InMesh: true,
		Addresses: []netip.Addr{a("198.18.1.5")}}
	server := &registry.Workload{Name: "web", Namespace: "default", Node: "n2", InMesh: true,
		Addresses: []netip.Addr{a("198.18.2.20")}, Labels: map[string]string{"app": "web"},
		Waypoint: &registry.Waypoint{Addr: a("198.18.2.5"), Port: 15008}}
	lost := &registry.Workload{Name: "lost", Namespace: "default", Node: "n2", InMesh: true,
		Addresses: []netip.Addr{a("198.18.2.21")}, Waypoint: &registry.Waypoint{Addr: a("198.18.9.9"), Port: 15008}}
	local := &registry.Workload{Name: "local", Namespace: "default", Node: "n2", InMesh: true,
		Addresses: []netip.Addr{a("198.18.2.22")}, Waypoint: &registry.Waypoint{Addr: a("198.18.1.5"), Port: 15008}}
	plain := &registry.Workload{Name: "plain", Namespace: "default", Node: "n2", InMesh: true, Addresses: []netip.Addr{a("198.18.2.23")}}
	e := newStackEnv(t, wpPod, wpLocal, server, lost, local, plain)

	// The HBONE client records whom it is asked to verify, and goes no
	// further (no TLS): the record says where it went.
	var mu sync.Mutex
	var peers []spiffeid.ID
	hc, err := hbone.NewClient(hbone.ClientConfig{TLS: func(_, dst spiffeid.ID) (*tls.Config, error) {
		mu.Lock()
		defer mu.Unlock()
		peers = append(peers, dst)
		return nil, errors.New("test: no TLS")
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { hc.Close() })
	e.p.cfg.HBONE = hc
	lastPeer := func() string {
		mu.Lock()
		defer mu.Unlock()
		if len(peers) == 0 {
			return ""
		}
		return peers[len(peers)-1].String()
	}

	vip := func(s string) []netip.Addr { return []netip.Addr{a(s)} }
	ports := []registry.ServicePort{{Port: 80, TargetPort: 8080}}
	byHost := &registry.Waypoint{Hostname: "wp.infra.svc.cluster.local", Namespace: "infra", Port: 15008}
	snap := e.p.cfg.Registry.Load()
	snap, err = registry.Build(registry.Model{TrustDomain: testTD, Workloads: snap.Workloads, Services: []*registry.Service{
		{Name: "wp", Namespace: "infra", VIPs: vip("198.19.0.50"), Ports: []registry.ServicePort{{Port: 15008}},
			Selector: map[string]string{"gateway": "wp"}},
		{Name: "web", Namespace: "default", VIPs: vip("198.19.0.1"), Ports: ports, Selector: map[string]string{"app": "web"}, Waypoint: byHost},
		{Name: "web-vip", Namespace: "default", VIPs: vip("198.19.0.2"), Ports: ports, Selector: map[string]string{"app": "web"},
			Waypoint: &registry.Waypoint{Addr: a("198.19.0.50"), Port: 15008}},
		{Name: "web-nx", Namespace: "default", VIPs: vip("198.19.0.3"), Ports: ports, Selector: map[string]string{"app": "web"},
			Waypoint: &registry.Waypoint{Hostname: "nx.infra.svc.cluster.local", Namespace: "infra"}},
		{Name: "web-zero", Namespace: "default", VIPs: vip("198.19.0.4"), Ports: ports, Selector: map[string]string{"app": "web"},
			WeightedWaypoints: []registry.WeightedWaypoint{{Waypoint: *byHost, Weight: 0}}},
		{Name: "plain", Namespace: "default", VIPs: vip("198.19.0.5"), Ports: ports, Workloads: []registry.WorkloadRef{{Namespace: "default", Name: "plain"}},
			Waypoint: &registry.Waypoint{Addr: a("198.18.1.5"), Port: 15008}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	e.p.cfg.Registry.Store(snap)

	const wpID = "spiffe://cluster.local/ns/infra/sa/waypoint"
	port := uint16(43000)
	for _, c := range []struct {
		what      string
		from, dst string
		route     string // "" for a refusal
		hboneAddr string
		peer      string
		errHas    string
	}{
		{"service, waypoint by hostname", "198.18.1.11", "198.19.0.1:80", "waypoint", "198.18.2.5:15008", wpID, ""},
		{"service, waypoint by the waypoint service's VIP", "198.18.1.11", "198.19.0.2:80", "waypoint", "198.18.2.5:15008", wpID, ""},
		{"service, a port it does not have", "198.18.1.11", "198.19.0.1:9999", "waypoint", "198.18.2.5:15008", wpID, ""},
		{"workload, waypoint by address", "198.18.1.11", "198.18.2.20:8080", "waypoint", "198.18.2.5:15008", wpID, ""},
		{"no such waypoint service", "198.18.1.11", "198.19.0.3:80", "", "", "", "waypoint infra/nx.infra.svc.cluster.local:15008: no service"},
		{"weighted waypoints all of weight 0", "198.18.1.11", "198.19.0.4:80", "", "", "", "no waypoint to use"},
		{"no such waypoint address", "198.18.1.11", "198.18.2.21:8080", "", "", "", "waypoint 198.18.9.9:15008: no workload or service has address 198.18.9.9"},
		// The waypoint itself sends on to the destination directly.
		{"workload, from its waypoint", "198.18.1.5", "198.18.2.22:8080", "hbone", "198.18.2.22:15008", "spiffe://cluster.local/ns/default/sa/default", ""},
		{"service, from its waypoint", "198.18.1.5", "198.19.0.5:80", "hbone", "198.18.2.23:15008", "spiffe://cluster.local/ns/default/sa/default", ""},
		// Another client of the same destination goes through it (the
		// waypoint is on this node: over HBONE all the same).
		{"workload, from another client", "198.18.1.11", "198.18.2.22:8080", "waypoint", "198.18.1.5:15008", wpID, ""},
	} {
		port++
		from := netip.AddrPortFrom(a(c.from), port)
		to := netip.MustParseAddrPort(c.dst)
		e.send(t, syn(from, to))
		// Every case ends in a reset of the client: a refusal, or the
		// HBONE dial this test's client cannot complete. Nothing is
		// ever dialled in plaintext.
		s, ok := e.dev.next(t, func(s segment) bool { return s.dst == from || s.flags == header.TCPFlagSyn && s.dst != from })
		switch {
		case !ok:
			t.Fatalf("%s: no answer to the SYN", c.what)
		case s.dst != from || !s.flags.Contains(header.TCPFlagRst):
			t.Fatalf("%s: got %v to %s, want a reset to the client", c.what, s.flags, s.dst)
		}
		rec := e.access.WaitLine(t, func(l map[string]any) bool { return l["src.addr"] == from.String() })
		errText, _ := rec["error"].(string)
		if c.route == "" {
			if rec["response_flags"] != "UH" || !strings.Contains(errText, c.errHas) || rec["route"] != "waypoint" {
				t.Errorf("%s: access log %v, want route waypoint, response_flags UH and an error with %q", c.what, rec, c.errHas)
			}
			continue
		}
		if rec["route"] != c.route || rec["dst.hbone_addr"] != c.hboneAddr || !strings.Contains(errText, "test: no TLS") {
			t.Errorf("%s: access log %v, want route %s to %s", c.what, rec, c.route, c.hboneAddr)
		}
		if got := lastPeer(); got != c.peer {
			t.Errorf("%s: the HBONE peer to verify is %q, want %q", c.what, got, c.peer)
		}
	}
	// The three unresolved waypoints are counted as failed connections.
	fams, err := e.p.cfg.Metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var failedUH float64
	for _, f := range fams {
		if f.GetName() != "istio_tcp_connections_failed_total" {
			continue
		}
		for _, mt := range f.GetMetric() {
			for _, l := range mt.GetLabel() {
				if l.GetName() == "response_flags" && l.GetValue() == "UH" {
					failedUH += mt.GetCounter().GetValue()
				}
			}
		}
	}
	if failedUH != 3 {
		t.Errorf("istio_tcp_connections_failed_total{response_flags=UH} = %v, want 3", failedUH)
	}
}

// TestInboundFromWaypoint: HBONE from a workload's waypoint is inbound
// like any other, as in ztunnel: the node authorizes it by the waypoint's
// identity and address (the client's are the waypoint's business), and
// delivers it from the waypoint's address. The node does not require the
// waypoint: a client that connects directly is authorized by the same
// policies (istiod's, which can allow only the waypoint), not refused
// for bypassing it.
func TestInboundFromWaypoint(t *testing.T) {
	e := newInboundEnv(t)
	// d/pod (127.0.0.3, dialling from its own address) is b/server's
	// waypoint; b/server allows only the waypoint's identity.
	ws := append([]*registry.Workload(nil), e.snap.Workloads...)
	for i, w := range ws {
		if w.Name == "server" {
			c := *w
			c.Waypoint = &registry.Waypoint{Addr: podAddr, Port: 15008}
			ws[i] = &c
		}
	}
	allow, err := policy.New(policy.Policy{Name: "only-waypoint", Namespace: "b", Action: policy.Allow,
		Rules: []policy.Rule{{From: []policy.Source{{Principals: []string{strings.TrimPrefix(e.pod.String(), "spiffe://")}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	build := func(ps ...*policy.Policy) {
		snap, err := registry.Build(registry.Model{TrustDomain: testTD, Workloads: ws, Policies: ps})
		if err != nil {
			t.Fatal(err)
		}
		e.p.cfg.Registry.Store(snap)
	}
	build(allow)

	// From the waypoint: authorized, dialled from the waypoint's address.
	se := e.dialFrom(t, e.pod, podAddr, netip.AddrPortFrom(clientAddr, 40020))
	if se.Code != 503 {
		t.Errorf("CONNECT from the waypoint: %d, want 503 (allowed; the test's netstack refuses the dial)", se.Code)
	}
	if d := e.nextDial(t); d.src.Addr() != podAddr || d.dst != targetServer {
		t.Errorf("dialled %s -> %s, want from the waypoint's address %s to %s", d.src, d.dst, podAddr, targetServer)
	}
	if rec := e.lastRecord(t); rec["src.identity"] != e.pod.String() || rec["src.workload"] != "pod" {
		t.Errorf("access log %v, want the waypoint as the source", rec)
	}

	// Directly from the client: the policy denies it.
	se = e.dialFrom(t, e.client, netip.Addr{}, netip.AddrPort{})
	if se.Code != 401 && se.Code != 403 {
		t.Errorf("CONNECT from the client, bypassing the waypoint: %d, want a denial by policy", se.Code)
	}
	if rec := e.lastRecord(t); rec["response_flags"] != "DENY" || rec["src.identity"] != e.client.String() {
		t.Errorf("access log %v, want a denial (DENY) of the client", rec)
	}
	select {
	case d := <-e.dialer.calls:
		t.Errorf("the denied connection was dialled: %s -> %s", d.src, d.dst)
	default:
	}

	// Without that policy the node lets the client in: the waypoint is
	// not the node's to enforce (ztunnel's inbound does not either).
	build()
	if se := e.dialFrom(t, e.client, netip.Addr{}, netip.AddrPort{}); se.Code != 503 {
		t.Errorf("CONNECT from the client without a policy: %d, want 503 (allowed)", se.Code)
	}
	e.nextDial(t)
}
