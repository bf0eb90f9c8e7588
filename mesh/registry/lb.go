package registry

import (
	"net/netip"
	"sort"
)

// Locality is where a workload runs: Kubernetes' topology.kubernetes.io/
// region and zone labels and Istio's subzone. Empty fields are equal to
// each other, as in ztunnel.
type Locality struct {
	Region, Zone, Subzone string
}

// LBMode is how a service's routing preferences (LoadBalancing.Scopes)
// choose among its endpoints.
type LBMode uint8

const (
	// LBAny ignores the scopes: any endpoint (Istio's unspecified mode).
	LBAny LBMode = iota
	// LBFailover picks among the endpoints that share the longest prefix
	// of the scopes with the client, and falls back to those sharing a
	// shorter one (Istio's FAILOVER; Kubernetes trafficDistribution
	// PreferClose and PreferSameZone/PreferSameNode arrive this way).
	LBFailover
	// LBStrict picks only among endpoints that share every scope with the
	// client; without one, the connection is refused (Istio's STRICT;
	// Kubernetes internalTrafficPolicy: Local is STRICT on NODE).
	LBStrict
)

func (m LBMode) String() string {
	switch m {
	case LBFailover:
		return "FAILOVER"
	case LBStrict:
		return "STRICT"
	}
	return "ANY"
}

// Scope is one routing preference: what an endpoint must share with the
// client.
type Scope uint8

// The scopes of Istio's LoadBalancing.Scope.
const (
	ScopeRegion Scope = iota + 1
	ScopeZone
	ScopeSubzone
	ScopeNode
	ScopeCluster
	// ScopeNetwork always matches: meshtun models one network (workloads
	// of another are refused).
	ScopeNetwork
)

func (s Scope) String() string {
	switch s {
	case ScopeRegion:
		return "REGION"
	case ScopeZone:
		return "ZONE"
	case ScopeSubzone:
		return "SUBZONE"
	case ScopeNode:
		return "NODE"
	case ScopeCluster:
		return "CLUSTER"
	case ScopeNetwork:
		return "NETWORK"
	}
	return "UNKNOWN"
}

// LoadBalancing is a service's endpoint selection: the scopes in order of
// preference and how they apply.
type LoadBalancing struct {
	Mode   LBMode
	Scopes []Scope
}

// ranked reports whether the scopes decide anything.
func (lb *LoadBalancing) ranked() bool { return lb.Mode != LBAny && len(lb.Scopes) > 0 }

// rank is how many of the scopes, in order, ep shares with from (it stops
// at the first it does not); ok is false when the mode is STRICT and ep
// does not share them all.
func (lb *LoadBalancing) rank(from, ep *Workload) (rank int, ok bool) {
	for _, sc := range lb.Scopes {
		var m bool
		switch sc {
		case ScopeRegion:
			m = from.Locality.Region == ep.Locality.Region
		case ScopeZone:
			m = from.Locality.Zone == ep.Locality.Zone
		case ScopeSubzone:
			m = from.Locality.Subzone == ep.Locality.Subzone
		case ScopeNode:
			m = from.Node == ep.Node
		case ScopeCluster:
			m = from.Cluster == ep.Cluster
		case ScopeNetwork:
			m = true
		}
		if !m {
			break
		}
		rank++
	}
	if lb.Mode == LBStrict && rank != len(lb.Scopes) {
		return 0, false
	}
	return rank, true
}

// weight is a workload's share of its services' connections among the
// endpoints of equal rank: its Capacity, 1 if unset.
func (w *Workload) weight() uint64 {
	if w.Capacity == 0 {
		return 1
	}
	return uint64(w.Capacity)
}

// Unresolved reports whether the endpoint has no address, only a DNS
// name (Workload.Hostname): a connection given this endpoint must resolve
// the name, or be refused; never go to the VIP in its place.
func (e Endpoint) Unresolved() bool { return !e.Addr.IsValid() }

// noSource stands for a client that is no workload: nothing of its
// locality is known.
var noSource = &Workload{}

// pickFrom chooses an endpoint of set for a connection from the workload
// from: among those of the highest rank (all of them without ranked
// scopes), at random in proportion to their weights. It does not
// allocate.
func (s *Service) pickFrom(set *endpointSet, from *Workload, rnd func(uint64) uint64) (Endpoint, bool) {
	list := set.all
	if len(list) == 0 {
		return Endpoint{}, false
	}
	if !s.LB.ranked() {
		if set.cum == nil {
			if len(list) == 1 {
				return list[0], true
			}
			return list[rnd(uint64(len(list)))], true
		}
		total := set.cum[len(set.cum)-1]
		if total == 0 {
			return Endpoint{}, false
		}
		r := rnd(total)
		i := sort.Search(len(set.cum), func(i int) bool { return set.cum[i] > r })
		return list[i], true
	}
	if from == nil {
		from = noSource
	}
	// Two passes, one random number: the best rank and the total weight
	// of its endpoints, then the endpoint the number falls on.
	best := -1
	var total uint64
	for i := range list {
		r, ok := s.LB.rank(from, list[i].Workload)
		switch {
		case !ok || r < best:
		case r > best:
			best, total = r, list[i].Workload.weight()
		default:
			total += list[i].Workload.weight()
		}
	}
	if best < 0 || total == 0 {
		return Endpoint{}, false
	}
	x := rnd(total)
	for i := range list {
		if r, ok := s.LB.rank(from, list[i].Workload); !ok || r != best {
			continue
		}
		w := list[i].Workload.weight()
		if x < w {
			return list[i], true
		}
		x -= w
	}
	return Endpoint{}, false // not reached: x < total
}

// Families returns an address of each family the service has VIPs (or
// VIP ranges) of, for Endpoints.
func (s *Service) Families() []netip.Addr {
	var v4, v6 bool
	for _, a := range s.VIPs {
		v4, v6 = v4 || a.Unmap().Is4(), v6 || !a.Unmap().Is4()
	}
	for _, p := range s.CIDRs {
		v4, v6 = v4 || p.Addr().Is4(), v6 || !p.Addr().Is4()
	}
	var out []netip.Addr
	if v4 {
		out = append(out, netip.IPv4Unspecified())
	}
	if v6 {
		out = append(out, netip.IPv6Unspecified())
	}
	return out
}
