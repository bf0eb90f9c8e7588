package registry

// Locality is a workload's region, zone and subzone, as Istio names them
// (topology.kubernetes.io/region and /zone, topology.istio.io/subzone);
// empty when unknown.
//
// (Branch istiosvc declares the same type in lb.go for load balancing:
// merging both, keep that one and delete this file.)
type Locality struct {
	Region, Zone, Subzone string
}
