package xds

import (
	"errors"
	"net/netip"
	"slices"
	"strings"
	"testing"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/protobuf/types/known/anypb"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

func exact(s string) *security.StringMatch {
	return &security.StringMatch{MatchType: &security.StringMatch_Exact{Exact: s}}
}

// Policies in the shape istiod gives them (a rule's to, from and each
// when condition as separate AND-ed rules) decide as the Istio policy
// would.
func TestAuthorizationShapes(t *testing.T) {
	c := &converter{td: spiffeid.RequireTrustDomainFromString("cluster.local"), root: "istio-system"}
	presence := &security.StringMatch{MatchType: &security.StringMatch_Presence{}}
	// ALLOW to port 80 from namespace "a" (or principal .../sa/x), when
	// source.ip in 10.0.0.0/8.
	allow := &security.Authorization{
		Name: "p", Namespace: "ns", Scope: security.Scope_NAMESPACE, Action: security.Action_ALLOW,
		Groups: []*security.Group{{Rules: []*security.Rules{
			{Matches: []*security.Match{{DestinationPorts: []uint32{80}}}},
			{Matches: []*security.Match{{Namespaces: []*security.StringMatch{exact("a")}}, {Principals: []*security.StringMatch{exact("cluster.local/ns/b/sa/x")}}}},
			{Matches: []*security.Match{{SourceIps: []*security.Address{{Address: netip.MustParseAddr("10.0.0.0").AsSlice(), Length: 8}}}}},
		}}},
	}
	p, err := c.authorization(allow)
	if err != nil {
		t.Fatal(err)
	}
	req := func(peer, src, dst string) *policy.Request {
		r := &policy.Request{Source: netip.MustParseAddr(src), Dest: netip.MustParseAddrPort(dst)}
		if peer != "" {
			r.Peer = spiffeid.RequireFromString(peer)
		}
		return r
	}
	for _, tc := range []struct {
		r    *policy.Request
		want bool
	}{
		{req("spiffe://cluster.local/ns/a/sa/y", "10.1.1.1", "10.2.0.1:80"), true},
		{req("spiffe://cluster.local/ns/b/sa/x", "10.1.1.1", "10.2.0.1:80"), true},
		{req("spiffe://cluster.local/ns/b/sa/y", "10.1.1.1", "10.2.0.1:80"), false},
		{req("spiffe://cluster.local/ns/a/sa/y", "10.1.1.1", "10.2.0.1:81"), false},
		{req("spiffe://cluster.local/ns/a/sa/y", "192.168.0.1", "10.2.0.1:80"), false},
	} {
		if got := p.Matches(tc.r); got != tc.want {
			t.Errorf("%v from %s to %s: matches %v, want %v", tc.r.Peer, tc.r.Source, tc.r.Dest, got, tc.want)
		}
	}
	// istiod's static STRICT policy: DENY when no principal is present
	// matches plaintext only.
	strict, err := c.authorization(&security.Authorization{
		Name: "istio_converted_static_strict", Namespace: "istio-system", Scope: security.Scope_GLOBAL, Action: security.Action_DENY,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{{NotPrincipals: []*security.StringMatch{presence}}}}}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if !strict.Matches(req("", "10.1.1.1", "10.2.0.1:80")) || strict.Matches(req("spiffe://cluster.local/ns/a/sa/y", "10.1.1.1", "10.2.0.1:80")) {
		t.Error("the static strict policy does not match exactly the plaintext requests")
	}
	// What meshtun cannot express is refused with a message saying so.
	_, err = c.authorization(&security.Authorization{
		Name: "mixed", Namespace: "ns", Scope: security.Scope_NAMESPACE,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{
			{Namespaces: []*security.StringMatch{exact("a")}}, {DestinationPorts: []uint32{80}},
		}}}}},
	})
	if err == nil || !strings.Contains(err.Error(), "cannot express") {
		t.Errorf("mixed matches: %v", err)
	}
}

// A policy meshtun cannot apply denies everything in its scope instead of
// being left out (which would let in what it denies).
func TestUnappliablePolicyFailsClosed(t *testing.T) {
	src := New(Config{TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local")})
	bad := &security.Authorization{
		Name: "mixed", Namespace: "ns", Scope: security.Scope_WORKLOAD_SELECTOR, Action: security.Action_DENY,
		Groups: []*security.Group{{Rules: []*security.Rules{{Matches: []*security.Match{
			{Namespaces: []*security.StringMatch{exact("a")}}, {DestinationPorts: []uint32{80}},
		}}}}},
	}
	pany, err := anypb.New(bad)
	if err != nil {
		t.Fatal(err)
	}
	w := wl("ns", "w", "10.0.0.1", "n1", "ns/mixed")
	wany, _ := anypb.New(w)
	if nack := src.apply(response{typeURL: AddressType, full: true, resources: []*discoveryv3.Resource{{Name: "w", Resource: wany}}}); nack != "" {
		t.Fatal(nack)
	}
	nack := src.apply(response{typeURL: AuthorizationType, full: true, resources: []*discoveryv3.Resource{{Name: "ns/mixed", Resource: pany}}})
	if !strings.Contains(nack, "ns/mixed") || !strings.Contains(nack, "denying every connection") {
		t.Fatalf("NACK %q", nack)
	}
	snap, _, _, err := src.build(src.st)
	if err != nil {
		t.Fatal(err)
	}
	r := &policy.Request{Peer: spiffeid.RequireFromString("spiffe://cluster.local/ns/b/sa/x"), Source: netip.MustParseAddr("10.9.0.1"), Dest: netip.MustParseAddrPort("10.0.0.1:8080")}
	if d := snap.Authorize(r); d.Allowed {
		t.Errorf("a connection the unappliable DENY policy might cover is allowed: %v", d)
	}
}

// istiod's names for a workload (its owner, canonical service and
// revision, uid, cluster, locality) reach the registry, for telemetry and
// /config_dump.
func TestWorkloadKeepsIstiodNames(t *testing.T) {
	c := &converter{td: spiffeid.RequireTrustDomainFromString("cluster.local"), root: "istio-system"}
	in := wl("ns", "web-5d4f-x2x", "10.0.0.1", "n1").GetWorkload()
	in.WorkloadName, in.WorkloadType = "web", workloadapi.WorkloadType_DEPLOYMENT
	in.CanonicalName, in.CanonicalRevision, in.ClusterId = "web-svc", "v2", "Kubernetes"
	in.Locality = &workloadapi.Locality{Region: "eu-west1", Zone: "eu-west1-b", Subzone: "rack7"}
	out, err := c.workload(in)
	if err != nil {
		t.Fatal(err)
	}
	w := out.w
	if w.UID != "Kubernetes//Pod/ns/web-5d4f-x2x" || w.WorkloadName != "web" || w.WorkloadType != "deployment" ||
		w.CanonicalName != "web-svc" || w.CanonicalRevision != "v2" || w.Cluster != "Kubernetes" {
		t.Errorf("converted workload = uid %q name %q type %q canonical %q/%q cluster %q",
			w.UID, w.WorkloadName, w.WorkloadType, w.CanonicalName, w.CanonicalRevision, w.Cluster)
	}
	if want := (registry.Locality{Region: "eu-west1", Zone: "eu-west1-b", Subzone: "rack7"}); w.Locality != want {
		t.Errorf("locality %+v, want %+v", w.Locality, want)
	}
}

// Workloads and services with a waypoint are kept, their waypoint
// recorded (by address on this node's network, or by hostname and
// namespace; the HBONE port 15008 when istiod leaves it 0); a waypoint
// meshtun cannot reach (another network) or that names nothing refuses
// the workload (captured and denied on its node) and NACKs the service.
func TestWaypointConversion(t *testing.T) {
	c := &converter{td: spiffeid.RequireTrustDomainFromString("cluster.local"), network: "net1", root: "istio-system"}
	byAddr := func(network, ip string, port uint32) *workloadapi.GatewayAddress {
		return &workloadapi.GatewayAddress{HboneMtlsPort: port, Destination: &workloadapi.GatewayAddress_Address{
			Address: &workloadapi.NetworkAddress{Network: network, Address: netip.MustParseAddr(ip).AsSlice()}}}
	}
	byHost := func(ns, host string) *workloadapi.GatewayAddress {
		return &workloadapi.GatewayAddress{HboneMtlsPort: 15008, Destination: &workloadapi.GatewayAddress_Hostname{
			Hostname: &workloadapi.NamespacedHostname{Namespace: ns, Hostname: host}}}
	}
	pod := func(gw *workloadapi.GatewayAddress) *workloadapi.Workload {
		return &workloadapi.Workload{Uid: "c//Pod/app/p", Name: "p", Namespace: "app", Network: "net1", Node: "n1",
			Addresses: [][]byte{netip.MustParseAddr("10.0.0.7").AsSlice()}, TunnelProtocol: workloadapi.TunnelProtocol_HBONE, Waypoint: gw}
	}
	for _, tc := range []struct {
		what string
		gw   *workloadapi.GatewayAddress
		want registry.Waypoint
		err  string
	}{
		{"by address", byAddr("net1", "10.0.0.50", 15008), registry.Waypoint{Addr: netip.MustParseAddr("10.0.0.50"), Port: 15008}, ""},
		{"port 0", byAddr("net1", "fd00::50", 0), registry.Waypoint{Addr: netip.MustParseAddr("fd00::50"), Port: 15008}, ""},
		{"by hostname", byHost("infra", "wp.infra.svc.cluster.local"), registry.Waypoint{Hostname: "wp.infra.svc.cluster.local", Namespace: "infra", Port: 15008}, ""},
		{"another network", byAddr("net2", "10.0.0.50", 15008), registry.Waypoint{}, `is on network "net2"`},
		{"no namespace", byHost("", "wp.infra.svc.cluster.local"), registry.Waypoint{}, "both are required"},
		{"no destination", &workloadapi.GatewayAddress{HboneMtlsPort: 15008}, registry.Waypoint{}, "without an address or a hostname"},
	} {
		out, err := c.workload(pod(tc.gw))
		if tc.err != "" {
			var r *refusal
			if !errors.As(err, &r) || r.reason != RefusedWaypoint || !strings.Contains(err.Error(), tc.err) || out == nil || out.w.Refused != RefusedWaypoint {
				t.Errorf("workload, %s: %v, %v; want refused (%s) with %q", tc.what, out, err, RefusedWaypoint, tc.err)
			}
		} else if err != nil || out.w.Refused != "" || out.w.Waypoint == nil || *out.w.Waypoint != tc.want {
			t.Errorf("workload, %s: %+v, %v; want waypoint %+v", tc.what, out, err, tc.want)
		}

		in := &workloadapi.Service{Name: "web", Namespace: "app", Hostname: "web.app.svc.cluster.local", Waypoint: tc.gw,
			Addresses: []*workloadapi.NetworkAddress{{Network: "net1", Address: netip.MustParseAddr("10.96.0.1").AsSlice()}},
			Ports:     []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}}
		s, err := c.service(in)
		if tc.err != "" {
			if err == nil || !strings.Contains(err.Error(), tc.err) || !strings.Contains(err.Error(), "app/web.app.svc.cluster.local") {
				t.Errorf("service, %s: %v, want an error naming it with %q", tc.what, err, tc.err)
			}
		} else if err != nil || s.s.Waypoint == nil || *s.s.Waypoint != tc.want {
			t.Errorf("service, %s: %+v, %v; want waypoint %+v", tc.what, s, err, tc.want)
		}
	}

	weighted := &workloadapi.Service{Name: "web", Namespace: "app", Hostname: "web.app.svc.cluster.local",
		Addresses: []*workloadapi.NetworkAddress{{Network: "net1", Address: netip.MustParseAddr("10.96.0.1").AsSlice()}},
		WeightedWaypoints: []*workloadapi.WeightedWaypoint{
			{Destination: byHost("infra", "a.infra.svc.cluster.local"), Weight: 90},
			{Destination: byAddr("net1", "10.0.0.51", 15008), Weight: 10},
		}}
	s, err := c.service(weighted)
	if err != nil {
		t.Fatal(err)
	}
	if ww := s.s.WeightedWaypoints; len(ww) != 2 || ww[0].Weight != 90 || ww[0].Waypoint.Hostname != "a.infra.svc.cluster.local" ||
		ww[1].Weight != 10 || ww[1].Waypoint.Addr != netip.MustParseAddr("10.0.0.51") || s.s.Waypoint != nil {
		t.Errorf("weighted waypoints: %+v", s.s)
	}
	weighted.WeightedWaypoints = append(weighted.WeightedWaypoints, &workloadapi.WeightedWaypoint{Weight: 1})
	if _, err := c.service(weighted); err == nil || !strings.Contains(err.Error(), "weighted_waypoints[2]") {
		t.Errorf("a weighted waypoint without destination: %v, want an error naming it", err)
	}
}

// A waypoint's own workload (native_tunnel: it terminates HBONE itself)
// is in the mesh for its clients (reached over HBONE, never in
// plaintext) but captured by no node: its node neither intercepts its
// port 15008 nor holds its certificate.
func TestNativeTunnelNotCaptured(t *testing.T) {
	c := &converter{td: spiffeid.RequireTrustDomainFromString("cluster.local"), network: "net1", root: "istio-system"}
	in := &workloadapi.Workload{Uid: "c//Pod/infra/wp", Name: "wp", Namespace: "infra", Network: "net1", Node: "n1",
		Addresses: [][]byte{netip.MustParseAddr("10.0.0.5").AsSlice()}, TunnelProtocol: workloadapi.TunnelProtocol_HBONE}
	out, err := c.workload(in)
	if err != nil || !out.w.InMesh || !out.w.CapturedBy("n1") {
		t.Fatalf("an HBONE workload: %+v, %v; want in the mesh, captured by n1", out, err)
	}
	in.NativeTunnel = true
	if out, err = c.workload(in); err != nil || !out.w.InMesh || out.w.CapturedBy("n1") {
		t.Errorf("a native-tunnel workload: %+v, %v; want in the mesh, captured by no node", out, err)
	}
}

// A port istiod lists once per protocol (kube-dns: 53/UDP and 53/TCP;
// WDS ports carry no protocol) is one service port: the service is kept
// with it once, and the registry builds it (it used to drop kube-dns:
// "port 53 listed twice", seen on kind under istiod).
func TestServicePortListedPerProtocol(t *testing.T) {
	c := &converter{td: spiffeid.RequireTrustDomainFromString("cluster.local"), network: "net1", root: "istio-system"}
	in := &workloadapi.Service{Name: "kube-dns", Namespace: "kube-system", Hostname: "kube-dns.kube-system.svc.cluster.local",
		Addresses: []*workloadapi.NetworkAddress{{Network: "net1", Address: netip.MustParseAddr("10.96.0.10").AsSlice()}},
		Ports:     []*workloadapi.Port{{ServicePort: 53, TargetPort: 53}, {ServicePort: 53, TargetPort: 53}, {ServicePort: 9153, TargetPort: 9153}}}
	s, err := c.service(in)
	if err != nil {
		t.Fatal(err)
	}
	want := []registry.ServicePort{{Port: 53, TargetPort: 53}, {Port: 9153, TargetPort: 9153}}
	if !slices.Equal(s.s.Ports, want) {
		t.Fatalf("ports %+v, want %+v", s.s.Ports, want)
	}
	snap, err := registry.Build(registry.Model{TrustDomain: c.td, Services: []*registry.Service{s.s}})
	if err != nil {
		t.Fatal(err)
	}
	if len(snap.Services) != 1 {
		t.Errorf("the registry kept %d services, want kube-dns", len(snap.Services))
	}
}
