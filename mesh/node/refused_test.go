package node

import (
	"net/netip"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/proxy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// TestRefusedWorkloadCaptured: a local workload meshtun refuses is
// captured both ways (what it opens, and plaintext to any of its ports,
// so that the proxy denies it), gets no certificate, and is counted by
// reason in meshtun_refused_workloads.
func TestRefusedWorkloadCaptured(t *testing.T) {
	a := netip.MustParseAddr
	snap, err := registry.NewSnapshot(spiffeid.RequireTrustDomainFromString("cluster.local"), []*registry.Workload{
		{Name: "ok", Namespace: "default", Node: "n1", InMesh: true, Addresses: []netip.Addr{a("198.18.1.11")}},
		{Name: "w", Namespace: "default", Node: "n1", InMesh: true, Refused: "waypoint", Addresses: []netip.Addr{a("198.18.1.12")}},
		{Name: "w2", Namespace: "default", Node: "n1", InMesh: true, Refused: "waypoint", Addresses: []netip.Addr{a("198.18.1.13")}},
		{Name: "n", Namespace: "default", Node: "n1", InMesh: true, Refused: "network", Addresses: []netip.Addr{a("198.18.1.14")}},
		{Name: "denied-address:198.18.2.13", Namespace: "istio-system", InMesh: true, Refused: "address_conflict", Addresses: []netip.Addr{a("198.18.2.13")}},
	})
	if err != nil {
		t.Fatal(err)
	}
	reg := registry.New(snap)
	p := proxy.CapturePolicy(reg, "n1", func(netip.Addr) bool { return false })
	ap := netip.MustParseAddrPort
	for _, tc := range []struct{ src, dst string }{
		{"198.18.1.12:40000", "203.0.113.1:443"},  // outbound from it
		{"198.18.0.99:40000", "198.18.1.12:8080"}, // plaintext from outside the mesh to it
		{"198.18.0.99:40000", "198.18.1.12:1"},
	} {
		if !p.InterceptTCP(ap(tc.src), ap(tc.dst)) {
			t.Errorf("%s -> %s is not captured", tc.src, tc.dst)
		}
	}
	if p.InterceptTCP(ap("198.18.0.99:40000"), ap("198.18.1.11:8080")) {
		t.Error("control: plaintext to an unprotected PERMISSIVE workload is captured")
	}
	certified := withCertificates(localWorkloads(snap, "n1"))
	if len(certified) != 1 || certified[0].Name != "ok" {
		t.Errorf("workloads with certificates: %v, want ok only", certified)
	}
	r := prometheus.NewPedanticRegistry()
	r.MustRegister(refusedCollector{reg, "n1"})
	mfs, err := r.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]float64{}
	for _, mf := range mfs {
		if mf.GetName() != RefusedWorkloadsMetric && mf.GetName() != DeniedAddressesMetric {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				got[l.GetName()+"="+l.GetValue()] = m.GetGauge().GetValue()
			}
		}
	}
	if got["reason=waypoint"] != 2 || got["reason=network"] != 1 || got["reason=address_conflict"] != 1 || len(got) != 3 {
		t.Errorf("%s and %s = %v, want waypoint 2, network 1 (local workloads), address_conflict 1 (another node's address)", RefusedWorkloadsMetric, DeniedAddressesMetric, got)
	}
}
