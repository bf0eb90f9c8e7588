package kind_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshtun/meshtun/test/kind"
)

// kubeRouterYAML runs kube-router as the cluster's NetworkPolicy
// controller only (no routing, no service proxy): iptables and ipset in
// each node's network namespace, as kube-router's own
// kube-router-firewall-daemonset.yaml does.
const kubeRouterYAML = `apiVersion: v1
kind: ServiceAccount
metadata: {name: kube-router, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: meshtun-test-kube-router}
rules:
  - apiGroups: [""]
    resources: [namespaces, pods, services, nodes, endpoints]
    verbs: [get, list, watch]
  - apiGroups: [networking.k8s.io]
    resources: [networkpolicies]
    verbs: [get, list, watch]
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [get, list, watch]
  - apiGroups: [coordination.k8s.io]
    resources: [leases]
    verbs: [get, create, update]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: meshtun-test-kube-router}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: meshtun-test-kube-router}
subjects: [{kind: ServiceAccount, name: kube-router, namespace: kube-system}]
---
apiVersion: apps/v1
kind: DaemonSet
metadata: {name: kube-router, namespace: kube-system}
spec:
  selector: {matchLabels: {k8s-app: kube-router}}
  template:
    metadata: {labels: {k8s-app: kube-router}}
    spec:
      serviceAccountName: kube-router
      hostNetwork: true
      priorityClassName: system-node-critical
      tolerations: [{operator: Exists}]
      containers:
        - name: kube-router
          image: {{IMAGE}}
          imagePullPolicy: Never
          args: [--run-router=false, --run-firewall=true, --run-service-proxy=false,
                 --enable-ipv4=true, --enable-ipv6=true, --bgp-graceful-restart=false,
                 --metrics-port=0, --health-port=20244]
          env:
            - name: NODE_NAME
              valueFrom: {fieldRef: {fieldPath: spec.nodeName}}
          securityContext: {privileged: true}
          readinessProbe:
            httpGet: {path: /healthz, port: 20244}
            periodSeconds: 2
          volumeMounts:
            - {name: lib-modules, mountPath: /lib/modules, readOnly: true}
            - {name: xtables-lock, mountPath: /run/xtables.lock}
      volumes:
        - name: lib-modules
          hostPath: {path: /lib/modules}
        - name: xtables-lock
          hostPath: {path: /run/xtables.lock, type: FileOrCreate}
`

const netpolWorkloadsYAML = `apiVersion: v1
kind: Namespace
metadata:
  name: {{NS}}
  labels: {istio.io/dataplane-mode: ambient}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: server, namespace: {{NS}}}
---
apiVersion: v1
kind: ServiceAccount
metadata: {name: client, namespace: {{NS}}}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: {{NS}}, labels: {app: server}}
spec:
  serviceAccountName: server
  nodeSelector: {kubernetes.io/hostname: {{W1}}}
  terminationGracePeriodSeconds: 0
  containers:
    - {name: probe, image: meshtun-probe:dev, imagePullPolicy: Never, args: [serve]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: {{NS}}, labels: {app: client}}
spec:
  serviceAccountName: client
  nodeSelector: {kubernetes.io/hostname: {{W2}}}
  terminationGracePeriodSeconds: 0
  containers:
    - {name: probe, image: meshtun-probe:dev, imagePullPolicy: Never, args: [sleep]}
---
apiVersion: v1
kind: Pod
metadata: {name: near, namespace: {{NS}}, labels: {app: client}}
spec:
  serviceAccountName: client
  nodeSelector: {kubernetes.io/hostname: {{W1}}}
  terminationGracePeriodSeconds: 0
  containers:
    - {name: probe, image: meshtun-probe:dev, imagePullPolicy: Never, args: [sleep]}
---
apiVersion: v1
kind: Pod
metadata: {name: other, namespace: {{NS}}, labels: {app: other}}
spec:
  serviceAccountName: client
  nodeSelector: {kubernetes.io/hostname: {{W2}}}
  terminationGracePeriodSeconds: 0
  containers:
    - {name: probe, image: meshtun-probe:dev, imagePullPolicy: Never, args: [sleep]}
`

// netpolYAML is a NetworkPolicy on the server admitting app=client on the
// given ports only; with no ports it admits nothing (deny all ingress).
func netpolYAML(ns, name string, ports ...int) string {
	y := fmt.Sprintf(`apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: %s, namespace: %s}
spec:
  podSelector: {matchLabels: {app: server}}
  policyTypes: [Ingress]
`, name, ns)
	if len(ports) == 0 {
		return y + "  ingress: []\n"
	}
	y += "  ingress:\n    - from: [{podSelector: {matchLabels: {app: client}}}]\n      ports:\n"
	for _, p := range ports {
		y += fmt.Sprintf("        - {protocol: TCP, port: %d}\n", p)
	}
	return y
}

// TestNetworkPolicy: a real NetworkPolicy controller (kube-router's
// firewall, iptables + ipset; docs/kind.md says why not
// kube-network-policies) with the mesh. A policy that denies client →
// server:8080 still denies it when both are in the mesh (across nodes and
// on one node); one that allows client → server:8080 alone lets the mesh
// client through, with both identities in the server node's access log,
// while a pod the policy does not admit stays refused: meshtun needs no
// rule for port 15008 (HBONE arrives at the node, which dials the pod
// from the client's address to port 8080, so the pod's ingress rules see
// what they would see without the mesh). A policy that opens only 15008
// lets nothing through.
func TestNetworkPolicy(t *testing.T) {
	ctx := context.Background()
	mesh, _ := meshWorkloads(t)
	start := time.Now()

	// The controller's image, loaded into the nodes.
	rootfs, err := kind.BaseRootfs(ctx, logf)
	if err != nil {
		t.Fatal(err)
	}
	tar := filepath.Join(t.TempDir(), "kube-router.tar")
	if err := kind.WriteKubeRouterImage(ctx, logf, rootfs, tar); err != nil {
		t.Fatal(err)
	}
	if err := cl.LoadImage(ctx, tar); err != nil {
		t.Fatal(err)
	}
	built := time.Since(start)

	// meshtun's CA admits only the nodes' address ranges; the shipped ones
	// are Docker kind's, this cluster's network is podman's: put its
	// subnets there first, as docs/kubernetes.md tells users to.
	if err := admitNodesToCA(ctx); err != nil {
		t.Fatal(err)
	}

	if _, err := cl.KubectlIn(ctx, strings.ReplaceAll(kubeRouterYAML, "{{IMAGE}}", kind.KubeRouterImage), "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { removeKubeRouter(t) })
	if _, err := cl.Kubectl(ctx, "-n", "kube-system", "rollout", "status", "ds/kube-router", "--timeout=5m"); err != nil {
		out, _ := cl.Kubectl(ctx, "-n", "kube-system", "logs", "ds/kube-router", "--tail=30")
		t.Fatalf("kube-router: %v\n%s", err, out)
	}
	ready := time.Since(start)

	ns := "netpol-" + randHex(3)
	sharedNamespaces = append(sharedNamespaces, ns)
	y := strings.NewReplacer("{{NS}}", ns, "{{W1}}", mesh.serverNode, "{{W2}}", mesh.farNode).Replace(netpolWorkloadsYAML)
	if _, err := cl.KubectlIn(ctx, y, "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Kubectl(ctx, "-n", ns, "wait", "--for=condition=Ready", "pod", "--all", "--timeout=5m"); err != nil {
		t.Fatal(err)
	}
	out, err := cl.Kubectl(ctx, "-n", ns, "get", "pod", "server", "-o", "jsonpath={.status.podIP}")
	if err != nil {
		t.Fatal(err)
	}
	sip, err := netip.ParseAddr(strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatalf("pod %s/server IP %q: %v", ns, out, err)
	}
	to := netip.AddrPortFrom(sip, 8080)
	td := "spiffe://cluster.local/ns/" + ns + "/sa/"
	clientIP := func(name string) netip.Addr {
		out, err := cl.Kubectl(ctx, "-n", ns, "get", "pod", name, "-o", "jsonpath={.status.podIP}")
		if err != nil {
			t.Fatal(err)
		}
		a, err := netip.ParseAddr(strings.TrimSpace(string(out)))
		if err != nil {
			t.Fatalf("pod %s/%s IP %q: %v", ns, name, out, err)
		}
		return a
	}

	// No policy: the mesh carries client → server (the first exchange may
	// wait for the node to capture the pods: it follows the API).
	for _, c := range []string{"client", "near", "other"} {
		if err := eventually(time.Minute, func() error { return send(ctx, ns, c, to, "before-policy") }); err != nil {
			t.Fatalf("%s → server before any policy: %v", c, err)
		}
	}
	waitAccess(t, mesh.serverNode, clientIP("near"), td+"client", td+"server")

	apply := func(name string, ports ...int) {
		t.Helper()
		if _, err := cl.KubectlIn(ctx, netpolYAML(ns, name, ports...), "apply", "-f", "-"); err != nil {
			t.Fatal(err)
		}
	}
	del := func(name string) {
		t.Helper()
		if _, err := cl.Kubectl(ctx, "-n", ns, "delete", "networkpolicy", name, "--wait=true"); err != nil {
			t.Fatal(err)
		}
	}
	// policySync is how long kube-router may take to apply a change: it
	// follows an API watch and rewrites its iptables and ipsets, which
	// took over a minute once in CI, with the other suite's builds on
	// the same two cores.
	const policySync = 3 * time.Minute
	// refused waits until every client in from is refused, then checks it
	// stays so for three more tries each.
	refused := func(what string, from ...string) {
		t.Helper()
		for _, c := range from {
			if err := eventually(policySync, func() error {
				if send(ctx, ns, c, to, "MESHTUN-NETPOL-"+what) == nil {
					return fmt.Errorf("%s → server:8080 still got through", c)
				}
				return nil
			}); err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			for i := 0; i < 3; i++ {
				if err := send(ctx, ns, c, to, "MESHTUN-NETPOL-"+what); err == nil {
					t.Fatalf("%s: %s → server:8080 got through once the policy was enforced", what, c)
				}
			}
		}
	}
	allowed := func(what string, from ...string) {
		t.Helper()
		for _, c := range from {
			start := time.Now()
			if err := eventually(policySync, func() error { return send(ctx, ns, c, to, "MESHTUN-NETPOL-"+what) }); err != nil {
				t.Fatalf("%s: %s → server:8080: %v (for %s)", what, c, err, time.Since(start).Round(time.Second))
			}
		}
	}

	// 1. Deny: no ingress at all to the server.
	apply("deny-all")
	refused("deny", "client", "near", "other")
	del("deny-all")
	allowed("deny-removed", "client", "near", "other")

	// 2. Allow client → server:8080, nothing for 15008.
	apply("allow-8080", 8080)
	refused("allow-8080-other", "other")
	before, err := countFrom(ctx, mesh.serverNode, clientIP("near"))
	if err != nil {
		t.Fatal(err)
	}
	allowed("allow-8080", "client", "near")
	// The admitted exchanges were the mesh's: the near client's with both
	// identities, the far one's arriving over HBONE (the server's node
	// logs the far client's identity).
	if n, err := countFrom(ctx, mesh.serverNode, clientIP("near")); err != nil || n <= before {
		t.Fatalf("the near client's admitted exchange is not in the server node's access log (%d records, %d before, %v)", n, before, err)
	}
	waitAccess(t, mesh.serverNode, clientIP("near"), td+"client", td+"server")
	farSeen := false
	recs, err := accessLog(ctx, mesh.serverNode)
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range recs {
		if r.SrcIdentity == td+"client" && r.DstIdentity == td+"server" && r.Direction == "inbound" {
			farSeen = true
		}
	}
	if !farSeen {
		t.Errorf("no inbound HBONE record with %s → %s on the server's node", td+"client", td+"server")
	}
	del("allow-8080")

	// 3. Only 15008 open: that is not port 8080, nothing gets through.
	apply("allow-15008", 15008)
	refused("allow-15008-only", "client", "near")
	del("allow-15008")

	t.Logf("kube-router %s: image built and loaded in %s, ready on 3 nodes %s after start; test %s",
		kind.KubeRouterVersion, built.Round(time.Second), ready.Round(time.Second), time.Since(start).Round(time.Second))
}

// eventually retries f every second until it returns nil or d passes.
func eventually(d time.Duration, f func() error) error {
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(time.Second) // the policy reaches the nodes through an API watch
	}
}

// admitNodesToCA replaces the ranges of meshtun-ca-nodes-only by the
// cluster network's subnets.
func admitNodesToCA(ctx context.Context) error {
	out, err := cl.Podman(ctx, "network", "inspect", cl.Network, "--format", "{{range .Subnets}}{{.Subnet}} {{end}}")
	if err != nil {
		return err
	}
	var from []map[string]map[string]string
	for _, s := range strings.Fields(string(out)) {
		from = append(from, map[string]map[string]string{"ipBlock": {"cidr": s}})
	}
	if len(from) == 0 {
		return fmt.Errorf("podman network %s has no subnets", cl.Network)
	}
	patch, _ := json.Marshal([]map[string]any{{"op": "replace", "path": "/spec/ingress/0/from", "value": from}})
	_, err = cl.Kubectl(ctx, "-n", "meshtun-system", "patch", "networkpolicy", "meshtun-ca-nodes-only", "--type=json", "-p", string(patch))
	return err
}

// removeKubeRouter deletes the controller, waiting for its pods to go.
// Its iptables chains and ipsets stay on the nodes: `kube-router
// --cleanup-config` (v2.1.0, in a pod per node) logs "Successfully cleaned
// the NetworkPolicyController configurations" and leaves them (82 rules on
// a worker before and after), then panics in the service proxy's cleanup
// (no IPVS here). With no NetworkPolicy left but meshtun-ca's, what stays
// accepts what it did; a node restart (TestNodeReboot) drops it.
func removeKubeRouter(t *testing.T) {
	if _, err := cl.Kubectl(context.Background(), "-n", "kube-system", "delete", "ds/kube-router", "--cascade=foreground", "--wait=true", "--timeout=3m"); err != nil {
		t.Errorf("remove kube-router: %v", err)
	}
}
