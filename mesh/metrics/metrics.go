// Package metrics exposes what a node proxy does in Prometheus form: Istio's
// standard TCP metrics, with their names and labels, so that existing Istio
// dashboards read them, and meshtun's own data-plane metrics.
//
// The Istio counters are updated per connection (opened when the upstream
// is connected or refused, bytes and closed when it ends). The data-plane
// figures are read from their owners' counters only when scraped, so the
// packet path pays nothing for them.
package metrics

import (
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// Labels of Istio's TCP metrics, in Istio's names (those ztunnel
// reports).
var connLabels = []string{
	"reporter",
	"source_workload", "source_workload_namespace", "source_principal",
	"source_canonical_service", "source_canonical_revision", "source_app", "source_version", "source_cluster",
	"destination_workload", "destination_workload_namespace", "destination_principal",
	"destination_canonical_service", "destination_canonical_revision", "destination_app", "destination_version", "destination_cluster",
	"destination_service", "destination_service_name", "destination_service_namespace",
	"request_protocol",
	"connection_security_policy",
	"response_flags",
	// ztunnel's locality labels (it leaves them out of a series when
	// it knows neither end; a Prometheus vector has one label set, so
	// meshtun reports them "unknown" then).
	"source_region", "source_zone", "destination_region", "destination_zone",
}

// Conn identifies one connection for Istio's TCP metrics. Empty fields are
// reported as "unknown", as Istio does.
type Conn struct {
	// Reporter is "source" (the client's node) or "destination".
	Reporter string
	// Src and Dst are the two ends. Their app and version labels repeat
	// the canonical service and revision, as ztunnel's do.
	Src, Dst Peer
	// DstService is the service the connection was addressed to, as
	// ztunnel labels it: destination_service (its hostname),
	// destination_service_name and destination_service_namespace.
	DstService Service
	// SecurityPolicy is "mutual_tls" for HBONE, "none" for plaintext.
	SecurityPolicy string
	// ResponseFlags is "-" for a connection that went through, "DENY" for
	// one refused by policy, "CONNECT" for an upstream connect failure,
	// "TLS_FAILURE" for a failed handshake.
	ResponseFlags string
}

// Service is the destination service of a connection: the one whose VIP
// the client connected to or, inbound, the known service the client named
// in its HBONE request. The zero Service (none) is "unknown" in all three
// labels.
type Service struct {
	Hostname, Name, Namespace string
}

// Peer is one end of a connection, as Istio's labels name it.
type Peer struct {
	// Workload is the name of the workload's owner (a Deployment's name,
	// not its pod's) when the model knows it.
	Workload, Namespace, Principal string
	// CanonicalService and CanonicalRevision are Istio's canonical names.
	CanonicalService, CanonicalRevision string
	Cluster                             string
	// Region and Zone are the workload's locality, when known.
	Region, Zone string
}

func (c *Conn) values() []string {
	v := []string{c.Reporter,
		c.Src.Workload, c.Src.Namespace, c.Src.Principal,
		c.Src.CanonicalService, c.Src.CanonicalRevision, c.Src.CanonicalService, c.Src.CanonicalRevision, c.Src.Cluster,
		c.Dst.Workload, c.Dst.Namespace, c.Dst.Principal,
		c.Dst.CanonicalService, c.Dst.CanonicalRevision, c.Dst.CanonicalService, c.Dst.CanonicalRevision, c.Dst.Cluster,
		c.DstService.Hostname, c.DstService.Name, c.DstService.Namespace,
		"tcp", c.SecurityPolicy, c.ResponseFlags,
		c.Src.Region, c.Src.Zone, c.Dst.Region, c.Dst.Zone}
	for i := range v {
		if v[i] == "" {
			v[i] = "unknown"
		}
	}
	return v
}

// Metrics is a node's metric registry.
type Metrics struct {
	// Registry is what the /metrics handler serves.
	Registry *prometheus.Registry

	opened, closed, failed, sent, received *prometheus.CounterVec
}

// New returns the metrics of a node, with Go runtime and process metrics
// registered too.
func New() *Metrics {
	m := &Metrics{Registry: prometheus.NewRegistry()}
	vec := func(name, help string) *prometheus.CounterVec {
		v := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, connLabels)
		m.Registry.MustRegister(v)
		return v
	}
	m.opened = vec("istio_tcp_connections_opened_total", "TCP connections opened (Istio standard metric).")
	m.closed = vec("istio_tcp_connections_closed_total", "TCP connections closed (Istio standard metric).")
	m.failed = vec("istio_tcp_connections_failed_total", "TCP connections that failed to establish: refused by policy, a failed TLS handshake or upstream connect (ztunnel's metric).")
	m.sent = vec("istio_tcp_sent_bytes_total", "Bytes sent by the client, towards the destination (Istio standard metric).")
	m.received = vec("istio_tcp_received_bytes_total", "Bytes received by the client, from the destination (Istio standard metric).")
	m.Registry.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Opened counts a connection as opened.
func (m *Metrics) Opened(c *Conn) {
	if m == nil {
		return
	}
	m.opened.WithLabelValues(c.values()...).Inc()
}

// Closed counts a connection as closed. Its bytes are counted while it
// runs, through Bytes.
func (m *Metrics) Closed(c *Conn) {
	if m == nil {
		return
	}
	m.closed.WithLabelValues(c.values()...).Inc()
}

// Bytes returns the byte counters of a connection, sent by the client and
// received by it, for the relay to add to as data moves (so that a long
// connection shows in the metrics before it ends). Adding to them is an
// atomic add. A nil Metrics returns nil counters.
func (m *Metrics) Bytes(c *Conn) (sent, received prometheus.Counter) {
	if m == nil {
		return nil, nil
	}
	v := c.values()
	return m.sent.WithLabelValues(v...), m.received.WithLabelValues(v...)
}

// Refused counts a connection that was refused before it opened (policy,
// connect failure): opened, closed and failed at once, with no bytes.
func (m *Metrics) Refused(c *Conn) {
	if m == nil {
		return
	}
	v := c.values()
	m.opened.WithLabelValues(v...).Inc()
	m.closed.WithLabelValues(v...).Inc()
	m.failed.WithLabelValues(v...).Inc()
}

// Register adds a collector (the data-plane figures) to the registry.
func (m *Metrics) Register(c prometheus.Collector) error { return m.Registry.Register(c) }
