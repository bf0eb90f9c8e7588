package xds

import (
	"net/netip"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"

	"github.com/meshtun/meshtun/mesh/metrics"
)

// scrape gathers reg into name{labels…} → value, labels in the order
// Prometheus sorts them.
func scrape(t *testing.T, reg *prometheus.Registry) map[string]float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]float64{}
	for _, f := range fams {
		for _, m := range f.GetMetric() {
			k := f.GetName()
			for i, l := range m.GetLabel() {
				sep := ","
				if i == 0 {
					sep = "{"
				}
				k += sep + l.GetName() + "=" + l.GetValue()
			}
			if len(m.GetLabel()) > 0 {
				k += "}"
			}
			out[k] = value(m)
		}
	}
	return out
}

func value(m *dto.Metric) float64 {
	if m.GetGauge() != nil {
		return m.GetGauge().GetValue()
	}
	return m.GetCounter().GetValue()
}

// TestXDSHealthMetrics: the xDS health metrics follow the stream:
// connected, responses ACKed and NACKed by type with the time of the
// last of each, resources held by type, bytes received, and a stream
// that ends counted as a termination (ztunnel's names where it has them).
func TestXDSHealthMetrics(t *testing.T) {
	f := newFakeIstiod(t)
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(f.addrs.UpdateResource("Kubernetes//Pod/default/a", wl("default", "a", "10.0.0.1", "node1")))
	must(f.addrs.UpdateResource("Kubernetes//Pod/default/b", wl("default", "b", "10.0.0.2", "node2")))
	must(f.addrs.UpdateResource("default/web.default.svc.cluster.local", svc("10.96.0.10")))
	must(f.authz.UpdateResource("default/deny-c", denyFrom("default", "deny-c", security.Scope_WORKLOAD_SELECTOR, "cluster.local/ns/default/sa/c")))
	before := time.Now()
	src, _ := newSource(t, f)
	reg := prometheus.NewRegistry()
	reg.MustRegister(metrics.XDS(src.MetricsStats))
	f.waitReq(t, "ACK of addresses", isACK(AddressType))
	f.waitReq(t, "ACK of authorization", isACK(AuthorizationType))

	got := scrape(t, reg)
	for k, want := range map[string]float64{
		"meshtun_xds_connected":      1,
		"meshtun_xds_connects_total": 1,
		"istio_xds_connection_terminations_total{reason=ConnectionError}":       0,
		"meshtun_xds_resources{type_url=" + AddressType + "}":                   3,
		"meshtun_xds_resources{type_url=" + AuthorizationType + "}":             1,
		"meshtun_xds_responses_total{answer=ack,type_url=" + AddressType + "}":  1,
		"meshtun_xds_responses_total{answer=nack,type_url=" + AddressType + "}": 0,
		"istio_xds_message_total{url=" + AddressType + "}":                      1,
	} {
		if v, ok := got[k]; !ok || v != want {
			t.Errorf("%s = %v (present %v), want %v", k, v, ok, want)
		}
	}
	if v := got["istio_xds_message_bytes_total{url="+AddressType+"}"]; v < 30 {
		t.Errorf("istio_xds_message_bytes_total of three addresses = %v", v)
	}
	if ack := got["meshtun_xds_last_ack_timestamp_seconds{type_url="+AddressType+"}"]; ack < float64(before.Unix()) || ack > float64(time.Now().Unix()+1) {
		t.Errorf("last ACK at %v, want between %v and now", ack, before.Unix())
	}
	if _, ok := got["meshtun_xds_last_nack_timestamp_seconds{type_url="+AddressType+"}"]; ok {
		t.Error("a last NACK time before any NACK")
	}

	// A workload behind a waypoint on another network is NACKed.
	waypointed := wl("default", "w", "10.0.0.9", "node2")
	waypointed.GetWorkload().Waypoint = &workloadapi.GatewayAddress{
		Destination:   &workloadapi.GatewayAddress_Address{Address: &workloadapi.NetworkAddress{Network: "elsewhere", Address: netip.MustParseAddr("10.0.0.50").AsSlice()}},
		HboneMtlsPort: 15008,
	}
	must(f.addrs.UpdateResource("Kubernetes//Pod/default/w", waypointed))
	f.waitReq(t, "NACK of the waypoint workload", isNACK)
	got = scrape(t, reg)
	if v := got["meshtun_xds_responses_total{answer=nack,type_url="+AddressType+"}"]; v != 1 {
		t.Errorf("NACKs of addresses = %v, want 1", v)
	}
	if v := got["meshtun_xds_resources{type_url="+AddressType+"}"]; v != 4 {
		t.Errorf("address resources held = %v, want 4 (the refused one is istiod's state too)", v)
	}
	if _, ok := got["meshtun_xds_last_nack_timestamp_seconds{type_url="+AddressType+"}"]; !ok {
		t.Error("no last NACK time after a NACK")
	}

	// istiod goes away: not connected, terminations counted (the stream,
	// and each failed attempt to reopen it since, 20 ms apart here).
	f.stop()
	deadline := time.Now().Add(10 * time.Second)
	for src.Status().Connected {
		if time.Now().After(deadline) {
			t.Fatal("the source still says connected 10s after istiod stopped")
		}
		time.Sleep(10 * time.Millisecond)
	}
	got = scrape(t, reg)
	if got["meshtun_xds_connected"] != 0 || got["istio_xds_connection_terminations_total{reason=ConnectionError}"] < 1 {
		t.Errorf("after istiod stopped: connected %v, terminations %v; want 0 and at least 1",
			got["meshtun_xds_connected"], got["istio_xds_connection_terminations_total{reason=ConnectionError}"])
	}
}
