package node

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/proxy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// TestConfigDumpZtunnelShape: /config_dump?format=ztunnel has ztunnel's
// top-level keys and field names, with the values of the registry
// snapshot (istiod's workload name, canonical service and revision) and
// the node's certificates; ConfigDumpFormat makes it the default.
func TestConfigDumpZtunnelShape(t *testing.T) {
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	deny, err := policy.New(policy.Policy{Name: "no", Namespace: "ns", Action: policy.Deny, Selector: map[string]string{"app": "web"},
		Rules: []policy.Rule{{To: []policy.Operation{{Ports: []uint16{9}}}}}})
	if err != nil {
		t.Fatal(err)
	}
	snap, err := registry.Build(registry.Model{TrustDomain: td, Policies: []*policy.Policy{deny},
		Workloads: []*registry.Workload{{
			Name: "web-5d4f-x2x", Namespace: "ns", ServiceAccount: "web", Node: "n1", InMesh: true,
			Addresses: []netip.Addr{netip.MustParseAddr("10.0.0.1")}, Labels: map[string]string{"app": "web"},
			UID: "Kubernetes//Pod/ns/web-5d4f-x2x", WorkloadName: "web", WorkloadType: "deployment",
			CanonicalName: "web-canonical", CanonicalRevision: "v7", Cluster: "Kubernetes",
			Locality: registry.Locality{Region: "eu-west1", Zone: "eu-west1-b"},
		}},
		Services: []*registry.Service{{Name: "web", Namespace: "ns", VIPs: []netip.Addr{netip.MustParseAddr("10.96.0.1")},
			Ports: []registry.ServicePort{{Port: 80, TargetPort: 8080}}, Selector: map[string]string{"app": "web"}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	ca, err := identity.OpenCA(identity.CAConfig{Dir: t.TempDir(), TrustDomain: td, SVIDTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	src, err := identity.NewSource(identity.SourceConfig{Issuer: ca, Bundle: ca.Bundle(), TrustDomain: td})
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	id := spiffeid.RequireFromString("spiffe://cluster.local/ns/ns/sa/web")
	if err := src.Add(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	n := &node{reg: registry.New(snap), svids: src}

	get := func(target string) map[string]any {
		t.Helper()
		rec := httptest.NewRecorder()
		n.configDump(rec, httptest.NewRequest(http.MethodGet, target, nil))
		if rec.Code != http.StatusOK {
			t.Fatalf("%s: %d %s", target, rec.Code, rec.Body)
		}
		var d map[string]any
		if err := json.Unmarshal(rec.Body.Bytes(), &d); err != nil {
			t.Fatal(err)
		}
		return d
	}
	d := get("/config_dump?format=ztunnel")
	for _, k := range []string{"workloads", "services", "policies", "certificates"} {
		if _, ok := d[k].([]any); !ok {
			t.Errorf("no %q list in %v", k, d)
		}
	}
	if _, ok := d["trustDomain"]; ok {
		t.Error("the ztunnel shape carries meshtun's own keys")
	}
	w := d["workloads"].([]any)[0].(map[string]any)
	for k, want := range map[string]any{
		"uid": "Kubernetes//Pod/ns/web-5d4f-x2x", "name": "web-5d4f-x2x", "namespace": "ns", "serviceAccount": "web",
		"workloadName": "web", "workloadType": "deployment", "canonicalName": "web-canonical", "canonicalRevision": "v7",
		"node": "n1", "protocol": "HBONE", "status": "Healthy", "clusterId": "Kubernetes", "trustDomain": "cluster.local",
	} {
		if w[k] != want {
			t.Errorf("workload %s = %v, want %v", k, w[k], want)
		}
	}
	if l, _ := w["locality"].(map[string]any); l["region"] != "eu-west1" || l["zone"] != "eu-west1-b" || l["subzone"] != "" {
		t.Errorf("workload locality = %v", w["locality"])
	}
	if ips, _ := w["workloadIps"].([]any); len(ips) != 1 || ips[0] != "10.0.0.1" {
		t.Errorf("workloadIps = %v", w["workloadIps"])
	}
	if svcs, _ := w["services"].([]any); len(svcs) != 1 || svcs[0] != "ns/web.ns.svc.cluster.local" {
		t.Errorf("workload services = %v", w["services"])
	}
	if ps, _ := w["authorizationPolicies"].([]any); len(ps) != 1 || ps[0] != "ns/no" {
		t.Errorf("workload authorizationPolicies = %v", w["authorizationPolicies"])
	}
	s := d["services"].([]any)[0].(map[string]any)
	if s["hostname"] != "web.ns.svc.cluster.local" || s["ports"].(map[string]any)["80"] != 8080.0 {
		t.Errorf("service = %v", s)
	}
	if ep, ok := s["endpoints"].(map[string]any)["Kubernetes//Pod/ns/web-5d4f-x2x"].(map[string]any); !ok || ep["service"] != "ns/web.ns.svc.cluster.local" {
		t.Errorf("service endpoints = %v", s["endpoints"])
	}
	p := d["policies"].([]any)[0].(map[string]any)
	if p["name"] != "no" || p["scope"] != "WorkloadSelector" || p["action"] != "Deny" {
		t.Errorf("policy = %v", p)
	}
	c := d["certificates"].([]any)[0].(map[string]any)
	if c["identity"] != id.String() || c["state"] != "Available" {
		t.Errorf("certificate = %v", c)
	}
	chain, _ := c["certChain"].([]any)
	if len(chain) == 0 {
		t.Fatalf("no certChain in %v", c)
	}
	leaf := chain[0].(map[string]any)
	raw, err := base64.StdEncoding.DecodeString(leaf["pem"].(string))
	if b, _ := pem.Decode(raw); err != nil || b == nil || b.Type != "CERTIFICATE" {
		t.Errorf("certChain[0].pem is not base64 of a PEM certificate: %v", err)
	}
	if exp, err := time.Parse(time.RFC3339, leaf["expirationTime"].(string)); err != nil || exp.Before(time.Now()) {
		t.Errorf("expirationTime %v: %v", leaf["expirationTime"], err)
	}
	if _, err := time.Parse(time.RFC3339, leaf["validFrom"].(string)); err != nil {
		t.Errorf("validFrom: %v", err)
	}

	// The default stays meshtun's shape, unless the node is configured
	// for ztunnel's; a format it does not know is refused.
	if _, ok := get("/config_dump")["trustDomain"]; !ok {
		t.Error("/config_dump without format is not meshtun's shape")
	}
	n.cfg.ConfigDumpFormat = "ztunnel"
	if _, ok := get("/config_dump")["workloads"].([]any)[0].(map[string]any)["workloadIps"]; !ok {
		t.Error("/config_dump with ConfigDumpFormat ztunnel is not ztunnel's shape")
	}
	if _, ok := get("/config_dump?format=meshtun")["trustDomain"]; !ok {
		t.Error("?format=meshtun is not meshtun's shape")
	}
	rec := httptest.NewRecorder()
	n.configDump(rec, httptest.NewRequest(http.MethodGet, "/config_dump?format=envoy", nil))
	if rec.Code != http.StatusBadRequest {
		t.Errorf("?format=envoy: %d, want 400", rec.Code)
	}
}

// TestZtunnelDumpRules checks that a policy's rules are rendered in
// ztunnel's nesting (rules of clauses of matches) with its field names and
// StringMatch encoding.
func TestZtunnelDumpRules(t *testing.T) {
	rules := []policy.Rule{{
		From: []policy.Source{
			{Principals: []string{"cluster.local/ns/a/sa/x"}, Namespaces: []string{"b*"}, NotNamespaces: []string{"*"}},
			{ServiceAccounts: []string{"c/y"}, IPBlocks: []policy.IPBlock{
				{CIDR: netip.MustParsePrefix("10.0.0.0/8")},
				{CIDR: netip.MustParsePrefix("192.0.2.0/24"), Except: []netip.Prefix{netip.MustParsePrefix("192.0.2.8/29")}},
			}},
		},
		To:   []policy.Operation{{Ports: []uint16{9}}, {NotPorts: []uint16{22}}},
		When: []policy.Condition{{Key: "source.ip", Values: []string{"198.51.100.1"}}, {Key: "destination.port", NotValues: []string{"80"}}},
	}, {}}
	got, err := json.Marshal(ztRules(rules))
	if err != nil {
		t.Fatal(err)
	}
	want := `[[` +
		`[{"namespaces":[{"Prefix":"b"}],"notNamespaces":[{"Presence":[]}],"principals":[{"Exact":"cluster.local/ns/a/sa/x"}]},` +
		`{"serviceAccounts":[{"namespace":"c","serviceAccount":"y"}],"sourceIps":["10.0.0.0/8"]},` +
		`{"serviceAccounts":[{"namespace":"c","serviceAccount":"y"}],"sourceIps":["192.0.2.0/24"],"notSourceIps":["192.0.2.8/29"]}],` +
		`[{"destinationPorts":[9]},{"notDestinationPorts":[22]}],` +
		`[{"sourceIps":["198.51.100.1/32"]}],` +
		`[{"notDestinationPorts":[80]}]` +
		`],[]]`
	if string(got) != want {
		t.Errorf("rules:\n got %s\nwant %s", got, want)
	}
}

// TestZtunnelWorkloadState: workloadState lists the node's mesh workloads
// (and only them) with the open connections each is an end of, inbound
// on the server's entry and outbound on the client's, as istioctl
// ztunnel-config connections reads them.
func TestZtunnelWorkloadState(t *testing.T) {
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	wl := func(name, node, ip string) *registry.Workload {
		return &registry.Workload{Name: name, Namespace: "ns", ServiceAccount: name, Node: node, InMesh: true,
			Addresses: []netip.Addr{netip.MustParseAddr(ip)}, UID: "Kubernetes//Pod/ns/" + name}
	}
	web, client, far := wl("web", "n1", "10.0.0.1"), wl("client", "n1", "10.0.0.2"), wl("far", "n2", "10.0.1.1")
	snap, err := registry.Build(registry.Model{TrustDomain: td, Workloads: []*registry.Workload{web, client, far}})
	if err != nil {
		t.Fatal(err)
	}
	ap := netip.MustParseAddrPort
	states := ztWorkloadStates(snap, "n1", []proxy.OpenConn{
		{Direction: "inbound", Src: ap("10.0.1.1:40000"), Dst: ap("10.0.0.1:8080"), Actual: "10.0.0.1:8080", Protocol: "HBONE",
			SrcWorkload: far, DstWorkload: web},
		{Direction: "outbound", Src: ap("10.0.0.2:40001"), Dst: ap("10.96.0.9:80"), Actual: "10.0.1.1:15008", Protocol: "HBONE",
			SrcWorkload: client, DstWorkload: far},
	})
	b, _ := json.Marshal(states)
	if len(states) != 2 {
		t.Fatalf("workloadState %s: want web and client (n1's), not far", b)
	}
	w := states["Kubernetes//Pod/ns/web"]
	if w.Info.Name != "web" || w.Info.TrustDomain != "cluster.local" || len(w.Connections.Inbound) != 1 || len(w.Connections.Outbound) != 0 ||
		w.Connections.Inbound[0] != (ztConn{Src: "10.0.1.1:40000", OriginalDst: "10.0.0.1:8080", ActualDst: "10.0.0.1:8080", Protocol: "HBONE"}) {
		t.Errorf("web's state %+v", w)
	}
	c := states["Kubernetes//Pod/ns/client"]
	if len(c.Connections.Outbound) != 1 || len(c.Connections.Inbound) != 0 ||
		c.Connections.Outbound[0] != (ztConn{Src: "10.0.0.2:40001", OriginalDst: "10.96.0.9:80", ActualDst: "10.0.1.1:15008", Protocol: "HBONE"}) {
		t.Errorf("client's state %+v", c)
	}
}

// TestZtunnelDumpWaypoints: workloads' and services' waypoints appear as
// ztunnel writes them: {"destination": "network/address" or
// "namespace/hostname", "hboneMtlsPort"}, weighted ones with their
// weight; none, no key.
func TestZtunnelDumpWaypoints(t *testing.T) {
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	a := netip.MustParseAddr
	snap, err := registry.Build(registry.Model{TrustDomain: td,
		Workloads: []*registry.Workload{
			{Name: "web", Namespace: "ns", Node: "n1", InMesh: true, Addresses: []netip.Addr{a("10.0.0.1")},
				Waypoint: &registry.Waypoint{Addr: a("10.0.0.9"), Port: 15008}},
			{Name: "plain", Namespace: "ns", Node: "n1", InMesh: true, Addresses: []netip.Addr{a("10.0.0.2")}},
		},
		Services: []*registry.Service{{Name: "web", Namespace: "ns", VIPs: []netip.Addr{a("10.96.0.1")},
			Ports:    []registry.ServicePort{{Port: 80}},
			Waypoint: &registry.Waypoint{Hostname: "wp.infra.svc.cluster.local", Namespace: "infra", Port: 15008},
			WeightedWaypoints: []registry.WeightedWaypoint{
				{Waypoint: registry.Waypoint{Hostname: "wp2.infra.svc.cluster.local", Namespace: "infra"}, Weight: 10}}}},
	})
	if err != nil {
		t.Fatal(err)
	}
	b, err := json.Marshal(ztunnelDump(snap, nil))
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Workloads []map[string]any `json:"workloads"`
		Services  []map[string]any `json:"services"`
	}
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatal(err)
	}
	js := func(v any) string { b, _ := json.Marshal(v); return string(b) }
	if got := js(d.Workloads[0]["waypoint"]); got != `{"destination":"/10.0.0.9","hboneMtlsPort":15008}` {
		t.Errorf("workload waypoint %s", got)
	}
	if _, ok := d.Workloads[1]["waypoint"]; ok {
		t.Errorf("a workload without a waypoint has one: %v", d.Workloads[1])
	}
	if got := js(d.Services[0]["waypoint"]); got != `{"destination":"infra/wp.infra.svc.cluster.local","hboneMtlsPort":15008}` {
		t.Errorf("service waypoint %s", got)
	}
	if got := js(d.Services[0]["weightedWaypoints"]); got != `[{"destination":{"destination":"infra/wp2.infra.svc.cluster.local","hboneMtlsPort":15008},"weight":10}]` {
		t.Errorf("service weighted waypoints %s", got)
	}
}
