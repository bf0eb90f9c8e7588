package kube

import (
	"context"
	"net/netip"
	"slices"
	"sync"
	"testing"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/kubernetes/fake"
)

// startAnnounced starts a source whose CNI gate announced addrs for the
// pods in ann (namespace/name).
func startAnnounced(t *testing.T, ann map[string][]netip.Addr, objs ...runtime.Object) *Source {
	t.Helper()
	var mu sync.Mutex
	s := New(Config{Client: fakeAPI{fake.NewClientset(objs...)}, Node: "n1",
		TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local"), Logger: zerolog.Nop(),
		Announced: func(ns, name, uid string) []netip.Addr {
			mu.Lock()
			defer mu.Unlock()
			return ann[ns+"/"+name]
		}})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if _, err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	return s
}

// TestAnnouncedPod: a pending pod without IPs in its status is a mesh
// workload with the addresses the CNI gate announced (its init
// containers and first packets are captured); without an announcement it
// is not a workload, and a pod's own status IPs win over an announcement.
func TestAnnouncedPod(t *testing.T) {
	a4, a6 := netip.MustParseAddr("198.18.1.21"), netip.MustParseAddr("fd00:6d74:1::21")
	early := pod("mesh", "early", "n1")
	early.Status = corev1.PodStatus{Phase: corev1.PodPending}
	plainPending := pod("mesh", "unannounced", "n1")
	plainPending.Status = corev1.PodStatus{Phase: corev1.PodPending}
	running := pod("mesh", "running", "n1", "198.18.1.22")
	ann := map[string][]netip.Addr{
		"mesh/early":   {a4, a6},
		"mesh/running": {netip.MustParseAddr("198.18.1.99")},
	}
	s := startAnnounced(t, ann, ns("mesh", true), ns("plain", false), early, plainPending, running)
	snap, err := s.Build()
	if err != nil {
		t.Fatal(err)
	}
	w := snap.Workload(a6)
	if w == nil || !w.InMesh || w.Name != "early" || !slices.Equal(w.Addresses, []netip.Addr{a4, a6}) ||
		w.Identity.String() != "spiffe://cluster.local/ns/mesh/sa/early-sa" {
		t.Fatalf("announced pending pod: %+v, want a mesh workload with the announced addresses", w)
	}
	for _, wl := range snap.Workloads {
		if wl.Name == "unannounced" {
			t.Errorf("a pending pod without an announcement is workload %+v", wl)
		}
	}
	if w := snap.Workload(netip.MustParseAddr("198.18.1.99")); w != nil {
		t.Errorf("the announcement won over the pod's status IPs: %+v", w)
	}
	if w := snap.Workload(netip.MustParseAddr("198.18.1.22")); w == nil || w.Name != "running" {
		t.Errorf("running pod: %+v", w)
	}

	// What the gate asks.
	p, ok := s.Pod("mesh", "early")
	if !ok || !p.InMesh || p.Running || len(p.Addresses) != 0 || p.Node != "n1" {
		t.Errorf("Pod(mesh/early) = %+v, %v", p, ok)
	}
	if p, ok := s.Pod("mesh", "running"); !ok || !p.Running || len(p.Addresses) != 1 {
		t.Errorf("Pod(mesh/running) = %+v, %v", p, ok)
	}
	if _, ok := s.Pod("mesh", "nope"); ok {
		t.Error("Pod of an unknown pod: found")
	}
	if ex := s.Exempt(); !slices.Equal(ex, []string{"plain"}) {
		t.Errorf("Exempt() = %v, want [plain]", ex)
	}
}
