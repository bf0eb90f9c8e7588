package registry

import (
	"fmt"
	"math/rand/v2"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/policy"
)

var td = spiffeid.RequireTrustDomainFromString("cluster.local")

func addrs(ss ...string) []netip.Addr {
	var out []netip.Addr
	for _, s := range ss {
		out = append(out, netip.MustParseAddr(s))
	}
	return out
}

func wl(ns, name, node string, labels map[string]string, as ...string) *Workload {
	return &Workload{Name: name, Namespace: ns, ServiceAccount: name, Node: node, Labels: labels, InMesh: true, Addresses: addrs(as...)}
}

func mustBuild(t testing.TB, m Model) *Snapshot {
	t.Helper()
	if m.TrustDomain.IsZero() {
		m.TrustDomain = td
	}
	s, err := Build(m)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

func mustPolicy(t testing.TB, p policy.Policy) *policy.Policy {
	t.Helper()
	out, err := policy.New(p)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func TestWorkloadLookup(t *testing.T) {
	in := wl("default", "a", "n1", nil, "198.18.1.11", "fd00:6d74:1::11")
	s, err := NewSnapshot(td, []*Workload{in, wl("prod", "b", "n2", nil, "198.18.2.11")})
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range []string{"198.18.1.11", "fd00:6d74:1::11", "::ffff:198.18.1.11"} {
		w := s.Workload(netip.MustParseAddr(a))
		if w == nil || w.String() != "default/a" {
			t.Errorf("Workload(%s) = %v, want default/a", a, w)
			continue
		}
		if got := w.Identity.String(); got != "spiffe://cluster.local/ns/default/sa/a" {
			t.Errorf("Identity = %s", got)
		}
	}
	if w := s.Workload(netip.MustParseAddr("198.18.1.12")); w != nil {
		t.Errorf("unknown address found %v", w)
	}
	if w := s.WorkloadByName("prod", "b"); w == nil || w.Node != "n2" {
		t.Errorf("WorkloadByName(prod, b) = %v", w)
	}
	if w := s.WorkloadByName("default", "b"); w != nil {
		t.Errorf("WorkloadByName(default, b) = %v, want nil", w)
	}
	if !in.Identity.IsZero() {
		t.Error("Build modified the caller's workload")
	}
	if s.RootNamespace != DefaultRootNamespace {
		t.Errorf("RootNamespace = %q", s.RootNamespace)
	}
	if w, _ := s.Workload(netip.MustParseAddr("198.18.1.11")).Addr(netip.MustParseAddr("fd00::1")); w != netip.MustParseAddr("fd00:6d74:1::11") {
		t.Errorf("Addr(v6) = %v", w)
	}
}

func TestBuildErrors(t *testing.T) {
	unbuilt := &policy.Policy{Name: "x", Namespace: "default"}
	p := mustPolicy(t, policy.Policy{Name: "p", Namespace: "default"})
	tests := []struct {
		name string
		m    Model
		want string
	}{
		{"no trust domain", Model{TrustDomain: spiffeid.TrustDomain{}}, "no trust domain"},
		{"dup address", Model{Workloads: []*Workload{wl("d", "a", "", nil, "10.0.0.1"), wl("d", "b", "", nil, "::ffff:10.0.0.1")}},
			"address 10.0.0.1 belongs to both d/a and d/b"},
		{"dup name", Model{Workloads: []*Workload{wl("d", "a", "", nil, "10.0.0.1"), wl("d", "a", "", nil, "10.0.0.2")}},
			"two workloads named d/a"},
		{"no name", Model{Workloads: []*Workload{wl("d", "", "", nil, "10.0.0.1")}}, "name and namespace are required"},
		{"bad sa", Model{Workloads: []*Workload{{Name: "a", Namespace: "d", ServiceAccount: "a/b"}}}, "workload d/a: identity"},
		{"vip is workload", Model{Workloads: []*Workload{wl("d", "a", "", nil, "10.0.0.1")},
			Services: []*Service{{Name: "s", Namespace: "d", VIPs: addrs("10.0.0.1"), Ports: []ServicePort{{Port: 80}}}}},
			"service d/s: VIP 10.0.0.1 is the address of workload d/a"},
		{"dup vip", Model{Services: []*Service{
			{Name: "s", Namespace: "d", VIPs: addrs("10.1.0.1"), Ports: []ServicePort{{Port: 80}}},
			{Name: "t", Namespace: "d", VIPs: addrs("10.1.0.1"), Ports: []ServicePort{{Port: 81}}}}},
			"service d/t: VIP 10.1.0.1 is also a VIP of service d/s of the same namespace"},
		{"dup service", Model{Services: []*Service{{Name: "s", Namespace: "d"}, {Name: "s", Namespace: "d"}}},
			"service d/s: two services with this name"},
		{"dup port", Model{Services: []*Service{{Name: "s", Namespace: "d", Ports: []ServicePort{{Port: 80}, {Port: 80, TargetPort: 81}}}}},
			"service d/s: port 80 listed twice"},
		{"unknown endpoint", Model{Services: []*Service{{Name: "s", Namespace: "d", Workloads: []WorkloadRef{{"d", "nope"}}}}},
			"service d/s: endpoint d/nope is not a known workload"},
		{"unbuilt policy", Model{Policies: []*policy.Policy{unbuilt}}, "policy 0 was not built by policy.New"},
		{"policy twice", Model{Policies: []*policy.Policy{p, p}}, "policy default/p listed twice"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.name != "no trust domain" {
				tt.m.TrustDomain = td
			}
			_, err := Build(tt.m)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("Build: err = %v, want it to contain %q", err, tt.want)
			}
		})
	}
}

func echoModel(t testing.TB) Model {
	return Model{
		Workloads: []*Workload{
			wl("default", "client", "n1", map[string]string{"app": "client"}, "198.18.1.11", "fd00:6d74:1::11"),
			wl("default", "echo-1", "n1", map[string]string{"app": "echo"}, "198.18.1.21", "fd00:6d74:1::21"),
			wl("default", "echo-2", "n2", map[string]string{"app": "echo"}, "198.18.2.21", "fd00:6d74:2::21"),
			wl("default", "echo-3", "n2", map[string]string{"app": "echo"}, "198.18.2.22"),
			{Name: "echo-4", Namespace: "default", Node: "n2", Labels: map[string]string{"app": "echo"}, Addresses: addrs("198.18.2.23"), Health: Unhealthy},
			wl("prod", "echo-x", "n1", map[string]string{"app": "echo"}, "198.18.1.99"),
		},
		Services: []*Service{
			{Name: "echo", Namespace: "default", VIPs: addrs("198.18.100.1", "fd00:6d74:100::1"),
				Ports: []ServicePort{{Name: "http", Port: 80, TargetPort: 8080}, {Port: 9090}}, Selector: map[string]string{"app": "echo"}},
			{Name: "echo-local", Namespace: "default", VIPs: addrs("198.18.100.2"), Ports: []ServicePort{{Port: 80, TargetPort: 8080}},
				Selector: map[string]string{"app": "echo"}, PreferSameNode: true},
			{Name: "pinned", Namespace: "default", Hostname: "pinned.example", VIPs: addrs("198.18.100.3"), Ports: []ServicePort{{Port: 80}},
				Workloads: []WorkloadRef{{"default", "echo-2"}, {"prod", "echo-x"}}},
			{Name: "empty", Namespace: "default", VIPs: addrs("198.18.100.4"), Ports: []ServicePort{{Port: 80}}, Selector: map[string]string{"app": "none"}},
		},
	}
}

func names(eps []Endpoint) string {
	var out []string
	for _, e := range eps {
		out = append(out, e.Workload.Name+"@"+e.Addr.String())
	}
	return strings.Join(out, " ")
}

func TestServices(t *testing.T) {
	s := mustBuild(t, echoModel(t))
	svc, port := s.Service(netip.MustParseAddrPort("198.18.100.1:80"))
	if svc == nil || svc.String() != "default/echo" || port.Name != "http" || port.Target() != 8080 {
		t.Fatalf("Service(198.18.100.1:80) = %v, %+v", svc, port)
	}
	if svc.Hostname != "echo.default.svc.cluster.local" {
		t.Errorf("Hostname = %q", svc.Hostname)
	}
	if _, p := s.Service(netip.MustParseAddrPort("[::ffff:198.18.100.1]:9090")); p == nil || p.Target() != 9090 {
		t.Errorf("v4-mapped VIP:9090 port = %+v, want target 9090", p)
	}
	if v6, _ := s.Service(netip.MustParseAddrPort("[fd00:6d74:100::1]:80")); v6 != svc {
		t.Errorf("v6 VIP gives %v", v6)
	}
	if x, p := s.Service(netip.MustParseAddrPort("198.18.100.1:81")); x != nil || p != nil {
		t.Errorf("VIP on a port the service does not have: %v %v", x, p)
	}
	if x := s.ServiceByVIP(netip.MustParseAddr("198.18.100.1")); x != svc {
		t.Errorf("ServiceByVIP = %v", x)
	}
	if x, _ := s.Service(netip.MustParseAddrPort("198.18.1.21:8080")); x != nil {
		t.Errorf("a pod address is a service: %v", x)
	}
	if x := s.ServiceByName("default", "pinned"); x == nil || x.Hostname != "pinned.example" {
		t.Errorf("ServiceByName(pinned) = %v", x)
	}

	// Selector: same namespace only, healthy only; per family.
	if got, want := names(svc.Endpoints(netip.MustParseAddr("198.18.100.1"))),
		"echo-1@198.18.1.21 echo-2@198.18.2.21 echo-3@198.18.2.22"; got != want {
		t.Errorf("v4 endpoints = %s, want %s", got, want)
	}
	if got, want := names(svc.Endpoints(netip.MustParseAddr("fd00:6d74:100::1"))),
		"echo-1@fd00:6d74:1::21 echo-2@fd00:6d74:2::21"; got != want {
		t.Errorf("v6 endpoints = %s, want %s", got, want)
	}
	pinned := s.ServiceByName("default", "pinned")
	if got, want := names(pinned.Endpoints(netip.MustParseAddr("198.18.100.3"))), "echo-2@198.18.2.21 echo-x@198.18.1.99"; got != want {
		t.Errorf("explicit endpoints = %s, want %s", got, want)
	}
	empty := s.ServiceByName("default", "empty")
	if e, ok := empty.Pick(netip.MustParseAddr("198.18.100.4"), &Workload{Node: "n1"}); ok {
		t.Errorf("Pick on a service without endpoints = %v", e)
	}
	// Endpoints point at the snapshot's workloads.
	if e := svc.Endpoints(netip.MustParseAddr("198.18.100.1"))[0]; e.Workload != s.WorkloadByName("default", "echo-1") {
		t.Error("endpoint workload is not the snapshot's")
	}
}

// TestPickDistribution: 10,000 picks spread evenly (within 10% of the
// expected count, > 5 standard deviations) over the endpoints.
func TestPickDistribution(t *testing.T) {
	s := mustBuild(t, echoModel(t))
	vip := netip.MustParseAddr("198.18.100.1")
	vip6 := netip.MustParseAddr("fd00:6d74:100::1")
	local := netip.MustParseAddr("198.18.100.2")
	tests := []struct {
		name string
		svc  string
		vip  netip.Addr
		node string
		want map[string]bool // endpoints that may be picked, evenly
	}{
		{"all", "echo", vip, "n1", map[string]bool{"echo-1": true, "echo-2": true, "echo-3": true}},
		{"v6", "echo", vip6, "n1", map[string]bool{"echo-1": true, "echo-2": true}},
		{"prefer n2", "echo-local", local, "n2", map[string]bool{"echo-2": true, "echo-3": true}},
		{"prefer n1", "echo-local", local, "n1", map[string]bool{"echo-1": true}},
		{"prefer, none local", "echo-local", local, "n9", map[string]bool{"echo-1": true, "echo-2": true, "echo-3": true}},
		{"prefer, no node", "echo-local", local, "", map[string]bool{"echo-1": true, "echo-2": true, "echo-3": true}},
	}
	const n = 10000
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			svc := s.ServiceByName("default", tt.svc)
			counts := map[string]int{}
			for range n {
				e, ok := svc.Pick(tt.vip, &Workload{Node: tt.node})
				if !ok {
					t.Fatal("no endpoint")
				}
				if e.Addr.Is4() != tt.vip.Is4() {
					t.Fatalf("picked %v for VIP %v", e.Addr, tt.vip)
				}
				counts[e.Workload.Name]++
			}
			exp := float64(n) / float64(len(tt.want))
			for name, c := range counts {
				if !tt.want[name] {
					t.Errorf("picked %s %d times; it is not eligible", name, c)
				}
			}
			for name := range tt.want {
				if c := float64(counts[name]); c < 0.9*exp || c > 1.1*exp {
					t.Errorf("%s picked %v times of %d, want %.0f ± 10%%", name, c, n, exp)
				}
			}
		})
	}
}

func TestPickDeterministic(t *testing.T) {
	s := mustBuild(t, echoModel(t))
	svc := s.ServiceByName("default", "echo")
	vip := netip.MustParseAddr("198.18.100.1")
	for i, want := range []string{"echo-1", "echo-2", "echo-3"} {
		e, _ := svc.pick(vip, nil, func(n uint64) uint64 {
			if n != 3 {
				t.Fatalf("rnd(%d), want rnd(3)", n)
			}
			return uint64(i)
		})
		if e.Workload.Name != want {
			t.Errorf("pick %d = %s, want %s", i, e.Workload.Name, want)
		}
	}
}

// policyModel: workloads in three namespaces, policies of every scope.
func policyModel(t testing.TB, root string) Model {
	m := Model{RootNamespace: root}
	for _, ns := range []string{"default", "prod", root} {
		for i, app := range []string{"echo", "echo", "db", "web"} {
			m.Workloads = append(m.Workloads, &Workload{
				Name: fmt.Sprintf("%s-%d", app, i), Namespace: ns, ServiceAccount: app,
				Labels:    map[string]string{"app": app, "tier": fmt.Sprint(i % 2)},
				Addresses: addrs(fmt.Sprintf("10.%d.0.%d", len(ns), i+1)),
				InMesh:    true, PeerAuth: map[bool]PeerAuth{true: Strict}[ns == "prod"],
			})
		}
	}
	add := func(ns, name string, sel map[string]string, a policy.Action, rules ...policy.Rule) {
		m.Policies = append(m.Policies, mustPolicy(t, policy.Policy{Name: name, Namespace: ns, Selector: sel, Action: a, Rules: rules}))
	}
	from := func(ns ...string) policy.Rule { return policy.Rule{From: []policy.Source{{Namespaces: ns}}} }
	port := func(p uint16) policy.Rule { return policy.Rule{To: []policy.Operation{{Ports: []uint16{p}}}} }
	add(root, "global-deny-23", nil, policy.Deny, port(23))
	add(root, "global-db-allow", map[string]string{"app": "db"}, policy.Allow, from("default"))
	add("default", "ns-deny-prod", nil, policy.Deny, from("prod"))
	add("default", "echo-allow", map[string]string{"app": "echo"}, policy.Allow, from("default", "prod"))
	add("default", "echo-tier1-deny", map[string]string{"app": "echo", "tier": "1"}, policy.Deny, port(8081))
	add("prod", "prod-allow-all", nil, policy.Allow, policy.Rule{})
	add("other", "elsewhere", nil, policy.Deny, policy.Rule{})
	return m
}

// TestPolicyIndex compares the index with testing every policy.
func TestPolicyIndex(t *testing.T) {
	for _, root := range []string{"istio-system", "mesh-root"} {
		m := policyModel(t, root)
		s := mustBuild(t, m)
		for _, w := range s.Workloads {
			var want []string
			for _, p := range m.Policies {
				if p.AppliesTo(root, w.Namespace, w.Labels) {
					want = append(want, p.ID())
				}
			}
			deny, allow, strict := w.Policies()
			var got []string
			for _, p := range append(append([]*policy.Policy{}, deny...), allow...) {
				got = append(got, p.ID())
			}
			// Set order is DENY then ALLOW; compare as sets in model order.
			var wantSorted []string
			for _, id := range want {
				for _, p := range deny {
					if p.ID() == id {
						wantSorted = append(wantSorted, id)
					}
				}
			}
			for _, id := range want {
				for _, p := range allow {
					if p.ID() == id {
						wantSorted = append(wantSorted, id)
					}
				}
			}
			if strings.Join(got, ",") != strings.Join(wantSorted, ",") || len(got) != len(want) {
				t.Errorf("root %s, workload %s (%v): policies %v, want %v", root, w, w.Labels, got, want)
			}
			if strict != (w.Namespace == "prod") {
				t.Errorf("workload %s strict = %v", w, strict)
			}
		}
	}
}

func TestAuthorize(t *testing.T) {
	s := mustBuild(t, policyModel(t, "istio-system"))
	id := func(ns, sa string) spiffeid.ID { return spiffeid.RequireFromSegments(td, "ns", ns, "sa", sa) }
	dst := func(ns, name string, port uint16) netip.AddrPort {
		w := s.WorkloadByName(ns, name)
		return netip.AddrPortFrom(w.Addresses[0], port)
	}
	src := netip.MustParseAddr("10.0.0.1")
	tests := []struct {
		name string
		r    policy.Request
		want string
	}{
		{"echo from default", policy.Request{Peer: id("default", "web"), Source: src, Dest: dst("default", "echo-0", 80)}, "allowed by policy default/echo-allow"},
		{"echo from prod denied ns-wide", policy.Request{Peer: id("prod", "web"), Source: src, Dest: dst("default", "echo-0", 80)}, "denied by policy default/ns-deny-prod"},
		{"echo global deny port", policy.Request{Peer: id("default", "web"), Source: src, Dest: dst("default", "echo-0", 23)}, "denied by policy istio-system/global-deny-23"},
		{"echo tier1 deny", policy.Request{Peer: id("default", "web"), Source: src, Dest: dst("default", "echo-1", 8081)}, "denied by policy default/echo-tier1-deny"},
		{"echo tier0 no deny", policy.Request{Peer: id("default", "web"), Source: src, Dest: dst("default", "echo-0", 8081)}, "allowed by policy default/echo-allow"},
		{"echo plaintext", policy.Request{Source: src, Dest: dst("default", "echo-0", 80)}, "denied: no ALLOW policy matched"},
		{"web no allow", policy.Request{Source: src, Dest: dst("default", "web-3", 80)}, "allowed: no ALLOW policy applies"},
		{"db global allow", policy.Request{Peer: id("default", "web"), Source: src, Dest: dst("prod", "db-2", 5432)}, "allowed by policy istio-system/global-db-allow"},
		{"prod strict", policy.Request{Source: src, Dest: dst("prod", "web-3", 80)}, "denied: STRICT peer authentication requires a verified peer identity"},
		{"prod allow all", policy.Request{Peer: id("x", "y"), Source: src, Dest: dst("prod", "web-3", 80)}, "allowed by policy prod/prod-allow-all"},
		{"unknown", policy.Request{Source: src, Dest: netip.MustParseAddrPort("10.99.0.1:80")}, "denied: unknown destination workload"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := s.Authorize(&tt.r).String(); got != tt.want {
				t.Errorf("Authorize = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestRegistrySwap(t *testing.T) {
	a := mustBuild(t, Model{Workloads: []*Workload{wl("d", "a", "", nil, "10.0.0.1")}})
	b := mustBuild(t, Model{Workloads: []*Workload{wl("d", "b", "", nil, "10.0.0.1")}})
	r := New(a)
	var wg sync.WaitGroup
	stop := make(chan struct{})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			w := r.Load().Workload(netip.MustParseAddr("10.0.0.1"))
			if w == nil || (w.Name != "a" && w.Name != "b") {
				t.Errorf("reader saw %v", w)
				return
			}
		}
	}()
	for i := range 1000 {
		if i%2 == 0 {
			r.Store(b)
		} else {
			r.Store(a)
		}
	}
	close(stop)
	wg.Wait()
	if r.Load() != a {
		t.Error("last Store did not win")
	}
}

// bigModel is the benchmark mesh: 100 namespaces of 100 workloads (10 apps
// each, IPv4 and IPv6), one service per app (1,000 services), and 1,000
// policies: 10 per namespace (a namespace-wide DENY, a namespace-wide
// ALLOW and 8 selector policies) with 4 global ones replacing the first
// namespace's selector policies.
func bigModel(t testing.TB) Model {
	m := Model{TrustDomain: td}
	for n := range 100 {
		ns := fmt.Sprintf("ns-%d", n)
		for i := range 100 {
			app := fmt.Sprintf("app-%d", i%10)
			m.Workloads = append(m.Workloads, &Workload{
				Name: fmt.Sprintf("%s-%d", app, i), Namespace: ns, ServiceAccount: app, Node: fmt.Sprintf("node-%d", i%8),
				Labels:    map[string]string{"app": app, "version": fmt.Sprintf("v%d", i%3), "pod-template-hash": fmt.Sprintf("h%d", i)},
				Addresses: addrs(fmt.Sprintf("10.%d.%d.%d", 64+n/64, n%64*4+i/64, i%64+1), fmt.Sprintf("fd00:%x::%x", n+1, i+1)),
				InMesh:    true,
			})
		}
		for a := range 10 {
			app := fmt.Sprintf("app-%d", a)
			m.Services = append(m.Services, &Service{
				Name: app, Namespace: ns, VIPs: addrs(fmt.Sprintf("172.%d.%d.%d", 16+n/100, n%100, a+1), fmt.Sprintf("fd01:%x::%x", n+1, a+1)),
				Ports: []ServicePort{{Port: 80, TargetPort: 8080}, {Port: 443, TargetPort: 8443}}, Selector: map[string]string{"app": app},
				PreferSameNode: a%2 == 0,
			})
		}
	}
	for n := range 100 {
		ns := fmt.Sprintf("ns-%d", n)
		add := func(p policy.Policy) { m.Policies = append(m.Policies, mustPolicy(t, p)) }
		add(policy.Policy{Name: "deny-ext", Namespace: ns, Action: policy.Deny, Rules: []policy.Rule{
			{From: []policy.Source{{NotIPBlocks: []policy.IPBlock{{CIDR: netip.MustParsePrefix("10.64.0.0/10"), Except: []netip.Prefix{netip.MustParsePrefix("10.127.0.0/16")}}}}},
				To: []policy.Operation{{NotPorts: []uint16{15021}}}}}})
		add(policy.Policy{Name: "allow-ns", Namespace: ns, Action: policy.Allow, Rules: []policy.Rule{
			{From: []policy.Source{{Namespaces: []string{ns}}}}}})
		for a := range 8 {
			sel := map[string]string{"app": fmt.Sprintf("app-%d", a)}
			pns := ns
			if n == 0 && a < 4 {
				pns = DefaultRootNamespace // global policies
			}
			var principals []string
			for k := range 5 {
				principals = append(principals, fmt.Sprintf("cluster.local/ns/ns-%d/sa/app-%d", (n+k+1)%100, a))
			}
			add(policy.Policy{Name: fmt.Sprintf("app-%d-from-%d", a, n), Namespace: pns, Selector: sel, Action: policy.Allow, Rules: []policy.Rule{
				{From: []policy.Source{{Principals: principals}}, To: []policy.Operation{{Ports: []uint16{8080, 8443}}}},
				{From: []policy.Source{{ServiceAccounts: []string{fmt.Sprintf("ns-%d/admin", n)}}}},
			}})
		}
	}
	return m
}

func TestBigModel(t *testing.T) {
	m := bigModel(t)
	if len(m.Workloads) != 10000 || len(m.Policies) != 1000 || len(m.Services) != 1000 {
		t.Fatalf("model has %d workloads, %d policies, %d services", len(m.Workloads), len(m.Policies), len(m.Services))
	}
	s := mustBuild(t, m)
	dst := s.WorkloadByName("ns-50", "app-3-13")
	deny, allow, _ := dst.Policies()
	// deny-ext; allow-ns, its own app-3 policy and the global app-3 one.
	if len(deny) != 1 || len(allow) != 3 {
		t.Errorf("ns-50/app-3-13 has %d DENY and %d ALLOW policies, want 1 and 3", len(deny), len(allow))
	}
	r := benchRequest(s)
	if d := s.Authorize(&r); !d.Allowed || d.Policy.ID() != "ns-50/app-3-from-50" {
		t.Errorf("decision %s, want allowed by ns-50/app-3-from-50", d)
	}
	r.Peer = spiffeid.RequireFromSegments(td, "ns", "ns-9", "sa", "app-3")
	if d := s.Authorize(&r); d.Allowed || d.Reason != policy.NoAllowMatched {
		t.Errorf("decision %s, want denied: no ALLOW policy matched", d)
	}
}

// benchRequest: ns-54/app-3 (listed last among ns-50/app-3's principals)
// connects to ns-50/app-3-13 on 8080.
func benchRequest(s *Snapshot) policy.Request {
	dst := s.WorkloadByName("ns-50", "app-3-13")
	return policy.Request{
		Peer:   spiffeid.RequireFromSegments(td, "ns", "ns-54", "sa", "app-3"),
		Source: s.WorkloadByName("ns-54", "app-3-3").Addresses[0],
		Dest:   netip.AddrPortFrom(dst.Addresses[0], 8080),
	}
}

func TestLookupsDoNotAllocate(t *testing.T) {
	s := mustBuild(t, bigModel(t))
	a := s.WorkloadByName("ns-50", "app-3-13").Addresses[1]
	vip := netip.MustParseAddrPort("172.16.50.4:80")
	r := benchRequest(s)
	from := s.WorkloadByName("ns-54", "app-3-3")
	for name, f := range map[string]func(){
		"Workload": func() { s.Workload(a) },
		"Service+Pick": func() {
			svc, _ := s.Service(vip)
			svc.Pick(vip.Addr(), from)
		},
		"Authorize":  func() { s.Authorize(&r) },
		"ServiceFor": func() { s.ServiceFor(vip, "ns-54") },
	} {
		if n := testing.AllocsPerRun(1000, f); n != 0 {
			t.Errorf("%s allocates %v times per call", name, n)
		}
	}
}

func BenchmarkWorkloadLookup(b *testing.B) {
	s := mustBuild(b, bigModel(b))
	var as []netip.Addr
	for _, w := range s.Workloads {
		as = append(as, w.Addresses...)
	}
	rand.Shuffle(len(as), func(i, j int) { as[i], as[j] = as[j], as[i] })
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		if s.Workload(as[i%len(as)]) == nil {
			b.Fatal("not found")
		}
		i++
	}
}

func BenchmarkWorkloadLookupMiss(b *testing.B) {
	s := mustBuild(b, bigModel(b))
	a := netip.MustParseAddr("192.0.2.1")
	b.ReportAllocs()
	for b.Loop() {
		if s.Workload(a) != nil {
			b.Fatal("found")
		}
	}
}

func BenchmarkServicePick(b *testing.B) {
	s := mustBuild(b, bigModel(b))
	var dsts []netip.AddrPort
	for _, svc := range s.Services {
		for _, v := range svc.VIPs {
			dsts = append(dsts, netip.AddrPortFrom(v, 80))
		}
	}
	rand.Shuffle(len(dsts), func(i, j int) { dsts[i], dsts[j] = dsts[j], dsts[i] })
	from := &Workload{Node: "node-3"}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		d := dsts[i%len(dsts)]
		svc, _ := s.Service(d)
		if _, ok := svc.Pick(d.Addr(), from); !ok {
			b.Fatal("no endpoint")
		}
		i++
	}
}

func BenchmarkAuthorize(b *testing.B) {
	s := mustBuild(b, bigModel(b))
	r := benchRequest(s)
	b.ReportAllocs()
	for b.Loop() {
		if !s.Authorize(&r).Allowed {
			b.Fatal("denied")
		}
	}
}

func BenchmarkAuthorizeDenied(b *testing.B) {
	s := mustBuild(b, bigModel(b))
	r := benchRequest(s)
	r.Peer = spiffeid.RequireFromSegments(td, "ns", "ns-9", "sa", "app-3")
	b.ReportAllocs()
	for b.Loop() {
		if s.Authorize(&r).Allowed {
			b.Fatal("allowed")
		}
	}
}

func BenchmarkBuild(b *testing.B) {
	m := bigModel(b)
	b.ReportAllocs()
	for b.Loop() {
		if _, err := Build(m); err != nil {
			b.Fatal(err)
		}
	}
}

// TestPortPeerAuth: a workload's port-level modes decide plaintext on
// those ports, and Protected says which ports the node must intercept.
func TestPortPeerAuth(t *testing.T) {
	w := wl("default", "web", "n1", nil, "198.18.1.20")
	w.PeerAuth = Strict
	w.PortPeerAuth = map[uint16]PeerAuth{8080: Permissive}
	p := wl("default", "plain", "n1", nil, "198.18.1.21")
	p.PortPeerAuth = map[uint16]PeerAuth{9090: Strict}
	s := mustBuild(t, Model{TrustDomain: td, Workloads: []*Workload{w, p}})
	src := netip.MustParseAddr("198.18.1.10")
	for _, tc := range []struct {
		dst       string
		allowed   bool
		protected bool
	}{
		{"198.18.1.20:8080", true, false},
		{"198.18.1.20:9090", false, true},
		{"198.18.1.21:9090", false, true},
		{"198.18.1.21:8080", true, false},
	} {
		d := netip.MustParseAddrPort(tc.dst)
		if got := s.Authorize(&policy.Request{Source: src, Dest: d}); got.Allowed != tc.allowed {
			t.Errorf("plaintext to %s: %v, want allowed %v", d, got, tc.allowed)
		}
		if got := s.Workload(d.Addr()).Protected(d.Port()); got != tc.protected {
			t.Errorf("Protected(%d) of %s = %v, want %v", d.Port(), d.Addr(), got, tc.protected)
		}
	}
}

// Canonical and Workload give istiod's values when set, and otherwise
// derive them from the labels as Istio does.
func TestCanonical(t *testing.T) {
	for _, tc := range []struct {
		w            Workload
		wl, svc, rev string
	}{
		{Workload{Name: "p", WorkloadName: "d", CanonicalName: "c", CanonicalRevision: "r", Labels: map[string]string{"app": "a"}}, "d", "c", "r"},
		{Workload{Name: "p", Labels: map[string]string{"app": "a", "version": "v1"}}, "p", "a", "v1"},
		{Workload{Name: "p", Labels: map[string]string{"app": "a", "app.kubernetes.io/name": "k", "service.istio.io/canonical-revision": "cr"}}, "p", "k", "cr"},
		{Workload{Name: "p", WorkloadName: "d"}, "d", "d", "latest"},
	} {
		svc, rev := tc.w.Canonical()
		if got := tc.w.Workload(); got != tc.wl || svc != tc.svc || rev != tc.rev {
			t.Errorf("%+v: workload %q canonical %q/%q, want %q %q/%q", tc.w, got, svc, rev, tc.wl, tc.svc, tc.rev)
		}
	}
}

// TestBuildReusesUnchangedWorkloads: a workload of Model.Reuse given
// again is shared by the new snapshot when its identity and policies come
// out the same, and copied (with the new policies) when they do not; a
// workload not of Reuse is copied.
func TestBuildReusesUnchangedWorkloads(t *testing.T) {
	a := wl("ns", "a", "n1", map[string]string{"app": "a"}, "10.0.0.1")
	b := wl("ns", "b", "n1", map[string]string{"app": "b"}, "10.0.0.2")
	s1 := mustBuild(t, Model{Workloads: []*Workload{a, b}})
	if s1.Workloads[0] == a {
		t.Fatal("Build kept the model's own workload: it must copy it")
	}
	deny := mustPolicy(t, policy.Policy{Name: "deny-a", Namespace: "ns", Action: policy.Deny,
		Selector: map[string]string{"app": "a"}, Rules: []policy.Rule{{}}})
	s2 := mustBuild(t, Model{Workloads: s1.Workloads, Reuse: s1})
	for i := range s1.Workloads {
		if s2.Workloads[i] != s1.Workloads[i] {
			t.Errorf("workload %s unchanged but copied", s1.Workloads[i])
		}
	}
	s3 := mustBuild(t, Model{Workloads: s2.Workloads, Policies: []*policy.Policy{deny}, Reuse: s2})
	if s3.Workloads[0] == s2.Workloads[0] {
		t.Error("workload ns/a shared although a policy now applies to it")
	}
	if d, _, _ := s3.Workloads[0].Policies(); len(d) != 1 {
		t.Errorf("ns/a has %d DENY policies, want 1", len(d))
	}
	if d, _, _ := s2.Workloads[0].Policies(); len(d) != 0 {
		t.Errorf("the previous snapshot's ns/a changed: %d DENY policies", len(d))
	}
	if s3.Workloads[1] != s2.Workloads[1] {
		t.Error("workload ns/b unchanged but copied")
	}
	// Another snapshot's workloads are not Reuse's: copied.
	s4 := mustBuild(t, Model{Workloads: s1.Workloads, Reuse: mustBuild(t, Model{Workloads: []*Workload{a, b}})})
	if s4.Workloads[0] == s1.Workloads[0] {
		t.Error("a workload not of Reuse was shared")
	}
}
