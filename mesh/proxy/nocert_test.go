package proxy

import (
	"net/netip"
	"strings"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/meshtun/meshtun/mesh/registry"
)

// TestUncertifiedWorkloadBlocked: a local workload that holds no
// certificate (Config.Certified says so) is blocked for mesh connections:
// what it opens to a mesh workload is reset without being dialled, and so
// is what a local mesh workload opens to it, each logged as having no
// certificate. Its connections out of the mesh are not mesh connections
// and pass; so do the other workloads'.
func TestUncertifiedWorkloadBlocked(t *testing.T) {
	nocert := netip.MustParseAddr("198.18.1.14")
	e := newStackEnv(t, &registry.Workload{
		Name: "nocert", Namespace: "default", ServiceAccount: "nocert", Node: "n1", InMesh: true,
		Addresses: []netip.Addr{nocert},
	})
	blocked := e.p.cfg.Registry.Load().Workload(nocert).Identity
	e.p.cfg.Certified = func(id spiffeid.ID) bool { return id != blocked }
	for _, c := range []struct {
		what     string
		from, to netip.AddrPort
	}{
		{"outbound from the workload without certificate", netip.AddrPortFrom(nocert, 41000), netip.AddrPortFrom(server12, 8080)},
		{"from a local mesh workload to it", netip.AddrPortFrom(client11, 41001), netip.AddrPortFrom(nocert, 8080)},
	} {
		rec, ok := e.refusedSYN(t, c.what, c.from, c.to)
		if !ok {
			continue
		}
		if err, _ := rec["error"].(string); rec["message"] != "connection refused" || !strings.Contains(err, "nocert has no certificate") {
			t.Errorf("%s: access log %v, want a refusal saying default/nocert has no certificate", c.what, rec)
		}
	}
	for _, c := range []struct {
		what     string
		from, to netip.AddrPort
	}{
		{"from it out of the mesh", netip.AddrPortFrom(nocert, 41002), netip.MustParseAddrPort("198.18.9.9:80")},
		{"between certified workloads", netip.AddrPortFrom(client11, 41003), netip.AddrPortFrom(server12, 8080)},
	} {
		e.send(t, syn(c.from, c.to))
		if _, ok := e.dev.next(t, func(s segment) bool { return s.dst == c.to && s.flags == header.TCPFlagSyn }); !ok {
			t.Errorf("%s: not dialled", c.what)
		}
	}
}
