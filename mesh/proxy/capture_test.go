package proxy

import (
	"net/netip"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// TestCapturePolicyNode: what the node itself sends to a local workload is
// captured like plaintext from any other host (STRICT and policy-protected
// workloads), except to the workload's probe ports, which only the node
// reaches directly.
func TestCapturePolicyNode(t *testing.T) {
	a := netip.MustParseAddr
	snap, err := registry.NewSnapshot(spiffeid.RequireTrustDomainFromString("cluster.local"), []*registry.Workload{
		{Name: "strict", Namespace: "default", Node: "n1", InMesh: true, PeerAuth: registry.Strict,
			Addresses: []netip.Addr{a("198.18.1.11"), a("fd00:6d74:1::11")}, ProbePorts: []uint16{8081}},
		{Name: "open", Namespace: "default", Node: "n1", InMesh: true, Addresses: []netip.Addr{a("198.18.1.12")}, ProbePorts: []uint16{8081}},
		{Name: "remote", Namespace: "default", Node: "n2", InMesh: true, PeerAuth: registry.Strict, Addresses: []netip.Addr{a("198.18.2.11")}},
	})
	if err != nil {
		t.Fatal(err)
	}
	nodeAddrs := map[netip.Addr]bool{a("198.18.0.11"): true, a("198.18.1.1"): true, a("fd00:6d74:1::1"): true}
	p := CapturePolicy(registry.New(snap), "n1", func(x netip.Addr) bool { return nodeAddrs[x] })
	ap := netip.MustParseAddrPort
	for _, tc := range []struct {
		src, dst string
		want     bool
	}{
		{"198.18.0.11:40000", "198.18.1.11:8080", true}, // node → STRICT: authorized (refused)
		{"198.18.1.1:40000", "198.18.1.11:8080", true},  // from the node's pod-link address too
		{"198.18.1.1:40000", "198.18.1.11:8081", false}, // node → probe port: direct
		{"[fd00:6d74:1::1]:40000", "[fd00:6d74:1::11]:8081", false},
		{"[fd00:6d74:1::1]:40000", "[fd00:6d74:1::11]:8080", true},
		{"198.18.0.99:40000", "198.18.1.11:8081", true},  // another host → probe port: STRICT applies
		{"198.18.0.11:40000", "198.18.1.11:15008", true}, // HBONE is always taken
		{"198.18.0.11:40000", "198.18.1.12:8080", false}, // node → unprotected PERMISSIVE: direct
		{"198.18.0.11:40000", "198.18.2.11:8080", false}, // not this node's workload
		{"198.18.1.12:40000", "198.18.0.11:8081", true},  // a local mesh workload's own connection
		// Mesh to mesh is taken both ways (the classifier's rule for
		// segments of no known flow): a remote mesh workload's plaintext
		// to an unprotected local one, and the reverse orientation.
		{"198.18.2.11:40000", "198.18.1.12:8080", true},
		{"198.18.1.12:8080", "198.18.2.11:40000", true},
	} {
		if got := p.InterceptTCP(ap(tc.src), ap(tc.dst)); got != tc.want {
			t.Errorf("%s → %s: intercept %v, want %v", tc.src, tc.dst, got, tc.want)
		}
	}
}

// TestCapturePolicy: the SYNs the netstack takes on node n1. Connections
// opened by a local mesh workload and HBONE to one are always taken;
// plaintext to a local mesh workload only when STRICT mode or a policy
// protects it; nothing that concerns only other nodes' or non-mesh
// workloads.
func TestCapturePolicy(t *testing.T) {
	deny, err := policy.New(policy.Policy{Name: "no-9", Namespace: "guarded", Action: policy.Deny,
		Rules: []policy.Rule{{To: []policy.Operation{{Ports: []uint16{9}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	a := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	snap, err := registry.Build(registry.Model{
		TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local"),
		Workloads: []*registry.Workload{
			{Name: "open", Namespace: "default", Node: "n1", InMesh: true, Addresses: []netip.Addr{a("198.18.1.1"), a("fd00:6d74:1::1")}},
			{Name: "strict", Namespace: "default", Node: "n1", InMesh: true, PeerAuth: registry.Strict, Addresses: []netip.Addr{a("198.18.1.2"), a("fd00:6d74:1::2")}},
			{Name: "guarded", Namespace: "guarded", Node: "n1", InMesh: true, Addresses: []netip.Addr{a("198.18.1.3")}},
			{Name: "plain", Namespace: "default", Node: "n1", InMesh: false, PeerAuth: registry.Strict, Addresses: []netip.Addr{a("198.18.1.4")}},
			{Name: "remote", Namespace: "default", Node: "n2", InMesh: true, PeerAuth: registry.Strict, Addresses: []netip.Addr{a("198.18.2.1")}},
			{Name: "waypoint", Namespace: "default", Node: "n1", InMesh: true, NativeTunnel: true, PeerAuth: registry.Strict, Addresses: []netip.Addr{a("198.18.1.5")}},
		},
		Policies: []*policy.Policy{deny},
	})
	if err != nil {
		t.Fatal(err)
	}
	take := CapturePolicy(registry.New(snap), "n1", func(netip.Addr) bool { return false })
	ap := func(s string) netip.AddrPort { return netip.MustParseAddrPort(s) }
	for _, tc := range []struct {
		name     string
		src, dst string
		want     bool
	}{
		{"from a local mesh workload", "198.18.1.1:40000", "198.18.9.9:80", true},
		{"from a local mesh workload (IPv6)", "[fd00:6d74:1::1]:40000", "[fd00:6d74:9::9]:80", true},
		{"HBONE to a local mesh workload", "198.18.9.9:40000", "198.18.1.1:15008", true},
		{"plaintext to a PERMISSIVE unprotected local workload", "198.18.9.9:40000", "198.18.1.1:80", false},
		{"plaintext to a STRICT local workload", "198.18.9.9:40000", "198.18.1.2:80", true},
		{"plaintext to a STRICT local workload (IPv6)", "[fd00:6d74:9::9]:40000", "[fd00:6d74:1::2]:80", true},
		{"plaintext to a policy-protected local workload", "198.18.9.9:40000", "198.18.1.3:80", true},
		{"to a STRICT workload outside the mesh", "198.18.9.9:40000", "198.18.1.4:80", false},
		{"from a workload outside the mesh", "198.18.1.4:40000", "198.18.9.9:80", false},
		{"to a STRICT mesh workload of another node", "198.18.9.9:40000", "198.18.2.1:80", false},
		{"from a mesh workload of another node", "198.18.2.1:40000", "198.18.9.9:80", false},
		{"HBONE to another node's workload", "198.18.9.9:40000", "198.18.2.1:15008", false},
		{"between unknown addresses", "198.18.9.8:40000", "198.18.9.9:80", false},
		{"HBONE to a local waypoint (it terminates HBONE itself)", "198.18.9.9:40000", "198.18.1.5:15008", false},
		{"plaintext to a local STRICT waypoint", "198.18.9.9:40000", "198.18.1.5:80", false},
		{"from a local waypoint", "198.18.1.5:40000", "198.18.9.9:80", false},
		{"from a local mesh workload to a local waypoint", "198.18.1.1:40000", "198.18.1.5:15008", true},
	} {
		if got := take.InterceptTCP(ap(tc.src), ap(tc.dst)); got != tc.want {
			t.Errorf("%s: %s -> %s intercepted %v, want %v", tc.name, tc.src, tc.dst, got, tc.want)
		}
	}
}
