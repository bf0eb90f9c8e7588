package proxy

import (
	"net/netip"
	"testing"

	"github.com/meshtun/meshtun/mesh/registry"
)

// TestServiceTargetPassthrough: a connection to a service VIP goes to a
// chosen endpoint and is refused without one, but a PASSTHROUGH service
// (Istio's mode: no endpoint selection) sends it to the original
// destination, as ztunnel does, endpoints or not.
func TestServiceTargetPassthrough(t *testing.T) {
	web := &registry.Workload{Name: "web", Namespace: "default", Node: "n2", InMesh: true,
		Addresses: []netip.Addr{netip.MustParseAddr("198.18.2.20")}, Labels: map[string]string{"app": "web"}}
	vip := func(s string) netip.Addr { return netip.MustParseAddr(s) }
	snap, err := registry.Build(registry.Model{TrustDomain: testTD, Workloads: []*registry.Workload{web},
		Services: []*registry.Service{
			{Name: "web", Namespace: "default", VIPs: []netip.Addr{vip("198.19.0.1")},
				Ports: []registry.ServicePort{{Port: 80, TargetPort: 8080}}, Selector: map[string]string{"app": "web"}},
			{Name: "empty", Namespace: "default", VIPs: []netip.Addr{vip("198.19.0.2")},
				Ports: []registry.ServicePort{{Port: 80}}},
			{Name: "external", Namespace: "default", VIPs: []netip.Addr{vip("198.19.0.3")},
				Ports: []registry.ServicePort{{Port: 443}}, Passthrough: true},
			{Name: "external-sel", Namespace: "default", VIPs: []netip.Addr{vip("198.19.0.4")},
				Ports: []registry.ServicePort{{Port: 80, TargetPort: 8080}}, Selector: map[string]string{"app": "web"}, Passthrough: true},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		dst    string
		ok     bool
		target string
		to     string // the workload's namespace/name
	}{
		{"198.19.0.1:80", true, "198.18.2.20:8080", "default/web"},
		{"198.19.0.2:80", false, "", ""},
		{"198.19.0.3:443", true, "198.19.0.3:443", ""},
		{"198.19.0.4:80", true, "198.19.0.4:80", ""},
		{"198.18.2.20:8080", true, "198.18.2.20:8080", "default/web"},
	} {
		orig := netip.MustParseAddrPort(c.dst)
		_, target, w, ok := serviceTarget(snap, orig, snap.Workload(orig.Addr()), "n1")
		to := ""
		if w != nil {
			to = w.String()
		}
		if ok != c.ok || ok && (target.String() != c.target || to != c.to) {
			t.Errorf("%s: target %s workload %v ok %v, want %s %v %v", c.dst, target, to, ok, c.target, c.to, c.ok)
		}
	}
}
