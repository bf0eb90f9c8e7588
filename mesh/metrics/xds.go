package metrics

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// XDSStats is the health of a node's xDS stream to istiod, read at scrape
// time (from xds.Source's status).
type XDSStats struct {
	// Connected: a stream to istiod is open and has delivered a response.
	Connected bool
	// Connects counts the streams opened; Disconnects those that ended
	// and the attempts to open one that failed.
	Connects, Disconnects uint64
	// Types holds each subscribed resource type's figures, by type URL.
	Types map[string]XDSType
}

// XDSType is what istiod sent of one resource type.
type XDSType struct {
	Responses, Bytes  uint64
	ACKs, NACKs       uint64
	LastACK, LastNACK time.Time // zero: none yet
	Resources         int
}

// XDS collects XDSStats from read at every scrape: ztunnel's xDS metrics
// (istio_xds_message_total, istio_xds_message_bytes_total,
// istio_xds_connection_terminations_total) and meshtun's health figures
// (connected, ACK and NACK counts and times, resources held, by type).
func XDS(read func() XDSStats) prometheus.Collector { return &xdsCollector{read: read} }

type xdsCollector struct{ read func() XDSStats }

var (
	descXDSMessages     = prometheus.NewDesc("istio_xds_message_total", "Responses received from istiod, by type (ztunnel's metric).", []string{"url"}, nil)
	descXDSBytes        = prometheus.NewDesc("istio_xds_message_bytes_total", "Bytes of the resources received from istiod, by type (ztunnel's metric).", []string{"url"}, nil)
	descXDSTerminations = prometheus.NewDesc("istio_xds_connection_terminations_total", "Streams to istiod that ended, and attempts to open one that failed (ztunnel's metric; meshtun's end only on a connection error).", []string{"reason"}, nil)
	descXDSConnected    = prometheus.NewDesc("meshtun_xds_connected", "1 while a stream to istiod is open and has delivered a response, else 0.", nil, nil)
	descXDSConnects     = prometheus.NewDesc("meshtun_xds_connects_total", "Streams to istiod opened.", nil, nil)
	descXDSAnswers      = prometheus.NewDesc("meshtun_xds_responses_total", "Responses from istiod answered, by type and answer (ack, nack).", []string{"type_url", "answer"}, nil)
	descXDSLastACK      = prometheus.NewDesc("meshtun_xds_last_ack_timestamp_seconds", "When the last response of the type was ACKed (Unix time; absent before the first).", []string{"type_url"}, nil)
	descXDSLastNACK     = prometheus.NewDesc("meshtun_xds_last_nack_timestamp_seconds", "When the last response of the type was NACKed (Unix time; absent before the first).", []string{"type_url"}, nil)
	descXDSResources    = prometheus.NewDesc("meshtun_xds_resources", "Resources of the type held as istiod last sent them (applied or refused).", []string{"type_url"}, nil)
)

func (c *xdsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descXDSMessages, descXDSBytes, descXDSTerminations, descXDSConnected,
		descXDSConnects, descXDSAnswers, descXDSLastACK, descXDSLastNACK, descXDSResources} {
		ch <- d
	}
}

func (c *xdsCollector) Collect(ch chan<- prometheus.Metric) {
	s := c.read()
	connected := 0.0
	if s.Connected {
		connected = 1
	}
	ch <- prometheus.MustNewConstMetric(descXDSConnected, prometheus.GaugeValue, connected)
	ch <- prometheus.MustNewConstMetric(descXDSConnects, prometheus.CounterValue, float64(s.Connects))
	ch <- prometheus.MustNewConstMetric(descXDSTerminations, prometheus.CounterValue, float64(s.Disconnects), "ConnectionError")
	for url, t := range s.Types {
		ch <- prometheus.MustNewConstMetric(descXDSMessages, prometheus.CounterValue, float64(t.Responses), url)
		ch <- prometheus.MustNewConstMetric(descXDSBytes, prometheus.CounterValue, float64(t.Bytes), url)
		ch <- prometheus.MustNewConstMetric(descXDSAnswers, prometheus.CounterValue, float64(t.ACKs), url, "ack")
		ch <- prometheus.MustNewConstMetric(descXDSAnswers, prometheus.CounterValue, float64(t.NACKs), url, "nack")
		ch <- prometheus.MustNewConstMetric(descXDSResources, prometheus.GaugeValue, float64(t.Resources), url)
		if !t.LastACK.IsZero() {
			ch <- prometheus.MustNewConstMetric(descXDSLastACK, prometheus.GaugeValue, unixSeconds(t.LastACK), url)
		}
		if !t.LastNACK.IsZero() {
			ch <- prometheus.MustNewConstMetric(descXDSLastNACK, prometheus.GaugeValue, unixSeconds(t.LastNACK), url)
		}
	}
}

func unixSeconds(t time.Time) float64 { return float64(t.UnixNano()) / 1e9 }
