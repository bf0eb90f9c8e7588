package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// DataPlaneStats is a snapshot of the packet path's counters, read at
// scrape time.
type DataPlaneStats struct {
	// Packets and bytes from the TUN by verdict ("intercept", "verbatim")
	// and protocol ("tcp", "udp", "icmp", "other").
	Packets, Bytes map[[2]string]uint64
	Drops          map[string]uint64 // packets the classifier dropped, by reason
	// PacketDrops are packets dropped before the classifier, by reason:
	// "spoofed-source", a capture link's packets whose source is not one
	// of that link's pods (routed to the spoof sink).
	PacketDrops   map[string]uint64
	Outbound      uint64 // packets the netstack sent
	Flows         int    // flow-table entries
	FlowsInserted uint64
	FlowsExpired  uint64
	// FlowsHalfOpen are flows whose handshake the initiator has not
	// completed and that the netstack does not hold.
	FlowsHalfOpen int
	// UnknownIntercepted counts TCP segments of no known flow that were
	// handed to the netstack (to be reset) rather than sent verbatim.
	UnknownIntercepted uint64

	TCPRetransmits      uint64 // netstack TCP segments retransmitted
	ForwarderDrops      uint64 // SYNs dropped: too many connections pending
	VerbatimWriteErrors uint64 // verbatim packets the TUN refused
	// UDPCoalesced counts verbatim UDP datagrams written back into the
	// TUN in a UDP GSO super-packet with others of their flow.
	UDPCoalesced uint64
	// AcksElided and AcksDelayed count the netstack's pure ACKs held back
	// (node --ack-delay): superseded by a later packet of the flow, or
	// written once the delay passed.
	AcksElided, AcksDelayed uint64

	HBONEConns, HBONEStreams int // outbound pool
	HBONEServerConns         int // inbound connections being served
	// HBONEInbound counts the inbound HBONE connections accepted, by
	// socket: "kernel" (delivered locally by the node's routing) or
	// "netstack" (captured through the TUN).
	HBONEInbound map[string]uint64
	// HBONERefused counts the inbound HBONE connections refused before
	// any request, by reason (hbone.Refused*: a bound, a failed or timed
	// out handshake, the wrong address); HBONEHandshakes is the number
	// of handshakes pending now.
	HBONERefused    map[string]uint64
	HBONEHandshakes int

	// CertExpiry is the expiry of each local identity's certificate.
	CertExpiry map[string]time.Time
	// CertRenewals and CertRenewalFailures count renewal attempts that
	// succeeded and failed; CertsFailing is the number of identities whose
	// renewal is failing now (the certificate service is unreachable or
	// refuses), CertsValid those holding an unexpired certificate.
	CertRenewals, CertRenewalFailures uint64
	CertsFailing, CertsValid          int
}

// DataPlane collects DataPlaneStats from read at every scrape.
func DataPlane(read func() DataPlaneStats) prometheus.Collector {
	return &dataPlane{read: read}
}

type dataPlane struct{ read func() DataPlaneStats }

var (
	descPackets   = prometheus.NewDesc("meshtun_packets_total", "Packets read from the TUN, by the classifier's verdict and protocol.", []string{"verdict", "protocol"}, nil)
	descBytes     = prometheus.NewDesc("meshtun_bytes_total", "Bytes (IP packets) read from the TUN, by the classifier's verdict and protocol.", []string{"verdict", "protocol"}, nil)
	descDrops     = prometheus.NewDesc("meshtun_classifier_drops_total", "Packets the classifier dropped, by reason.", []string{"reason"}, nil)
	descPktDrops  = prometheus.NewDesc("meshtun_packets_dropped_total", "Packets dropped before the classifier, by reason (spoofed-source: from a capture link, with a source that is not one of that link's pods).", []string{"reason"}, nil)
	descOutbound  = prometheus.NewDesc("meshtun_netstack_packets_sent_total", "Packets the netstack wrote to the TUN.", nil, nil)
	descFlows     = prometheus.NewDesc("meshtun_flows", "Entries in the classifier's flow table.", nil, nil)
	descInserted  = prometheus.NewDesc("meshtun_flows_inserted_total", "Flows added to the flow table.", nil, nil)
	descExpired   = prometheus.NewDesc("meshtun_flows_expired_total", "Flows removed from the flow table after their timeout.", nil, nil)
	descHalfOpen  = prometheus.NewDesc("meshtun_flows_half_open", "Flows whose initiator has not completed the handshake and that the netstack does not hold yet.", nil, nil)
	descUnknown   = prometheus.NewDesc("meshtun_unknown_segments_intercepted_total", "TCP segments of no known flow, of a connection intercepted whichever side opened it, handed to the netstack (which resets them) instead of being forwarded verbatim.", nil, nil)
	descRetrans   = prometheus.NewDesc("meshtun_netstack_tcp_retransmits_total", "TCP segments the netstack retransmitted.", nil, nil)
	descFwdDrops  = prometheus.NewDesc("meshtun_netstack_forwarder_drops_total", "New connections dropped because too many were pending, in all or from their source.", nil, nil)
	descAcksHeld  = prometheus.NewDesc("meshtun_netstack_acks_held_total", "Pure ACKs of the netstack held back (--ack-delay), by outcome: elided (a later packet of the flow carried the acknowledgment) or written (the delay passed).", []string{"outcome"}, nil)
	descWriteErrs = prometheus.NewDesc("meshtun_verbatim_write_errors_total", "Verbatim packets the TUN refused.", nil, nil)
	descUDPGSO    = prometheus.NewDesc("meshtun_verbatim_udp_coalesced_total", "Verbatim UDP datagrams written back in one UDP GSO super-packet with others of their flow.", nil, nil)
	descPoolConns = prometheus.NewDesc("meshtun_hbone_pool_connections", "Outbound HBONE connections in the pool.", nil, nil)
	descPoolStrms = prometheus.NewDesc("meshtun_hbone_pool_streams", "Outbound HBONE streams open.", nil, nil)
	descSrvConns  = prometheus.NewDesc("meshtun_hbone_server_connections", "Inbound HBONE connections being served.", nil, nil)
	descInbound   = prometheus.NewDesc("meshtun_hbone_inbound_connections_total", "Inbound HBONE connections accepted, by the socket that terminated them (kernel, netstack).", []string{"socket"}, nil)
	descRefused   = prometheus.NewDesc("meshtun_hbone_connections_refused_total", "Inbound HBONE connections refused before any request, by reason: handshake_limit, source_limit and evicted (the bounds on pending handshakes), peer_limit (the bound on one identity's connections), handshake_timeout, handshake_failed, no_h2, no_identity, not_local (not a local mesh workload's port 15008).", []string{"reason"}, nil)
	descPending   = prometheus.NewDesc("meshtun_hbone_handshakes_pending", "Inbound HBONE connections whose TLS handshake is pending.", nil, nil)
	descExpiry    = prometheus.NewDesc("meshtun_certificate_expiry_seconds", "Expiry of each local identity's certificate, in Unix seconds.", []string{"identity"}, nil)
	descRenewals  = prometheus.NewDesc("meshtun_certificate_renewals_total", "Certificate renewals that succeeded.", nil, nil)
	descRenewFail = prometheus.NewDesc("meshtun_certificate_renewal_failures_total", "Certificate renewal attempts that failed (certificate service unreachable or refusing).", nil, nil)
	descFailing   = prometheus.NewDesc("meshtun_certificates_renewal_failing", "Local identities whose certificate renewal is failing now; they keep serving with their current certificate until it expires.", nil, nil)
	descValid     = prometheus.NewDesc("meshtun_certificates_valid", "Local identities holding an unexpired certificate.", nil, nil)
)

func (d *dataPlane) Describe(ch chan<- *prometheus.Desc) {
	for _, desc := range []*prometheus.Desc{descPackets, descBytes, descDrops, descPktDrops, descOutbound, descFlows, descInserted, descExpired,
		descHalfOpen, descUnknown, descRetrans, descFwdDrops, descAcksHeld, descWriteErrs, descUDPGSO, descPoolConns, descPoolStrms, descSrvConns, descInbound, descRefused, descPending, descExpiry,
		descRenewals, descRenewFail, descFailing, descValid} {
		ch <- desc
	}
}

func (d *dataPlane) Collect(ch chan<- prometheus.Metric) {
	s := d.read()
	counter := func(desc *prometheus.Desc, v uint64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(desc, prometheus.CounterValue, float64(v), labels...)
	}
	gauge := func(desc *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(desc, prometheus.GaugeValue, v, labels...)
	}
	for k, v := range s.Packets {
		counter(descPackets, v, k[0], k[1])
	}
	for k, v := range s.Bytes {
		counter(descBytes, v, k[0], k[1])
	}
	for reason, n := range s.Drops {
		counter(descDrops, n, reason)
	}
	for reason, n := range s.PacketDrops {
		counter(descPktDrops, n, reason)
	}
	counter(descOutbound, s.Outbound)
	gauge(descFlows, float64(s.Flows))
	counter(descInserted, s.FlowsInserted)
	counter(descExpired, s.FlowsExpired)
	gauge(descHalfOpen, float64(s.FlowsHalfOpen))
	counter(descUnknown, s.UnknownIntercepted)
	counter(descRetrans, s.TCPRetransmits)
	counter(descFwdDrops, s.ForwarderDrops)
	counter(descAcksHeld, s.AcksElided, "elided")
	counter(descAcksHeld, s.AcksDelayed, "written")
	counter(descWriteErrs, s.VerbatimWriteErrors)
	counter(descUDPGSO, s.UDPCoalesced)
	gauge(descPoolConns, float64(s.HBONEConns))
	gauge(descPoolStrms, float64(s.HBONEStreams))
	gauge(descSrvConns, float64(s.HBONEServerConns))
	for socket, n := range s.HBONEInbound {
		counter(descInbound, n, socket)
	}
	for reason, n := range s.HBONERefused {
		counter(descRefused, n, reason)
	}
	gauge(descPending, float64(s.HBONEHandshakes))
	for id, t := range s.CertExpiry {
		gauge(descExpiry, float64(t.Unix()), id)
	}
	counter(descRenewals, s.CertRenewals)
	counter(descRenewFail, s.CertRenewalFailures)
	gauge(descFailing, float64(s.CertsFailing))
	gauge(descValid, float64(s.CertsValid))
}
