package proxy

import (
	"context"
	"maps"
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
	svc := &registry.Service{Name: "server", Namespace: "b", Hostname: "server.b.svc.cluster.local"}
	p := &Proxy{}
	r := p.newRecord(netip.MustParseAddrPort("10.0.0.1:4000"), netip.MustParseAddrPort("10.0.0.2:80"), src, dst, "outbound", "hbone").
		via(netip.MustParseAddrPort("10.0.0.2:80"), svc)
	got := r.labels("source", "-")
	want := metrics.Conn{
		Reporter: "source",
		Src: metrics.Peer{Workload: "client", Namespace: "a", Principal: "spiffe://cluster.local/ns/a/sa/client",
			CanonicalService: "client-svc", CanonicalRevision: "v3", Cluster: "Kubernetes"},
		Dst: metrics.Peer{Workload: "server-0", Namespace: "b", Principal: "spiffe://cluster.local/ns/b/sa/server",
			CanonicalService: "server", CanonicalRevision: "v1"},
		DstService:     metrics.Service{Hostname: "server.b.svc.cluster.local", Name: "server", Namespace: "b"},
		SecurityPolicy: "mutual_tls", ResponseFlags: "-",
	}
	if got != want {
		t.Errorf("labels =\n%+v\nwant\n%+v", got, want)
	}
}

// TestServiceMetricLabels: a connection to a service carries the service's
// hostname, name and namespace in destination_service,
// destination_service_name and destination_service_namespace, as ztunnel's
// metrics do: outbound when the client connected to its VIP, inbound when
// the peer's forwarded host is its hostname. A connection to a workload's
// own address, or naming an unknown host, has "unknown" in all three.
func TestServiceMetricLabels(t *testing.T) {
	p, _ := inboundProxy(t, refusingDialer{}, 0)
	snap := p.cfg.Registry.Load()
	web := metrics.Service{Hostname: "web.default.svc.cluster.local", Name: "web", Namespace: "default"}
	clientAddr, webAddr := netip.MustParseAddr("198.18.2.10"), netip.MustParseAddr("198.18.1.20")
	client, server := snap.Workload(clientAddr), snap.Workload(webAddr)

	vip := netip.MustParseAddrPort("198.18.100.1:80")
	svc, port := snap.Service(vip)
	if svc == nil {
		t.Fatalf("no service at %s", vip)
	}
	target := netip.AddrPortFrom(webAddr, port.Target())
	r := p.newRecord(netip.AddrPortFrom(clientAddr, 40000), vip, client, server, "outbound", "hbone").via(target, svc)
	if got := r.labels("source", "-").DstService; got != web {
		t.Errorf("outbound to the VIP: destination service %+v, want %+v", got, web)
	}
	r = p.newRecord(netip.AddrPortFrom(clientAddr, 40000), target, client, server, "outbound", "hbone").via(target, nil)
	if got := r.labels("source", "-").DstService; got != (metrics.Service{}) {
		t.Errorf("outbound to the pod's address: destination service %+v, want none", got)
	}

	// Inbound, through the HBONE handler (the workload refuses, so each
	// request is counted opened with CONNECT).
	for _, host := range []string{"web.default.svc.cluster.local", "other.example", ""} {
		if _, err := p.connect(context.Background(), inboundRequest(host)); err == nil {
			t.Fatal("connect succeeded through a dialer that refuses")
		}
	}
	fams, err := p.cfg.Metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[[3]string]float64{}
	for _, f := range fams {
		if f.GetName() != "istio_tcp_connections_opened_total" {
			continue
		}
		for _, m := range f.GetMetric() {
			l := map[string]string{}
			for _, lp := range m.GetLabel() {
				l[lp.GetName()] = lp.GetValue()
			}
			got[[3]string{l["destination_service"], l["destination_service_name"], l["destination_service_namespace"]}] += m.GetCounter().GetValue()
		}
	}
	want := map[[3]string]float64{
		{"web.default.svc.cluster.local", "web", "default"}: 1,
		{"unknown", "unknown", "unknown"}:                   2,
	}
	if !maps.Equal(got, want) {
		t.Errorf("inbound istio_tcp_connections_opened_total by destination service (hostname, name, namespace) = %v, want %v", got, want)
	}
}
