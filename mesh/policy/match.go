package policy

import (
	"fmt"
	"net/netip"
	"strconv"
	"strings"

	"github.com/meshtun/meshtun/mesh/identity/workloadid"
)

// attrs is a Request taken apart once per evaluation: the principal and
// its namespace and service account are substrings of the peer ID, so
// nothing is allocated.
type attrs struct {
	hasPeer   bool
	principal string // peer ID without "spiffe://"
	ns, sa    string // from a /ns/<ns>/sa/<sa> path; empty otherwise
	src, dst  netip.Addr
	port      uint16
}

func attrsOf(r *Request) attrs {
	a := attrs{src: r.Source.Unmap(), dst: r.Dest.Addr().Unmap(), port: r.Dest.Port()}
	if r.Peer.IsZero() {
		return a
	}
	a.hasPeer = true
	a.principal = strings.TrimPrefix(r.Peer.String(), "spiffe://")
	a.ns, a.sa, _ = workloadid.Split(r.Peer.Path())
	return a
}

// strMatch is a list of Istio string patterns: exact, "prefix*",
// "*suffix" and "*" (presence). No pattern matches the empty string.
type strMatch struct {
	set      bool // any pattern at all
	presence bool
	exact    []string
	exactSet map[string]struct{} // instead of exact for long lists
	prefix   []string
	suffix   []string
}

const exactSetMin = 16

func (m *strMatch) empty() bool { return !m.set }

func (m *strMatch) add(p string) {
	switch {
	case p == "*":
		m.presence = true
	case strings.HasSuffix(p, "*"):
		m.prefix = append(m.prefix, p[:len(p)-1])
	case strings.HasPrefix(p, "*"):
		m.suffix = append(m.suffix, p[1:])
	default:
		m.exact = append(m.exact, p)
	}
}

func (m *strMatch) finish() {
	m.set = m.presence || len(m.exact) > 0 || len(m.prefix) > 0 || len(m.suffix) > 0
	if len(m.exact) >= exactSetMin {
		m.exactSet = make(map[string]struct{}, len(m.exact))
		for _, e := range m.exact {
			m.exactSet[e] = struct{}{}
		}
		m.exact = nil
	}
}

func (m *strMatch) match(v string) bool {
	if v == "" {
		return false
	}
	if m.presence {
		return true
	}
	for _, e := range m.exact {
		if e == v {
			return true
		}
	}
	if m.exactSet != nil {
		if _, ok := m.exactSet[v]; ok {
			return true
		}
	}
	for _, p := range m.prefix {
		if strings.HasPrefix(v, p) {
			return true
		}
	}
	for _, s := range m.suffix {
		if strings.HasSuffix(v, s) {
			return true
		}
	}
	return false
}

type saMatch struct{ ns, sa string }

// matcher is one source, one operation or one condition: every non-empty
// field must match.
type matcher struct {
	ports, notPorts           []uint16
	srcIPs, notSrcIPs         []IPBlock
	dstIPs, notDstIPs         []IPBlock
	principals, notPrincipals strMatch
	namespaces, notNamespaces strMatch
	sas, notSAs               []saMatch
}

func hasPort(ps []uint16, p uint16) bool {
	for _, q := range ps {
		if q == p {
			return true
		}
	}
	return false
}

func inBlocks(bs []IPBlock, a netip.Addr) bool {
	for i := range bs {
		if bs[i].Contains(a) {
			return true
		}
	}
	return false
}

func hasSA(list []saMatch, a *attrs) bool {
	if a.sa == "" {
		return false
	}
	for _, m := range list {
		if m.ns == a.ns && m.sa == a.sa {
			return true
		}
	}
	return false
}

func (m *matcher) matches(a *attrs) bool {
	if len(m.ports) > 0 && !hasPort(m.ports, a.port) {
		return false
	}
	if len(m.notPorts) > 0 && hasPort(m.notPorts, a.port) {
		return false
	}
	if len(m.srcIPs) > 0 && !inBlocks(m.srcIPs, a.src) {
		return false
	}
	if len(m.notSrcIPs) > 0 && inBlocks(m.notSrcIPs, a.src) {
		return false
	}
	if len(m.dstIPs) > 0 && !inBlocks(m.dstIPs, a.dst) {
		return false
	}
	if len(m.notDstIPs) > 0 && inBlocks(m.notDstIPs, a.dst) {
		return false
	}
	if !m.principals.empty() && !m.principals.match(a.principal) {
		return false
	}
	if !m.notPrincipals.empty() && m.notPrincipals.match(a.principal) {
		return false
	}
	if !m.namespaces.empty() && !m.namespaces.match(a.ns) {
		return false
	}
	if !m.notNamespaces.empty() && m.notNamespaces.match(a.ns) {
		return false
	}
	if len(m.sas) > 0 && !hasSA(m.sas, a) {
		return false
	}
	if len(m.notSAs) > 0 && hasSA(m.notSAs, a) {
		return false
	}
	return true
}

// rule is a compiled Rule: every clause must have a matching matcher.
type rule struct {
	clauses [][]matcher
	// never: an ALLOW rule with HTTP attributes, which matches nothing.
	never bool
}

func (r *rule) matches(a *attrs) bool {
	if r.never {
		return false
	}
	for _, c := range r.clauses {
		ok := false
		for i := range c {
			if c[i].matches(a) {
				ok = true
				break
			}
		}
		if !ok {
			return false
		}
	}
	return true
}

// validator compiles a policy's rules and collects what is wrong with them.
type validator struct {
	errs []*FieldError
}

func (v *validator) add(path, reason string) {
	v.errs = append(v.errs, &FieldError{Path: path, Reason: reason})
}

func (v *validator) rule(r *Rule, path string, action Action) rule {
	var out rule
	l7 := false
	for i := range r.From {
		l7 = l7 || len(r.From[i].L7) > 0
	}
	for i := range r.To {
		l7 = l7 || len(r.To[i].L7) > 0
	}
	for i := range r.When {
		l7 = l7 || IsL7Key(r.When[i].Key)
	}
	// An ALLOW rule with HTTP attributes matches nothing; other actions
	// match on the L4 part (the HTTP parts match everything).
	out.never = l7 && action == Allow
	if len(r.From) > 0 {
		c := make([]matcher, 0, len(r.From))
		for i := range r.From {
			c = append(c, v.source(&r.From[i], fmt.Sprintf("%s.from[%d]", path, i)))
		}
		out.clauses = append(out.clauses, c)
	}
	if len(r.To) > 0 {
		c := make([]matcher, 0, len(r.To))
		for i := range r.To {
			c = append(c, v.operation(&r.To[i], fmt.Sprintf("%s.to[%d]", path, i)))
		}
		out.clauses = append(out.clauses, c)
	}
	for i := range r.When {
		m := v.condition(&r.When[i], fmt.Sprintf("%s.when[%d]", path, i))
		out.clauses = append(out.clauses, []matcher{m})
	}
	return out
}

// CheckPattern reports whether s is a valid Istio string match: exact,
// "prefix*", "*suffix" or "*".
func CheckPattern(s string) error {
	if s == "" {
		return fmt.Errorf("empty value")
	}
	switch n := strings.Count(s, "*"); {
	case n == 0, s == "*":
		return nil
	case n == 1 && (s[0] == '*' || s[len(s)-1] == '*'):
		return nil
	}
	return fmt.Errorf("%q: a wildcard is allowed only as the whole value (\"*\"), as a prefix (\"*x\") or as a suffix (\"x*\")", s)
}

func (v *validator) patterns(m *strMatch, vals []string, path string, principal bool) {
	for i, s := range vals {
		p := fmt.Sprintf("%s[%d]", path, i)
		if err := CheckPattern(s); err != nil {
			v.add(p, err.Error())
			continue
		}
		if principal && strings.HasPrefix(s, "spiffe://") {
			v.add(p, fmt.Sprintf("%q: write principals without the spiffe:// prefix, as Istio does (%q)", s, strings.TrimPrefix(s, "spiffe://")))
			continue
		}
		m.add(s)
	}
	m.finish()
}

// CheckServiceAccount reports whether s is "<namespace>/<service account>".
func CheckServiceAccount(s string) error {
	ns, sa, ok := strings.Cut(s, "/")
	if !ok || ns == "" || sa == "" || strings.Contains(sa, "/") {
		return fmt.Errorf("%q is not <namespace>/<service account>", s)
	}
	if strings.Contains(s, "*") {
		return fmt.Errorf("%q: serviceAccounts take no wildcards", s)
	}
	return nil
}

func (v *validator) serviceAccounts(vals []string, path string) []saMatch {
	var out []saMatch
	for i, s := range vals {
		if err := CheckServiceAccount(s); err != nil {
			v.add(fmt.Sprintf("%s[%d]", path, i), err.Error())
			continue
		}
		ns, sa, _ := strings.Cut(s, "/")
		out = append(out, saMatch{ns: ns, sa: sa})
	}
	return out
}

func (v *validator) blocks(bs []IPBlock, path string) []IPBlock {
	out := make([]IPBlock, 0, len(bs))
	for i, b := range bs {
		p := fmt.Sprintf("%s[%d]", path, i)
		if !b.CIDR.IsValid() {
			v.add(p, "no CIDR")
			continue
		}
		nb := IPBlock{CIDR: b.CIDR.Masked()}
		ok := true
		for j, e := range b.Except {
			ep := fmt.Sprintf("%s.except[%d]", p, j)
			switch {
			case !e.IsValid():
				v.add(ep, "not a CIDR")
				ok = false
			case e.Addr().Is4() != nb.CIDR.Addr().Is4():
				v.add(ep, fmt.Sprintf("%s is not of the same address family as %s", e, nb.CIDR))
				ok = false
			case e.Bits() < nb.CIDR.Bits() || !nb.CIDR.Contains(e.Addr()):
				v.add(ep, fmt.Sprintf("%s is not inside %s", e, nb.CIDR))
				ok = false
			default:
				nb.Except = append(nb.Except, e.Masked())
			}
		}
		if ok {
			out = append(out, nb)
		}
	}
	return out
}

func (v *validator) ports(ps []uint16, path string) []uint16 {
	for i, p := range ps {
		if p == 0 {
			v.add(fmt.Sprintf("%s[%d]", path, i), "0 is not a port number (1-65535)")
		}
	}
	return ps
}

func (v *validator) source(s *Source, path string) matcher {
	if len(s.Principals)+len(s.NotPrincipals)+len(s.Namespaces)+len(s.NotNamespaces)+
		len(s.ServiceAccounts)+len(s.NotServiceAccounts)+len(s.IPBlocks)+len(s.NotIPBlocks) == 0 {
		if len(s.L7) > 0 {
			return matcher{} // HTTP fields only: its L4 part matches anything
		}
		v.add(path, "source is empty: set at least one of principals, namespaces, serviceAccounts, ipBlocks or their not-forms (omit from to match any source)")
		return matcher{}
	}
	var m matcher
	v.patterns(&m.principals, s.Principals, path+".principals", true)
	v.patterns(&m.notPrincipals, s.NotPrincipals, path+".notPrincipals", true)
	v.patterns(&m.namespaces, s.Namespaces, path+".namespaces", false)
	v.patterns(&m.notNamespaces, s.NotNamespaces, path+".notNamespaces", false)
	m.sas = v.serviceAccounts(s.ServiceAccounts, path+".serviceAccounts")
	m.notSAs = v.serviceAccounts(s.NotServiceAccounts, path+".notServiceAccounts")
	m.srcIPs = v.blocks(s.IPBlocks, path+".ipBlocks")
	m.notSrcIPs = v.blocks(s.NotIPBlocks, path+".notIpBlocks")
	return m
}

func (v *validator) operation(o *Operation, path string) matcher {
	if len(o.Ports)+len(o.NotPorts) == 0 {
		if len(o.L7) > 0 {
			return matcher{} // HTTP fields only: its L4 part matches anything
		}
		v.add(path, "operation is empty: set ports or notPorts (omit to to match any port)")
		return matcher{}
	}
	return matcher{ports: v.ports(o.Ports, path+".ports"), notPorts: v.ports(o.NotPorts, path+".notPorts")}
}

// conditionKeys are the when keys an L4 policy can match.
var conditionKeys = []string{"source.ip", "source.namespace", "source.principal", "destination.ip", "destination.port"}

// IsL7Key reports whether key is one of Istio's condition keys that need
// HTTP or an L7 proxy: request.*, remote.ip, connection.sni and
// experimental.*. A rule with one is treated as the package doc says.
func IsL7Key(key string) bool {
	return strings.HasPrefix(key, "request.") || strings.HasPrefix(key, "experimental.") ||
		key == "remote.ip" || key == "connection.sni"
}

func (v *validator) condition(c *Condition, path string) matcher {
	var m matcher
	if IsL7Key(c.Key) {
		return m // matches anything; the rule knows it has HTTP attributes
	}
	if len(c.Values)+len(c.NotValues) == 0 {
		v.add(path, "set values or notValues")
	}
	switch c.Key {
	case "source.ip", "destination.ip":
		pos, neg := v.condIPs(c.Values, path+".values"), v.condIPs(c.NotValues, path+".notValues")
		if c.Key == "source.ip" {
			m.srcIPs, m.notSrcIPs = pos, neg
		} else {
			m.dstIPs, m.notDstIPs = pos, neg
		}
	case "source.namespace":
		v.patterns(&m.namespaces, c.Values, path+".values", false)
		v.patterns(&m.notNamespaces, c.NotValues, path+".notValues", false)
	case "source.principal":
		v.patterns(&m.principals, c.Values, path+".values", true)
		v.patterns(&m.notPrincipals, c.NotValues, path+".notValues", true)
	case "destination.port":
		m.ports = v.condPorts(c.Values, path+".values")
		m.notPorts = v.condPorts(c.NotValues, path+".notValues")
	case "":
		v.add(path+".key", "is required")
	default:
		v.add(path+".key", fmt.Sprintf("%q is not a condition key (L4: %s; HTTP: request.*, remote.ip, connection.sni, experimental.*)", c.Key, strings.Join(conditionKeys, ", ")))
	}
	return m
}

func (v *validator) condIPs(vals []string, path string) []IPBlock {
	var out []IPBlock
	for i, s := range vals {
		b, err := ParseIPBlock(s)
		if err != nil {
			v.add(fmt.Sprintf("%s[%d]", path, i), err.Error())
			continue
		}
		out = append(out, b)
	}
	return out
}

func (v *validator) condPorts(vals []string, path string) []uint16 {
	var out []uint16
	for i, s := range vals {
		n, err := strconv.ParseUint(s, 10, 32)
		if err != nil || n == 0 || n > 65535 {
			v.add(fmt.Sprintf("%s[%d]", path, i), fmt.Sprintf("%q is not a port number (1-65535)", s))
			continue
		}
		out = append(out, uint16(n))
	}
	return out
}
