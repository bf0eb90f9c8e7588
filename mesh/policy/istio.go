package policy

import (
	"errors"
	"fmt"
	"strings"
)

// Istio is an Istio AuthorizationPolicy as one of meshtun's sources read
// it (the config file, the Kubernetes API, istiod's xDS), before
// FromIstio turns it into a Policy. The sources only decode their format
// into it; what an L4 node proxy makes of the policy (the action, CUSTOM
// and waypoint policies ignored, HTTP attributes, service accounts of the
// policy's namespace, dry run) is decided by FromIstio alone.
type Istio struct {
	Name, Namespace string
	Selector        map[string]string
	// Action is ALLOW (or empty), DENY, AUDIT or CUSTOM.
	Action string
	// HasProvider: the policy names an external authorizer (provider),
	// which only CUSTOM may.
	HasProvider bool
	// TargetRef names the field that attaches the policy to a waypoint or
	// gateway ("targetRef" or "targetRefs"), if the policy has one.
	TargetRef string
	// DryRun: evaluate and log, do not enforce (Policy.DryRun).
	DryRun bool
	// Rules as Istio writes them: a service account without "/" is one
	// of the policy's namespace, and a Source or Operation lists the HTTP
	// fields it had in L7 (by name, as Istio spells them).
	Rules []Rule
}

// Problem is what FromIstio says about a policy: Path names the field
// relative to the policy ("action", "rules[0].from[1].methods"), Reason
// what is wrong or, for a Warning, what meshtun does with it.
type Problem struct {
	Path, Reason string
	Warning      bool
}

// Error returns "path: reason".
func (p Problem) Error() string { return (&FieldError{Path: p.Path, Reason: p.Reason}).Error() }

// FromIstio converts an Istio AuthorizationPolicy into a Policy, as
// Istio's ztunnel enforces it. It returns nil with a warning for a policy
// a node proxy ignores (CUSTOM, or attached to a waypoint), and nil with
// errors for one it cannot build; the problems are in field order.
func FromIstio(in Istio) (*Policy, []Problem) {
	var probs []Problem
	warn := func(path, format string, args ...any) {
		probs = append(probs, Problem{Path: path, Reason: fmt.Sprintf(format, args...), Warning: true})
	}
	fail := func(path, reason string) { probs = append(probs, Problem{Path: path, Reason: reason}) }
	if in.Action == "" {
		in.Action = "ALLOW"
	}
	action, err := ParseAction(in.Action)
	switch {
	case errors.Is(err, ErrCustom):
		// As Istio's ztunnel: a CUSTOM policy is not loaded.
		warn("action", "%v: policy %s/%s is ignored (its requests are not sent to any authorizer)", err, in.Namespace, in.Name)
		return nil, probs
	case err != nil:
		fail("action", err.Error())
	case in.HasProvider:
		fail("provider", "is only for action CUSTOM")
	}
	if in.TargetRef != "" {
		// As Istio's ztunnel: such a policy is for a waypoint.
		warn(in.TargetRef, "policy %s/%s targets a waypoint or gateway, not workloads: a node proxy ignores it", in.Namespace, in.Name)
		return nil, probs
	}
	p := Policy{Name: in.Name, Namespace: in.Namespace, Selector: in.Selector, Action: action, DryRun: in.DryRun}
	for ri, r := range in.Rules {
		pr := Rule{When: r.When}
		type field struct{ path, name string }
		var l7 []field
		for fi, s := range r.From {
			s.ServiceAccounts = qualifySAs(in.Namespace, s.ServiceAccounts)
			s.NotServiceAccounts = qualifySAs(in.Namespace, s.NotServiceAccounts)
			for _, f := range s.L7 {
				l7 = append(l7, field{fmt.Sprintf("rules[%d].from[%d].%s", ri, fi, f), f})
			}
			pr.From = append(pr.From, s)
		}
		for ti, o := range r.To {
			for _, f := range o.L7 {
				l7 = append(l7, field{fmt.Sprintf("rules[%d].to[%d].%s", ri, ti, f), f})
			}
			pr.To = append(pr.To, o)
		}
		for wi, c := range r.When {
			if IsL7Key(c.Key) {
				l7 = append(l7, field{fmt.Sprintf("rules[%d].when[%d].key", ri, wi), c.Key})
			}
		}
		for _, f := range l7 {
			warn(f.path, "%s is an HTTP (L7) attribute, which an L4 proxy cannot see: %s", f.name, l7Effect(action))
		}
		p.Rules = append(p.Rules, pr)
	}
	built, err := New(p)
	var ve *ValidationError
	switch {
	case errors.As(err, &ve):
		for _, fe := range ve.Fields {
			fail(fe.Path, fe.Reason)
		}
		return nil, probs
	case err != nil:
		fail("", err.Error())
		return nil, probs
	case fails(probs):
		return nil, probs
	}
	return built, probs
}

func fails(probs []Problem) bool {
	for _, p := range probs {
		if !p.Warning {
			return true
		}
	}
	return false
}

// l7Effect says what a rule with HTTP attributes does under action, as
// Istio's ztunnel enforces it.
func l7Effect(a Action) string {
	switch a {
	case Deny:
		return "this DENY rule is enforced on its L4 part alone (it denies more than asked, as in Istio ambient)"
	case Audit:
		return "this AUDIT rule is matched on its L4 part alone"
	}
	return "this ALLOW rule matches nothing (it allows less than asked, as in Istio ambient)"
}

// qualifySAs turns Istio's "<service account>" (in the policy's
// namespace) into "<namespace>/<service account>".
func qualifySAs(ns string, sas []string) []string {
	var out []string
	for _, s := range sas {
		if s != "" && !strings.Contains(s, "/") && !strings.Contains(s, "*") {
			s = ns + "/" + s
		}
		out = append(out, s)
	}
	return out
}

// The policies that stand, failing closed, for one meshtun cannot read.
// Leaving such a policy out would fail open: a DENY policy missing, or the
// only ALLOW policy of a workload missing, lets everything in.

// AllowNothing is an ALLOW policy without rules in the scope of the
// unreadable policy (name, namespace, selector): its workloads allow only
// what their other ALLOW policies allow (the Kubernetes source's choice,
// where the action of the unreadable policy is usually known to the
// operator who wrote it). A selector New refuses is dropped, widening the
// scope to the namespace.
func AllowNothing(name, namespace string, selector map[string]string) *Policy {
	p, err := New(Policy{Name: name, Namespace: namespace, Selector: selector, Action: Allow})
	if err != nil {
		p, err = New(Policy{Name: name, Namespace: namespace, Action: Allow})
	}
	if err != nil {
		return nil // no name or namespace: nothing to scope it to
	}
	return p
}

// DenyAll is a DENY policy whose one empty rule matches every request,
// in the scope of the unreadable policy (name, namespace, selector): its
// workloads refuse every connection (the xDS source's choice, where
// istiod's update may be of any action).
func DenyAll(name, namespace string, selector map[string]string) *Policy {
	p, err := New(Policy{Name: name, Namespace: namespace, Selector: selector, Action: Deny, Rules: []Rule{{}}})
	if err != nil {
		p, err = New(Policy{Name: name, Namespace: namespace, Action: Deny, Rules: []Rule{{}}})
	}
	if err != nil {
		return nil
	}
	return p
}
