package proxy

import (
	"net/netip"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/metrics"
	"github.com/meshtun/meshtun/mesh/registry"
)

// TestMetricLabelsFromModel: Istio's metric labels take istiod's names
// from the model (the owner's workload name, canonical service and
// revision, cluster) and, for workloads that lack them, derive them from
// the labels as Istio does.
func TestMetricLabelsFromModel(t *testing.T) {
	src := &registry.Workload{Name: "client-7c9-abc", Namespace: "a", InMesh: true,
		Identity:     spiffeid.RequireFromString("spiffe://cluster.local/ns/a/sa/client"),
		WorkloadName: "client", CanonicalName: "client-svc", CanonicalRevision: "v3", Cluster: "Kubernetes"}
	dst := &registry.Workload{Name: "server-0", Namespace: "b", InMesh: true,
		Identity: spiffeid.RequireFromString("spiffe://cluster.local/ns/b/sa/server"),
		Labels:   map[string]string{"app": "server", "version": "v1"}}
	p := &Proxy{}
	r := p.newRecord(netip.MustParseAddrPort("10.0.0.1:4000"), netip.MustParseAddrPort("10.0.0.2:80"), src, dst, "outbound", "hbone").
		via(netip.MustParseAddrPort("10.0.0.2:80"), "server.b.svc.cluster.local")
	got := r.labels("source", "-")
	want := metrics.Conn{
		Reporter: "source",
		Src: metrics.Peer{Workload: "client", Namespace: "a", Principal: "spiffe://cluster.local/ns/a/sa/client",
			CanonicalService: "client-svc", CanonicalRevision: "v3", Cluster: "Kubernetes"},
		Dst: metrics.Peer{Workload: "server-0", Namespace: "b", Principal: "spiffe://cluster.local/ns/b/sa/server",
			CanonicalService: "server", CanonicalRevision: "v1"},
		DstService: "server.b.svc.cluster.local", SecurityPolicy: "mutual_tls", ResponseFlags: "-",
	}
	if got != want {
		t.Errorf("labels =\n%+v\nwant\n%+v", got, want)
	}
}
