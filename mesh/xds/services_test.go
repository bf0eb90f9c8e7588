package xds

import (
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/envoyproxy/go-control-plane/pkg/cache/types"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/protobuf/types/known/wrapperspb"
	"istio.io/istio/pkg/workloadapi"

	"github.com/meshtun/meshtun/mesh/registry"
)

// TestServiceLoadBalancingConverted: istiod's load-balancing settings
// become the registry's, as Kubernetes produces them; values this meshtun
// does not know are refused (a STRICT preference ignored would send
// traffic where it must not go).
func TestServiceLoadBalancingConverted(t *testing.T) {
	c := &converter{td: spiffeid.RequireTrustDomainFromString("cluster.local")}
	lb := func(mode workloadapi.LoadBalancing_Mode, health workloadapi.LoadBalancing_HealthPolicy, scopes ...workloadapi.LoadBalancing_Scope) *workloadapi.Service {
		return &workloadapi.Service{Name: "web", Namespace: "default", Hostname: "web.default.svc.cluster.local",
			Addresses: []*workloadapi.NetworkAddress{{Address: netip.MustParseAddr("10.96.0.1").AsSlice()}},
			Ports:     []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}, Canonical: true,
			LoadBalancing: &workloadapi.LoadBalancing{Mode: mode, HealthPolicy: health, RoutingPreference: scopes}}
	}
	W := workloadapi.LoadBalancing_NETWORK
	R, Z, S, N := workloadapi.LoadBalancing_REGION, workloadapi.LoadBalancing_ZONE, workloadapi.LoadBalancing_SUBZONE, workloadapi.LoadBalancing_NODE
	for _, tt := range []struct {
		name  string
		in    *workloadapi.Service
		want  string // mode and scopes
		all   bool   // AllowUnhealthy
		err   string
		reset bool
	}{
		{name: "internalTrafficPolicy Local", in: lb(workloadapi.LoadBalancing_STRICT, 0, N), want: "STRICT [NODE]"},
		{name: "trafficDistribution PreferClose", in: lb(workloadapi.LoadBalancing_FAILOVER, 0, W, R, Z), want: "FAILOVER [NETWORK REGION ZONE]"},
		{name: "trafficDistribution PreferSameNode", in: lb(workloadapi.LoadBalancing_FAILOVER, 0, W, R, Z, S, N), want: "FAILOVER [NETWORK REGION ZONE SUBZONE NODE]"},
		{name: "publishNotReadyAddresses", in: lb(0, workloadapi.LoadBalancing_ALLOW_ALL), want: "ANY []", all: true},
		{name: "cluster scope", in: lb(workloadapi.LoadBalancing_FAILOVER, 0, workloadapi.LoadBalancing_CLUSTER), want: "FAILOVER [CLUSTER]"},
		{name: "unknown mode", in: lb(99, 0, N), err: "load balancing mode 99 is not known"},
		{name: "unknown scope", in: lb(workloadapi.LoadBalancing_STRICT, 0, N, 42), err: "routing_preference[1] 42 is not known"},
		{name: "unknown health policy", in: lb(0, 7), err: "health policy 7 is not known"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			out, err := c.service(tt.in)
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) || !strings.Contains(err.Error(), "default/web.default.svc.cluster.local") {
					t.Fatalf("err = %v, want one naming the service and %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			s := out.s
			if got := s.LB.Mode.String() + " " + scopes(s.LB.Scopes); got != tt.want || s.AllowUnhealthy != tt.all || !s.Canonical {
				t.Errorf("LB %s, AllowUnhealthy %v, Canonical %v; want %s, %v, true", got, s.AllowUnhealthy, s.Canonical, tt.want, tt.all)
			}
		})
	}
}

func scopes(ss []registry.Scope) string {
	var out []string
	for _, s := range ss {
		out = append(out, s.String())
	}
	return "[" + strings.Join(out, " ") + "]"
}

// TestWorkloadLocalityCapacityHostname: what load balancing needs of a
// workload: its locality, its capacity (0: no endpoint of its services,
// with its policies kept), and for a ServiceEntry endpoint of resolution
// DNS its hostname.
func TestWorkloadLocalityCapacityHostname(t *testing.T) {
	c := &converter{td: spiffeid.RequireTrustDomainFromString("cluster.local")}
	a := wl("default", "a", "10.0.0.1", "node1", "default/p").GetWorkload()
	a.Locality = &workloadapi.Locality{Region: "r", Zone: "z", Subzone: "s"}
	a.Capacity = wrapperspb.UInt32(5)
	out, err := c.workload(a)
	if err != nil {
		t.Fatal(err)
	}
	if w := out.w; w.Locality != (registry.Locality{Region: "r", Zone: "z", Subzone: "s"}) || w.Capacity != 5 || w.Hostname != "" || len(out.services) != 1 {
		t.Errorf("workload %+v, services %v", w, out.services)
	}
	a.Capacity = wrapperspb.UInt32(0)
	if out, err = c.workload(a); err != nil || len(out.services) != 0 || out.w.Labels[policyLabel("default/p")] != "true" {
		t.Errorf("capacity 0: services %v, labels %v, err %v; want no services, the policy label kept", out.services, out.w.Labels, err)
	}
	dns := &workloadapi.Workload{Uid: "Kubernetes/networking.istio.io/ServiceEntry/default/db/db.example.com",
		Name: "db", Namespace: "default", Hostname: "db.example.com", TunnelProtocol: workloadapi.TunnelProtocol_NONE,
		Services: map[string]*workloadapi.PortList{"default/db.example.com": {Ports: []*workloadapi.Port{{ServicePort: 5432, TargetPort: 5432}}}}}
	if out, err = c.workload(dns); err != nil || out.w.Hostname != "db.example.com" || len(out.w.Addresses) != 0 {
		t.Errorf("DNS endpoint: %+v, %v", out.w, err)
	}
}

// TestServicesAsIstiodSendsThem, through the source from a (fake) istiod
// stream: a service with STRICT load balancing (internalTrafficPolicy:
// Local, NACKed before) is applied without a NACK; two ServiceEntries of
// different namespaces with one VIP are both in the model, each
// namespace's clients given their own; a ServiceEntry of resolution DNS
// has its hostname endpoint, unresolved.
func TestServicesAsIstiodSendsThem(t *testing.T) {
	f := newFakeIstiod(t)
	local := svc("10.96.0.10")
	local.GetService().LoadBalancing = &workloadapi.LoadBalancing{
		RoutingPreference: []workloadapi.LoadBalancing_Scope{workloadapi.LoadBalancing_NODE}, Mode: workloadapi.LoadBalancing_STRICT}
	seA, a := serviceEntry("ns-a", "db.example.com", "240.240.0.1")
	seB, b := serviceEntry("ns-b", "db.example.com", "240.240.0.1")
	b.GetService().Ports[0].ServicePort = 5432
	dns := &workloadapi.Address{Type: &workloadapi.Address_Workload{Workload: &workloadapi.Workload{
		Uid:  "Kubernetes/networking.istio.io/ServiceEntry/ns-a/db/db.example.com",
		Name: "db", Namespace: "ns-a", Hostname: "db.example.com", TunnelProtocol: workloadapi.TunnelProtocol_NONE,
		Services: map[string]*workloadapi.PortList{"ns-a/db.example.com": {Ports: []*workloadapi.Port{{ServicePort: 443, TargetPort: 443}}}},
	}}}
	if err := f.addrs.UpdateResources(map[string]types.Resource{
		"Kubernetes//Pod/default/a":             wl("default", "a", "10.0.0.1", "node1"),
		"Kubernetes//Pod/default/b":             wl("default", "b", "10.0.0.2", "node2"),
		"default/web.default.svc.cluster.local": local,
		seA:                                     a,
		seB:                                     b,
		dns.GetWorkload().Uid:                   dns,
	}, nil); err != nil {
		t.Fatal(err)
	}
	src, snap := newSource(t, f)
	f.waitReq(t, "ACK of addresses", isACK(AddressType))
	if st := src.Status(); st.NACKs != 0 {
		t.Fatalf("NACKs: %+v", st)
	}
	web, _ := snap.Service(netip.MustParseAddrPort("10.96.0.10:80"))
	if web == nil || web.LB.Mode != registry.LBStrict {
		t.Fatalf("STRICT service: %+v", web)
	}
	from := snap.WorkloadByName("default", "a")
	for range 20 {
		if e, ok := web.Pick(netip.MustParseAddr("10.96.0.10"), from); !ok || e.Workload.Name != "a" {
			t.Fatalf("STRICT on NODE from node1 picked %+v (%v), want a (node1)", e, ok)
		}
	}
	for _, tt := range []struct {
		dst, ns, want string
	}{
		{"240.240.0.1:443", "ns-a", "ns-a"},
		{"240.240.0.1:5432", "ns-b", "ns-b"},
	} {
		s, port := snap.ServiceFor(netip.MustParseAddrPort(tt.dst), tt.ns)
		if s == nil || port == nil || s.Namespace != tt.want {
			t.Errorf("ServiceFor(%s, %s) = %v, %v; want the ServiceEntry of %s", tt.dst, tt.ns, s, port, tt.want)
		}
	}
	sa, _ := snap.ServiceFor(netip.MustParseAddrPort("240.240.0.1:443"), "ns-a")
	if e, ok := sa.Pick(netip.MustParseAddr("240.240.0.1"), from); !ok || !e.Unresolved() || e.Workload.Hostname != "db.example.com" {
		t.Errorf("DNS ServiceEntry endpoint: %+v, %v; want db.example.com, unresolved", e, ok)
	}
}

// TestServiceCIDRVIP: a ServiceEntry address with a prefix length is a
// VIP range of the service (NACKed before); a length beyond the
// address's is refused.
func TestServiceCIDRVIP(t *testing.T) {
	c := &converter{td: spiffeid.RequireTrustDomainFromString("cluster.local")}
	l := func(n uint32) *uint32 { return &n }
	in := &workloadapi.Service{Name: "r", Namespace: "default", Hostname: "r.example.com",
		Addresses: []*workloadapi.NetworkAddress{
			{Address: netip.MustParseAddr("240.10.0.0").AsSlice(), Length: l(16)},
			{Address: netip.MustParseAddr("240.11.0.1").AsSlice(), Length: l(32)},
			{Address: netip.MustParseAddr("2001:db8::").AsSlice(), Length: l(64)},
		},
		Ports: []*workloadapi.Port{{ServicePort: 443, TargetPort: 443}}}
	out, err := c.service(in)
	if err != nil {
		t.Fatal(err)
	}
	if got := fmt.Sprint(out.s.VIPs, out.s.CIDRs); got != "[240.11.0.1] [240.10.0.0/16 2001:db8::/64]" {
		t.Errorf("VIPs, CIDRs = %s", got)
	}
	in.Addresses = in.Addresses[:1]
	in.Addresses[0].Length = l(33)
	if _, err := c.service(in); err == nil || !strings.Contains(err.Error(), "240.10.0.0/33 is not a valid range") {
		t.Errorf("/33: err = %v", err)
	}
}
