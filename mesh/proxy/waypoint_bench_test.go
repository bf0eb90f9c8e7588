package proxy

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/registry"
)

// BenchmarkWaypointServiceMiss is the waypoint check every outbound
// connection makes first, to a pod's address in a model of 1,000 pods and
// 1,000 services none of which has a waypoint (the usual mesh).
func BenchmarkWaypointServiceMiss(b *testing.B) {
	var ws []*registry.Workload
	var ss []*registry.Service
	for i := range 1000 {
		ws = append(ws, &registry.Workload{Name: fmt.Sprintf("p%d", i), Namespace: "apps", Node: "n1", InMesh: true,
			Labels:    map[string]string{"app": fmt.Sprintf("a%d", i)},
			Addresses: []netip.Addr{netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)})}})
		ss = append(ss, &registry.Service{Name: fmt.Sprintf("s%d", i), Namespace: "apps",
			Selector: map[string]string{"app": fmt.Sprintf("a%d", i)},
			VIPs:     []netip.Addr{netip.AddrFrom4([4]byte{10, 96, byte(i >> 8), byte(i)})},
			Ports:    []registry.ServicePort{{Port: 80, TargetPort: 8080}}})
	}
	snap, err := registry.Build(registry.Model{TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local"), Workloads: ws, Services: ss})
	if err != nil {
		b.Fatal(err)
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		dst := netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8 & 3), byte(i)}), 8080)
		if waypointService(snap, dst, "apps") != nil {
			b.Fatal("a waypoint where there is none")
		}
		i++
	}
}
