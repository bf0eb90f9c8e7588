package kube

import (
	"strings"
	"testing"

	"github.com/meshtun/meshtun/mesh/policy"
)

// TestDecodeAuthorizationPolicy: the CRD spec decodes strictly into what
// policy.FromIstio converts, HTTP fields kept by name.
func TestDecodeAuthorizationPolicy(t *testing.T) {
	in, err := decodeAuthorizationPolicy("shop", "p", []byte(`{
		"selector": {"matchLabels": {"app": "web"}},
		"action": "DENY",
		"rules": [{
			"from": [{"source": {"serviceAccounts": ["client"], "ipBlocks": ["10.0.0.0/8"], "requestPrincipals": ["*"]}}],
			"to": [{"operation": {"ports": ["8080", 9090], "methods": ["GET"]}}],
			"when": [{"key": "source.ip", "values": ["10.1.0.0/16"]}]
		}]}`))
	if err != nil {
		t.Fatal(err)
	}
	p, probs := policy.FromIstio(in)
	if p == nil {
		t.Fatalf("not converted: %v", probs)
	}
	r := p.Rules[0]
	if p.Action != policy.Deny || p.Selector["app"] != "web" || r.From[0].ServiceAccounts[0] != "shop/client" ||
		r.From[0].IPBlocks[0].CIDR.String() != "10.0.0.0/8" || len(r.To[0].Ports) != 2 || r.To[0].Ports[1] != 9090 || len(r.When) != 1 {
		t.Errorf("converted: %+v", p)
	}
	if len(probs) != 2 || probs[0].Path != "rules[0].from[0].requestPrincipals" || probs[1].Path != "rules[0].to[0].methods" {
		t.Errorf("warnings %+v; want requestPrincipals and methods", probs)
	}
	for _, bad := range []string{
		`{"rulez": []}`,
		`{"rules": [{"from": [{"source": {"principalz": ["a"]}}]}]}`,
		`{"rules": [{"to": [{"operation": {"ports": ["http"]}}]}]}`,
		`{"rules": [{"from": [{"source": {"ipBlocks": ["10.0.0.300"]}}]}]}`,
		`{"selector": {"app": "web"}}`,
	} {
		if _, err := decodeAuthorizationPolicy("shop", "p", []byte(bad)); err == nil || strings.TrimSpace(err.Error()) == "" {
			t.Errorf("%s: decoded; want an error", bad)
		}
	}
}
