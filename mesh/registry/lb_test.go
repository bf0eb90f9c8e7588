package registry

import (
	"net/netip"
	"strings"
	"testing"
)

// lbModel: endpoints of one service spread over two regions, three zones,
// subzones and nodes, with capacities; the client runs in region r1, zone
// z1, subzone s1, on node n1.
func lbModel(lb LoadBalancing, allowUnhealthy bool) Model {
	ep := func(name, region, zone, subzone, node string, capacity uint32, a string) *Workload {
		return &Workload{Name: name, Namespace: "d", Node: node, Addresses: addrs(a),
			Locality: Locality{Region: region, Zone: zone, Subzone: subzone}, Capacity: capacity,
			Labels: map[string]string{"app": "lb"}}
	}
	sick := ep("same-node-sick", "r1", "z1", "s1", "n1", 0, "10.0.0.9")
	sick.Health = Unhealthy
	return Model{
		TrustDomain: td,
		Workloads: []*Workload{
			{Name: "client", Namespace: "d", Node: "n1", Addresses: addrs("10.0.1.1"),
				Locality: Locality{Region: "r1", Zone: "z1", Subzone: "s1"}},
			sick,
			ep("same-zone-a", "r1", "z1", "s2", "n2", 0, "10.0.0.2"),
			ep("same-zone-b", "r1", "z1", "s2", "n3", 3, "10.0.0.3"),
			ep("same-region", "r1", "z2", "s1", "n4", 0, "10.0.0.4"),
			// Zone z1 of another region is not the client's zone.
			ep("other-region", "r2", "z1", "s1", "n5", 0, "10.0.0.5"),
		},
		Services: []*Service{{Name: "lb", Namespace: "d", VIPs: addrs("10.96.0.1"), Ports: []ServicePort{{Port: 80}},
			Selector: map[string]string{"app": "lb"}, LB: lb, AllowUnhealthy: allowUnhealthy}},
	}
}

// picks returns how often each endpoint is picked in n picks from the
// client (nil: no workload), and how often none is.
func picks(t *testing.T, m Model, from string, n int) (map[string]int, int) {
	t.Helper()
	s := mustBuild(t, m)
	svc := s.ServiceByName("d", "lb")
	var src *Workload
	if from != "" {
		src = s.WorkloadByName("d", from)
	}
	got, none := map[string]int{}, 0
	for range n {
		e, ok := svc.Pick(netip.MustParseAddr("10.96.0.1"), src)
		if !ok {
			none++
			continue
		}
		got[e.Workload.Name]++
	}
	return got, none
}

// within reports whether c is within 10% of want.
func within(c int, want float64) bool { return float64(c) >= 0.9*want && float64(c) <= 1.1*want }

func TestPickLoadBalancing(t *testing.T) {
	preferClose := LoadBalancing{Mode: LBFailover, Scopes: []Scope{ScopeNetwork, ScopeRegion, ScopeZone}}
	preferNode := LoadBalancing{Mode: LBFailover, Scopes: []Scope{ScopeNetwork, ScopeRegion, ScopeZone, ScopeSubzone, ScopeNode}}
	local := LoadBalancing{Mode: LBStrict, Scopes: []Scope{ScopeNode}}
	const n = 20000
	tests := []struct {
		name           string
		lb             LoadBalancing
		allowUnhealthy bool
		from           string
		// want: the endpoints picked and their expected shares (weights);
		// none: every pick fails.
		want map[string]float64
		none bool
	}{
		// Capacities: same-zone-b has 3, the others 1; unhealthy left out.
		{name: "any, weighted", lb: LoadBalancing{}, from: "client",
			want: map[string]float64{"same-zone-a": 1, "same-zone-b": 3, "same-region": 1, "other-region": 1}},
		{name: "any mode ignores scopes", lb: LoadBalancing{Scopes: []Scope{ScopeNode}}, from: "client",
			want: map[string]float64{"same-zone-a": 1, "same-zone-b": 3, "same-region": 1, "other-region": 1}},
		// PreferClose (PreferSameZone): the client's zone, weighted.
		{name: "failover zone", lb: preferClose, from: "client",
			want: map[string]float64{"same-zone-a": 1, "same-zone-b": 3}},
		// Subzone then node: the client's subzone has only the unhealthy
		// one, so the zone's endpoints (rank 3 of 5) are picked.
		{name: "failover node, node unhealthy", lb: preferNode, from: "client",
			want: map[string]float64{"same-zone-a": 1, "same-zone-b": 3}},
		{name: "failover node, allow all", lb: preferNode, allowUnhealthy: true, from: "client",
			want: map[string]float64{"same-node-sick": 1}},
		// From same-region (zone z2, subzone s1): zone z2 has only itself.
		{name: "failover from another zone", lb: preferClose, from: "same-region",
			want: map[string]float64{"same-region": 1}},
		// From a client that is no workload: empty locality matches none.
		{name: "failover, no client", lb: preferClose,
			want: map[string]float64{"same-zone-a": 1, "same-zone-b": 3, "same-region": 1, "other-region": 1}},
		// internalTrafficPolicy: Local.
		{name: "strict node, none healthy local", lb: local, from: "client", none: true},
		{name: "strict node, allow all", lb: local, allowUnhealthy: true, from: "client",
			want: map[string]float64{"same-node-sick": 1}},
		{name: "strict node from n3", lb: local, from: "same-zone-b", want: map[string]float64{"same-zone-b": 1}},
		{name: "strict zone", lb: LoadBalancing{Mode: LBStrict, Scopes: []Scope{ScopeRegion, ScopeZone}}, from: "client",
			want: map[string]float64{"same-zone-a": 1, "same-zone-b": 3}},
		{name: "strict, no client", lb: local, none: true},
		{name: "strict without scopes is any", lb: LoadBalancing{Mode: LBStrict}, from: "client",
			want: map[string]float64{"same-zone-a": 1, "same-zone-b": 3, "same-region": 1, "other-region": 1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, none := picks(t, lbModel(tt.lb, tt.allowUnhealthy), tt.from, n)
			if tt.none {
				if none != n {
					t.Fatalf("picked %v, want no endpoint", got)
				}
				return
			}
			if none > 0 {
				t.Fatalf("no endpoint %d times of %d", none, n)
			}
			var sum float64
			for _, w := range tt.want {
				sum += w
			}
			for name, c := range got {
				if _, ok := tt.want[name]; !ok {
					t.Errorf("picked %s %d times; want only %v", name, c, tt.want)
				}
			}
			for name, w := range tt.want {
				if exp := n * w / sum; !within(got[name], exp) {
					t.Errorf("%s picked %d times of %d, want %.0f ± 10%%", name, got[name], n, exp)
				}
			}
		})
	}
}

// TestPickCluster: the CLUSTER scope compares istiod's cluster ids.
func TestPickCluster(t *testing.T) {
	m := lbModel(LoadBalancing{Mode: LBFailover, Scopes: []Scope{ScopeCluster, ScopeNode}}, false)
	for _, w := range m.Workloads {
		w.Cluster = "c2"
	}
	m.Workloads[0].Cluster = "c1"
	m.Workloads[4].Cluster = "c1" // same-region
	got, _ := picks(t, m, "client", 1000)
	if got["same-region"] != 1000 {
		t.Errorf("picked %v, want only same-region (the client's cluster)", got)
	}
}

func TestPreferSameNodeIsFailoverNode(t *testing.T) {
	m := lbModel(LoadBalancing{}, true)
	m.Services[0].PreferSameNode = true
	s := mustBuild(t, m)
	if lb := s.ServiceByName("d", "lb").LB; lb.Mode != LBFailover || len(lb.Scopes) != 1 || lb.Scopes[0] != ScopeNode {
		t.Errorf("LB = %+v, want FAILOVER on NODE", lb)
	}
	if m.Services[0].LB.Mode != LBAny {
		t.Error("Build modified the model's service")
	}
}

func TestPickUnresolved(t *testing.T) {
	m := Model{TrustDomain: td,
		Workloads: []*Workload{{Name: "ext", Namespace: "d", Hostname: "db.example.com"}},
		Services: []*Service{{Name: "ext", Namespace: "d", VIPs: addrs("240.240.0.1", "2001:2::1"), Ports: []ServicePort{{Port: 5432}},
			Workloads: []WorkloadRef{{"d", "ext"}}}},
	}
	s := mustBuild(t, m)
	svc := s.ServiceByName("d", "ext")
	for _, vip := range svc.VIPs {
		e, ok := svc.Pick(vip, nil)
		if !ok || !e.Unresolved() || e.Workload.Hostname != "db.example.com" {
			t.Errorf("Pick(%s) = %+v, %v; want the unresolved hostname endpoint", vip, e, ok)
		}
	}
}

// TestSharedVIP: ServiceEntries of two namespaces with one VIP (and a
// Kubernetes-style canonical one on another): each namespace's clients
// get their own; others the canonical one, else the first.
func TestSharedVIP(t *testing.T) {
	svc := func(name, ns string, canonical bool, port uint16, vips ...string) *Service {
		return &Service{Name: name, Namespace: ns, Hostname: "db.example.com", VIPs: addrs(vips...),
			Ports: []ServicePort{{Port: port}}, Canonical: canonical}
	}
	m := Model{TrustDomain: td, Services: []*Service{
		svc("db", "a", false, 5432, "240.0.0.1"),
		svc("db", "b", false, 5433, "240.0.0.1", "240.0.0.2"),
		svc("x", "a", false, 80, "240.0.0.3"),
		svc("x", "b", true, 80, "240.0.0.3"),
		svc("x", "c", false, 80, "240.0.0.3"),
	}}
	m2, cs := Resolve(m)
	if len(cs) != 0 {
		t.Fatalf("Resolve: %v", cs)
	}
	s := mustBuild(t, m2)
	for _, tt := range []struct {
		dst, ns, want string
	}{
		{"240.0.0.1:5432", "a", "a/db"},
		{"240.0.0.1:5433", "b", "b/db"},
		{"240.0.0.1:5433", "a", ""}, // a's service, which has no port 5433
		{"240.0.0.1:5432", "z", "a/db"},
		{"240.0.0.2:5433", "a", "b/db"}, // b's alone
		{"240.0.0.3:80", "c", "c/x"},
		{"240.0.0.3:80", "z", "b/x"}, // canonical
		{"240.0.0.3:80", "", "b/x"},
	} {
		got, port := s.ServiceFor(netip.MustParseAddrPort(tt.dst), tt.ns)
		name := ""
		if got != nil {
			name = got.String()
			if port == nil || port.Port != netip.MustParseAddrPort(tt.dst).Port() {
				t.Errorf("ServiceFor(%s, %s) port = %+v", tt.dst, tt.ns, port)
			}
		}
		if name != tt.want {
			t.Errorf("ServiceFor(%s, %s) = %q, want %q", tt.dst, tt.ns, name, tt.want)
		}
	}
	if got := s.ServicesByVIP(netip.MustParseAddr("240.0.0.3")); len(got) != 3 {
		t.Errorf("ServicesByVIP = %v", got)
	}
	if x := s.ServiceByVIP(netip.MustParseAddr("240.0.0.3")); x == nil || x.String() != "b/x" {
		t.Errorf("ServiceByVIP = %v, want the canonical b/x", x)
	}
	// One namespace, one VIP: the later service loses it.
	m.Services = append(m.Services, svc("y", "a", false, 81, "240.0.0.1"))
	_, cs = Resolve(m)
	if len(cs) != 1 || !cs[0].Dropped || !strings.Contains(cs[0].Reason, "service a/db of the same namespace") {
		t.Errorf("Resolve conflicts = %v, want a/y left out for a/db", cs)
	}
}

// TestCIDRVIPs: an address in a service's VIP range is the service's,
// unless it is a workload's address or another service's VIP; ranked as
// ztunnel ranks them: the client's namespace first, then the longest
// prefix, then canonical.
func TestCIDRVIPs(t *testing.T) {
	pfx := func(s string) []netip.Prefix { return []netip.Prefix{netip.MustParsePrefix(s)} }
	m := Model{TrustDomain: td,
		Workloads: []*Workload{{Name: "pod", Namespace: "a", Addresses: addrs("240.1.0.7")}},
		Services: []*Service{
			{Name: "wide", Namespace: "a", CIDRs: pfx("240.1.0.0/16"), Ports: []ServicePort{{Port: 443}}},
			{Name: "narrow", Namespace: "b", CIDRs: pfx("240.1.2.0/24"), Ports: []ServicePort{{Port: 443}}},
			{Name: "narrow-canonical", Namespace: "c", CIDRs: pfx("240.1.2.0/24"), Ports: []ServicePort{{Port: 443}}, Canonical: true},
			{Name: "vip", Namespace: "b", VIPs: addrs("240.1.2.9"), Ports: []ServicePort{{Port: 443}}},
			{Name: "v6", Namespace: "a", CIDRs: pfx("2001:db8::/64"), Ports: []ServicePort{{Port: 80}}},
		}}
	m2, cs := Resolve(m)
	if len(cs) != 0 {
		t.Fatalf("Resolve: %v", cs)
	}
	s := mustBuild(t, m2)
	for _, tt := range []struct{ dst, ns, want string }{
		{"240.1.5.5:443", "z", "a/wide"},
		{"240.1.2.5:443", "z", "c/narrow-canonical"}, // longest, then canonical
		{"240.1.2.5:443", "b", "b/narrow"},
		{"240.1.2.5:443", "a", "a/wide"}, // the client's namespace before the longer prefix
		{"240.1.2.9:443", "a", "b/vip"},  // a VIP before any range
		{"240.1.0.7:443", "a", ""},       // a workload's address
		{"240.1.5.5:444", "a", ""},       // a port the service does not have
		{"240.2.0.1:443", "a", ""},
		{"[2001:db8::5]:80", "z", "a/v6"},
		{"[::ffff:240.1.5.5]:443", "z", "a/wide"},
	} {
		got, port := s.ServiceFor(netip.MustParseAddrPort(tt.dst), tt.ns)
		name := ""
		if got != nil {
			name = got.String()
			if port == nil {
				t.Errorf("ServiceFor(%s, %s): no port", tt.dst, tt.ns)
			}
		}
		if name != tt.want {
			t.Errorf("ServiceFor(%s, %s) = %q, want %q", tt.dst, tt.ns, name, tt.want)
		}
	}
	if _, err := Build(Model{TrustDomain: td, Services: []*Service{{Name: "x", Namespace: "a", CIDRs: []netip.Prefix{netip.MustParsePrefix("10.0.0.1/8")}}}}); err == nil {
		t.Error("Build accepted an unmasked range")
	}
}
