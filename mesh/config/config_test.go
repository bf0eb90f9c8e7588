package config

import (
	"errors"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

func TestExamplesParse(t *testing.T) {
	files, err := filepath.Glob("../../deploy/examples/*.yaml")
	if err != nil || len(files) < 2 {
		t.Fatalf("examples: %v %v", files, err)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			c, err := Load(f)
			if err != nil {
				t.Fatal(err)
			}
			if len(c.Warnings) > 0 {
				t.Errorf("warnings: %q", c.Warnings)
			}
			s, err := c.Snapshot()
			if err != nil {
				t.Fatal(err)
			}
			if len(s.Workloads) != len(c.Workloads) || len(s.Services) != len(c.Services) || len(s.Policies) != len(c.AuthorizationPolicies) {
				t.Errorf("snapshot has %d workloads, %d services, %d policies", len(s.Workloads), len(s.Services), len(s.Policies))
			}
			if _, err := c.Node("n1"); err != nil {
				t.Error(err)
			}
		})
	}
}

// TestMeshExample checks what deploy/examples/mesh.yaml means, end to end
// through the registry and the policy evaluator.
func TestMeshExample(t *testing.T) {
	c, err := Load("../../deploy/examples/mesh.yaml")
	if err != nil {
		t.Fatal(err)
	}
	n1, err := c.Node("n1")
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"vp1p1", "vp1p2", "vp1p3"}; !slices.Equal(n1.CaptureLinks, want) {
		t.Errorf("n1 capture links %q, want %q", n1.CaptureLinks, want)
	}
	n2, _ := c.Node("n2")
	if want := []string{"vp2p9", "vp2p1", "vp2p2"}; !slices.Equal(n2.CaptureLinks, want) {
		t.Errorf("n2 capture links %q, want %q (legacy is not in the mesh)", n2.CaptureLinks, want)
	}
	if n1.TUN.TxQueueLen != 5000 || n2.Listen.Metrics != DefaultMetrics || c.CA.SVIDTTL != time.Hour {
		t.Errorf("node settings: %+v %+v %v", n1.TUN, n2.Listen, c.CA.SVIDTTL)
	}
	s, err := c.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	if echo1 := s.Workload(netip.MustParseAddr("198.18.1.13")); !echo1.ProbePort(8081) || echo1.ProbePort(8080) {
		t.Errorf("echo-1 probe ports %v, want [8081]", echo1.ProbePorts)
	}
	svc, port := s.Service(netip.MustParseAddrPort("198.18.100.1:80"))
	if svc == nil || port.Target() != 8080 || svc.Hostname != "echo.default.svc.cluster.local" {
		t.Fatalf("echo service: %v %+v", svc, port)
	}
	if e := svc.Endpoints(netip.MustParseAddr("fd00:6d74:100::1")); len(e) != 2 {
		t.Errorf("echo has %d IPv6 endpoints, want 2", len(e))
	}
	if local := s.ServiceByName("default", "echo-local"); !local.PreferSameNode {
		t.Error("echo-local does not prefer same-node endpoints")
	}
	if w := s.WorkloadByName("default", "legacy"); w == nil || w.InMesh {
		t.Errorf("legacy: %+v", w)
	}
	if w := s.WorkloadByName("default", "echo-1"); w.PeerAuth != registry.Strict {
		t.Error("echo-1 is not STRICT")
	}
	id := func(ns, sa string) spiffeid.ID {
		return spiffeid.RequireFromSegments(spiffeid.RequireTrustDomainFromString("cluster.local"), "ns", ns, "sa", sa)
	}
	client, intruder := id("default", "client"), id("other", "intruder")
	src := netip.MustParseAddr("198.18.1.11")
	for _, tt := range []struct {
		peer spiffeid.ID
		src  netip.Addr
		dst  string
		want string
	}{
		{client, src, "198.18.2.11:8080", "allowed by policy default/allow-client"},
		{intruder, src, "198.18.2.11:8080", "denied: no ALLOW policy matched"},
		{client, src, "198.18.2.11:9090", "denied by policy default/deny-echo-admin"},
		{client, netip.MustParseAddr("198.18.0.11"), "198.18.2.11:9090", "allowed by policy default/allow-client"},
		{client, netip.MustParseAddr("198.18.0.100"), "198.18.2.11:9090", "denied by policy default/deny-echo-admin"},
		{client, src, "198.18.2.11:23", "denied by policy istio-system/deny-telnet"},
		{spiffeid.ID{}, src, "198.18.1.13:8080", "denied: STRICT peer authentication requires a verified peer identity"},
		{client, src, "198.18.2.12:5432", "allowed by policy default/db-clients"},
		{intruder, src, "198.18.2.12:5432", "denied: no ALLOW policy matched"},
		{client, netip.MustParseAddr("10.0.0.1"), "198.18.2.12:5432", "denied: no ALLOW policy matched"},
		{client, src, "198.18.2.12:5433", "denied: no ALLOW policy matched"},
		{spiffeid.ID{}, src, "198.18.2.13:80", "allowed: no ALLOW policy applies"},
	} {
		r := policy.Request{Peer: tt.peer, Source: tt.src, Dest: netip.MustParseAddrPort(tt.dst)}
		if got := s.Authorize(&r).String(); got != tt.want {
			t.Errorf("%v from %v to %s: %q, want %q", tt.peer, tt.src, tt.dst, got, tt.want)
		}
	}
}

func TestDefaults(t *testing.T) {
	c, err := Parse("/etc/meshtun/mesh.yaml", []byte(`
ca: {dir: ca}
nodes: [{name: n1, listen: {admin: ""}}]
workloads:
  - {name: a, node: n1, addresses: [198.18.1.11]}
services:
  - {name: s, vips: [198.18.100.1], ports: [{port: 80}], selector: {app: a}}
authorizationPolicies:
  - {name: p}
`))
	if err != nil {
		t.Fatal(err)
	}
	n := c.Nodes[0]
	w := c.Workloads[0]
	for _, f := range []struct{ name, got, want string }{
		{"trustDomain", c.TrustDomain, "cluster.local"},
		{"rootNamespace", c.RootNamespace, "istio-system"},
		{"clusterDomain", c.ClusterDomain, "cluster.local"},
		{"peerAuthentication", c.PeerAuthentication, "PERMISSIVE"},
		{"ca.dir (relative to the file)", c.CA.Dir, "/etc/meshtun/ca"},
		{"tun.name", n.TUN.Name, "meshtun0"},
		{"listen.admin (set to empty: off)", n.Listen.Admin, ""},
		{"listen.metrics", n.Listen.Metrics, ":15020"},
		{"listen.adminSocket", n.Listen.AdminSocket, DefaultAdminSocket},
		{"listen.readiness", n.Listen.Readiness, ":15021"},
		{"workload namespace", w.Namespace, "default"},
		{"workload serviceAccount", w.ServiceAccount, "default"},
		{"workload peerAuthentication", w.PeerAuthentication, "PERMISSIVE"},
		{"service namespace", c.Services[0].Namespace, "default"},
		{"policy namespace", c.AuthorizationPolicies[0].Namespace, "default"},
		{"policy action", c.AuthorizationPolicies[0].Action, "ALLOW"},
	} {
		if f.got != f.want {
			t.Errorf("%s = %q, want %q", f.name, f.got, f.want)
		}
	}
	if n.TUN.MTU != 1500 || !w.InMesh() || c.Services[0].Ports[0].TargetPort != 80 {
		t.Errorf("mtu %d, in mesh %v, target port %d", n.TUN.MTU, w.InMesh(), c.Services[0].Ports[0].TargetPort)
	}
	if want := "selects no workload in namespace default"; len(c.Warnings) != 1 || !strings.Contains(c.Warnings[0], want) {
		t.Errorf("warnings %q, want one with %q", c.Warnings, want)
	}
	if _, err := c.Node("n2"); err == nil || !strings.Contains(err.Error(), `no node "n2" (nodes: [n1])`) {
		t.Errorf("Node(n2): %v", err)
	}
}

// TestForms: Istio's nested forms and the short forms mean the same.
func TestForms(t *testing.T) {
	const head = `
nodes: [{name: n1}]
workloads: [{name: a, node: n1, addresses: [198.18.1.11], labels: {app: a}}]
authorizationPolicies:
`
	long, err := Parse("long.yaml", []byte(head+`
  - name: p
    selector: {matchLabels: {app: a}}
    rules:
      - from: [{source: {principals: ["*"], ipBlocks: [{cidr: 10.0.0.0/8, except: [10.1.0.0/16]}]}}]
        to: [{operation: {ports: ["80"]}}]
`))
	if err != nil {
		t.Fatal(err)
	}
	short, err := Parse("short.yaml", []byte(head+`
  - name: p
    selector: {app: a}
    rules:
      - from: [{principals: ["*"], ipBlocks: [{cidr: 10.0.0.0/8, except: [10.1.0.0/16]}]}]
        to: [{ports: [80]}]
`))
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []*Config{long, short} {
		ap := c.AuthorizationPolicies[0]
		r := ap.Rules[0]
		if ap.Selector["app"] != "a" || len(ap.Selector) != 1 ||
			r.From[0].Source.Principals[0] != "*" || r.From[0].Source.IPBlocks[0].String() != "10.0.0.0/8 except 10.1.0.0/16" ||
			r.To[0].Operation.Ports[0] != 80 {
			t.Errorf("%s: %+v", c.Path, ap)
		}
	}
}

func TestErrors(t *testing.T) {
	const node = "nodes: [{name: n1}]\n"
	const wl = node + "workloads: [{name: a, node: n1, addresses: [198.18.1.11], labels: {app: a}}]\n"
	tests := []struct {
		name string
		yaml string
		want []string // every error line, in order
	}{
		{"empty", ``, []string{`t.yaml: the file is empty`}},
		{"syntax", "nodes: [\n", []string{`t.yaml:1: did not find expected node content`}},
		{"two documents", node + "---\n" + node, []string{`t.yaml:2: more than one YAML document; put everything in one`}},
		{"not a mapping", "- a\n", []string{`t.yaml:1:1: expected a mapping, found a list`}},
		{"unknown field", "trustDomian: x\n",
			[]string{`t.yaml:1:1: trustDomian: unknown field "trustDomian" (known fields: authorizationPolicies, ca, clusterDomain, nodes, peerAuthentication, peerAuthentications, rootNamespace, services, trustDomain, workloads)`}},
		{"field twice", "trustDomain: a\ntrustDomain: b\n", []string{`t.yaml:2:1: trustDomain: field "trustDomain" appears twice`}},
		{"nested unknown field", "nodes:\n  - name: n1\n    tun: {nmae: x}\n",
			[]string{`t.yaml:3:11: nodes[0].tun.nmae: unknown field "nmae" (known fields: mtu, name, txQueueLen)`}},
		{"list expected", "nodes: {name: n1}\n", []string{`t.yaml:1:8: nodes: expected a list, found a mapping`}},
		{"mapping expected", "ca: /x\n", []string{`t.yaml:1:5: ca: expected a mapping, found "/x"`}},
		{"string expected", "trustDomain: [a]\n", []string{`t.yaml:1:14: trustDomain: expected a string, found a list`}},
		{"integer expected", "nodes: [{name: n1, tun: {mtu: big}}]\n", []string{`t.yaml:1:31: nodes[0].tun.mtu: expected an integer, found "big"`}},
		{"bool expected", node + "workloads: [{name: a, node: n1, addresses: [198.18.1.11], mesh: yes}]\n",
			[]string{`t.yaml:2:65: workloads[0].mesh: expected true or false, found "yes"`}},
		{"bad address", node + "workloads:\n  - name: a\n    node: n1\n    addresses: [198.18.1.11, 198.18.1.300]\n",
			[]string{`t.yaml:5:30: workloads[0].addresses[1]: "198.18.1.300" is not an IP address`}},
		{"address with zone", node + "workloads: [{name: a, node: n1, addresses: [\"fe80::1%eth0\"]}]\n",
			[]string{`t.yaml:2:45: workloads[0].addresses[0]: "fe80::1%eth0" is not an IP address`}},
		{"labels twice", node + "workloads: [{name: a, node: n1, addresses: [198.18.1.11], labels: {app: a, app: b}}]\n",
			[]string{`t.yaml:2:76: workloads[0].labels.app: key "app" appears twice`}},
		{"labels value list", node + "workloads: [{name: a, node: n1, addresses: [198.18.1.11], labels: {app: [a]}}]\n",
			[]string{`t.yaml:2:73: workloads[0].labels.app: expected a string, found a list`}},
		{"duration", "ca: {svidTTL: 1 hour}\n", []string{`t.yaml:1:15: ca.svidTTL: "1 hour" is not a positive duration (like 1h or 30m)`}},
		{"port out of range", wl + "services: [{name: s, vips: [198.18.100.1], ports: [{port: 70000}], selector: {app: a}}]\n",
			[]string{`t.yaml:3:59: services[0].ports[0].port: 70000 is not a port number (1-65535)`}},
		{"port zero", wl + "services: [{name: s, vips: [198.18.100.1], ports: [{port: 80, targetPort: 0}], selector: {app: a}}]\n",
			[]string{`t.yaml:3:75: services[0].ports[0].targetPort: 0 is not a port number (1-65535)`}},
		{"probe port out of range", node + "workloads: [{name: a, node: n1, addresses: [198.18.1.11], probePorts: [8081, 0]}]\n",
			[]string{`t.yaml:2:78: workloads[0].probePorts[1]: 0 is not a port number (1-65535)`}},
		{"port word", wl + "services: [{name: s, vips: [198.18.100.1], ports: [{port: http}], selector: {app: a}}]\n",
			[]string{`t.yaml:3:59: services[0].ports[0].port: "http" is not a port number (1-65535)`}},
		{"bad cidr", wl + "authorizationPolicies: [{name: p, rules: [{from: [{ipBlocks: [10.0.0.0/33]}]}]}]\n",
			[]string{`t.yaml:3:63: authorizationPolicies[0].rules[0].from[0].ipBlocks[0]: "10.0.0.0/33" is not an IP address or CIDR`}},
		{"ipBlock without cidr", wl + "authorizationPolicies: [{name: p, rules: [{from: [{ipBlocks: [{except: [10.1.0.0/16]}]}]}]}]\n",
			[]string{`t.yaml:3:63: authorizationPolicies[0].rules[0].from[0].ipBlocks[0].cidr: is required`}},
		{"ipBlock bad field", wl + "authorizationPolicies: [{name: p, rules: [{from: [{ipBlocks: [{cidr: 10.0.0.0/8, exclude: [10.1.0.0/16]}]}]}]}]\n",
			[]string{`t.yaml:3:82: authorizationPolicies[0].rules[0].from[0].ipBlocks[0].exclude: unknown field "exclude" (known fields: cidr, except)`}},
		{"L7 field of the wrong kind", wl + "authorizationPolicies: [{name: p, rules: [{to: [{operation: {methods: GET}}]}]}]\n",
			[]string{`t.yaml:3:71: authorizationPolicies[0].rules[0].to[0].operation.methods: expected a list, found "GET"`}},
		{"L7 field in the wrong place", wl + "authorizationPolicies: [{name: p, rules: [{from: [{source: {methods: [GET]}}]}]}]\n",
			[]string{`t.yaml:3:61: authorizationPolicies[0].rules[0].from[0].source.methods: unknown field "methods" (known fields: ipBlocks, namespaces, notIpBlocks, notNamespaces, notPrincipals, notServiceAccounts, principals, serviceAccounts)`}},
		{"portLevelMtls without selector", wl + "peerAuthentications: [{name: pa, portLevelMtls: {8080: {mode: DISABLE}}}]\n",
			[]string{`t.yaml:3:49: peerAuthentications[0].portLevelMtls: needs a selector (as in Istio)`}},
		{"peer authentication mode", wl + "peerAuthentications: [{name: pa, mtls: {mode: strict}}]\n",
			[]string{`t.yaml:3:47: peerAuthentications[0].mtls.mode: unknown mode "strict" (want UNSET, STRICT, PERMISSIVE or DISABLE)`}},
		{"port-level port", wl + "peerAuthentications: [{name: pa, selector: {app: a}, portLevelMtls: {http: {mode: STRICT}}}]\n",
			[]string{`t.yaml:3:76: peerAuthentications[0].portLevelMtls.http: "http" is not a port number (1-65535)`}},
		{"CUSTOM provider on ALLOW", wl + "authorizationPolicies: [{name: p, provider: {name: x}}]\n",
			[]string{`t.yaml:3:45: authorizationPolicies[0].provider: is only for action CUSTOM`}},
		{"source and fields mixed", wl + "authorizationPolicies: [{name: p, rules: [{from: [{source: {namespaces: [a]}, principals: [b]}]}]}]\n",
			[]string{`t.yaml:3:51: authorizationPolicies[0].rules[0].from[0]: write either source: {…} or its fields directly, not both`}},

		{"bad trust domain", "trustDomain: Cluster.Local!\n",
			[]string{`t.yaml:1:14: trustDomain: "Cluster.Local!" is not a valid trust domain: trust domain characters are limited to lowercase letters, numbers, dots, dashes, and underscores`}},
		{"bad root namespace", "rootNamespace: Istio_System\n",
			[]string{`t.yaml:1:16: rootNamespace: "Istio_System" is not a valid name: at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit`}},
		{"bad mesh mode", "peerAuthentication: DISABLE\n", []string{`t.yaml:1:21: peerAuthentication: unknown mode "DISABLE" (want STRICT or PERMISSIVE)`}},
		{"node without name", "nodes: [{tun: {name: meshtun0}}]\n", []string{`t.yaml:1:9: nodes[0].name: is required`}},
		{"duplicate node", "nodes:\n  - name: n1\n  - name: n1\n", []string{`t.yaml:3:11: nodes[1].name: node "n1" is already defined at line 2`}},
		{"bad tun name", "nodes: [{name: n1, tun: {name: a-very-long-tun-name}}]\n",
			[]string{`t.yaml:1:32: nodes[0].tun.name: "a-very-long-tun-name" is not a valid link name (1-15 bytes, no '/', ':' or spaces)`}},
		{"mtu", "nodes: [{name: n1, tun: {mtu: 576}}]\n", []string{`t.yaml:1:31: nodes[0].tun.mtu: 576 is not a valid MTU (1280-65535)`}},
		{"uplink twice", "nodes: [{name: n1, uplinks: [eth0, eth0]}]\n", []string{`t.yaml:1:36: nodes[0].uplinks[1]: "eth0" is listed twice`}},
		{"capture link is uplink", "nodes: [{name: n1, uplinks: [eth0], captureLinks: [eth0]}]\n",
			[]string{`t.yaml:1:52: nodes[0].captureLinks[0]: "eth0" is already listed as uplink`}},
		{"listen", "nodes: [{name: n1, listen: {metrics: \"15020\", readiness: \"[::]:99999\", admin: \"example.com:1\"}}]\n",
			[]string{
				`t.yaml:1:38: nodes[0].listen.metrics: "15020" is not host:port`,
				`t.yaml:1:58: nodes[0].listen.readiness: "[::]:99999": "99999" is not a port number (1-65535)`,
				`t.yaml:1:79: nodes[0].listen.admin: "example.com:1": the host must be an IP address, localhost or empty (all addresses)`,
			}},
		{"admin format", "nodes: [{name: n1, listen: {adminFormat: envoy}}]\n",
			[]string{`t.yaml:1:42: nodes[0].listen.adminFormat: "envoy": want meshtun or ztunnel`}},
		{"workload without name", node + "workloads: [{node: n1, addresses: [198.18.1.11]}]\n", []string{`t.yaml:2:13: workloads[0].name: is required`}},
		{"bad workload name", node + "workloads: [{name: Echo_1, node: n1, addresses: [198.18.1.11]}]\n",
			[]string{`t.yaml:2:20: workloads[0].name: "Echo_1" is not a valid name: lower-case letters, digits, '-' and '.', starting and ending with a letter or digit`}},
		{"duplicate workload", node + "workloads:\n  - {name: a, node: n1, addresses: [198.18.1.11]}\n  - {name: a, node: n1, addresses: [198.18.1.12]}\n",
			[]string{`t.yaml:4:12: workloads[1].name: workload default/a is already defined at line 3`}},
		{"same name other namespace", node + "workloads:\n  - {name: a, node: n1, addresses: [198.18.1.11]}\n  - {name: a, namespace: b, node: n1, addresses: [198.18.1.12]}\n", nil},
		{"no addresses", node + "workloads: [{name: a, node: n1}]\n", []string{`t.yaml:2:13: workloads[0].addresses: at least one address is required`}},
		{"duplicate address", node + "workloads:\n  - {name: a, node: n1, addresses: [198.18.1.11]}\n  - {name: b, node: n1, addresses: [\"fd00::1\", \"::ffff:198.18.1.11\"]}\n",
			[]string{`t.yaml:4:48: workloads[1].addresses[1]: 198.18.1.11 is already the address of workload default/a (line 3)`}},
		{"address twice", node + "workloads: [{name: a, node: n1, addresses: [198.18.1.11, 198.18.1.11]}]\n",
			[]string{`t.yaml:2:58: workloads[0].addresses[1]: 198.18.1.11 is listed twice`}},
		{"loopback address", node + "workloads: [{name: a, node: n1, addresses: [127.0.0.1]}]\n",
			[]string{`t.yaml:2:45: workloads[0].addresses[0]: 127.0.0.1 is not a unicast address a workload can have`}},
		{"unknown node", node + "workloads: [{name: a, node: n3, addresses: [198.18.1.11]}]\n",
			[]string{`t.yaml:2:29: workloads[0].node: node "n3" is not defined in nodes (known: n1)`}},
		{"mesh workload without node", node + "workloads: [{name: a, addresses: [198.18.1.11]}]\n",
			[]string{`t.yaml:2:13: workloads[0].node: is required for a workload in the mesh (the node whose proxy captures it)`}},
		{"non-mesh workload without node", node + "workloads: [{name: a, addresses: [198.18.1.11], mesh: false}]\n", nil},
		{"workload mode", node + "workloads: [{name: a, node: n1, addresses: [198.18.1.11], peerAuthentication: strict}]\n",
			[]string{`t.yaml:2:79: workloads[0].peerAuthentication: unknown mode "strict" (want STRICT or PERMISSIVE)`}},
		{"capture link is uplink (workload)", "nodes: [{name: n1, uplinks: [eth0]}]\nworkloads: [{name: a, node: n1, addresses: [198.18.1.11], captureLink: eth0}]\n",
			[]string{`t.yaml:2:72: workloads[0].captureLink: "eth0" is an uplink of node n1`}},
		{"bad capture link", node + "workloads: [{name: a, node: n1, addresses: [198.18.1.11], captureLink: \"a/b\"}]\n",
			[]string{`t.yaml:2:72: workloads[0].captureLink: "a/b" is not a valid link name (1-15 bytes, no '/', ':' or spaces)`}},

		{"service without vips", wl + "services: [{name: s, ports: [{port: 80}], selector: {app: a}}]\n",
			[]string{`t.yaml:3:12: services[0].vips: at least one VIP is required`}},
		{"bad service name", wl + "services: [{name: my.svc, vips: [198.18.100.1], ports: [{port: 80}], selector: {app: a}}]\n",
			[]string{`t.yaml:3:19: services[0].name: "my.svc" is not a valid name: at most 63 lower-case letters, digits and '-', starting and ending with a letter or digit`}},
		{"duplicate service", wl + "services:\n  - {name: s, vips: [198.18.100.1], ports: [{port: 80}], selector: {app: a}}\n  - {name: s, vips: [198.18.100.2], ports: [{port: 80}], selector: {app: a}}\n",
			[]string{`t.yaml:5:12: services[1].name: service default/s is already defined at line 4`}},
		{"vip is workload", wl + "services: [{name: s, vips: [198.18.1.11], ports: [{port: 80}], selector: {app: a}}]\n",
			[]string{`t.yaml:3:29: services[0].vips[0]: 198.18.1.11 is the address of workload default/a (line 2)`}},
		{"vip twice", wl + "services:\n  - {name: s, vips: [198.18.100.1], ports: [{port: 80}], selector: {app: a}}\n  - {name: t, vips: [198.18.100.1], ports: [{port: 81}], selector: {app: a}}\n",
			[]string{`t.yaml:5:22: services[1].vips[0]: 198.18.100.1 is already a VIP of service default/s (line 4)`}},
		{"no ports", wl + "services: [{name: s, vips: [198.18.100.1], selector: {app: a}}]\n",
			[]string{`t.yaml:3:12: services[0].ports: at least one port is required`}},
		{"port missing", wl + "services: [{name: s, vips: [198.18.100.1], ports: [{targetPort: 80}], selector: {app: a}}]\n",
			[]string{`t.yaml:3:52: services[0].ports[0].port: is required`}},
		{"port twice", wl + "services: [{name: s, vips: [198.18.100.1], ports: [{port: 80}, {port: 80, targetPort: 81}], selector: {app: a}}]\n",
			[]string{`t.yaml:3:71: services[0].ports[1].port: port 80 is listed twice`}},
		{"selector and workloads", wl + "services: [{name: s, vips: [198.18.100.1], ports: [{port: 80}], selector: {app: a}, workloads: [a]}]\n",
			[]string{`t.yaml:3:96: services[0].workloads: set either selector or workloads, not both`}},
		{"no endpoints", wl + "services: [{name: s, vips: [198.18.100.1], ports: [{port: 80}]}]\n",
			[]string{`t.yaml:3:12: services[0].selector: set selector or workloads to give the service endpoints`}},
		{"unknown endpoint", wl + "services: [{name: s, vips: [198.18.100.1], ports: [{port: 80}], workloads: [a, b/a]}]\n",
			[]string{`t.yaml:3:80: services[0].workloads[1]: workload b/a is not defined`}},
		{"traffic distribution", wl + "services: [{name: s, vips: [198.18.100.1], ports: [{port: 80}], selector: {app: a}, trafficDistribution: PreferClose}]\n",
			[]string{`t.yaml:3:106: services[0].trafficDistribution: unknown value "PreferClose" (want PreferSameNode, or nothing for any endpoint)`}},

		{"unknown action", wl + "authorizationPolicies: [{name: p, action: PERMIT}]\n",
			[]string{`t.yaml:3:43: authorizationPolicies[0].action: unknown action "PERMIT" (want ALLOW, DENY or AUDIT)`}},
		{"duplicate policy", wl + "authorizationPolicies:\n  - {name: p}\n  - {name: p, namespace: default}\n",
			[]string{`t.yaml:5:12: authorizationPolicies[1].name: policy default/p is already defined at line 4`}},
		{"policy without name", wl + "authorizationPolicies: [{action: DENY}]\n",
			[]string{`t.yaml:3:25: authorizationPolicies[0].name: is required`}},
		{"policy rule errors (short form)", wl + "authorizationPolicies:\n  - name: p\n    rules:\n      - from: [{principals: [\"spiffe://cluster.local/ns/a/sa/b\"]}, {}]\n        to: [{notPorts: [80]}, {}]\n        when: [{key: source.nope, values: [1.2.3.4]}, {key: source.ip}]\n",
			[]string{
				`t.yaml:6:30: authorizationPolicies[0].rules[0].from[0].principals[0]: "spiffe://cluster.local/ns/a/sa/b": write principals without the spiffe:// prefix, as Istio does ("cluster.local/ns/a/sa/b")`,
				`t.yaml:6:68: authorizationPolicies[0].rules[0].from[1]: source is empty: set at least one of principals, namespaces, serviceAccounts, ipBlocks or their not-forms (omit from to match any source)`,
				`t.yaml:7:32: authorizationPolicies[0].rules[0].to[1]: operation is empty: set ports or notPorts (omit to to match any port)`,
				`t.yaml:8:22: authorizationPolicies[0].rules[0].when[0].key: "source.nope" is not a condition key (L4: source.ip, source.namespace, source.principal, destination.ip, destination.port; HTTP: request.*, remote.ip, connection.sni, experimental.*)`,
				`t.yaml:8:55: authorizationPolicies[0].rules[0].when[1]: set values or notValues`,
			}},
		{"policy rule errors (Istio form)", wl + "authorizationPolicies:\n  - name: p\n    rules:\n      - from:\n          - source:\n              serviceAccounts: [client]\n              ipBlocks: [{cidr: 10.0.0.0/16, except: [10.1.0.0/24]}]\n          - source: {}\n        to:\n          - operation: {}\n",
			[]string{
				`t.yaml:9:55: authorizationPolicies[0].rules[0].from[0].source.ipBlocks[0].except[0]: 10.1.0.0/24 is not inside 10.0.0.0/16`,
				`t.yaml:10:21: authorizationPolicies[0].rules[0].from[1].source: source is empty: set at least one of principals, namespaces, serviceAccounts, ipBlocks or their not-forms (omit from to match any source)`,
				`t.yaml:12:24: authorizationPolicies[0].rules[0].to[0].operation: operation is empty: set ports or notPorts (omit to to match any port)`,
			}},
		{"when values", wl + "authorizationPolicies: [{name: p, rules: [{when: [{key: destination.port, values: [\"80\", \"http\"]}]}]}]\n",
			[]string{`t.yaml:3:90: authorizationPolicies[0].rules[0].when[0].values[1]: "http" is not a port number (1-65535)`}},
		{"several errors, file order", "nodes:\n  - name: n1\n    tun: {mtu: 100}\nworkloads: [{name: a, node: n9, addresses: [198.18.1.11]}]\n",
			[]string{
				`t.yaml:3:16: nodes[0].tun.mtu: 100 is not a valid MTU (1280-65535)`,
				`t.yaml:4:29: workloads[0].node: node "n9" is not defined in nodes (known: n1)`,
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := Parse("/some/dir/t.yaml", []byte(tt.yaml))
			if len(tt.want) == 0 {
				if err != nil {
					t.Fatalf("unexpected error:\n%v", err)
				}
				return
			}
			var es Errors
			if !errors.As(err, &es) {
				t.Fatalf("err = %v, want config.Errors", err)
			}
			got := strings.Split(err.Error(), "\n")
			if !slices.Equal(got, tt.want) {
				t.Errorf("errors:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(tt.want, "\n"))
			}
		})
	}
}

func TestWarnings(t *testing.T) {
	c, err := Parse("w.yaml", []byte(`nodes: [{name: n1}]
workloads:
  - {name: a, node: n1, addresses: [198.18.1.11], labels: {app: a}}
  - {name: b, addresses: [198.18.1.12], mesh: false, captureLink: vp1p2}
services:
  - {name: s, vips: [198.18.100.1, "fd00::100:1"], ports: [{port: 80}], selector: {app: a}}
  - {name: t, vips: [198.18.100.2], ports: [{port: 80}], selector: {app: nothing}}
authorizationPolicies:
  - {name: p, selector: {app: nothing}}
  - {name: q, namespace: istio-system, selector: {app: nothing}}
  - {name: r, namespace: istio-system, selector: {app: a}}
`))
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		`w.yaml:4:67: workloads[1].captureLink: ignored: the workload is not in the mesh, so its link is not captured`,
		`w.yaml:6:36: services[0].vips[1]: no endpoint has an IPv6 address: connections to fd00::100:1 find no endpoint`,
		`w.yaml:7:68: services[1].selector: selects no workload in namespace default`,
		`w.yaml:9:25: authorizationPolicies[0].selector: selects no workload in namespace default`,
		`w.yaml:10:50: authorizationPolicies[1].selector: selects no workload in any namespace (root namespace policy)`,
	}
	if !slices.Equal(c.Warnings, want) {
		t.Errorf("warnings:\n%s\nwant:\n%s", strings.Join(c.Warnings, "\n"), strings.Join(want, "\n"))
	}
	if n, _ := c.Node("n1"); len(n.CaptureLinks) != 0 {
		t.Errorf("capture links %q: a non-mesh workload's link was captured", n.CaptureLinks)
	}
}

func TestLoadMissingFile(t *testing.T) {
	_, err := Load(filepath.Join(t.TempDir(), "nope.yaml"))
	if err == nil || !strings.Contains(err.Error(), "nope.yaml: no such file or directory") {
		t.Errorf("Load: %v", err)
	}
}

// FuzzParse: no input makes Parse panic, and an accepted config always
// builds a snapshot.
func FuzzParse(f *testing.F) {
	for _, p := range []string{"../../deploy/examples/mesh.yaml", "../../deploy/examples/minimal.yaml"} {
		data, err := os.ReadFile(p)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(data)
	}
	f.Add([]byte("nodes: [{name: n1}]\nworkloads: [{name: a, node: n1, addresses: [198.18.1.11], labels: &l {app: a}}]\nservices: [{name: s, vips: [198.18.100.1], ports: [{port: 80}], selector: *l}]\n"))
	f.Add([]byte("authorizationPolicies: [{name: p, rules: [{from: [{source: }], to: [{operation: }]}]}]\n"))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := Parse("f.yaml", data)
		if err != nil {
			return
		}
		if _, err := c.Snapshot(); err != nil {
			t.Fatalf("accepted config does not build: %v", err)
		}
	})
}

func TestAliasBomb(t *testing.T) {
	// Each level lists the previous one 20 times: 20^5 sources.
	const bomb = `
x: &p [a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a, a]
y: &s {principals: *p}
z: &f [*s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s, *s]
w: &r {from: *f}
v: &rs [*r, *r, *r, *r, *r, *r, *r, *r, *r, *r, *r, *r, *r, *r, *r, *r, *r, *r, *r, *r]
u: &ap {name: p, rules: *rs}
authorizationPolicies: [*ap, *ap, *ap, *ap, *ap, *ap, *ap, *ap, *ap, *ap, *ap, *ap, *ap, *ap, *ap, *ap, *ap, *ap, *ap, *ap]
`
	_, err := Parse("bomb.yaml", []byte(bomb))
	if err == nil || !strings.Contains(err.Error(), "aliases expand the file too much") {
		t.Errorf("Parse: %v", err)
	}
}

// TestLoadTooLarge: a file over MaxFileSize is refused with an error that
// names the file and the limit, before it is parsed.
func TestLoadTooLarge(t *testing.T) {
	p := filepath.Join(t.TempDir(), "huge.yaml")
	f, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	// A valid file padded with a comment past the limit.
	if _, err := f.WriteString(meshFile(1) + "#" + strings.Repeat("x", MaxFileSize) + "\n"); err != nil {
		t.Fatal(err)
	}
	f.Close()
	_, err = Load(p)
	if err == nil || !strings.Contains(err.Error(), "huge.yaml: the file is larger than 8 MiB") {
		t.Errorf("Load: %v, want a size error", err)
	}
}

// TestSum: the same content has the same Sum, another content another.
func TestSum(t *testing.T) {
	a1, err1 := Parse("a.yaml", []byte(meshFile(1)))
	a2, err2 := Parse("b.yaml", []byte(meshFile(1)))
	b, err3 := Parse("a.yaml", []byte(meshFile(2)))
	if err := errors.Join(err1, err2, err3); err != nil {
		t.Fatal(err)
	}
	if a1.Sum() != a2.Sum() || a1.Sum() == b.Sum() {
		t.Errorf("Sum: equal content %v, different content %v", a1.Sum() == a2.Sum(), a1.Sum() != b.Sum())
	}
}

// TestIstioPoliciesLoad: policies Istio accepts but an L4 proxy cannot
// fully enforce load, each with a warning naming the file, line and
// field, and are enforced as Istio's ztunnel enforces them.
func TestIstioPoliciesLoad(t *testing.T) {
	const file = `nodes: [{name: n1}]
workloads:
  - {name: web, node: n1, addresses: [198.18.1.20], labels: {app: web}}
authorizationPolicies:
  - name: deny-get
    action: DENY
    rules:
      - to: [{operation: {methods: [GET], ports: ["8080"]}}]
  - name: allow-admin
    selector: {matchLabels: {app: web}}
    rules:
      - from: [{source: {requestPrincipals: ["*"]}}]
      - when: [{key: "request.headers[x-admin]", values: ["1"]}]
  - name: audit-all
    action: AUDIT
    rules:
      - from: [{source: {remoteIpBlocks: [203.0.113.0/24]}}]
  - name: ext
    action: CUSTOM
    provider: {name: opa}
    rules: [{}]
  - name: waypoint-only
    action: DENY
    targetRefs: [{kind: Service, group: "", name: web}]
    rules: [{}]
  - name: allow-sa
    namespace: default
    rules: [{from: [{source: {serviceAccounts: [client]}}]}]
`
	c, err := Parse("istio.yaml", []byte(file))
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	want := []string{
		`istio.yaml:8:36: authorizationPolicies[0].rules[0].to[0].operation.methods: methods is an HTTP (L7) attribute, which an L4 proxy cannot see: this DENY rule is enforced on its L4 part alone (it denies more than asked, as in Istio ambient)`,
		`istio.yaml:12:45: authorizationPolicies[1].rules[0].from[0].source.requestPrincipals: requestPrincipals is an HTTP (L7) attribute, which an L4 proxy cannot see: this ALLOW rule matches nothing (it allows less than asked, as in Istio ambient)`,
		`istio.yaml:13:22: authorizationPolicies[1].rules[1].when[0].key: request.headers[x-admin] is an HTTP (L7) attribute, which an L4 proxy cannot see: this ALLOW rule matches nothing (it allows less than asked, as in Istio ambient)`,
		`istio.yaml:17:42: authorizationPolicies[2].rules[0].from[0].source.remoteIpBlocks: remoteIpBlocks is an HTTP (L7) attribute, which an L4 proxy cannot see: this AUDIT rule is matched on its L4 part alone`,
		`istio.yaml:19:13: authorizationPolicies[3].action: action CUSTOM (an external authorizer) is not supported: policy default/ext is ignored (its requests are not sent to any authorizer)`,
		`istio.yaml:24:17: authorizationPolicies[4].targetRefs: policy default/waypoint-only targets a waypoint or gateway, not workloads: a node proxy ignores it`,
	}
	if !slices.Equal(c.Warnings, want) {
		t.Errorf("warnings:\n%s\nwant:\n%s", strings.Join(c.Warnings, "\n"), strings.Join(want, "\n"))
	}
	snap, err := c.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	if got := len(snap.Policies); got != 4 {
		t.Errorf("%d policies loaded, want 4 (CUSTOM and targetRefs ignored)", got)
	}
	client := spiffeid.RequireFromString("spiffe://cluster.local/ns/default/sa/client")
	other := spiffeid.RequireFromString("spiffe://cluster.local/ns/default/sa/other")
	for _, tc := range []struct {
		peer  spiffeid.ID
		dst   string
		want  string
		audit bool
	}{
		// The DENY's L4 part: any connection to 8080.
		{client, "198.18.1.20:8080", "denied by policy default/deny-get", true},
		// allow-admin allows nothing; allow-sa (serviceAccounts: [client],
		// in the policy's namespace) allows the client.
		{client, "198.18.1.20:9090", "allowed by policy default/allow-sa", true},
		{other, "198.18.1.20:9090", "denied: no ALLOW policy matched", true},
	} {
		r := policy.Request{Peer: tc.peer, Source: netip.MustParseAddr("198.18.1.10"), Dest: netip.MustParseAddrPort(tc.dst)}
		d := snap.Authorize(&r)
		if d.String() != tc.want || (d.Audit != nil) != tc.audit {
			t.Errorf("%s to %s: %v (audit %v), want %s (audit %v)", tc.peer, tc.dst, d, d.Audit, tc.want, tc.audit)
		}
	}
}

// TestPeerAuthentications: mesh-wide, namespace-wide and workload
// peer authentications resolve as in Istio, with port-level modes.
func TestPeerAuthentications(t *testing.T) {
	const file = `nodes: [{name: n1}]
workloads:
  - {name: a, namespace: prod, node: n1, addresses: [198.18.1.20], labels: {app: a}}
  - {name: b, namespace: prod, node: n1, addresses: [198.18.1.21], labels: {app: b}}
  - {name: c, namespace: dev, node: n1, addresses: [198.18.1.22]}
  - {name: d, namespace: test, node: n1, addresses: [198.18.1.23], peerAuthentication: PERMISSIVE}
  - {name: e, namespace: test, node: n1, addresses: [198.18.1.24]}
peerAuthentications:
  - {name: mesh, namespace: istio-system, mtls: {mode: STRICT}}
  - {name: dev, namespace: dev, mtls: {mode: PERMISSIVE}}
  - name: a-ports
    namespace: prod
    selector: {matchLabels: {app: a}}
    mtls: {mode: UNSET}
    portLevelMtls:
      "8080": {mode: DISABLE}
      9090: {mode: STRICT}
`
	c, err := Parse("pa.yaml", []byte(file))
	if err != nil {
		t.Fatalf("Parse: %v", err)
	}
	snap, err := c.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		dst     string
		allowed bool
	}{
		{"198.18.1.20:8080", true},  // a: port 8080 DISABLE
		{"198.18.1.20:9090", false}, // a: port 9090 STRICT
		{"198.18.1.20:80", false},   // a: mesh-wide STRICT
		{"198.18.1.21:8080", false}, // b: mesh-wide STRICT
		{"198.18.1.22:80", true},    // c: namespace dev PERMISSIVE
		{"198.18.1.23:80", true},    // d: its own field
		{"198.18.1.24:80", false},   // e: mesh-wide STRICT
	} {
		r := policy.Request{Source: netip.MustParseAddr("198.18.1.10"), Dest: netip.MustParseAddrPort(tc.dst)}
		if d := snap.Authorize(&r); d.Allowed != tc.allowed {
			t.Errorf("plaintext to %s: %v, want allowed %v", tc.dst, d, tc.allowed)
		}
	}
}
