package proxy

import (
	"context"
	"net/netip"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/rs/zerolog"
	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/meshtun/meshtun/mesh/registry"
)

// TestRefusedWorkloadDenied: a local workload the control plane put in
// the mesh with a feature meshtun refuses is captured and denied both
// ways: what it opens is reset without being dialled, and so is what a
// mesh peer or a plaintext client opens to it; each refusal is logged
// with response_flags DENY.
func TestRefusedWorkloadDenied(t *testing.T) {
	refused := netip.MustParseAddr("198.18.1.13")
	remoteRefused := netip.MustParseAddr("198.18.2.13")
	e := newStackEnv(t, &registry.Workload{
		Name: "refused", Namespace: "default", Node: "n1", InMesh: true, Refused: "waypoint",
		Addresses: []netip.Addr{refused},
	}, &registry.Workload{
		// Of another node: an address claimed by pods of two nodes
		// (kube.RefusedAddressConflict) stands as one.
		Name: "denied-address:198.18.2.13", Namespace: "istio-system", ServiceAccount: "Denied-Address",
		InMesh: true, Refused: "address_conflict", Addresses: []netip.Addr{remoteRefused},
	})
	outsider := netip.MustParseAddr("198.18.9.9") // no workload: plaintext from outside the mesh
	for _, c := range []struct {
		what     string
		from, to netip.AddrPort
	}{
		{"outbound from the refused workload", netip.AddrPortFrom(refused, 41000), netip.AddrPortFrom(server12, 8080)},
		{"from a local mesh workload to it", netip.AddrPortFrom(client11, 41001), netip.AddrPortFrom(refused, 8080)},
		{"plaintext from outside the mesh to it", netip.AddrPortFrom(outsider, 41002), netip.AddrPortFrom(refused, 8080)},
		{"from a local mesh workload to a refused one of no node", netip.AddrPortFrom(client11, 41004), netip.AddrPortFrom(remoteRefused, 8080)},
	} {
		rec, ok := e.refusedSYN(t, c.what, c.from, c.to)
		if !ok {
			continue
		}
		if rec["response_flags"] != "DENY" || rec["message"] != "connection refused" {
			t.Errorf("%s: access log %v, want a refusal with response_flags DENY", c.what, rec)
		}
		if err, _ := rec["error"].(string); c.from.Addr() == refused && !strings.Contains(err, "refused by meshtun (waypoint)") {
			t.Errorf("%s: error %q does not say why", c.what, err)
		}
	}
	// Control: the same connection between two ordinary workloads is dialled.
	from := netip.AddrPortFrom(client11, 41003)
	to := netip.AddrPortFrom(server12, 8080)
	e.send(t, syn(from, to))
	if _, ok := e.dev.next(t, func(s segment) bool { return s.dst == to && s.flags == header.TCPFlagSyn }); !ok {
		t.Error("control: client to server was not dialled")
	}
}

// TestReauthorizeClosesRefusedWorkloadsConnections: what a local
// workload opened before meshtun refused it is closed when the refusal
// arrives; another workload's connection stays.
func TestReauthorizeClosesRefusedWorkloadsConnections(t *testing.T) {
	ws := func(refused string) []*registry.Workload {
		return []*registry.Workload{
			{Name: "client", Namespace: "default", Node: "n1", InMesh: true, Addresses: []netip.Addr{client11}, Refused: refused},
			{Name: "server", Namespace: "default", Node: "n1", InMesh: true, Addresses: []netip.Addr{server12}},
		}
	}
	snap, err := registry.NewSnapshot(testTD, ws(""))
	if err != nil {
		t.Fatal(err)
	}
	reg := registry.New(snap)
	p, err := New(context.Background(), Config{Node: "n1", Registry: reg, Logger: zerolog.New(zerolog.NewTestWriter(t))})
	if err != nil {
		t.Fatal(err)
	}
	var fromClient, fromServer atomic.Int32
	p.open.track(nil, client11, nil, func() { fromClient.Add(1) })
	p.open.track(nil, server12, nil, func() { fromServer.Add(1) })
	if got := p.Reauthorize(); got != 0 {
		t.Fatalf("Reauthorize with nothing refused closed %d", got)
	}
	snap, err = registry.NewSnapshot(testTD, ws(refusedTestReason))
	if err != nil {
		t.Fatal(err)
	}
	reg.Store(snap)
	if got := p.Reauthorize(); got != 1 || fromClient.Load() != 1 || fromServer.Load() != 0 {
		t.Errorf("after client is refused: closed %d (client's %d, server's %d), want client's only", got, fromClient.Load(), fromServer.Load())
	}
}

// refusedTestReason is a registry.Workload.Refused of the tests.
const refusedTestReason = "waypoint"
