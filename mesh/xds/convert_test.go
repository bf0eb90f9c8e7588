package xds

import (
	"net/netip"
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
