package policy

import (
	"strings"
	"testing"
)

// TestFromIstio: the one conversion of an Istio AuthorizationPolicy that
// the config file, the Kubernetes source and the xDS source share.
func TestFromIstio(t *testing.T) {
	// A bare service account is one of the policy's namespace; a DENY
	// rule with an HTTP field is kept (L4 part) with a warning at the
	// field's path; dry run is carried.
	p, probs := FromIstio(Istio{
		Name: "p", Namespace: "shop", Action: "DENY", DryRun: true,
		Rules: []Rule{{
			From: []Source{{ServiceAccounts: []string{"client", "other/sa"}}},
			To:   []Operation{{Ports: []uint16{8080}, L7: []string{"methods"}}},
			When: []Condition{{Key: "request.headers[x]", Values: []string{"1"}}},
		}},
	})
	if p == nil {
		t.Fatalf("not built: %v", probs)
	}
	if got := p.Rules[0].From[0].ServiceAccounts; len(got) != 2 || got[0] != "shop/client" || got[1] != "other/sa" {
		t.Errorf("service accounts %v, want [shop/client other/sa]", got)
	}
	if !p.DryRun || p.Action != Deny {
		t.Errorf("dry run %v, action %v; want a dry-run DENY", p.DryRun, p.Action)
	}
	if len(probs) != 2 || !probs[0].Warning || probs[0].Path != "rules[0].to[0].methods" ||
		!strings.Contains(probs[0].Reason, "DENY rule is enforced on its L4 part") || probs[1].Path != "rules[0].when[0].key" {
		t.Errorf("problems %+v; want L7 warnings at rules[0].to[0].methods and rules[0].when[0].key", probs)
	}
	// The default action is ALLOW.
	if p, _ := FromIstio(Istio{Name: "p", Namespace: "shop"}); p == nil || p.Action != Allow {
		t.Errorf("no action: %+v, want ALLOW", p)
	}

	// Ignored, with a warning: CUSTOM, and a policy for a waypoint.
	for _, in := range []Istio{
		{Name: "p", Namespace: "shop", Action: "CUSTOM", HasProvider: true},
		{Name: "p", Namespace: "shop", TargetRef: "targetRefs"},
	} {
		p, probs := FromIstio(in)
		if p != nil || len(probs) != 1 || !probs[0].Warning {
			t.Errorf("%+v: %v %+v; want ignored with one warning", in, p, probs)
		}
	}
	// Errors: an unknown action, a provider without CUSTOM, a bad value.
	p, probs = FromIstio(Istio{Name: "p", Namespace: "shop", Action: "MAYBE", HasProvider: true,
		Rules: []Rule{{From: []Source{{Principals: []string{"a*b"}}}}}})
	var paths []string
	for _, pr := range probs {
		if !pr.Warning {
			paths = append(paths, pr.Path)
		}
	}
	if p != nil || strings.Join(paths, " ") != "action rules[0].from[0].principals[0]" {
		t.Errorf("errors at %v (policy %v); want action and rules[0].from[0].principals[0]", paths, p)
	}
}

// TestFailClosed: what stands for a policy meshtun cannot read.
func TestFailClosed(t *testing.T) {
	r := req(t, "spiffe://td/ns/a/sa/b", "10.0.0.1", "10.0.0.2:80")
	sel := map[string]string{"app": "x"}
	if p := AllowNothing("p", "ns", sel); p == nil || p.Action != Allow || len(p.Rules) != 0 || p.Selector["app"] != "x" || p.Matches(r) {
		t.Errorf("AllowNothing: %+v", p)
	}
	if p := AllowNothing("p", "ns", map[string]string{"": "x"}); p == nil || len(p.Selector) != 0 {
		t.Errorf("AllowNothing with a bad selector: %+v, want namespace-wide", p)
	}
	if p := DenyAll("p", "ns", sel); p == nil || p.Action != Deny || !p.Matches(r) || p.Selector["app"] != "x" {
		t.Errorf("DenyAll: %+v", p)
	}
}
