package node

import (
	"github.com/prometheus/client_golang/prometheus"

	"github.com/meshtun/meshtun/mesh/registry"
)

// RefusedWorkloadsMetric is the gauge of this node's workloads that the
// control plane put in the mesh with a feature meshtun refuses (a
// waypoint, another network, LEGACY_ISTIO_MTLS…), by reason: they are
// captured and every connection to or from them is denied.
const RefusedWorkloadsMetric = "meshtun_refused_workloads"

var refusedDesc = prometheus.NewDesc(RefusedWorkloadsMetric,
	"Workloads of this node that meshtun refuses (captured, every connection denied), by reason.",
	[]string{"reason"}, nil)

// refusedCollector reports RefusedWorkloadsMetric from the current model.
type refusedCollector struct {
	reg  *registry.Registry
	node string
}

func (refusedCollector) Describe(ch chan<- *prometheus.Desc) { ch <- refusedDesc }

func (c refusedCollector) Collect(ch chan<- prometheus.Metric) {
	by := map[string]int{}
	for _, w := range localWorkloads(c.reg.Load(), c.node) {
		if w.Refused != "" {
			by[w.Refused]++
		}
	}
	for reason, n := range by {
		ch <- prometheus.MustNewConstMetric(refusedDesc, prometheus.GaugeValue, float64(n), reason)
	}
}
