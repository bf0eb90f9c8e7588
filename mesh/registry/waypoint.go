package registry

import (
	"errors"
	"fmt"
	"net/netip"
)

// DefaultWaypointPort is the HBONE port of a waypoint whose Port is 0.
const DefaultWaypointPort = 15008

// Waypoint names a waypoint: an L7 proxy that terminates HBONE itself
// (Istio's GatewayAddress). It is either an address, Addr (a workload's,
// or a service VIP whose endpoints are the waypoint's workloads), or a
// service named by Hostname in Namespace. Port is the HBONE port of the
// waypoint (15008; 0 means DefaultWaypointPort).
type Waypoint struct {
	Addr                netip.Addr
	Hostname, Namespace string
	Port                uint16
}

// WeightedWaypoint is one of a service's weighted waypoints: a share
// Weight of its connections (0: none) goes to Waypoint.
type WeightedWaypoint struct {
	Waypoint Waypoint
	Weight   uint32
}

// String returns the waypoint as istiod names it: "address:port" or
// "namespace/hostname:port".
func (wp *Waypoint) String() string {
	if wp == nil {
		return "(none)"
	}
	if wp.Addr.IsValid() {
		return netip.AddrPortFrom(wp.Addr, wp.port()).String()
	}
	return fmt.Sprintf("%s/%s:%d", wp.Namespace, wp.Hostname, wp.port())
}

func (wp *Waypoint) port() uint16 {
	if wp.Port == 0 {
		return DefaultWaypointPort
	}
	return wp.Port
}

// check reports what makes wp unusable; a nil wp is fine (none).
func (wp *Waypoint) check() error {
	switch {
	case wp == nil:
		return nil
	case wp.Addr.IsValid() && wp.Hostname != "":
		return fmt.Errorf("waypoint %s has both an address and a hostname", wp)
	case !wp.Addr.IsValid() && (wp.Hostname == "" || wp.Namespace == ""):
		return errors.New("waypoint has neither an address nor a hostname and namespace")
	}
	return nil
}

// HasWaypoint reports whether connections to the service's VIPs must
// cross a waypoint.
func (s *Service) HasWaypoint() bool { return s.Waypoint != nil || len(s.WeightedWaypoints) > 0 }

// PickWaypoint chooses the waypoint of one connection to the service, as
// ztunnel does: one of WeightedWaypoints at random in proportion to their
// weights, or Waypoint when none has a weight. Nil: no waypoint to use
// (none, or weighted ones all of weight 0 and no Waypoint), which for a
// service that HasWaypoint must refuse the connection.
func (s *Service) PickWaypoint() *Waypoint { return s.pickWaypoint(randN) }

func (s *Service) pickWaypoint(rnd func(uint64) uint64) *Waypoint {
	var sum uint64
	for _, ww := range s.WeightedWaypoints {
		sum += uint64(ww.Weight)
	}
	if sum == 0 {
		return s.Waypoint
	}
	n := rnd(sum)
	for i := range s.WeightedWaypoints {
		ww := &s.WeightedWaypoints[i]
		if n < uint64(ww.Weight) {
			return &ww.Waypoint
		}
		n -= uint64(ww.Weight)
	}
	return s.Waypoint // not reached
}

// WaypointHop is where a connection that must cross a waypoint is sent:
// one of the waypoint's workloads, whose identity the waypoint must
// present, and its HBONE endpoint (address and port).
type WaypointHop struct {
	Workload *Workload
	Endpoint netip.AddrPort
}

// WaypointError says why a waypoint could not be resolved to a workload
// to send to. A connection that must cross the waypoint is then refused:
// it never goes to its destination another way.
type WaypointError struct {
	Waypoint *Waypoint
	Reason   string
}

func (e *WaypointError) Error() string {
	return fmt.Sprintf("waypoint %s: %s", e.Waypoint, e.Reason)
}

// ResolveWaypoint resolves wp for a connection of the workload from to
// orig (its original destination), as ztunnel does:
//
//   - an address that is a service VIP: an endpoint of that service
//     (chosen as Pick does, for from), at the target port of the service's
//     port wp.Port; the service must have that port;
//   - an address that is a workload's: that workload, at wp.Port;
//   - a hostname: the service of that hostname and namespace, an endpoint
//     of orig's address family if there is one (else of the other), at the
//     target port of its port wp.Port.
//
// The waypoint's workload must be one the node does not refuse, with an
// address. Anything else is a *WaypointError.
func (s *Snapshot) ResolveWaypoint(wp *Waypoint, from *Workload, orig netip.Addr) (WaypointHop, error) {
	fail := func(format string, args ...any) (WaypointHop, error) {
		return WaypointHop{}, &WaypointError{Waypoint: wp, Reason: fmt.Sprintf(format, args...)}
	}
	if wp == nil {
		return fail("no waypoint to use (weighted waypoints all of weight 0)")
	}
	port := wp.port()
	var hop WaypointHop
	if wp.Addr.IsValid() {
		ns := ""
		if from != nil {
			ns = from.Namespace
		}
		svc, sp := s.ServiceFor(netip.AddrPortFrom(wp.Addr, port), ns)
		switch {
		case svc != nil:
			ep, ok := svc.Pick(wp.Addr, from)
			if !ok || ep.Unresolved() {
				return fail("service %s has no endpoint with an address", svc)
			}
			hop = WaypointHop{Workload: ep.Workload, Endpoint: netip.AddrPortFrom(ep.Addr, sp.Target())}
		case s.ServiceByVIP(wp.Addr) != nil:
			return fail("service %s has no port %d", s.ServiceByVIP(wp.Addr), port)
		default:
			w := s.Workload(wp.Addr)
			if w == nil {
				return fail("no workload or service has address %s", wp.Addr)
			}
			hop = WaypointHop{Workload: w, Endpoint: netip.AddrPortFrom(wp.Addr.Unmap(), port)}
		}
	} else {
		svc := s.serviceByHostname(wp.Hostname, wp.Namespace)
		if svc == nil {
			return fail("no service %s in namespace %s", wp.Hostname, wp.Namespace)
		}
		_, sp := svc.withPort(port)
		if sp == nil {
			return fail("service %s has no port %d", svc, port)
		}
		like := orig
		if !like.IsValid() {
			like = netip.IPv4Unspecified()
		}
		ep, ok := svc.Pick(like, from)
		if !ok || ep.Unresolved() {
			other := netip.IPv6Unspecified()
			if !like.Unmap().Is4() {
				other = netip.IPv4Unspecified()
			}
			ep, ok = svc.Pick(other, from)
		}
		if !ok || ep.Unresolved() {
			return fail("service %s has no endpoint with an address", svc)
		}
		hop = WaypointHop{Workload: ep.Workload, Endpoint: netip.AddrPortFrom(ep.Addr, sp.Target())}
	}
	if hop.Workload.Refused != "" {
		return fail("its workload %s is refused by meshtun (%s)", hop.Workload, hop.Workload.Refused)
	}
	return hop, nil
}

// serviceByHostname returns the service of hostname host in namespace ns,
// or nil.
func (s *Snapshot) serviceByHostname(host, ns string) *Service {
	if svc := s.svcByHost[host]; svc == nil || svc.Namespace == ns {
		return svc
	}
	for _, svc := range s.Services { // a hostname several namespaces use
		if svc.Hostname == host && svc.Namespace == ns {
			return svc
		}
	}
	return nil
}

// IsWaypoint reports whether w, connecting from src, is one of the
// workloads of waypoint wp (ztunnel's check that a connection comes from
// the destination's own waypoint): a workload wp names (by address, or as
// an endpoint of the service it names) with w's identity and the address
// src. Such a connection does not cross the waypoint again.
func (s *Snapshot) IsWaypoint(wp *Waypoint, w *Workload, src netip.Addr) bool {
	if wp == nil || w == nil {
		return false
	}
	is := func(c *Workload) bool {
		if c == nil || c.Identity != w.Identity {
			return false
		}
		for _, a := range c.Addresses {
			if a.Unmap() == src.Unmap() {
				return true
			}
		}
		return false
	}
	var svc *Service
	if wp.Addr.IsValid() {
		if c := s.Workload(wp.Addr); c != nil {
			return is(c)
		}
		svc = s.ServiceByVIP(wp.Addr)
	} else {
		svc = s.serviceByHostname(wp.Hostname, wp.Namespace)
	}
	if svc == nil {
		return false
	}
	for f := range svc.eps {
		for _, ep := range svc.eps[f].all {
			if is(ep.Workload) {
				return true
			}
		}
	}
	return false
}
