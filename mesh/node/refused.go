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

// DeniedAddressesMetric is the gauge of the model's addresses of other
// nodes (or of none) that meshtun refuses, by reason: connections from
// this node's workloads to them are denied. Under Kubernetes,
// reason="address_conflict" counts the addresses that pods of different
// nodes claim, none of them verifiably this node's (kube.resolveClaims).
const DeniedAddressesMetric = "meshtun_denied_addresses"

var deniedDesc = prometheus.NewDesc(DeniedAddressesMetric,
	"Addresses of other nodes' (or no node's) workloads that meshtun refuses (connections to them denied), by reason.",
	[]string{"reason"}, nil)

// refusedCollector reports RefusedWorkloadsMetric and
// DeniedAddressesMetric from the current model.
type refusedCollector struct {
	reg  *registry.Registry
	node string
}

func (refusedCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- refusedDesc
	ch <- deniedDesc
}

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
	denied := map[string]int{}
	for _, w := range c.reg.Load().Workloads {
		if w.Refused != "" && w.Node != c.node {
			denied[w.Refused] += len(w.Addresses)
		}
	}
	for reason, n := range denied {
		ch <- prometheus.MustNewConstMetric(deniedDesc, prometheus.GaugeValue, float64(n), reason)
	}
}
