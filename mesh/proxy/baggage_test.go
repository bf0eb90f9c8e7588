package proxy

import (
	"context"
	"maps"
	"net/netip"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/metrics"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
)

// TestBaggageZtunnelKeys: the baggage of a source workload has ztunnel's
// keys: the owner under k8s.<type>.name, service.name and service.version
// the canonical service and revision (not the pod's name), the region and
// zone when known; a workload whose owner the model does not know is
// k8s.pod.name. It parses back through the header.
func TestBaggageZtunnelKeys(t *testing.T) {
	istiod := &registry.Workload{Name: "web-5d4f-x2x", Namespace: "shop", WorkloadName: "web", WorkloadType: "deployment",
		CanonicalName: "web-svc", CanonicalRevision: "v2", Cluster: "Kubernetes",
		Locality: registry.Locality{Region: "eu-west1", Zone: "eu-west1-b", Subzone: "rack7"}}
	bare := &registry.Workload{Name: "sleep-0", Namespace: "default", Labels: map[string]string{"app": "sleep", "version": "v1"}}
	for _, tc := range []struct {
		w    *registry.Workload
		want hbone.Baggage
	}{
		{istiod, hbone.Baggage{"k8s.cluster.name": "Kubernetes", "k8s.namespace.name": "shop", "k8s.deployment.name": "web",
			"service.name": "web-svc", "service.version": "v2", "cloud.region": "eu-west1", "cloud.availability_zone": "eu-west1-b"}},
		{bare, hbone.Baggage{"k8s.namespace.name": "default", "k8s.pod.name": "sleep-0", "service.name": "sleep", "service.version": "v1"}},
	} {
		got := baggage(tc.w)
		if !maps.Equal(got, tc.want) {
			t.Errorf("baggage(%s) = %v, want %v", tc.w, got, tc.want)
		}
		back, err := hbone.ParseBaggage(got.String())
		if err != nil || !maps.Equal(back, tc.want) {
			t.Errorf("baggage(%s) through the header: %v, %v", tc.w, back, err)
		}
		// What ztunnel's inbound reads from it comes back as the source.
		d, err := deriveSource(back, spiffeid.RequireFromString("spiffe://cluster.local/ns/"+tc.w.Namespace+"/sa/x"))
		if err != nil || d == nil {
			t.Fatalf("deriveSource of our own baggage: %v, %v", d, err)
		}
		svc, rev := tc.w.Canonical()
		want := metrics.Peer{Workload: tc.w.Workload(), Namespace: tc.w.Namespace, CanonicalService: svc, CanonicalRevision: rev,
			Cluster: tc.w.Cluster, Region: tc.w.Locality.Region, Zone: tc.w.Locality.Zone}
		if d.peer != want {
			t.Errorf("derived %+v, want %+v", d.peer, want)
		}
	}
}

// TestDeriveSourceBounds: what a peer claims in its baggage becomes
// labels only if it holds: values bounded and printable, the namespace
// the peer's own; nothing about the source is no derived source.
func TestDeriveSourceBounds(t *testing.T) {
	id := spiffeid.RequireFromString("spiffe://cluster.local/ns/shop/sa/web")
	for _, tc := range []struct {
		name string
		b    hbone.Baggage
		ok   bool
	}{
		{"valid", hbone.Baggage{"k8s.namespace.name": "shop", "k8s.job.name": "batch", "service.name": "batch"}, true},
		{"another namespace", hbone.Baggage{"k8s.namespace.name": "bank", "service.name": "web"}, false},
		{"long value", hbone.Baggage{"service.name": strings.Repeat("a", maxBaggageValue+1)}, false},
		{"control character", hbone.Baggage{"service.name": "a\nb"}, false},
		{"invalid UTF-8", hbone.Baggage{"k8s.pod.name": "\xff"}, false},
	} {
		d, err := deriveSource(tc.b, id)
		if (err == nil) != tc.ok || (d != nil) != tc.ok {
			t.Errorf("%s: %+v, %v; want accepted %v", tc.name, d, err, tc.ok)
		}
	}
	if d, err := deriveSource(hbone.Baggage{"other.key": "x"}, id); d != nil || err != nil {
		t.Errorf("baggage without ztunnel's keys: %+v, %v", d, err)
	}
	d, _ := deriveSource(hbone.Baggage{"k8s.job.name": "batch"}, id)
	if d == nil || d.peer.Namespace != "shop" {
		t.Errorf("the namespace defaults to the peer's: %+v", d)
	}
	// The labels of a connection from a source the model does not know
	// are the derived ones, with the verified principal.
	r := &record{srcID: id.String(), derived: d, reporters: []string{"destination"}}
	if c := r.labels("destination", "-"); c.Src.Workload != "batch" || c.Src.Namespace != "shop" || c.Src.Principal != id.String() {
		t.Errorf("labels with a derived source: %+v", c.Src)
	}
}

var traceIDRe = regexp.MustCompile(`^[0-9a-f]{32}$`)

// TestInboundTraceID: an inbound HBONE request's trace id is the access
// log's trace_id; without a traceparent (or with a malformed one) the
// connection gets a new trace id of its own.
func TestInboundTraceID(t *testing.T) {
	e := newInboundEnv(t)
	dial := func(tp string) map[string]any {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_, err := e.cl.Dial(ctx, hbone.DialRequest{
			Source: e.client, Destination: e.server, Endpoint: e.endpoint, Target: targetServer,
			Forwarded: hbone.Forwarded{For: netip.AddrPortFrom(clientAddr, 40100)}, TraceParent: tp,
			Baggage: hbone.Baggage{"k8s.namespace.name": "a"},
		})
		if err == nil {
			t.Fatal("HBONE stream opened; the test's netstack refuses every dial")
		}
		e.nextDial(t)
		return e.lastRecord(t)
	}
	const tp = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	if got := dial(tp)["trace_id"]; got != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Errorf("trace_id %v, want the request's 4bf92f3577b34da6a3ce929d0e0e4736", got)
	}
	first, _ := dial("")["trace_id"].(string)
	second, _ := dial("")["trace_id"].(string)
	if !traceIDRe.MatchString(first) || !traceIDRe.MatchString(second) || first == second {
		t.Errorf("trace ids without a traceparent %q, %q: want two different 32-digit ids", first, second)
	}
}

// TestRecordClusterAndLocality: the access log names each end's cluster
// (ztunnel's src.cluster and dst.cluster) and the trace id; the metric
// labels carry each end's region and zone.
func TestRecordClusterAndLocality(t *testing.T) {
	src := &registry.Workload{Name: "a", Namespace: "x", Cluster: "east", Locality: registry.Locality{Region: "r1", Zone: "z1"}}
	dst := &registry.Workload{Name: "b", Namespace: "y", Cluster: "west", Locality: registry.Locality{Region: "r2", Zone: "z2"}}
	var buf syncBuffer
	p := &Proxy{access: zerolog.New(&buf)}
	r := p.newRecord(netip.MustParseAddrPort("10.0.0.1:1"), netip.MustParseAddrPort("10.0.0.2:2"), src, dst, "outbound", "hbone")
	r.event(p.access.Info()).Msg("x")
	l := buf.Lines(t)[0]
	if l["src.cluster"] != "east" || l["dst.cluster"] != "west" || l["trace_id"] != r.trace.TraceIDString() || r.trace.IsZero() {
		t.Errorf("access log %v: want src.cluster east, dst.cluster west, trace_id %s", l, r.trace.TraceIDString())
	}
	c := r.labels("source", "-")
	if c.Src.Region != "r1" || c.Src.Zone != "z1" || c.Dst.Region != "r2" || c.Dst.Zone != "z2" {
		t.Errorf("labels %+v %+v: want each end's region and zone", c.Src, c.Dst)
	}
}
