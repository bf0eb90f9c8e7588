package metrics

import (
	"errors"
	"fmt"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// TestConnCounters: opened, closed and byte counters land on the series of
// the connection's labels, in Istio's names (the destination service's
// hostname, name and namespace as ztunnel's), empty labels as "unknown",
// and a refusal counts as opened and closed with no bytes.
func TestConnCounters(t *testing.T) {
	m := New()
	ok := Conn{
		Reporter: "source",
		Src: Peer{Workload: "client", Namespace: "a", Principal: "spiffe://cluster.local/ns/a/sa/client",
			CanonicalService: "client-app", CanonicalRevision: "v1", Cluster: "c1"},
		Dst: Peer{Workload: "server", Namespace: "b", Principal: "spiffe://cluster.local/ns/b/sa/server",
			CanonicalService: "server-app", CanonicalRevision: "v2", Cluster: "c1"},
		DstService:     Service{Hostname: "server.b.svc.cluster.local", Name: "server", Namespace: "b"},
		SecurityPolicy: "mutual_tls", ResponseFlags: "-",
	}
	m.Opened(&ok)
	sent, recv := m.Bytes(&ok)
	sent.Add(1000)
	recv.Add(250)
	sent.Add(24)
	m.Closed(&ok)
	// The same connection reported by the destination is another series.
	dst := ok
	dst.Reporter = "destination"
	m.Opened(&dst)
	// A refusal with unknown source.
	denied := Conn{Reporter: "destination", Dst: Peer{Workload: "server", Namespace: "b"}, SecurityPolicy: "none", ResponseFlags: "DENY"}
	m.Refused(&denied)

	want := `
# HELP istio_tcp_connections_opened_total TCP connections opened (Istio standard metric).
# TYPE istio_tcp_connections_opened_total counter
istio_tcp_connections_opened_total{connection_security_policy="mutual_tls",destination_app="server-app",destination_canonical_revision="v2",destination_canonical_service="server-app",destination_cluster="c1",destination_principal="spiffe://cluster.local/ns/b/sa/server",destination_region="unknown",destination_service="server.b.svc.cluster.local",destination_service_name="server",destination_service_namespace="b",destination_version="v2",destination_workload="server",destination_workload_namespace="b",destination_zone="unknown",reporter="destination",request_protocol="tcp",response_flags="-",source_app="client-app",source_canonical_revision="v1",source_canonical_service="client-app",source_cluster="c1",source_principal="spiffe://cluster.local/ns/a/sa/client",source_region="unknown",source_version="v1",source_workload="client",source_workload_namespace="a",source_zone="unknown"} 1
istio_tcp_connections_opened_total{connection_security_policy="mutual_tls",destination_app="server-app",destination_canonical_revision="v2",destination_canonical_service="server-app",destination_cluster="c1",destination_principal="spiffe://cluster.local/ns/b/sa/server",destination_region="unknown",destination_service="server.b.svc.cluster.local",destination_service_name="server",destination_service_namespace="b",destination_version="v2",destination_workload="server",destination_workload_namespace="b",destination_zone="unknown",reporter="source",request_protocol="tcp",response_flags="-",source_app="client-app",source_canonical_revision="v1",source_canonical_service="client-app",source_cluster="c1",source_principal="spiffe://cluster.local/ns/a/sa/client",source_region="unknown",source_version="v1",source_workload="client",source_workload_namespace="a",source_zone="unknown"} 1
istio_tcp_connections_opened_total{connection_security_policy="none",destination_app="unknown",destination_canonical_revision="unknown",destination_canonical_service="unknown",destination_cluster="unknown",destination_principal="unknown",destination_region="unknown",destination_service="unknown",destination_service_name="unknown",destination_service_namespace="unknown",destination_version="unknown",destination_workload="server",destination_workload_namespace="b",destination_zone="unknown",reporter="destination",request_protocol="tcp",response_flags="DENY",source_app="unknown",source_canonical_revision="unknown",source_canonical_service="unknown",source_cluster="unknown",source_principal="unknown",source_region="unknown",source_version="unknown",source_workload="unknown",source_workload_namespace="unknown",source_zone="unknown"} 1
# HELP istio_tcp_connections_closed_total TCP connections closed (Istio standard metric).
# TYPE istio_tcp_connections_closed_total counter
istio_tcp_connections_closed_total{connection_security_policy="mutual_tls",destination_app="server-app",destination_canonical_revision="v2",destination_canonical_service="server-app",destination_cluster="c1",destination_principal="spiffe://cluster.local/ns/b/sa/server",destination_region="unknown",destination_service="server.b.svc.cluster.local",destination_service_name="server",destination_service_namespace="b",destination_version="v2",destination_workload="server",destination_workload_namespace="b",destination_zone="unknown",reporter="source",request_protocol="tcp",response_flags="-",source_app="client-app",source_canonical_revision="v1",source_canonical_service="client-app",source_cluster="c1",source_principal="spiffe://cluster.local/ns/a/sa/client",source_region="unknown",source_version="v1",source_workload="client",source_workload_namespace="a",source_zone="unknown"} 1
istio_tcp_connections_closed_total{connection_security_policy="none",destination_app="unknown",destination_canonical_revision="unknown",destination_canonical_service="unknown",destination_cluster="unknown",destination_principal="unknown",destination_region="unknown",destination_service="unknown",destination_service_name="unknown",destination_service_namespace="unknown",destination_version="unknown",destination_workload="server",destination_workload_namespace="b",destination_zone="unknown",reporter="destination",request_protocol="tcp",response_flags="DENY",source_app="unknown",source_canonical_revision="unknown",source_canonical_service="unknown",source_cluster="unknown",source_principal="unknown",source_region="unknown",source_version="unknown",source_workload="unknown",source_workload_namespace="unknown",source_zone="unknown"} 1
# HELP istio_tcp_sent_bytes_total Bytes sent by the client, towards the destination (Istio standard metric).
# TYPE istio_tcp_sent_bytes_total counter
istio_tcp_sent_bytes_total{connection_security_policy="mutual_tls",destination_app="server-app",destination_canonical_revision="v2",destination_canonical_service="server-app",destination_cluster="c1",destination_principal="spiffe://cluster.local/ns/b/sa/server",destination_region="unknown",destination_service="server.b.svc.cluster.local",destination_service_name="server",destination_service_namespace="b",destination_version="v2",destination_workload="server",destination_workload_namespace="b",destination_zone="unknown",reporter="source",request_protocol="tcp",response_flags="-",source_app="client-app",source_canonical_revision="v1",source_canonical_service="client-app",source_cluster="c1",source_principal="spiffe://cluster.local/ns/a/sa/client",source_region="unknown",source_version="v1",source_workload="client",source_workload_namespace="a",source_zone="unknown"} 1024
# HELP istio_tcp_received_bytes_total Bytes received by the client, from the destination (Istio standard metric).
# TYPE istio_tcp_received_bytes_total counter
istio_tcp_received_bytes_total{connection_security_policy="mutual_tls",destination_app="server-app",destination_canonical_revision="v2",destination_canonical_service="server-app",destination_cluster="c1",destination_principal="spiffe://cluster.local/ns/b/sa/server",destination_region="unknown",destination_service="server.b.svc.cluster.local",destination_service_name="server",destination_service_namespace="b",destination_version="v2",destination_workload="server",destination_workload_namespace="b",destination_zone="unknown",reporter="source",request_protocol="tcp",response_flags="-",source_app="client-app",source_canonical_revision="v1",source_canonical_service="client-app",source_cluster="c1",source_principal="spiffe://cluster.local/ns/a/sa/client",source_region="unknown",source_version="v1",source_workload="client",source_workload_namespace="a",source_zone="unknown"} 250
`
	if err := gatherAndCompare(m.Registry, want,
		"istio_tcp_connections_opened_total", "istio_tcp_connections_closed_total",
		"istio_tcp_sent_bytes_total", "istio_tcp_received_bytes_total"); err != nil {
		t.Error(err)
	}
}

// TestNilMetrics: a nil *Metrics (metrics disabled) accepts every call.
func TestNilMetrics(t *testing.T) {
	var m *Metrics
	c := Conn{Reporter: "source"}
	m.Opened(&c)
	m.Closed(&c)
	m.Refused(&c)
	if s, r := m.Bytes(&c); s != nil || r != nil {
		t.Errorf("Bytes of nil Metrics = %v, %v; want nil counters", s, r)
	}
}

// TestDataPlane: the data-plane collector reports what its read function
// returns, read at each scrape, under meshtun's names and labels.
func TestDataPlane(t *testing.T) {
	m := New()
	calls := 0
	expiry := time.Unix(1_900_000_000, 0)
	if err := m.Register(DataPlane(func() DataPlaneStats {
		calls++
		return DataPlaneStats{
			Packets:  map[[2]string]uint64{{"verbatim", "udp"}: 7, {"intercept", "tcp"}: uint64(100 * calls)},
			Bytes:    map[[2]string]uint64{{"verbatim", "udp"}: 700},
			Drops:    map[string]uint64{"fragment": 3},
			Outbound: 11, Flows: 2, FlowsInserted: 5, FlowsExpired: 3,
			TCPRetransmits: 1, ForwarderDrops: 4, VerbatimWriteErrors: 6, UDPCoalesced: 64,
			HBONEConns: 1, HBONEStreams: 2, HBONEServerConns: 3,
			CertExpiry: map[string]time.Time{"spiffe://cluster.local/ns/a/sa/client": expiry},
		}
	})); err != nil {
		t.Fatal(err)
	}
	want := `
# HELP meshtun_packets_total Packets read from the TUN, by the classifier's verdict and protocol.
# TYPE meshtun_packets_total counter
meshtun_packets_total{protocol="tcp",verdict="intercept"} 100
meshtun_packets_total{protocol="udp",verdict="verbatim"} 7
# HELP meshtun_bytes_total Bytes (IP packets) read from the TUN, by the classifier's verdict and protocol.
# TYPE meshtun_bytes_total counter
meshtun_bytes_total{protocol="udp",verdict="verbatim"} 700
# HELP meshtun_classifier_drops_total Packets the classifier dropped, by reason.
# TYPE meshtun_classifier_drops_total counter
meshtun_classifier_drops_total{reason="fragment"} 3
# HELP meshtun_netstack_packets_sent_total Packets the netstack wrote to the TUN.
# TYPE meshtun_netstack_packets_sent_total counter
meshtun_netstack_packets_sent_total 11
# HELP meshtun_flows Entries in the classifier's flow table.
# TYPE meshtun_flows gauge
meshtun_flows 2
# HELP meshtun_flows_inserted_total Flows added to the flow table.
# TYPE meshtun_flows_inserted_total counter
meshtun_flows_inserted_total 5
# HELP meshtun_flows_expired_total Flows removed from the flow table after their timeout.
# TYPE meshtun_flows_expired_total counter
meshtun_flows_expired_total 3
# HELP meshtun_netstack_tcp_retransmits_total TCP segments the netstack retransmitted.
# TYPE meshtun_netstack_tcp_retransmits_total counter
meshtun_netstack_tcp_retransmits_total 1
# HELP meshtun_netstack_forwarder_drops_total New connections dropped because too many were pending.
# TYPE meshtun_netstack_forwarder_drops_total counter
meshtun_netstack_forwarder_drops_total 4
# HELP meshtun_verbatim_write_errors_total Verbatim packets the TUN refused.
# TYPE meshtun_verbatim_write_errors_total counter
meshtun_verbatim_write_errors_total 6
# HELP meshtun_verbatim_udp_coalesced_total Verbatim UDP datagrams written back in one UDP GSO super-packet with others of their flow.
# TYPE meshtun_verbatim_udp_coalesced_total counter
meshtun_verbatim_udp_coalesced_total 64
# HELP meshtun_hbone_pool_connections Outbound HBONE connections in the pool.
# TYPE meshtun_hbone_pool_connections gauge
meshtun_hbone_pool_connections 1
# HELP meshtun_hbone_pool_streams Outbound HBONE streams open.
# TYPE meshtun_hbone_pool_streams gauge
meshtun_hbone_pool_streams 2
# HELP meshtun_hbone_server_connections Inbound HBONE connections being served.
# TYPE meshtun_hbone_server_connections gauge
meshtun_hbone_server_connections 3
# HELP meshtun_certificate_expiry_seconds Expiry of each local identity's certificate, in Unix seconds.
# TYPE meshtun_certificate_expiry_seconds gauge
meshtun_certificate_expiry_seconds{identity="spiffe://cluster.local/ns/a/sa/client"} 1.9e+09
`
	names := []string{"meshtun_packets_total", "meshtun_bytes_total", "meshtun_classifier_drops_total",
		"meshtun_netstack_packets_sent_total", "meshtun_flows", "meshtun_flows_inserted_total", "meshtun_flows_expired_total",
		"meshtun_netstack_tcp_retransmits_total", "meshtun_netstack_forwarder_drops_total", "meshtun_verbatim_write_errors_total",
		"meshtun_verbatim_udp_coalesced_total", "meshtun_hbone_pool_connections", "meshtun_hbone_pool_streams", "meshtun_hbone_server_connections",
		"meshtun_certificate_expiry_seconds"}
	if err := gatherAndCompare(m.Registry, want, names...); err != nil {
		t.Error(err)
	}
	// Read again at the next scrape, not cached.
	if err := gatherAndCompare(m.Registry, (strings.Replace(want,
		`meshtun_packets_total{protocol="tcp",verdict="intercept"} 100`, `meshtun_packets_total{protocol="tcp",verdict="intercept"} 200`, 1)),
		names...); err != nil {
		t.Errorf("second scrape: %v", err)
	}
}

// gatherAndCompare compares the samples of the named metric families in
// reg with the sample lines of want (Prometheus text format; # lines are
// ignored): the same series, the same values, nothing more.
func gatherAndCompare(reg *prometheus.Registry, want string, names ...string) error {
	fams, err := reg.Gather()
	if err != nil {
		return err
	}
	keep := map[string]bool{}
	for _, n := range names {
		keep[n] = true
	}
	got := map[string]string{}
	for _, f := range fams {
		if !keep[f.GetName()] {
			continue
		}
		for _, m := range f.GetMetric() {
			var ls []string
			for _, l := range m.GetLabel() {
				ls = append(ls, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			key := f.GetName()
			if len(ls) > 0 {
				sort.Strings(ls)
				key += "{" + strings.Join(ls, ",") + "}"
			}
			v := m.GetCounter().GetValue()
			if m.GetGauge() != nil {
				v = m.GetGauge().GetValue()
			}
			got[key] = strconv.FormatFloat(v, 'g', -1, 64)
		}
	}
	exp := map[string]string{}
	for _, line := range strings.Split(want, "\n") {
		if line = strings.TrimSpace(line); line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			return fmt.Errorf("bad want line %q", line)
		}
		exp[line[:i]] = strconv.FormatFloat(v, 'g', -1, 64)
	}
	var diffs []string
	for k, v := range exp {
		if got[k] != v {
			diffs = append(diffs, fmt.Sprintf("%s = %q, want %s", k, got[k], v))
		}
	}
	for k, v := range got {
		if _, ok := exp[k]; !ok {
			diffs = append(diffs, fmt.Sprintf("unexpected %s = %s", k, v))
		}
	}
	if len(diffs) > 0 {
		sort.Strings(diffs)
		return errors.New(strings.Join(diffs, "\n"))
	}
	return nil
}

// seriesValues returns the values of name's series whose labels include
// match.
func seriesValues(t *testing.T, reg *prometheus.Registry, name string, match map[string]string) []float64 {
	t.Helper()
	fams, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var out []float64
	for _, f := range fams {
		if f.GetName() != name {
			continue
		}
	series:
		for _, m := range f.GetMetric() {
			have := map[string]string{}
			for _, l := range m.GetLabel() {
				have[l.GetName()] = l.GetValue()
			}
			for k, v := range match {
				if have[k] != v {
					continue series
				}
			}
			v := m.GetCounter().GetValue()
			if m.GetGauge() != nil {
				v = m.GetGauge().GetValue()
			}
			out = append(out, v)
		}
	}
	return out
}

// TestFailedAndLocality: a refusal counts in
// istio_tcp_connections_failed_total (ztunnel's) with the connection's
// labels, a connection that opened does not, and each end's region and
// zone are labels (unknown when not known).
func TestFailedAndLocality(t *testing.T) {
	m := New()
	ok := Conn{Reporter: "source", Src: Peer{Workload: "client", Region: "eu-west1", Zone: "eu-west1-b"},
		Dst: Peer{Workload: "server"}, ResponseFlags: "-"}
	m.Opened(&ok)
	m.Closed(&ok)
	denied := Conn{Reporter: "destination", Src: Peer{Workload: "client"}, Dst: Peer{Workload: "server", Region: "us-east1", Zone: "us-east1-c"}, ResponseFlags: "DENY"}
	m.Refused(&denied)
	m.Refused(&denied)

	if got := seriesValues(t, m.Registry, "istio_tcp_connections_failed_total", nil); len(got) != 1 {
		t.Fatalf("failed series %v, want one (the refusal's)", got)
	}
	if got := seriesValues(t, m.Registry, "istio_tcp_connections_failed_total", map[string]string{
		"response_flags": "DENY", "reporter": "destination", "source_workload": "client",
		"destination_region": "us-east1", "destination_zone": "us-east1-c", "source_region": "unknown", "source_zone": "unknown",
	}); len(got) != 1 || got[0] != 2 {
		t.Errorf("failed{DENY, destination us-east1/us-east1-c} = %v, want [2]", got)
	}
	if got := seriesValues(t, m.Registry, "istio_tcp_connections_opened_total", map[string]string{
		"response_flags": "-", "source_region": "eu-west1", "source_zone": "eu-west1-b", "destination_region": "unknown",
	}); len(got) != 1 || got[0] != 1 {
		t.Errorf("opened{source eu-west1/eu-west1-b} = %v, want [1]", got)
	}
	if got := seriesValues(t, m.Registry, "istio_tcp_connections_opened_total", map[string]string{"response_flags": "DENY"}); len(got) != 1 || got[0] != 2 {
		t.Errorf("a refusal counts as opened too (as ztunnel's): %v, want [2]", got)
	}
}
