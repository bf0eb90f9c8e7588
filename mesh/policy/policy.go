// Package policy evaluates Istio-style L4 authorization policies at the
// destination of a connection.
//
// A Policy applies to workloads by scope: a policy in the root namespace
// (configurable, "istio-system" by default) without a selector applies to
// every workload of the mesh (global scope); a policy in any other namespace
// without a selector applies to every workload of its namespace (namespace
// scope); a policy with a selector applies to the workloads whose labels
// match it, in its namespace, or in every namespace when the policy is in
// the root namespace (workload selector scope).
//
// Matching follows Istio: the rules of a policy are OR-ed; within a rule,
// the from, to and when clauses are AND-ed, the entries of from (and of to)
// are OR-ed, the conditions of when are AND-ed; within a source or an
// operation the fields are AND-ed and the values of one field are OR-ed. A
// policy without rules matches nothing; a rule without clauses matches
// everything.
//
// The decision at a workload (Set.Evaluate) is Istio's: any matching DENY
// policy denies; otherwise, with no ALLOW policy applying to the workload
// the request is allowed; otherwise a matching ALLOW policy allows it, and
// nothing matching denies it.
//
// A request without a verified peer identity (plaintext) matches no
// principals, namespaces or serviceAccounts value, not even "*", and
// matches every notPrincipals, notNamespaces and notServiceAccounts list:
// this is what Istio's ztunnel and Envoy do (a negative match is the
// negation of the positive one, and the positive one fails without an
// identity). So `notPrincipals: ["*"]` selects exactly the plaintext
// requests, and a DENY policy with it is how Istio writes "require mTLS";
// STRICT peer authentication (NewSet's strict) is that check, built in.
//
// An L4 proxy cannot see HTTP attributes. Policies that use them are
// accepted and enforced as Istio's ztunnel enforces them: a Source or
// Operation lists the HTTP fields it had in L7, and a condition's key may
// be an HTTP attribute (IsL7Key). An ALLOW rule with any of them matches
// nothing (it can only allow less); a DENY or AUDIT rule with them is
// enforced on its L4 part alone, the HTTP parts matching everything (it
// denies more than asked, never less).
//
// AUDIT policies do not change a decision: Evaluate reports the first
// matching one in Decision.Audit, for the proxy to log.
package policy

import (
	"errors"
	"fmt"
	"maps"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// Action is what a matching policy does.
type Action uint8

const (
	// Allow admits a matching request (the default action in Istio).
	Allow Action = iota
	// Deny refuses a matching request, whatever any ALLOW policy says.
	Deny
	// Audit marks a matching request for the log; it neither allows nor
	// denies.
	Audit
)

// String returns "ALLOW", "DENY" or "AUDIT".
func (a Action) String() string {
	switch a {
	case Deny:
		return "DENY"
	case Audit:
		return "AUDIT"
	}
	return "ALLOW"
}

// MarshalText returns String, so that dumps read "DENY", not 1.
func (a Action) MarshalText() ([]byte, error) { return []byte(a.String()), nil }

// ErrCustom is ParseAction's error for CUSTOM, Istio's action that asks an
// external authorizer: there is none at L4.
var ErrCustom = errors.New("action CUSTOM (an external authorizer) is not supported")

// ParseAction parses "ALLOW", "DENY" or "AUDIT" (as Istio spells them).
// "CUSTOM" returns ErrCustom.
func ParseAction(s string) (Action, error) {
	switch s {
	case "ALLOW":
		return Allow, nil
	case "DENY":
		return Deny, nil
	case "AUDIT":
		return Audit, nil
	case "CUSTOM":
		return 0, ErrCustom
	}
	return 0, fmt.Errorf("unknown action %q (want ALLOW, DENY or AUDIT)", s)
}

// IPBlock is a CIDR with exceptions, like a Kubernetes NetworkPolicy
// ipBlock: it contains the addresses of CIDR that are in none of Except.
type IPBlock struct {
	CIDR   netip.Prefix
	Except []netip.Prefix
}

// ParseIPBlock parses an address ("203.0.113.4", a /32 or /128 block) or a
// CIDR ("203.0.113.0/24"), as Istio's ipBlocks take them. Host bits of a
// CIDR are cleared.
func ParseIPBlock(s string) (IPBlock, error) {
	p, err := ParsePrefix(s)
	if err != nil {
		return IPBlock{}, err
	}
	return IPBlock{CIDR: p}, nil
}

// ParsePrefix parses an address or a CIDR into a masked prefix; an address
// is a prefix of its full length. IPv4-mapped IPv6 addresses are unmapped.
func ParsePrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return netip.Prefix{}, fmt.Errorf("%q is not an IP address or CIDR", s)
		}
		if p.Addr().Is4In6() && p.Bits() >= 96 {
			p = netip.PrefixFrom(p.Addr().Unmap(), p.Bits()-96)
		}
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil || a.Zone() != "" {
		return netip.Prefix{}, fmt.Errorf("%q is not an IP address or CIDR", s)
	}
	a = a.Unmap()
	return netip.PrefixFrom(a, a.BitLen()), nil
}

// Contains reports whether a is in the block's CIDR and in none of its
// exceptions.
func (b *IPBlock) Contains(a netip.Addr) bool {
	if !b.CIDR.Contains(a) {
		return false
	}
	for _, e := range b.Except {
		if e.Contains(a) {
			return false
		}
	}
	return true
}

// String returns the CIDR, followed by " except " and the exceptions if
// there are any.
func (b IPBlock) String() string {
	if len(b.Except) == 0 {
		return b.CIDR.String()
	}
	var sb strings.Builder
	sb.WriteString(b.CIDR.String())
	sb.WriteString(" except ")
	for i, e := range b.Except {
		if i > 0 {
			sb.WriteString(",")
		}
		sb.WriteString(e.String())
	}
	return sb.String()
}

// Source matches the peer of a request. Its fields are AND-ed, the values
// of a field OR-ed; an empty field matches anything. Principals,
// Namespaces and their not-forms accept Istio's wildcards: "*" (any
// non-empty value), "prefix*" and "*suffix".
type Source struct {
	// Principals are peer identities without "spiffe://", as Istio writes
	// them: "cluster.local/ns/default/sa/client".
	Principals, NotPrincipals []string
	// Namespaces are the namespaces of peer identities (the <ns> of
	// .../ns/<ns>/sa/<sa>).
	Namespaces, NotNamespaces []string
	// ServiceAccounts are "<namespace>/<service account>" of the peer
	// identity, in any trust domain; no wildcards.
	ServiceAccounts, NotServiceAccounts []string
	// IPBlocks match the source address of the connection.
	IPBlocks, NotIPBlocks []IPBlock
	// L7 names the HTTP fields the source had in the policy
	// (requestPrincipals, remoteIpBlocks, …): an L4 proxy cannot match
	// them (see the package doc).
	L7 []string
}

// Operation matches the destination of a request: at L4, its port. Ports
// are those the destination workload listens on (a service's target port,
// not the service port).
type Operation struct {
	Ports, NotPorts []uint16
	// L7 names the HTTP fields the operation had in the policy (methods,
	// paths, hosts, …): an L4 proxy cannot match them (see the package
	// doc).
	L7 []string
}

// Condition is one entry of a rule's when clause: the request attribute
// named by Key must have one of Values (if any) and none of NotValues.
// Supported keys: source.ip, source.namespace, source.principal,
// destination.ip, destination.port; HTTP keys (IsL7Key) are accepted and
// treated as the package doc says.
type Condition struct {
	Key       string
	Values    []string
	NotValues []string
}

// Rule matches a request when one of From (or From is empty), one of To
// (or To is empty) and every When condition match.
type Rule struct {
	From []Source
	To   []Operation
	When []Condition
}

// Policy is an authorization policy. Build it with New; do not modify it
// afterwards.
type Policy struct {
	Name      string
	Namespace string
	// Selector selects the workloads the policy applies to by label; empty
	// means every workload of the policy's scope.
	Selector map[string]string
	Action   Action
	Rules    []Rule
	// DryRun: the policy is evaluated but not enforced (Istio's
	// istio.io/dry-run annotation): like an AUDIT policy, a match is
	// reported in Decision.Audit for the log, where Action says what the
	// policy would have done.
	DryRun bool

	id    string
	rules []rule
	built bool
}

// FieldError is one problem in a policy: Path names the field relative to
// the policy, as "rules[0].from[1].principals[0]", and Reason says what is
// wrong with it.
type FieldError struct {
	Path   string
	Reason string
}

// Error returns "path: reason".
func (e *FieldError) Error() string {
	if e.Path == "" {
		return e.Reason
	}
	return e.Path + ": " + e.Reason
}

// ValidationError lists every problem New found in a policy.
type ValidationError struct {
	Policy string // namespace/name
	Fields []*FieldError
}

// Error names the policy and each problem.
func (e *ValidationError) Error() string {
	var sb strings.Builder
	fmt.Fprintf(&sb, "policy %s:", e.Policy)
	for i, f := range e.Fields {
		if i > 0 {
			sb.WriteString(";")
		}
		sb.WriteString(" ")
		sb.WriteString(f.Error())
	}
	return sb.String()
}

// Unwrap returns the field errors.
func (e *ValidationError) Unwrap() []error {
	out := make([]error, len(e.Fields))
	for i, f := range e.Fields {
		out[i] = f
	}
	return out
}

// New validates p and returns it ready for evaluation. The returned policy
// shares p's slices and maps, which must not be modified afterwards. The
// error, if any, is a *ValidationError listing every problem.
func New(p Policy) (*Policy, error) {
	v := &validator{}
	if p.Name == "" {
		v.add("name", "is required")
	}
	if p.Namespace == "" {
		v.add("namespace", "is required")
	}
	if p.Action != Allow && p.Action != Deny && p.Action != Audit {
		v.add("action", fmt.Sprintf("unknown action %d", p.Action))
	}
	for k := range p.Selector {
		if k == "" {
			v.add("selector", "label key is empty")
		}
	}
	p.rules = make([]rule, 0, len(p.Rules))
	for i := range p.Rules {
		p.rules = append(p.rules, v.rule(&p.Rules[i], fmt.Sprintf("rules[%d]", i), p.Action))
	}
	if len(v.errs) > 0 {
		return nil, &ValidationError{Policy: p.Namespace + "/" + p.Name, Fields: v.errs}
	}
	p.id = p.Namespace + "/" + p.Name
	p.built = true
	return &p, nil
}

// ID returns "namespace/name".
func (p *Policy) ID() string { return p.id }

// Built reports whether p was returned by New.
func (p *Policy) Built() bool { return p.built }

// AppliesTo reports whether p applies to a workload of namespace ns with
// labels, rootNamespace being the mesh's root namespace.
func (p *Policy) AppliesTo(rootNamespace, ns string, labels map[string]string) bool {
	if p.Namespace != rootNamespace && p.Namespace != ns {
		return false
	}
	return SelectorMatches(p.Selector, labels)
}

// SelectorMatches reports whether labels has every key of selector with the
// same value. An empty selector matches every label set.
func SelectorMatches(selector, labels map[string]string) bool {
	for k, want := range selector {
		if got, ok := labels[k]; !ok || got != want {
			return false
		}
	}
	return true
}

// Request is what authorization knows about a connection at its
// destination.
type Request struct {
	// Peer is the verified identity of the client; the zero ID when there
	// is none (plaintext).
	Peer spiffeid.ID
	// Source is the client's address.
	Source netip.Addr
	// Dest is the destination workload's address and the port it is
	// connected on (its target port).
	Dest netip.AddrPort
}

// Matches reports whether r matches one of p's rules.
func (p *Policy) Matches(r *Request) bool {
	a := attrsOf(r)
	return p.matches(&a)
}

func (p *Policy) matches(a *attrs) bool {
	for i := range p.rules {
		if p.rules[i].matches(a) {
			return true
		}
	}
	return false
}

// Reason says why a Decision was reached.
type Reason uint8

const (
	// NoAllowPolicy: no DENY matched and no ALLOW policy applies.
	NoAllowPolicy Reason = iota
	// AllowMatched: an ALLOW policy matched (Decision.Policy).
	AllowMatched
	// DenyMatched: a DENY policy matched (Decision.Policy).
	DenyMatched
	// NoAllowMatched: ALLOW policies apply but none matched.
	NoAllowMatched
	// StrictNoIdentity: the workload requires STRICT peer authentication
	// and the request has no verified identity.
	StrictNoIdentity
	// UnknownDestination: the destination is not a known workload.
	UnknownDestination
)

// Decision is the outcome of authorizing a request.
type Decision struct {
	Allowed bool
	Reason  Reason
	// Policy is the policy that decided: the matching DENY or ALLOW
	// policy; nil for the other reasons.
	Policy *Policy
	// Audit is the first AUDIT policy that matched, or nil; it does not
	// change the decision.
	Audit *Policy
}

// String describes the decision for logs: "allowed by policy ns/name",
// "denied by policy ns/name", "allowed: no ALLOW policy applies", "denied:
// no ALLOW policy matched", "denied: STRICT peer authentication requires a
// verified peer identity", "denied: unknown destination workload".
func (d Decision) String() string {
	switch d.Reason {
	case NoAllowPolicy:
		return "allowed: no ALLOW policy applies"
	case AllowMatched:
		return "allowed by policy " + d.Policy.ID()
	case DenyMatched:
		return "denied by policy " + d.Policy.ID()
	case NoAllowMatched:
		return "denied: no ALLOW policy matched"
	case StrictNoIdentity:
		return "denied: STRICT peer authentication requires a verified peer identity"
	case UnknownDestination:
		return "denied: unknown destination workload"
	}
	return "reason " + strconv.Itoa(int(d.Reason))
}

// Set is the policies that apply to one workload, ready to evaluate. The
// zero Set allows everything.
type Set struct {
	deny, allow, audit []*Policy
	strict             bool
	// ports overrides strict for some destination ports (port-level
	// peer authentication): port → strict.
	ports map[uint16]bool
}

// NewSet keeps the policies of ps (built by New) in their order, DENY
// before ALLOW. With strict, requests without a verified peer identity
// are denied before any policy is looked at (STRICT peer authentication).
func NewSet(ps []*Policy, strict bool) (Set, error) {
	s := Set{strict: strict}
	for _, p := range ps {
		if p == nil || !p.built {
			return Set{}, errors.New("policy: NewSet: policy not built by New")
		}
		switch {
		case p.DryRun || p.Action == Audit:
			s.audit = append(s.audit, p)
		case p.Action == Deny:
			s.deny = append(s.deny, p)
		default:
			s.allow = append(s.allow, p)
		}
	}
	return s, nil
}

// WithPorts returns s with port-level peer authentication: for a request
// to a port in ports, ports[port] (true: STRICT) replaces the set's mode.
// ports must not be modified afterwards.
func (s Set) WithPorts(ports map[uint16]bool) Set {
	s.ports = ports
	return s
}

// Same reports whether s and o are the same policies, in the same
// order, with the same peer-authentication modes: they decide every
// request alike.
func (s *Set) Same(o *Set) bool {
	return slices.Equal(s.deny, o.deny) && slices.Equal(s.allow, o.allow) && slices.Equal(s.audit, o.audit) &&
		s.strict == o.strict && maps.Equal(s.ports, o.ports)
}

// Strict reports whether the set requires a verified peer identity on
// ports without a port-level mode.
func (s *Set) Strict() bool { return s.strict }

// StrictOn reports whether the set requires a verified peer identity on
// port.
func (s *Set) StrictOn(port uint16) bool {
	if v, ok := s.ports[port]; ok {
		return v
	}
	return s.strict
}

// Audits returns the set's AUDIT policies. Do not modify them.
func (s *Set) Audits() []*Policy { return s.audit }

// Policies returns the set's DENY and ALLOW policies. Do not modify them.
func (s *Set) Policies() (deny, allow []*Policy) { return s.deny, s.allow }

// Evaluate decides r: STRICT peer authentication first, then any matching
// DENY denies, no ALLOW policy allows, a matching ALLOW allows, and
// otherwise r is denied. It does not allocate.
func (s *Set) Evaluate(r *Request) Decision {
	a := attrsOf(r)
	var audit *Policy
	for _, p := range s.audit {
		if p.matches(&a) {
			audit = p
			break
		}
	}
	if !a.hasPeer && s.StrictOn(a.port) {
		return Decision{Reason: StrictNoIdentity, Audit: audit}
	}
	for _, p := range s.deny {
		if p.matches(&a) {
			return Decision{Reason: DenyMatched, Policy: p, Audit: audit}
		}
	}
	if len(s.allow) == 0 {
		return Decision{Allowed: true, Reason: NoAllowPolicy, Audit: audit}
	}
	for _, p := range s.allow {
		if p.matches(&a) {
			return Decision{Allowed: true, Reason: AllowMatched, Policy: p, Audit: audit}
		}
	}
	return Decision{Reason: NoAllowMatched, Audit: audit}
}
