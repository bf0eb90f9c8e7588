package kube

import (
	"context"
	"net/netip"
	"testing"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	fakediscovery "k8s.io/client-go/discovery/fake"
	dynfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/meshtun/meshtun/mesh/registry"
)

func istioObj(kind, ns, name string, spec map[string]any) *unstructured.Unstructured {
	return &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "security.istio.io/v1", "kind": kind,
		"metadata": map[string]any{"namespace": ns, "name": name, "uid": ns + "-" + name, "resourceVersion": "1"},
		"spec":     spec,
	}}
}

func TestIstioPolicies(t *testing.T) {
	a := pod("mesh", "a", "n1", "198.18.1.11")
	b := pod("mesh", "b", "n1", "198.18.1.12")
	c := pod("other", "c", "n1", "198.18.1.13")
	cs := fake.NewClientset(ns("mesh", true), ns("other", true), a, b, c)
	cs.Discovery().(*fakediscovery.FakeDiscovery).Resources = []*metav1.APIResourceList{{
		GroupVersion: "security.istio.io/v1",
		APIResources: []metav1.APIResource{{Name: "authorizationpolicies"}, {Name: "peerauthentications"}},
	}}
	objs := []runtime.Object{
		istioObj("AuthorizationPolicy", "mesh", "deny-a", map[string]any{
			"selector": map[string]any{"matchLabels": map[string]any{"app": "a"}},
			"action":   "DENY",
			"rules":    []any{map[string]any{"to": []any{map[string]any{"operation": map[string]any{"ports": []any{"9000"}}}}}},
		}),
		// Not understood (an unknown field): its workloads allow nothing.
		istioObj("AuthorizationPolicy", "mesh", "broken", map[string]any{
			"selector": map[string]any{"matchLabels": map[string]any{"app": "b"}},
			"rulez":    []any{},
		}),
		// Dry run: evaluated and logged, not enforced.
		withAnnotation(istioObj("AuthorizationPolicy", "other", "dry-deny-c", map[string]any{
			"selector": map[string]any{"matchLabels": map[string]any{"app": "c"}},
			"action":   "DENY",
		}), DryRunAnnotation, "true"),
		// Not a boolean: enforced.
		withAnnotation(istioObj("AuthorizationPolicy", "mesh", "not-dry-a", map[string]any{
			"selector": map[string]any{"matchLabels": map[string]any{"app": "a"}},
			"action":   "DENY",
			"rules":    []any{map[string]any{"to": []any{map[string]any{"operation": map[string]any{"ports": []any{"9001"}}}}}},
		}), DryRunAnnotation, "yes please"),
		istioObj("PeerAuthentication", "mesh", "ns-strict", map[string]any{"mtls": map[string]any{"mode": "STRICT"}}),
		istioObj("PeerAuthentication", "mesh", "b-permissive", map[string]any{
			"selector":      map[string]any{"matchLabels": map[string]any{"app": "b"}},
			"mtls":          map[string]any{"mode": "PERMISSIVE"},
			"portLevelMtls": map[string]any{"8080": map[string]any{"mode": "STRICT"}},
		}),
	}
	sch := runtime.NewScheme()
	dyn := dynfake.NewSimpleDynamicClientWithCustomListKinds(sch, map[schema.GroupVersionResource]string{
		AuthorizationPolicies: "AuthorizationPolicyList", PeerAuthentications: "PeerAuthenticationList",
	}, objs...)
	s := New(Config{Client: fakeAPI{cs}, Dynamic: dyn, Node: "n1",
		TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local"), Logger: zerolog.Nop()})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	snap, err := s.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	wa := snap.Workload(netip.MustParseAddr("198.18.1.11"))
	deny, allow, strict := wa.Policies()
	if len(deny) != 2 || len(allow) != 0 || !strict {
		t.Errorf("pod a: %d DENY, %d ALLOW, strict %v; want the two DENY policies (one with a dry-run value that is not a boolean) and STRICT from its namespace", len(deny), len(allow), strict)
	}
	wb := snap.Workload(netip.MustParseAddr("198.18.1.12"))
	deny, allow, _ = wb.Policies()
	if len(deny) != 0 || len(allow) != 1 {
		t.Errorf("pod b: %d DENY, %d ALLOW; want the broken policy as an ALLOW without rules (fail closed)", len(deny), len(allow))
	}
	if wb.PeerAuth != registry.Permissive || wb.PortPeerAuth[8080] != registry.Strict {
		t.Errorf("pod b: mode %v, port modes %v; want PERMISSIVE from its own policy, STRICT on 8080", wb.PeerAuth, wb.PortPeerAuth)
	}
	wc := snap.Workload(netip.MustParseAddr("198.18.1.13"))
	if wc.PeerAuth != registry.Permissive {
		t.Errorf("pod c of another namespace: mode %v, want the default PERMISSIVE", wc.PeerAuth)
	}
	// The dry-run DENY is audited: not among the enforced policies, but
	// the workload's traffic is still taken to evaluate it.
	deny, allow, _ = wc.Policies()
	if len(deny) != 0 || len(allow) != 0 || !wc.Protected(80) {
		t.Errorf("pod c: %d DENY, %d ALLOW, protected %v; want its dry-run DENY evaluated (protected) but not enforced", len(deny), len(allow), wc.Protected(80))
	}
}

func withAnnotation(u *unstructured.Unstructured, k, v string) *unstructured.Unstructured {
	u.SetAnnotations(map[string]string{k: v, "kubectl.kubernetes.io/last-applied-configuration": "{}"})
	return u
}
