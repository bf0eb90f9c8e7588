package registry

import (
	"errors"
	"net/netip"
	"strings"
	"testing"
)

// waypointModel: a waypoint Deployment (two pods, one of them dual-stack)
// behind its service, a pod with a waypoint by address, services with a
// waypoint by hostname and by VIP, and broken references.
func waypointModel(t *testing.T) *Snapshot {
	t.Helper()
	a := netip.MustParseAddr
	ws := []*Workload{
		{Name: "wp-1", Namespace: "infra", ServiceAccount: "waypoint", Node: "n2", InMesh: true,
			Addresses: []netip.Addr{a("10.0.2.5")}, Labels: map[string]string{"gateway": "wp"}},
		{Name: "wp-2", Namespace: "infra", ServiceAccount: "waypoint", Node: "n3", InMesh: true,
			Addresses: []netip.Addr{a("10.0.3.5"), a("fd00::3:5")}, Labels: map[string]string{"gateway": "wp"}},
		{Name: "server", Namespace: "app", Node: "n2", InMesh: true, Addresses: []netip.Addr{a("10.0.2.20")},
			Waypoint: &Waypoint{Addr: a("10.0.2.5"), Port: 15008}},
		{Name: "bad", Namespace: "infra", ServiceAccount: "waypoint", Node: "n2", InMesh: true,
			Addresses: []netip.Addr{a("10.0.2.6")}, Refused: "network"},
		{Name: "client", Namespace: "app", Node: "n1", InMesh: true, Addresses: []netip.Addr{a("10.0.1.11"), a("fd00::1:11")}},
	}
	svcs := []*Service{
		{Name: "wp", Namespace: "infra", VIPs: []netip.Addr{a("10.96.0.5")}, Selector: map[string]string{"gateway": "wp"},
			Ports: []ServicePort{{Port: 15021}, {Port: 15008}}},
		{Name: "web", Namespace: "app", VIPs: []netip.Addr{a("10.96.0.1")}, Ports: []ServicePort{{Port: 80, TargetPort: 8080}},
			Workloads: []WorkloadRef{{"app", "server"}},
			Waypoint:  &Waypoint{Hostname: "wp.infra.svc.cluster.local", Namespace: "infra", Port: 15008}},
		{Name: "nowp", Namespace: "infra", VIPs: []netip.Addr{a("10.96.0.6")}, Ports: []ServicePort{{Port: 80}}},
	}
	snap, err := Build(Model{TrustDomain: td, Workloads: ws, Services: svcs})
	if err != nil {
		t.Fatal(err)
	}
	return snap
}

// TestResolveWaypoint: each form of GatewayAddress resolves to a
// waypoint workload and its HBONE endpoint as ztunnel resolves it, and
// every reference that names nothing usable is an error (the connection
// is then refused, never sent on another way).
func TestResolveWaypoint(t *testing.T) {
	snap := waypointModel(t)
	a := netip.MustParseAddr
	client := snap.WorkloadByName("app", "client")
	for _, c := range []struct {
		what string
		wp   *Waypoint
		orig netip.Addr
		want []string // possible endpoints, "" for an error
		err  string
	}{
		{"by a workload's address", &Waypoint{Addr: a("10.0.2.5"), Port: 15008}, a("10.0.2.20"), []string{"10.0.2.5:15008"}, ""},
		{"by the service's VIP: one of its endpoints", &Waypoint{Addr: a("10.96.0.5"), Port: 15008}, a("10.96.0.1"), []string{"10.0.2.5:15008", "10.0.3.5:15008"}, ""},
		{"by hostname: an endpoint of the destination's family", &Waypoint{Hostname: "wp.infra.svc.cluster.local", Namespace: "infra"}, a("fd00::96:1"), []string{"[fd00::3:5]:15008"}, ""},
		{"by hostname, IPv4", &Waypoint{Hostname: "wp.infra.svc.cluster.local", Namespace: "infra", Port: 15008}, a("10.96.0.1"), []string{"10.0.2.5:15008", "10.0.3.5:15008"}, ""},
		{"unknown hostname", &Waypoint{Hostname: "nope.infra.svc.cluster.local", Namespace: "infra"}, a("10.96.0.1"), nil, "no service nope.infra.svc.cluster.local"},
		{"hostname in another namespace", &Waypoint{Hostname: "wp.infra.svc.cluster.local", Namespace: "app"}, a("10.96.0.1"), nil, "no service"},
		{"service without the HBONE port", &Waypoint{Addr: a("10.96.0.6"), Port: 15008}, a("10.96.0.1"), nil, "has no port 15008"},
		{"service without endpoints", &Waypoint{Hostname: "nowp.infra.svc.cluster.local", Namespace: "infra", Port: 80}, a("10.96.0.1"), nil, "no endpoint"},
		{"unknown address", &Waypoint{Addr: a("10.0.9.9"), Port: 15008}, a("10.0.2.20"), nil, "no workload or service has address 10.0.9.9"},
		{"refused workload", &Waypoint{Addr: a("10.0.2.6"), Port: 15008}, a("10.0.2.20"), nil, "refused by meshtun (network)"},
		{"none", nil, a("10.0.2.20"), nil, "no waypoint to use"},
	} {
		seen := map[string]bool{}
		for range 40 {
			hop, err := snap.ResolveWaypoint(c.wp, client, c.orig)
			if c.err != "" {
				var we *WaypointError
				if !errors.As(err, &we) || !strings.Contains(err.Error(), c.err) {
					t.Errorf("%s: got %v %v, want a *WaypointError with %q", c.what, hop, err, c.err)
				}
				break
			}
			if err != nil {
				t.Fatalf("%s: %v", c.what, err)
			}
			if hop.Workload.Identity.String() != "spiffe://cluster.local/ns/infra/sa/waypoint" {
				t.Errorf("%s: identity %s, want the waypoint's", c.what, hop.Workload.Identity)
			}
			seen[hop.Endpoint.String()] = true
		}
		if c.err != "" {
			continue
		}
		for _, w := range c.want {
			if !seen[w] {
				t.Errorf("%s: endpoints %v, want each of %v", c.what, seen, c.want)
			}
			delete(seen, w)
		}
		if len(seen) > 0 {
			t.Errorf("%s: unexpected endpoints %v", c.what, seen)
		}
	}
}

// TestIsWaypoint: a connection comes from the waypoint when its source
// has a waypoint workload's identity and address, whichever form names
// it; the same identity at another address is not the waypoint.
func TestIsWaypoint(t *testing.T) {
	snap := waypointModel(t)
	a := netip.MustParseAddr
	wp1, wp2, client := snap.WorkloadByName("infra", "wp-1"), snap.WorkloadByName("infra", "wp-2"), snap.WorkloadByName("app", "client")
	byAddr := &Waypoint{Addr: a("10.0.2.5"), Port: 15008}
	byVIP := &Waypoint{Addr: a("10.96.0.5"), Port: 15008}
	byHost := &Waypoint{Hostname: "wp.infra.svc.cluster.local", Namespace: "infra"}
	for _, c := range []struct {
		what string
		wp   *Waypoint
		w    *Workload
		src  string
		want bool
	}{
		{"the workload named", byAddr, wp1, "10.0.2.5", true},
		{"another pod of the same account", byAddr, wp2, "10.0.3.5", false},
		{"an endpoint of the VIP", byVIP, wp2, "10.0.3.5", true},
		{"an endpoint of the hostname, IPv6", byHost, wp2, "fd00::3:5", true},
		{"the identity from another address", byHost, wp2, "10.0.1.11", false},
		{"a client", byHost, client, "10.0.1.11", false},
		{"no waypoint", nil, wp1, "10.0.2.5", false},
	} {
		if got := snap.IsWaypoint(c.wp, c.w, a(c.src)); got != c.want {
			t.Errorf("%s: IsWaypoint %v, want %v", c.what, got, c.want)
		}
	}
}

// TestPickWaypoint: weighted waypoints are chosen by weight, a weight of
// 0 gets nothing, and without any weight the single waypoint is used.
func TestPickWaypoint(t *testing.T) {
	one := &Waypoint{Hostname: "single", Namespace: "ns"}
	s := &Service{Waypoint: one, WeightedWaypoints: []WeightedWaypoint{
		{Waypoint: Waypoint{Hostname: "a", Namespace: "ns"}, Weight: 1},
		{Waypoint: Waypoint{Hostname: "zero", Namespace: "ns"}, Weight: 0},
		{Waypoint: Waypoint{Hostname: "b", Namespace: "ns"}, Weight: 3},
	}}
	got := map[string]int{}
	for n := range uint64(4) {
		got[s.pickWaypoint(func(uint64) uint64 { return n }).Hostname]++
	}
	if got["a"] != 1 || got["b"] != 3 || len(got) != 2 {
		t.Errorf("picks over the weights' range: %v, want a once and b three times", got)
	}
	s.WeightedWaypoints[0].Weight, s.WeightedWaypoints[2].Weight = 0, 0
	if wp := s.PickWaypoint(); wp != one {
		t.Errorf("all weights 0: %v, want the single waypoint", wp)
	}
	s.Waypoint = nil
	if wp := s.PickWaypoint(); wp != nil || !s.HasWaypoint() {
		t.Errorf("all weights 0 and no single waypoint: %v (HasWaypoint %v), want nil and true", wp, s.HasWaypoint())
	}
	if _, err := Build(Model{TrustDomain: td, Services: []*Service{{Name: "x", Namespace: "ns", Waypoint: &Waypoint{}}}}); err == nil {
		t.Error("Build accepted a waypoint without address or hostname")
	}
}
