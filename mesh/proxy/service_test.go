package proxy

import (
	"context"
	"fmt"
	"strings"

	"gvisor.dev/gvisor/pkg/tcpip/header"
	"net/netip"
	"testing"

	"github.com/meshtun/meshtun/mesh/registry"
)

// TestServiceTargetPassthrough: a connection to a service VIP goes to a
// chosen endpoint and is refused without one, but a PASSTHROUGH service
// (Istio's mode: no endpoint selection) sends it to the original
// destination, as ztunnel does, endpoints or not.
func TestServiceTargetPassthrough(t *testing.T) {
	web := &registry.Workload{Name: "web", Namespace: "default", Node: "n2", InMesh: true,
		Addresses: []netip.Addr{netip.MustParseAddr("198.18.2.20")}, Labels: map[string]string{"app": "web"}}
	vip := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	snap, err := registry.Build(registry.Model{TrustDomain: testTD, Workloads: []*registry.Workload{web},
		Services: []*registry.Service{
			{Name: "web", Namespace: "default", VIPs: []netip.Addr{vip("198.19.0.1")},
				Ports: []registry.ServicePort{{Port: 80, TargetPort: 8080}}, Selector: map[string]string{"app": "web"}},
			{Name: "empty", Namespace: "default", VIPs: []netip.Addr{vip("198.19.0.2")},
				Ports: []registry.ServicePort{{Port: 80}}},
			{Name: "external", Namespace: "default", VIPs: []netip.Addr{vip("198.19.0.3")},
				Ports: []registry.ServicePort{{Port: 443}}, Passthrough: true},
			{Name: "external-sel", Namespace: "default", VIPs: []netip.Addr{vip("198.19.0.4")},
				Ports: []registry.ServicePort{{Port: 80, TargetPort: 8080}}, Selector: map[string]string{"app": "web"}, Passthrough: true},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		dst    string
		ok     bool
		target string
		to     string // the workload's namespace/name
	}{
		{"198.19.0.1:80", true, "198.18.2.20:8080", "default/web"},
		{"198.19.0.2:80", false, "", ""},
		{"198.19.0.3:443", true, "198.19.0.3:443", ""},
		{"198.19.0.4:80", true, "198.19.0.4:80", ""},
		{"198.18.2.20:8080", true, "198.18.2.20:8080", "default/web"},
	} {
		orig := netip.MustParseAddrPort(c.dst)
		client := &registry.Workload{Name: "client", Namespace: "default", Node: "n1"}
		_, target, w, err := serviceTarget(snap, orig, client, snap.Workload(orig.Addr()))
		ok := err == nil
		to := ""
		if w != nil {
			to = w.String()
		}
		if ok != c.ok || ok && (target.String() != c.target || to != c.to) {
			t.Errorf("%s: target %s workload %v ok %v, want %s %v %v", c.dst, target, to, ok, c.target, c.to, c.ok)
		}
	}
}

// TestServiceLoadBalancingOnStack: through the proxy, a local client's
// connections to a service's VIP go where istiod's load balancing says:
// STRICT on NODE (internalTrafficPolicy: Local) to the endpoint on the
// client's node, and reset without one there (response_flags UH);
// FAILOVER by zone to the client's zone; where ServiceEntries of two
// namespaces share a VIP, to the endpoint of the client's namespace's; an
// endpoint known only by a DNS name is resolved on demand, and reset
// (response_flags DF, the hostname in the error, nothing dialled) when it
// does not resolve or resolves to a service VIP; an address in a
// service's VIP range goes to its endpoint.
func TestServiceLoadBalancingOnStack(t *testing.T) {
	remote := &registry.Workload{Name: "remote", Namespace: "default", Node: "n2", InMesh: true,
		Addresses: []netip.Addr{netip.MustParseAddr("198.18.2.30")}, Labels: map[string]string{"app": "web"},
		Locality: registry.Locality{Region: "r", Zone: "z2"}}
	local := &registry.Workload{Name: "local-web", Namespace: "default", Node: "n1", InMesh: true,
		Addresses: []netip.Addr{netip.MustParseAddr("198.18.1.30")}, Labels: map[string]string{"app": "web"},
		Locality: registry.Locality{Region: "r", Zone: "z1"}}
	other := &registry.Workload{Name: "other-ns", Namespace: "other", Node: "n1", InMesh: true,
		Addresses: []netip.Addr{netip.MustParseAddr("198.18.1.31")}}
	ext := &registry.Workload{Name: "ext", Namespace: "default", Hostname: "db.example.com"}
	extMesh := &registry.Workload{Name: "ext-mesh", Namespace: "default", Hostname: "mesh.example.com"} // TCP, as ServiceEntries are
	extVIP := &registry.Workload{Name: "ext-vip", Namespace: "default", Hostname: "vip.example.com"}
	extFail := &registry.Workload{Name: "ext-fail", Namespace: "default", Hostname: "nx.example.com"}
	e := newStackEnv(t, remote, local, other, ext, extMesh, extVIP, extFail)
	// The DNS: an external address, a local mesh pod's, a service VIP's;
	// nx.example.com does not exist.
	e.p.cfg.LookupHost = func(_ context.Context, host string) ([]netip.Addr, error) {
		switch host {
		case "db.example.com":
			return []netip.Addr{netip.MustParseAddr("2001:db8::5"), netip.MustParseAddr("203.0.113.5")}, nil
		case "mesh.example.com":
			return []netip.Addr{netip.MustParseAddr("198.18.2.30")}, nil
		case "vip.example.com":
			return []netip.Addr{netip.MustParseAddr("198.19.0.1")}, nil
		}
		return nil, fmt.Errorf("lookup %s: no such host", host)
	}
	snap := e.p.cfg.Registry.Load()
	vip := func(s string) []netip.Addr { return []netip.Addr{netip.MustParseAddr(s)} }
	m := registry.Model{TrustDomain: testTD, Workloads: snap.Workloads, Services: []*registry.Service{
		{Name: "local-only", Namespace: "default", VIPs: vip("198.19.0.1"), Ports: []registry.ServicePort{{Port: 80, TargetPort: 8080}},
			Workloads: []registry.WorkloadRef{{Namespace: "default", Name: "remote"}, {Namespace: "default", Name: "local-web"}},
			LB:        registry.LoadBalancing{Mode: registry.LBStrict, Scopes: []registry.Scope{registry.ScopeNode}}},
		{Name: "remote-only", Namespace: "default", VIPs: vip("198.19.0.2"), Ports: []registry.ServicePort{{Port: 80, TargetPort: 8080}},
			Workloads: []registry.WorkloadRef{{Namespace: "default", Name: "remote"}},
			LB:        registry.LoadBalancing{Mode: registry.LBStrict, Scopes: []registry.Scope{registry.ScopeNode}}},
		{Name: "close", Namespace: "default", VIPs: vip("198.19.0.3"), Ports: []registry.ServicePort{{Port: 80, TargetPort: 8080}},
			Workloads: []registry.WorkloadRef{{Namespace: "default", Name: "remote"}, {Namespace: "default", Name: "local-web"}},
			LB: registry.LoadBalancing{Mode: registry.LBFailover,
				Scopes: []registry.Scope{registry.ScopeNetwork, registry.ScopeRegion, registry.ScopeZone}}},
		{Name: "se", Namespace: "other", Hostname: "shared.example.com", VIPs: vip("198.19.0.4"), Ports: []registry.ServicePort{{Port: 80, TargetPort: 8080}},
			Workloads: []registry.WorkloadRef{{Namespace: "other", Name: "other-ns"}}},
		{Name: "se", Namespace: "default", Hostname: "shared.example.com", VIPs: vip("198.19.0.4"), Ports: []registry.ServicePort{{Port: 80, TargetPort: 8080}},
			Workloads: []registry.WorkloadRef{{Namespace: "default", Name: "local-web"}}},
		{Name: "range", Namespace: "default", CIDRs: []netip.Prefix{netip.MustParsePrefix("198.19.8.0/24")},
			Ports: []registry.ServicePort{{Port: 80, TargetPort: 8080}}, Workloads: []registry.WorkloadRef{{Namespace: "default", Name: "local-web"}}},
		{Name: "dns", Namespace: "default", Hostname: "db.example.com", VIPs: vip("198.19.0.5"), Ports: []registry.ServicePort{{Port: 5432}},
			Workloads: []registry.WorkloadRef{{Namespace: "default", Name: "ext"}}},
		{Name: "dns-mesh", Namespace: "default", Hostname: "mesh.example.com", VIPs: vip("198.19.0.6"), Ports: []registry.ServicePort{{Port: 80, TargetPort: 8080}},
			Workloads: []registry.WorkloadRef{{Namespace: "default", Name: "ext-mesh"}}},
		{Name: "dns-vip", Namespace: "default", Hostname: "vip.example.com", VIPs: vip("198.19.0.7"), Ports: []registry.ServicePort{{Port: 80}},
			Workloads: []registry.WorkloadRef{{Namespace: "default", Name: "ext-vip"}}},
		{Name: "dns-fail", Namespace: "default", Hostname: "nx.example.com", VIPs: vip("198.19.0.8"), Ports: []registry.ServicePort{{Port: 80}},
			Workloads: []registry.WorkloadRef{{Namespace: "default", Name: "ext-fail"}}},
	}}
	// The client's locality: zone z1 (local-web's).
	for i, w := range m.Workloads {
		if w.Name == "client" {
			c := *w
			c.Locality = registry.Locality{Region: "r", Zone: "z1"}
			m.Workloads[i] = &c
		}
	}
	snap, err := registry.Build(m)
	if err != nil {
		t.Fatal(err)
	}
	e.p.cfg.Registry.Store(snap)
	port := uint16(42000)
	for _, c := range []struct {
		what, vip string
		dial      string // the address dialled, or "" for a reset
		flags     string
		errHas    string
	}{
		{"STRICT node: the local endpoint", "198.19.0.1:80", "198.18.1.30:8080", "", ""},
		{"STRICT node: none on this node", "198.19.0.2:80", "", "UH", "no healthy endpoint"},
		{"FAILOVER zone: the client's zone", "198.19.0.3:80", "198.18.1.30:8080", "", ""},
		{"shared VIP: the client's namespace's", "198.19.0.4:80", "198.18.1.30:8080", "", ""},
		{"VIP range", "198.19.8.77:80", "198.18.1.30:8080", "", ""},
		// ServiceEntries of resolution DNS: resolved on demand, an
		// address of the VIP's family.
		{"DNS endpoint: plaintext to its address", "198.19.0.5:5432", "203.0.113.5:5432", "", ""},
		// Never plaintext to a mesh pod: HBONE (whose TLS the test
		// refuses, so the connection is reset after the attempt).
		{"DNS endpoint: a remote mesh pod's address, over HBONE", "198.19.0.6:80", "", "CONNECT", "test: no TLS"},
		{"DNS endpoint resolving to a VIP", "198.19.0.7:80", "", "DF", `resolves to 198.19.0.1, a VIP of service default/local-only`},
		{"DNS endpoint not resolved", "198.19.0.8:80", "", "DF", `DNS lookup of "nx.example.com"`},
	} {
		for range 5 { // several picks: a random choice would show
			port++
			from := netip.AddrPortFrom(client11, port)
			to := netip.MustParseAddrPort(c.vip)
			e.send(t, syn(from, to))
			s, ok := e.dev.next(t, func(s segment) bool {
				return s.dst == from || s.flags == header.TCPFlagSyn && s.dst != from
			})
			switch {
			case !ok:
				t.Fatalf("%s: no answer to the SYN", c.what)
			case c.dial != "" && s.dst.String() != c.dial:
				t.Fatalf("%s: got %v to %s, want a SYN to %s", c.what, s.flags, s.dst, c.dial)
			case c.dial == "" && (s.dst != from || !s.flags.Contains(header.TCPFlagRst)):
				t.Fatalf("%s: got %v to %s, want a reset to the client", c.what, s.flags, s.dst)
			}
			if c.dial != "" {
				continue
			}
			rec := e.access.WaitLine(t, func(l map[string]any) bool { return l["src.addr"] == from.String() })
			if c.flags == "CONNECT" && (rec["route"] != "hbone" || rec["dst.hbone_addr"] != "198.18.2.30:15008") {
				t.Fatalf("%s: access log %v, want route hbone to 198.18.2.30:15008", c.what, rec)
			}
			if err, _ := rec["error"].(string); rec["response_flags"] != c.flags || !strings.Contains(err, c.errHas) {
				t.Fatalf("%s: access log %v, want response_flags %s and an error with %q", c.what, rec, c.flags, c.errHas)
			}
		}
	}
}
