package registry

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/policy"
)

// TestResolve: what cannot hold together is left out or trimmed one
// object at a time, earlier objects winning, and the rest builds.
func TestResolve(t *testing.T) {
	a := wl("ns", "a", "n1", nil, "10.0.0.1")
	m := Model{
		TrustDomain: td,
		Workloads: []*Workload{
			a,
			wl("ns", "b", "n1", nil, "10.0.0.2", "10.0.0.1"), // a's address
			wl("ns", "a", "n2", nil, "10.0.0.3"),             // a's name
			{Name: "d", Namespace: "ns", ServiceAccount: "Not/Valid", Addresses: addrs("10.0.0.4")},
			wl("ns", "e", "n1", nil, "10.0.0.5"),
		},
		Services: []*Service{
			{Name: "s1", Namespace: "ns", VIPs: addrs("10.0.0.5", "10.96.0.1"), Ports: []ServicePort{{Port: 80}},
				Workloads: []WorkloadRef{{"ns", "a"}, {"ns", "b"}}},
			{Name: "s2", Namespace: "ns", VIPs: addrs("10.96.0.1"), Ports: []ServicePort{{Port: 80}}},
			{Name: "s3", Namespace: "ns", VIPs: addrs("10.96.0.3"), Ports: []ServicePort{{Port: 80}, {Port: 80}}},
			{Name: "s4", Namespace: "ns", VIPs: addrs("10.96.0.4", "10.96.0.4")},
		},
	}
	if _, err := Build(m); err == nil {
		t.Fatal("the unresolved model builds")
	}
	out, cs := Resolve(m)
	s := mustBuild(t, out)
	got := map[string]bool{}
	for _, c := range cs {
		got[string(c.Kind)+" "+c.Name+" "+map[bool]string{true: "dropped", false: "trimmed"}[c.Dropped]] = true
		t.Log(c)
	}
	for _, want := range []string{
		"workload ns/b dropped", "workload ns/a dropped", "workload ns/d dropped",
		"service ns/s1 trimmed", "service ns/s2 dropped", "service ns/s3 dropped",
	} {
		if !got[want] {
			t.Errorf("no conflict %q in %v", want, got)
		}
	}
	if len(cs) != 6 {
		t.Errorf("%d conflicts, want 6", len(cs))
	}
	if w := s.Workload(netip.MustParseAddr("10.0.0.1")); w == nil || w.Node != "n1" || w.Name != "a" {
		t.Errorf("10.0.0.1 is %v, want the first a", w)
	}
	if s.Workload(netip.MustParseAddr("10.0.0.2")) != nil {
		t.Error("b's other address is in the model without b")
	}
	s1 := s.ServiceByName("ns", "s1")
	if s1 == nil || len(s1.VIPs) != 1 || s1.VIPs[0] != netip.MustParseAddr("10.96.0.1") || len(s1.Workloads) != 1 {
		t.Errorf("s1 = %+v, want VIP 10.96.0.1 only, endpoint a only", s1)
	}
	if s.ServiceByName("ns", "s4") == nil {
		t.Error("s4, which lists its VIP twice, is gone")
	}
	// m's objects are untouched.
	if len(m.Services[0].VIPs) != 2 || len(m.Services[0].Workloads) != 2 {
		t.Error("Resolve modified the model's service")
	}
	if !strings.Contains(cs[0].Reason, "ns/a") {
		t.Errorf("the conflict %q does not name the winner", cs[0].Reason)
	}
}

// TestRefusedWorkloadDenied: a refused workload denies everything, even
// where no policy applies and an ALLOW-all one does, and every port of
// it is protected (intercepted).
func TestRefusedWorkloadDenied(t *testing.T) {
	allowAll, err := policy.New(policy.Policy{Name: "all", Namespace: "ns", Action: policy.Allow, Rules: []policy.Rule{{}}})
	if err != nil {
		t.Fatal(err)
	}
	r := wl("ns", "r", "n1", nil, "10.0.0.1")
	r.Refused = "waypoint"
	s := mustBuild(t, Model{Workloads: []*Workload{r, wl("ns", "ok", "n1", nil, "10.0.0.2")}, Policies: []*policy.Policy{allowAll}})
	peer := spiffeid.RequireFromString("spiffe://cluster.local/ns/ns/sa/ok")
	if d := s.Authorize(&policy.Request{Peer: peer, Dest: netip.MustParseAddrPort("10.0.0.1:80")}); d.Allowed {
		t.Errorf("the refused workload allows: %v", d)
	}
	if d := s.Authorize(&policy.Request{Peer: peer, Dest: netip.MustParseAddrPort("10.0.0.2:80")}); !d.Allowed {
		t.Errorf("control: %v", d)
	}
	if !s.Workload(netip.MustParseAddr("10.0.0.1")).Protected(12345) {
		t.Error("a port of the refused workload is not protected (plaintext would not be intercepted)")
	}
}
