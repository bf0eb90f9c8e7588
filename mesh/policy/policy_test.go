package policy

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

// req builds a request: peer is a SPIFFE ID ("" for none), src an address,
// dst "addr:port".
func req(t testing.TB, peer, src, dst string) *Request {
	t.Helper()
	r := &Request{Source: netip.MustParseAddr(src), Dest: netip.MustParseAddrPort(dst)}
	if peer != "" {
		id, err := spiffeid.FromString(peer)
		if err != nil {
			t.Fatal(err)
		}
		r.Peer = id
	}
	return r
}

func mustNew(t testing.TB, p Policy) *Policy {
	t.Helper()
	if p.Name == "" {
		p.Name = "p"
	}
	if p.Namespace == "" {
		p.Namespace = "default"
	}
	out, err := New(p)
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func block(s string, except ...string) IPBlock {
	b := IPBlock{CIDR: netip.MustParsePrefix(s)}
	for _, e := range except {
		b.Except = append(b.Except, netip.MustParsePrefix(e))
	}
	return b
}

const (
	client  = "spiffe://cluster.local/ns/default/sa/client"
	other   = "spiffe://cluster.local/ns/prod/sa/other"
	foreign = "spiffe://example.org/ns/default/sa/client"
	odd     = "spiffe://cluster.local/workload/x" // not /ns/<ns>/sa/<sa>
	none    = ""
)

func TestSourceFields(t *testing.T) {
	tests := []struct {
		name string
		src  Source
		peer string
		ip   string
		want bool
	}{
		// principals: exact, prefix, suffix, presence; absent identity fails all.
		{"principal exact", Source{Principals: []string{"cluster.local/ns/default/sa/client"}}, client, "10.0.0.1", true},
		{"principal exact other", Source{Principals: []string{"cluster.local/ns/default/sa/client"}}, other, "10.0.0.1", false},
		{"principal exact other td", Source{Principals: []string{"cluster.local/ns/default/sa/client"}}, foreign, "10.0.0.1", false},
		{"principal prefix", Source{Principals: []string{"cluster.local/ns/default/*"}}, client, "10.0.0.1", true},
		{"principal prefix miss", Source{Principals: []string{"cluster.local/ns/default/*"}}, other, "10.0.0.1", false},
		{"principal suffix", Source{Principals: []string{"*/sa/client"}}, foreign, "10.0.0.1", true},
		{"principal suffix miss", Source{Principals: []string{"*/sa/client"}}, other, "10.0.0.1", false},
		{"principal presence", Source{Principals: []string{"*"}}, other, "10.0.0.1", true},
		{"principal presence odd path", Source{Principals: []string{"*"}}, odd, "10.0.0.1", true},
		{"principal absent exact", Source{Principals: []string{"cluster.local/ns/default/sa/client"}}, none, "10.0.0.1", false},
		{"principal absent presence", Source{Principals: []string{"*"}}, none, "10.0.0.1", false},
		{"principal values OR-ed", Source{Principals: []string{"x/ns/a/sa/b", "cluster.local/ns/prod/sa/other"}}, other, "10.0.0.1", true},
		{"notPrincipals hit", Source{NotPrincipals: []string{"cluster.local/ns/default/sa/client"}}, client, "10.0.0.1", false},
		{"notPrincipals miss", Source{NotPrincipals: []string{"cluster.local/ns/default/sa/client"}}, other, "10.0.0.1", true},
		{"notPrincipals presence absent", Source{NotPrincipals: []string{"*"}}, none, "10.0.0.1", true},
		{"notPrincipals presence present", Source{NotPrincipals: []string{"*"}}, client, "10.0.0.1", false},
		{"notPrincipals absent", Source{NotPrincipals: []string{"cluster.local/ns/default/sa/client"}}, none, "10.0.0.1", true},

		// namespaces
		{"namespace exact", Source{Namespaces: []string{"default"}}, client, "10.0.0.1", true},
		{"namespace other td", Source{Namespaces: []string{"default"}}, foreign, "10.0.0.1", true},
		{"namespace miss", Source{Namespaces: []string{"default"}}, other, "10.0.0.1", false},
		{"namespace prefix", Source{Namespaces: []string{"pro*"}}, other, "10.0.0.1", true},
		{"namespace suffix", Source{Namespaces: []string{"*ault"}}, client, "10.0.0.1", true},
		{"namespace presence", Source{Namespaces: []string{"*"}}, client, "10.0.0.1", true},
		{"namespace presence odd path", Source{Namespaces: []string{"*"}}, odd, "10.0.0.1", false},
		{"namespace absent", Source{Namespaces: []string{"*"}}, none, "10.0.0.1", false},
		{"notNamespaces hit", Source{NotNamespaces: []string{"default"}}, client, "10.0.0.1", false},
		{"notNamespaces miss", Source{NotNamespaces: []string{"default"}}, other, "10.0.0.1", true},
		{"notNamespaces absent", Source{NotNamespaces: []string{"default"}}, none, "10.0.0.1", true},
		{"notNamespaces presence absent", Source{NotNamespaces: []string{"*"}}, none, "10.0.0.1", true},

		// serviceAccounts
		{"sa match", Source{ServiceAccounts: []string{"default/client"}}, client, "10.0.0.1", true},
		{"sa any trust domain", Source{ServiceAccounts: []string{"default/client"}}, foreign, "10.0.0.1", true},
		{"sa miss", Source{ServiceAccounts: []string{"default/client"}}, other, "10.0.0.1", false},
		{"sa wrong ns", Source{ServiceAccounts: []string{"prod/client"}}, client, "10.0.0.1", false},
		{"sa odd path", Source{ServiceAccounts: []string{"default/client"}}, odd, "10.0.0.1", false},
		{"sa absent", Source{ServiceAccounts: []string{"default/client"}}, none, "10.0.0.1", false},
		{"notServiceAccounts hit", Source{NotServiceAccounts: []string{"default/client"}}, client, "10.0.0.1", false},
		{"notServiceAccounts miss", Source{NotServiceAccounts: []string{"default/client"}}, other, "10.0.0.1", true},
		{"notServiceAccounts absent", Source{NotServiceAccounts: []string{"default/client"}}, none, "10.0.0.1", true},

		// ipBlocks, with except; identity does not matter
		{"ip in", Source{IPBlocks: []IPBlock{block("10.0.0.0/8")}}, none, "10.1.2.3", true},
		{"ip out", Source{IPBlocks: []IPBlock{block("10.0.0.0/8")}}, client, "11.1.2.3", false},
		{"ip single", Source{IPBlocks: []IPBlock{block("10.1.2.3/32")}}, none, "10.1.2.3", true},
		{"ip except hit", Source{IPBlocks: []IPBlock{block("10.0.0.0/8", "10.1.0.0/16")}}, none, "10.1.2.3", false},
		{"ip except miss", Source{IPBlocks: []IPBlock{block("10.0.0.0/8", "10.1.0.0/16")}}, none, "10.2.2.3", true},
		{"ip except one of two", Source{IPBlocks: []IPBlock{block("10.0.0.0/8", "10.1.0.0/16", "10.2.0.0/16")}}, none, "10.2.2.3", false},
		{"ip blocks OR-ed", Source{IPBlocks: []IPBlock{block("10.0.0.0/8", "10.1.0.0/16"), block("10.1.2.0/24")}}, none, "10.1.2.3", true},
		{"ip v6 in", Source{IPBlocks: []IPBlock{block("fd00::/8")}}, none, "fd00::1", true},
		{"ip v6 vs v4 block", Source{IPBlocks: []IPBlock{block("0.0.0.0/0")}}, none, "fd00::1", false},
		{"ip v4-mapped source", Source{IPBlocks: []IPBlock{block("10.0.0.0/8")}}, none, "::ffff:10.1.2.3", true},
		{"notIpBlocks hit", Source{NotIPBlocks: []IPBlock{block("10.0.0.0/8")}}, none, "10.1.2.3", false},
		{"notIpBlocks miss", Source{NotIPBlocks: []IPBlock{block("10.0.0.0/8")}}, none, "11.1.2.3", true},
		{"notIpBlocks except", Source{NotIPBlocks: []IPBlock{block("10.0.0.0/8", "10.1.0.0/16")}}, none, "10.1.2.3", true},

		// fields AND-ed
		{"and both", Source{Principals: []string{"*"}, IPBlocks: []IPBlock{block("10.0.0.0/8")}}, client, "10.1.2.3", true},
		{"and ip fails", Source{Principals: []string{"*"}, IPBlocks: []IPBlock{block("10.0.0.0/8")}}, client, "11.1.2.3", false},
		{"and principal fails", Source{Principals: []string{"*"}, IPBlocks: []IPBlock{block("10.0.0.0/8")}}, none, "10.1.2.3", false},
		{"and positive and negative", Source{Namespaces: []string{"*"}, NotNamespaces: []string{"prod"}}, other, "10.1.2.3", false},
		{"and positive and negative ok", Source{Namespaces: []string{"*"}, NotNamespaces: []string{"prod"}}, client, "10.1.2.3", true},
		{"and sa and principal", Source{ServiceAccounts: []string{"default/client"}, Principals: []string{"cluster.local/*"}}, foreign, "10.1.2.3", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := mustNew(t, Policy{Rules: []Rule{{From: []Source{tt.src}}}})
			if got := p.Matches(req(t, tt.peer, tt.ip, "10.9.9.9:8080")); got != tt.want {
				t.Errorf("Matches = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestLongPrincipalList(t *testing.T) {
	var ps []string
	for i := range 40 {
		ps = append(ps, fmt.Sprintf("cluster.local/ns/n%d/sa/s", i))
	}
	p := mustNew(t, Policy{Rules: []Rule{{From: []Source{{Principals: append(ps, "cluster.local/ns/default/sa/client")}}}}})
	if !p.Matches(req(t, client, "10.0.0.1", "10.9.9.9:80")) {
		t.Error("principal at the end of a long list did not match")
	}
	if p.Matches(req(t, other, "10.0.0.1", "10.9.9.9:80")) {
		t.Error("principal not in a long list matched")
	}
	if !p.Matches(req(t, "spiffe://cluster.local/ns/n17/sa/s", "10.0.0.1", "10.9.9.9:80")) {
		t.Error("principal inside a long list did not match")
	}
}

func TestOperationAndConditions(t *testing.T) {
	tests := []struct {
		name string
		rule Rule
		peer string
		src  string
		dst  string
		want bool
	}{
		{"port hit", Rule{To: []Operation{{Ports: []uint16{80, 8080}}}}, none, "10.0.0.1", "10.9.9.9:8080", true},
		{"port miss", Rule{To: []Operation{{Ports: []uint16{80}}}}, none, "10.0.0.1", "10.9.9.9:8080", false},
		{"notPorts hit", Rule{To: []Operation{{NotPorts: []uint16{8080}}}}, none, "10.0.0.1", "10.9.9.9:8080", false},
		{"notPorts miss", Rule{To: []Operation{{NotPorts: []uint16{80}}}}, none, "10.0.0.1", "10.9.9.9:8080", true},
		{"ports and notPorts", Rule{To: []Operation{{Ports: []uint16{80, 8080}, NotPorts: []uint16{8080}}}}, none, "10.0.0.1", "10.9.9.9:8080", false},
		{"operations OR-ed", Rule{To: []Operation{{Ports: []uint16{80}}, {Ports: []uint16{8080}}}}, none, "10.0.0.1", "10.9.9.9:8080", true},

		{"when source.ip", Rule{When: []Condition{{Key: "source.ip", Values: []string{"10.0.0.0/24"}}}}, none, "10.0.0.1", "10.9.9.9:80", true},
		{"when source.ip miss", Rule{When: []Condition{{Key: "source.ip", Values: []string{"10.0.1.0/24"}}}}, none, "10.0.0.1", "10.9.9.9:80", false},
		{"when source.ip notValues", Rule{When: []Condition{{Key: "source.ip", NotValues: []string{"10.0.0.1"}}}}, none, "10.0.0.1", "10.9.9.9:80", false},
		{"when destination.ip", Rule{When: []Condition{{Key: "destination.ip", Values: []string{"10.9.9.9"}}}}, none, "10.0.0.1", "10.9.9.9:80", true},
		{"when destination.ip notValues", Rule{When: []Condition{{Key: "destination.ip", NotValues: []string{"10.9.0.0/16"}}}}, none, "10.0.0.1", "10.9.9.9:80", false},
		{"when destination.port", Rule{When: []Condition{{Key: "destination.port", Values: []string{"80"}}}}, none, "10.0.0.1", "10.9.9.9:80", true},
		{"when destination.port notValues", Rule{When: []Condition{{Key: "destination.port", NotValues: []string{"80"}}}}, none, "10.0.0.1", "10.9.9.9:80", false},
		{"when source.namespace", Rule{When: []Condition{{Key: "source.namespace", Values: []string{"default"}}}}, client, "10.0.0.1", "10.9.9.9:80", true},
		{"when source.namespace absent", Rule{When: []Condition{{Key: "source.namespace", Values: []string{"*"}}}}, none, "10.0.0.1", "10.9.9.9:80", false},
		{"when source.namespace notValues absent", Rule{When: []Condition{{Key: "source.namespace", NotValues: []string{"default"}}}}, none, "10.0.0.1", "10.9.9.9:80", true},
		{"when source.principal", Rule{When: []Condition{{Key: "source.principal", Values: []string{"*/sa/client"}}}}, client, "10.0.0.1", "10.9.9.9:80", true},
		{"when source.principal notValues", Rule{When: []Condition{{Key: "source.principal", NotValues: []string{"*/sa/client"}}}}, client, "10.0.0.1", "10.9.9.9:80", false},
		{"when conditions AND-ed", Rule{When: []Condition{
			{Key: "destination.port", Values: []string{"80"}},
			{Key: "source.ip", Values: []string{"11.0.0.0/8"}},
		}}, none, "10.0.0.1", "10.9.9.9:80", false},
		{"when values and notValues", Rule{When: []Condition{{Key: "source.ip", Values: []string{"10.0.0.0/8"}, NotValues: []string{"10.0.0.1"}}}}, none, "10.0.0.2", "10.9.9.9:80", true},

		{"from and to both", Rule{From: []Source{{Namespaces: []string{"default"}}}, To: []Operation{{Ports: []uint16{80}}}}, client, "10.0.0.1", "10.9.9.9:80", true},
		{"from ok to fails", Rule{From: []Source{{Namespaces: []string{"default"}}}, To: []Operation{{Ports: []uint16{81}}}}, client, "10.0.0.1", "10.9.9.9:80", false},
		{"from fails to ok", Rule{From: []Source{{Namespaces: []string{"prod"}}}, To: []Operation{{Ports: []uint16{80}}}}, client, "10.0.0.1", "10.9.9.9:80", false},
		{"from to when, when fails", Rule{
			From: []Source{{Namespaces: []string{"default"}}},
			To:   []Operation{{Ports: []uint16{80}}},
			When: []Condition{{Key: "source.ip", Values: []string{"11.0.0.0/8"}}},
		}, client, "10.0.0.1", "10.9.9.9:80", false},
		{"sources OR-ed", Rule{From: []Source{{Namespaces: []string{"prod"}}, {IPBlocks: []IPBlock{block("10.0.0.0/8")}}}}, client, "10.0.0.1", "10.9.9.9:80", true},
		{"empty rule matches all", Rule{}, none, "10.0.0.1", "10.9.9.9:80", true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := mustNew(t, Policy{Rules: []Rule{tt.rule}})
			if got := p.Matches(req(t, tt.peer, tt.src, tt.dst)); got != tt.want {
				t.Errorf("Matches = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestNoRulesMatchesNothing(t *testing.T) {
	p := mustNew(t, Policy{})
	if p.Matches(req(t, client, "10.0.0.1", "10.9.9.9:80")) {
		t.Error("policy without rules matched")
	}
}

// permutations calls f with every order of n indices.
func permutations(n int, f func([]int)) {
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i
	}
	var rec func(k int)
	rec = func(k int) {
		if k == n {
			f(idx)
			return
		}
		for i := k; i < n; i++ {
			idx[k], idx[i] = idx[i], idx[k]
			rec(k + 1)
			idx[k], idx[i] = idx[i], idx[k]
		}
	}
	rec(0)
}

// TestOrderDoesNotMatter checks that the order of rules, of sources, of
// operations, of conditions and of values never changes the outcome.
func TestOrderDoesNotMatter(t *testing.T) {
	rules := []Rule{
		{From: []Source{{Namespaces: []string{"prod"}}}, To: []Operation{{Ports: []uint16{81}}}},
		{From: []Source{{ServiceAccounts: []string{"default/client"}}, {IPBlocks: []IPBlock{block("192.168.0.0/16")}}}},
		{To: []Operation{{NotPorts: []uint16{80}}}, When: []Condition{{Key: "source.ip", Values: []string{"10.0.0.0/8"}}}},
	}
	conds := []Condition{
		{Key: "destination.port", Values: []string{"443", "80"}},
		{Key: "source.ip", NotValues: []string{"10.0.0.0/30"}},
		{Key: "source.namespace", Values: []string{"def*"}},
	}
	reqs := []*Request{
		req(t, client, "10.0.0.1", "10.9.9.9:80"),
		req(t, client, "10.0.0.9", "10.9.9.9:80"),
		req(t, other, "10.0.0.9", "10.9.9.9:81"),
		req(t, other, "192.168.1.1", "10.9.9.9:443"),
		req(t, none, "10.0.0.9", "10.9.9.9:81"),
		req(t, none, "172.16.0.1", "10.9.9.9:80"),
		req(t, other, "10.0.0.9", "10.9.9.9:80"),
	}
	ref := mustNew(t, Policy{Rules: rules})
	refC := mustNew(t, Policy{Rules: []Rule{{When: conds}}})
	permutations(len(rules), func(order []int) {
		var rs []Rule
		for _, i := range order {
			r := rules[i]
			// also reverse the sources of each rule
			var from []Source
			for j := len(r.From) - 1; j >= 0; j-- {
				from = append(from, r.From[j])
			}
			r.From = from
			rs = append(rs, r)
		}
		p := mustNew(t, Policy{Rules: rs})
		for _, r := range reqs {
			if got, want := p.Matches(r), ref.Matches(r); got != want {
				t.Errorf("rule order %v: %v -> %v: Matches = %v, want %v", order, r.Peer, r.Dest, got, want)
			}
		}
	})
	permutations(len(conds), func(order []int) {
		var cs []Condition
		for _, i := range order {
			c := conds[i]
			c.Values = append([]string(nil), c.Values...)
			for a, b := 0, len(c.Values)-1; a < b; a, b = a+1, b-1 {
				c.Values[a], c.Values[b] = c.Values[b], c.Values[a]
			}
			cs = append(cs, c)
		}
		p := mustNew(t, Policy{Rules: []Rule{{When: cs}}})
		for _, r := range reqs {
			if got, want := p.Matches(r), refC.Matches(r); got != want {
				t.Errorf("condition order %v: Matches = %v, want %v", order, got, want)
			}
		}
	})
	// The reference outcomes themselves, so that the permutations compare
	// against something known.
	want := []bool{true, true, true, true, true, false, false}
	for i, r := range reqs {
		if got := ref.Matches(r); got != want[i] {
			t.Errorf("reference request %d: Matches = %v, want %v", i, got, want[i])
		}
	}
	wantC := []bool{false, true, false, false, false, false, false}
	for i, r := range reqs {
		if got := refC.Matches(r); got != wantC[i] {
			t.Errorf("reference conditions request %d: Matches = %v, want %v", i, got, wantC[i])
		}
	}
}

func TestScope(t *testing.T) {
	const root = "istio-system"
	app := map[string]string{"app": "echo", "version": "v1"}
	tests := []struct {
		name   string
		ns     string
		sel    map[string]string
		wlNS   string
		labels map[string]string
		root   string
		want   bool
	}{
		{"global", root, nil, "default", app, root, true},
		{"global other ns", root, nil, "prod", nil, root, true},
		{"global selector", root, map[string]string{"app": "echo"}, "prod", app, root, true},
		{"global selector miss", root, map[string]string{"app": "other"}, "prod", app, root, false},
		{"namespace", "default", nil, "default", app, root, true},
		{"namespace other", "default", nil, "prod", app, root, false},
		{"namespace empty selector", "default", map[string]string{}, "default", nil, root, true},
		{"selector", "default", map[string]string{"app": "echo"}, "default", app, root, true},
		{"selector all labels", "default", map[string]string{"app": "echo", "version": "v1"}, "default", app, root, true},
		{"selector one label differs", "default", map[string]string{"app": "echo", "version": "v2"}, "default", app, root, false},
		{"selector label missing", "default", map[string]string{"tier": "x"}, "default", app, root, false},
		{"selector other ns", "default", map[string]string{"app": "echo"}, "prod", app, root, false},
		{"custom root", "mesh-root", nil, "default", app, "mesh-root", true},
		{"istio-system not root", root, nil, "default", app, "mesh-root", false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := mustNew(t, Policy{Namespace: tt.ns, Selector: tt.sel})
			if got := p.AppliesTo(tt.root, tt.wlNS, tt.labels); got != tt.want {
				t.Errorf("AppliesTo = %v, want %v", got, tt.want)
			}
		})
	}
}

func TestSetEvaluate(t *testing.T) {
	allowClient := mustNew(t, Policy{Name: "allow-client", Action: Allow,
		Rules: []Rule{{From: []Source{{Principals: []string{"cluster.local/ns/default/sa/client"}}}}}})
	allowProd := mustNew(t, Policy{Name: "allow-prod", Action: Allow,
		Rules: []Rule{{From: []Source{{Namespaces: []string{"prod"}}}}}})
	denyPort := mustNew(t, Policy{Name: "deny-9090", Action: Deny,
		Rules: []Rule{{To: []Operation{{Ports: []uint16{9090}}}}}})
	denyPlain := mustNew(t, Policy{Name: "deny-plaintext", Action: Deny,
		Rules: []Rule{{From: []Source{{NotPrincipals: []string{"*"}}}}}})
	denyNothing := mustNew(t, Policy{Name: "deny-nothing", Action: Deny})

	tests := []struct {
		name     string
		policies []*Policy
		strict   bool
		r        *Request
		allowed  bool
		reason   Reason
		by       string
		text     string
	}{
		{"no policies", nil, false, req(t, none, "10.0.0.1", "10.9.9.9:80"), true, NoAllowPolicy, "", "allowed: no ALLOW policy applies"},
		{"only deny, not matching", []*Policy{denyPort}, false, req(t, none, "10.0.0.1", "10.9.9.9:80"), true, NoAllowPolicy, "", ""},
		{"deny without rules", []*Policy{denyNothing}, false, req(t, none, "10.0.0.1", "10.9.9.9:80"), true, NoAllowPolicy, "", ""},
		{"deny matching", []*Policy{denyPort}, false, req(t, client, "10.0.0.1", "10.9.9.9:9090"), false, DenyMatched, "default/deny-9090", "denied by policy default/deny-9090"},
		{"allow matching", []*Policy{allowClient}, false, req(t, client, "10.0.0.1", "10.9.9.9:80"), true, AllowMatched, "default/allow-client", "allowed by policy default/allow-client"},
		{"allow not matching", []*Policy{allowClient}, false, req(t, other, "10.0.0.1", "10.9.9.9:80"), false, NoAllowMatched, "", "denied: no ALLOW policy matched"},
		{"allow absent identity", []*Policy{allowClient}, false, req(t, none, "10.0.0.1", "10.9.9.9:80"), false, NoAllowMatched, "", ""},
		{"second allow matches", []*Policy{allowClient, allowProd}, false, req(t, other, "10.0.0.1", "10.9.9.9:80"), true, AllowMatched, "default/allow-prod", ""},
		{"deny before allow", []*Policy{allowClient, denyPort}, false, req(t, client, "10.0.0.1", "10.9.9.9:9090"), false, DenyMatched, "default/deny-9090", ""},
		{"deny first in list too", []*Policy{denyPort, allowClient}, false, req(t, client, "10.0.0.1", "10.9.9.9:9090"), false, DenyMatched, "default/deny-9090", ""},
		{"deny plaintext", []*Policy{denyPlain}, false, req(t, none, "10.0.0.1", "10.9.9.9:80"), false, DenyMatched, "default/deny-plaintext", ""},
		{"deny plaintext lets mTLS in", []*Policy{denyPlain}, false, req(t, other, "10.0.0.1", "10.9.9.9:80"), true, NoAllowPolicy, "", ""},
		{"strict no identity", nil, true, req(t, none, "10.0.0.1", "10.9.9.9:80"), false, StrictNoIdentity, "", "denied: STRICT peer authentication requires a verified peer identity"},
		{"strict with identity", nil, true, req(t, other, "10.0.0.1", "10.9.9.9:80"), true, NoAllowPolicy, "", ""},
		{"strict then allow", []*Policy{allowClient}, true, req(t, client, "10.0.0.1", "10.9.9.9:80"), true, AllowMatched, "default/allow-client", ""},
		{"strict before deny", []*Policy{denyPort}, true, req(t, none, "10.0.0.1", "10.9.9.9:9090"), false, StrictNoIdentity, "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Every order of the policies gives the same decision.
			permutations(len(tt.policies), func(order []int) {
				var ps []*Policy
				for _, i := range order {
					ps = append(ps, tt.policies[i])
				}
				s, err := NewSet(ps, tt.strict)
				if err != nil {
					t.Fatal(err)
				}
				d := s.Evaluate(tt.r)
				if d.Allowed != tt.allowed || d.Reason != tt.reason {
					t.Errorf("order %v: decision %+v (%s), want allowed=%v reason=%d", order, d, d, tt.allowed, tt.reason)
				}
				by := ""
				if d.Policy != nil {
					by = d.Policy.ID()
				}
				// With two ALLOWs both matching only the first in order
				// decides; here at most one matches.
				if by != tt.by {
					t.Errorf("order %v: decided by %q, want %q", order, by, tt.by)
				}
				if tt.text != "" && d.String() != tt.text {
					t.Errorf("String() = %q, want %q", d.String(), tt.text)
				}
			})
		})
	}
}

func TestNewSetRejectsUnbuilt(t *testing.T) {
	if _, err := NewSet([]*Policy{{Name: "x", Namespace: "y"}}, false); err == nil {
		t.Error("NewSet accepted a policy not built by New")
	}
}

func TestNewValidation(t *testing.T) {
	tests := []struct {
		name string
		p    Policy
		want []string // each a substring of one field error, "path: reason"
	}{
		{"no name", Policy{Namespace: "d"}, []string{"name: is required"}},
		{"no namespace", Policy{Name: "n"}, []string{"namespace: is required"}},
		{"bad action", Policy{Name: "n", Namespace: "d", Action: 7}, []string{"action: unknown action 7"}},
		{"empty source", Policy{Name: "n", Namespace: "d", Rules: []Rule{{From: []Source{{}}}}},
			[]string{"rules[0].from[0]: source is empty"}},
		{"empty operation", Policy{Name: "n", Namespace: "d", Rules: []Rule{{}, {To: []Operation{{}}}}},
			[]string{"rules[1].to[0]: operation is empty"}},
		{"inner wildcard", Policy{Name: "n", Namespace: "d", Rules: []Rule{{From: []Source{{Principals: []string{"a", "cluster.local/*/sa/x"}}}}}},
			[]string{`rules[0].from[0].principals[1]: "cluster.local/*/sa/x": a wildcard is allowed only`}},
		{"two wildcards", Policy{Name: "n", Namespace: "d", Rules: []Rule{{From: []Source{{NotNamespaces: []string{"*a*"}}}}}},
			[]string{`rules[0].from[0].notNamespaces[0]: "*a*"`}},
		{"empty value", Policy{Name: "n", Namespace: "d", Rules: []Rule{{From: []Source{{Namespaces: []string{""}}}}}},
			[]string{`rules[0].from[0].namespaces[0]: empty value`}},
		{"spiffe prefix", Policy{Name: "n", Namespace: "d", Rules: []Rule{{From: []Source{{NotPrincipals: []string{"spiffe://cluster.local/ns/a/sa/b"}}}}}},
			[]string{`rules[0].from[0].notPrincipals[0]: "spiffe://cluster.local/ns/a/sa/b": write principals without the spiffe:// prefix`}},
		{"sa format", Policy{Name: "n", Namespace: "d", Rules: []Rule{{From: []Source{{ServiceAccounts: []string{"client"}, NotServiceAccounts: []string{"a/b/c"}}}}}},
			[]string{`rules[0].from[0].serviceAccounts[0]: "client" is not <namespace>/<service account>`,
				`rules[0].from[0].notServiceAccounts[0]: "a/b/c" is not <namespace>/<service account>`}},
		{"sa wildcard", Policy{Name: "n", Namespace: "d", Rules: []Rule{{From: []Source{{ServiceAccounts: []string{"default/*"}}}}}},
			[]string{`serviceAccounts[0]: "default/*": serviceAccounts take no wildcards`}},
		{"except outside", Policy{Name: "n", Namespace: "d", Rules: []Rule{{From: []Source{{IPBlocks: []IPBlock{block("10.0.0.0/16", "10.1.0.0/24")}}}}}},
			[]string{`rules[0].from[0].ipBlocks[0].except[0]: 10.1.0.0/24 is not inside 10.0.0.0/16`}},
		{"except wider", Policy{Name: "n", Namespace: "d", Rules: []Rule{{From: []Source{{NotIPBlocks: []IPBlock{block("10.0.0.0/16", "10.0.0.0/8")}}}}}},
			[]string{`rules[0].from[0].notIpBlocks[0].except[0]: 10.0.0.0/8 is not inside 10.0.0.0/16`}},
		{"except family", Policy{Name: "n", Namespace: "d", Rules: []Rule{{From: []Source{{IPBlocks: []IPBlock{block("10.0.0.0/8", "fd00::/8")}}}}}},
			[]string{`ipBlocks[0].except[0]: fd00::/8 is not of the same address family as 10.0.0.0/8`}},
		{"no cidr", Policy{Name: "n", Namespace: "d", Rules: []Rule{{From: []Source{{IPBlocks: []IPBlock{{}}}}}}},
			[]string{`ipBlocks[0]: no CIDR`}},
		{"port 0", Policy{Name: "n", Namespace: "d", Rules: []Rule{{To: []Operation{{Ports: []uint16{80, 0}}}}}},
			[]string{`rules[0].to[0].ports[1]: 0 is not a port number`}},
		{"condition unknown", Policy{Name: "n", Namespace: "d", Rules: []Rule{{When: []Condition{{Key: "source.nope", Values: []string{"1.2.3.4"}}}}}},
			[]string{`rules[0].when[0].key: "source.nope" is not a condition key`}},
		{"condition no key", Policy{Name: "n", Namespace: "d", Rules: []Rule{{When: []Condition{{Values: []string{"1.2.3.4"}}}}}},
			[]string{`rules[0].when[0].key: is required`}},
		{"condition no values", Policy{Name: "n", Namespace: "d", Rules: []Rule{{When: []Condition{{Key: "source.ip"}}}}},
			[]string{`rules[0].when[0]: set values or notValues`}},
		{"condition bad ip", Policy{Name: "n", Namespace: "d", Rules: []Rule{{When: []Condition{{Key: "source.ip", NotValues: []string{"10.0.0.0/33"}}}}}},
			[]string{`rules[0].when[0].notValues[0]: "10.0.0.0/33" is not an IP address or CIDR`}},
		{"condition bad port", Policy{Name: "n", Namespace: "d", Rules: []Rule{{When: []Condition{{Key: "destination.port", Values: []string{"70000"}}}}}},
			[]string{`rules[0].when[0].values[0]: "70000" is not a port number (1-65535)`}},
		{"condition bad pattern", Policy{Name: "n", Namespace: "d", Rules: []Rule{{When: []Condition{{Key: "source.principal", Values: []string{"a*b"}}}}}},
			[]string{`rules[0].when[0].values[0]: "a*b"`}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := New(tt.p)
			var ve *ValidationError
			if !errors.As(err, &ve) {
				t.Fatalf("New: err = %v, want a *ValidationError", err)
			}
			if len(ve.Fields) != len(tt.want) {
				t.Errorf("got %d field errors (%v), want %d", len(ve.Fields), err, len(tt.want))
			}
			for _, w := range tt.want {
				found := false
				for _, f := range ve.Fields {
					if strings.Contains(f.Error(), w) {
						found = true
					}
				}
				if !found {
					t.Errorf("no field error contains %q; got %v", w, err)
				}
			}
		})
	}
}

func TestParsePrefix(t *testing.T) {
	for in, want := range map[string]string{
		"10.1.2.3":             "10.1.2.3/32",
		"10.1.2.3/8":           "10.0.0.0/8",
		"fd00::1":              "fd00::1/128",
		"::ffff:10.1.2.3":      "10.1.2.3/32",
		"::ffff:10.1.0.0/112":  "10.1.0.0/16",
		"fd00:6d74::/32":       "fd00:6d74::/32",
		"0.0.0.0/0":            "0.0.0.0/0",
		"198.18.1.300":         "",
		"10.0.0.0/33":          "",
		"fe80::1%eth0":         "",
		"not an address/8":     "",
		"":                     "",
		"2001:db8::/129":       "",
		"10.0.0.0/8/8":         "",
		"10.0.0.1 ":            "",
		"10.0.0.0/08":          "",
		"::ffff:10.1.0.0/96":   "0.0.0.0/0",
		"2001:db8::1/64":       "2001:db8::/64",
		"192.168.0.0/16":       "192.168.0.0/16",
		"192.168.255.255/16":   "192.168.0.0/16",
		"203.0.113.4/32":       "203.0.113.4/32",
		"100.64.0.0/10":        "100.64.0.0/10",
		"255.255.255.255":      "255.255.255.255/32",
		"::":                   "::/128",
		"::/0":                 "::/0",
		"1.2.3":                "",
		"a.b.c.d":              "",
		"10.0.0.0/-1":          "",
		"10.0.0.0/ 8":          "",
		"[fd00::1]":            "",
		"fd00::1/128":          "fd00::1/128",
		"FD00::ABCD":           "fd00::abcd/128",
		"fd00::abcd/ff":        "",
		"10.0.0.0/255.0.0.0":   "",
		"2001:db8::/32 ":       "",
		"2001:db8:0:0:0:0:0:1": "2001:db8::1/128",
	} {
		p, err := ParsePrefix(in)
		if want == "" {
			if err == nil {
				t.Errorf("ParsePrefix(%q) = %v, want an error", in, p)
			} else if !strings.Contains(err.Error(), "is not an IP address or CIDR") {
				t.Errorf("ParsePrefix(%q) error %q", in, err)
			}
			continue
		}
		if err != nil || p.String() != want {
			t.Errorf("ParsePrefix(%q) = %v, %v; want %s", in, p, err, want)
		}
	}
}

func TestActionParse(t *testing.T) {
	for in, want := range map[string]string{"ALLOW": "ALLOW", "DENY": "DENY", "allow": "unknown action", "AUDIT": "AUDIT", "CUSTOM": "CUSTOM (an external authorizer) is not supported", "": "unknown action"} {
		a, err := ParseAction(in)
		got := ""
		if err != nil {
			got = err.Error()
		} else {
			got = a.String()
		}
		if !strings.Contains(got, want) {
			t.Errorf("ParseAction(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestEvaluateDoesNotAllocate(t *testing.T) {
	ps := []*Policy{
		mustNew(t, Policy{Name: "d", Action: Deny, Rules: []Rule{{From: []Source{{NotNamespaces: []string{"default", "prod"}}}}}}),
		mustNew(t, Policy{Name: "a", Action: Allow, Rules: []Rule{
			{From: []Source{{Principals: []string{"cluster.local/ns/x/sa/*"}}}, To: []Operation{{Ports: []uint16{8080}}}},
			{From: []Source{{ServiceAccounts: []string{"default/client"}, IPBlocks: []IPBlock{block("10.0.0.0/8", "10.1.0.0/16")}}},
				When: []Condition{{Key: "destination.port", Values: []string{"80"}}}},
		}}),
	}
	s, err := NewSet(ps, true)
	if err != nil {
		t.Fatal(err)
	}
	r := req(t, client, "10.0.0.1", "10.9.9.9:80")
	if d := s.Evaluate(r); !d.Allowed || d.Policy.Name != "a" {
		t.Fatalf("decision %s, want allowed by default/a", d)
	}
	if n := testing.AllocsPerRun(1000, func() { s.Evaluate(r) }); n != 0 {
		t.Errorf("Evaluate allocates %v times per call", n)
	}
}

func BenchmarkEvaluate(b *testing.B) {
	ps := []*Policy{
		mustNew(b, Policy{Name: "d", Action: Deny, Rules: []Rule{{From: []Source{{NotNamespaces: []string{"default", "prod"}}}}}}),
		mustNew(b, Policy{Name: "a", Action: Allow, Rules: []Rule{
			{From: []Source{{Principals: []string{"cluster.local/ns/x/sa/*"}}}, To: []Operation{{Ports: []uint16{8080}}}},
			{From: []Source{{ServiceAccounts: []string{"default/client"}, IPBlocks: []IPBlock{block("10.0.0.0/8", "10.1.0.0/16")}}},
				When: []Condition{{Key: "destination.port", Values: []string{"80"}}}},
		}}),
	}
	s, _ := NewSet(ps, true)
	r := req(b, client, "10.0.0.1", "10.9.9.9:80")
	b.ReportAllocs()
	for b.Loop() {
		s.Evaluate(r)
	}
}

// TestL7Rules: as in Istio's ztunnel, an ALLOW rule with HTTP attributes
// matches nothing, a DENY or AUDIT rule with them matches on its L4 part
// (the HTTP parts matching everything).
func TestL7Rules(t *testing.T) {
	client := spiffeid.RequireFromString("spiffe://cluster.local/ns/default/sa/client")
	other := spiffeid.RequireFromString("spiffe://cluster.local/ns/other/sa/x")
	dst := netip.MustParseAddrPort("198.18.1.20:8080")
	req := func(peer spiffeid.ID, port uint16) *Request {
		return &Request{Peer: peer, Source: netip.MustParseAddr("198.18.1.10"), Dest: netip.AddrPortFrom(dst.Addr(), port)}
	}
	getOnly := Operation{L7: []string{"methods"}}
	ns := Source{Namespaces: []string{"default"}, L7: []string{"requestPrincipals"}}
	header := Condition{Key: "request.headers[x-user]", Values: []string{"admin"}}
	for _, tc := range []struct {
		name   string
		action Action
		rule   Rule
		req    *Request
		want   bool
	}{
		{"allow methods only", Allow, Rule{To: []Operation{getOnly}}, req(client, 8080), false},
		{"allow ports and paths", Allow, Rule{To: []Operation{{Ports: []uint16{8080}, L7: []string{"paths"}}}}, req(client, 8080), false},
		{"allow header condition", Allow, Rule{From: []Source{{Namespaces: []string{"default"}}}, When: []Condition{header}}, req(client, 8080), false},
		{"deny methods only", Deny, Rule{To: []Operation{getOnly}}, req(client, 8080), true},
		{"deny methods on a port", Deny, Rule{To: []Operation{{Ports: []uint16{9090}, L7: []string{"methods"}}}}, req(client, 8080), false},
		{"deny methods on the port", Deny, Rule{To: []Operation{{Ports: []uint16{8080}, L7: []string{"methods"}}}}, req(client, 8080), true},
		{"deny namespace and requestPrincipals", Deny, Rule{From: []Source{ns}}, req(client, 8080), true},
		{"deny namespace and requestPrincipals, other ns", Deny, Rule{From: []Source{ns}}, req(other, 8080), false},
		{"deny remoteIpBlocks only", Deny, Rule{From: []Source{{L7: []string{"remoteIpBlocks"}}}}, req(other, 8080), true},
		{"deny header condition", Deny, Rule{When: []Condition{header}}, req(client, 8080), true},
		{"deny header and port condition", Deny, Rule{When: []Condition{header, {Key: "destination.port", Values: []string{"9090"}}}}, req(client, 8080), false},
		{"audit methods only", Audit, Rule{To: []Operation{getOnly}}, req(client, 8080), true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := mustNew(t, Policy{Name: "p", Namespace: "default", Action: tc.action, Rules: []Rule{tc.rule}})
			if got := p.Matches(tc.req); got != tc.want {
				t.Errorf("Matches = %v, want %v", got, tc.want)
			}
		})
	}
	// An ALLOW policy whose only rule has HTTP attributes still applies:
	// it allows nothing, so the workload denies everything.
	allowGet := mustNew(t, Policy{Name: "allow-get", Namespace: "default", Rules: []Rule{{To: []Operation{getOnly}}}})
	s, err := NewSet([]*Policy{allowGet}, false)
	if err != nil {
		t.Fatal(err)
	}
	if d := s.Evaluate(req(client, 8080)); d.Allowed || d.Reason != NoAllowMatched {
		t.Errorf("Evaluate = %v, want denied: no ALLOW policy matched", d)
	}
}

// TestAudit: a matching AUDIT policy is reported and changes nothing.
func TestAudit(t *testing.T) {
	audit := mustNew(t, Policy{Name: "audit-9090", Namespace: "default", Action: Audit, Rules: []Rule{{To: []Operation{{Ports: []uint16{9090}}}}}})
	deny := mustNew(t, Policy{Name: "deny-9090", Namespace: "default", Action: Deny, Rules: []Rule{{To: []Operation{{Ports: []uint16{9090}}}}}})
	r := &Request{Peer: spiffeid.RequireFromString("spiffe://cluster.local/ns/default/sa/client"),
		Source: netip.MustParseAddr("198.18.1.10"), Dest: netip.MustParseAddrPort("198.18.1.20:9090")}
	s, _ := NewSet([]*Policy{audit}, false)
	if d := s.Evaluate(r); !d.Allowed || d.Reason != NoAllowPolicy || d.Audit != audit {
		t.Errorf("audit only: %v (audit %v), want allowed: no ALLOW policy applies, audited", d, d.Audit)
	}
	s, _ = NewSet([]*Policy{audit, deny}, false)
	if d := s.Evaluate(r); d.Allowed || d.Policy != deny || d.Audit != audit {
		t.Errorf("audit and deny: %v (audit %v), want denied by deny-9090, audited", d, d.Audit)
	}
	r.Dest = netip.MustParseAddrPort("198.18.1.20:8080")
	if d := s.Evaluate(r); !d.Allowed || d.Audit != nil {
		t.Errorf("other port: %v (audit %v), want allowed, not audited", d, d.Audit)
	}
}

// TestPortLevelStrict: port-level peer authentication overrides the
// workload's mode on its ports, both ways.
func TestPortLevelStrict(t *testing.T) {
	plain := func(port uint16) *Request {
		return &Request{Source: netip.MustParseAddr("198.18.1.10"), Dest: netip.AddrPortFrom(netip.MustParseAddr("198.18.1.20"), port)}
	}
	strict, _ := NewSet(nil, true)
	strict = strict.WithPorts(map[uint16]bool{8080: false})
	if d := strict.Evaluate(plain(8080)); !d.Allowed {
		t.Errorf("STRICT with port 8080 PERMISSIVE, plaintext to 8080: %v", d)
	}
	if d := strict.Evaluate(plain(9090)); d.Allowed || d.Reason != StrictNoIdentity {
		t.Errorf("STRICT with port 8080 PERMISSIVE, plaintext to 9090: %v", d)
	}
	perm, _ := NewSet(nil, false)
	perm = perm.WithPorts(map[uint16]bool{9090: true})
	if d := perm.Evaluate(plain(9090)); d.Allowed || d.Reason != StrictNoIdentity {
		t.Errorf("PERMISSIVE with port 9090 STRICT, plaintext to 9090: %v", d)
	}
	if d := perm.Evaluate(plain(8080)); !d.Allowed {
		t.Errorf("PERMISSIVE with port 9090 STRICT, plaintext to 8080: %v", d)
	}
	if !perm.StrictOn(9090) || perm.StrictOn(8080) {
		t.Errorf("StrictOn(9090) = %v, StrictOn(8080) = %v", perm.StrictOn(9090), perm.StrictOn(8080))
	}
}

// TestActionJSON: dumps name the action.
func TestActionJSON(t *testing.T) {
	for a, want := range map[Action]string{Allow: `"ALLOW"`, Deny: `"DENY"`, Audit: `"AUDIT"`} {
		b, err := json.Marshal(a)
		if err != nil || string(b) != want {
			t.Errorf("json of %v: %s, %v; want %s", a, b, err, want)
		}
	}
}
