package kube

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	sigsyaml "sigs.k8s.io/yaml"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
)

// meshtunBin is the binary under test, built once by TestMain.
var meshtunBin string

func TestMain(m *testing.M) {
	var remove func()
	var err error
	// The product's own module: its go.mod and go.sum, not this test module's.
	if meshtunBin, remove, err = noderun.Build("../.."); err != nil {
		fmt.Fprintln(os.Stderr, "kube:", err)
		os.Exit(1)
	}
	code := m.Run()
	remove()
	os.Exit(code)
}

const deployDir = "../../deploy/kubernetes"

// applyDeploy applies every manifest of deploy/kubernetes, namespaces
// first, as server-side apply against the real API server: the manifests
// are validated, and the node then runs with exactly the shipped RBAC.
func applyDeploy(t testing.TB, cp *ControlPlane) []Manifest {
	t.Helper()
	ms, err := ReadManifests(deployDir)
	if err != nil {
		t.Fatal(err)
	}
	var nss, rest []Manifest
	for _, m := range ms {
		if m.Obj.GetKind() == "Namespace" {
			nss = append(nss, m)
		} else {
			rest = append(rest, m)
		}
	}
	if err := cp.Apply(context.Background(), append(nss, rest...), false); err != nil {
		t.Fatalf("apply deploy/kubernetes: %v", err)
	}
	return ms
}

// nodeConfig writes the settings of deploy/kubernetes' ConfigMap (read
// by the nodes and by `meshtun ca`), with the CA's address moved to ca (the
// control plane's namespace) and its directory to dir.
func nodeConfig(t testing.TB, ms []Manifest, dir string, ca netip.AddrPort) string {
	t.Helper()
	const addr, caDir = "meshtun-ca.meshtun-system.svc:15012", "/var/lib/meshtun/ca"
	for _, m := range ms {
		if m.Obj.GetKind() != "ConfigMap" {
			continue
		}
		var cm corev1.ConfigMap
		data, _ := sigsyaml.Marshal(m.Obj.Object)
		if err := sigsyaml.Unmarshal(data, &cm); err != nil {
			t.Fatal(err)
		}
		y := cm.Data["mesh.yaml"]
		if !strings.Contains(y, addr) || !strings.Contains(y, caDir) {
			t.Fatalf("the ConfigMap's mesh.yaml has no CA address %s and directory %s:\n%s", addr, caDir, y)
		}
		if strings.Contains(y, "insecureSharedDir") {
			t.Fatalf("the shipped ConfigMap has nodes hold the CA key (insecureSharedDir):\n%s", y)
		}
		y = strings.ReplaceAll(y, addr, ca.String())
		y = strings.ReplaceAll(y, caDir, filepath.Join(dir, "ca"))
		y = strings.ReplaceAll(y, "/var/run/meshtun/admin.sock", filepath.Join(dir, "admin.sock"))
		path := filepath.Join(dir, "mesh.yaml")
		if err := os.WriteFile(path, []byte(y), 0o644); err != nil {
			t.Fatal(err)
		}
		return path
	}
	t.Fatal("deploy/kubernetes has no ConfigMap")
	return ""
}

// kubelet plays the kubelet and the CNI for the test's pods: the cluster
// package built the pods' namespaces and veths (like kindnet); kubelet
// creates their Pod objects and reports their status.
type kubelet struct {
	t  testing.TB
	cs *kubernetes.Clientset
}

func (k kubelet) namespace(name string, ambient bool) {
	k.t.Helper()
	ns := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}}}
	if ambient {
		ns.Labels["istio.io/dataplane-mode"] = "ambient"
	}
	if _, err := k.cs.CoreV1().Namespaces().Create(context.Background(), ns, metav1.CreateOptions{}); err != nil {
		k.t.Fatal(err)
	}
}

// run creates pod ns/name for cluster pod p with service account sa (and
// the account), then patches its status to Running and Ready with p's
// addresses.
func (k kubelet) run(p *cluster.Pod, ns, name, sa string, labels map[string]string) {
	k.t.Helper()
	ctx := context.Background()
	_, err := k.cs.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{})
	if err != nil && !strings.Contains(err.Error(), "already exists") {
		k.t.Fatal(err)
	}
	pod := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name, Labels: labels},
		Spec: corev1.PodSpec{
			NodeName: noderun.NodeName(p.Node), ServiceAccountName: sa,
			AutomountServiceAccountToken: new(bool),
			Containers: []corev1.Container{{Name: "app", Image: "example.invalid/app:1",
				Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}}},
		},
	}
	pod, err = k.cs.CoreV1().Pods(ns).Create(ctx, pod, metav1.CreateOptions{})
	if err != nil {
		k.t.Fatal(err)
	}
	now := metav1.Now()
	pod.Status = corev1.PodStatus{
		Phase: corev1.PodRunning, PodIP: p.IPv4.String(),
		PodIPs:    []corev1.PodIP{{IP: p.IPv4.String()}, {IP: p.IPv6.String()}},
		HostIP:    p.Node.IPv4.String(),
		StartTime: &now,
		Conditions: []corev1.PodCondition{
			{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
		},
	}
	if _, err := k.cs.CoreV1().Pods(ns).UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
		k.t.Fatal(err)
	}
}

// echo serves an echo on port in p's namespace.
func echo(t testing.TB, p *cluster.Pod, port int) {
	t.Helper()
	ln, err := p.Listen("tcp", fmt.Sprintf(":%d", port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() { defer c.Close(); io.Copy(c, c) }()
		}
	}()
}

// roundTrip connects from p to dst, has a message echoed and closes; it
// returns the connection's source and destination.
func roundTrip(t testing.TB, p *cluster.Pod, dst netip.AddrPort) (src netip.AddrPort) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := p.Dial(ctx, "tcp", dst.String())
	if err != nil {
		t.Fatalf("dial %s from %s: %v", dst, p.ID, err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	msg := []byte("hello " + p.ID)
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != string(msg) {
		t.Fatalf("%s → %s: echo %q, %v", p.ID, dst, buf, err)
	}
	a := c.LocalAddr().(*net.TCPAddr).AddrPort()
	return netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
}

// waitLog waits for a log line of m from mark on.
func waitLog(t testing.TB, m *noderun.Process, mark int, what string, pred func(noderun.Line) bool) noderun.Line {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	l, err := m.WaitLogSince(ctx, mark, pred)
	if err != nil {
		t.Fatalf("%s: no log line for %s: %v\nlogs:\n%s", m.Node.Name(), what, err, m.Logs())
	}
	return l
}

// nodeKubeconfig writes dir/kubeconfig for deploy/kubernetes' node
// service account (meshtun-system/meshtun), with a one-hour token, and
// returns its path.
func nodeKubeconfig(t testing.TB, cp *ControlPlane, dir string) string {
	t.Helper()
	tok, err := cp.Admin.CoreV1().ServiceAccounts("meshtun-system").CreateToken(context.Background(), "meshtun",
		&authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: new(int64(3600))}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	if err := os.WriteFile(kubeconfig, cp.Kubeconfig(tok.Status.Token), 0o600); err != nil {
		t.Fatal(err)
	}
	return kubeconfig
}

// accessLine returns a predicate for the access log of the connection from src.
func accessLine(src netip.AddrPort) func(noderun.Line) bool {
	return func(l noderun.Line) bool {
		return l.Str("log") == "access" && l.Str("message") == "connection complete" && l.Str("src.addr") == src.String()
	}
}

// hasLine reports whether a log line of m matches pred.
func hasLine(m *noderun.Process, pred func(noderun.Line) bool) bool {
	for _, l := range m.Lines() {
		if pred(l) {
			return true
		}
	}
	return false
}

func podLog(pod, message string) func(noderun.Line) bool {
	return func(l noderun.Line) bool { return l.Str("pod") == pod && l.Str("message") == message }
}

func wantField(t *testing.T, l noderun.Line, k, want string) {
	t.Helper()
	if got := l.Str(k); got != want {
		t.Errorf("log %s = %q, want %q (line %v)", k, got, want, l)
	}
}

func spiffe(ns, sa string) string { return "spiffe://cluster.local/ns/" + ns + "/sa/" + sa }

// TestKubernetes runs meshtun on two nodes with the mesh from a real API
// server, the node authenticating as deploy/kubernetes' service account.
func TestKubernetes(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "kube", Nodes: 2, PodsPerNode: 3})
	cp := controlPlaneT(t, c)
	ctx := context.Background()
	ms := applyDeploy(t, cp)
	dir := t.TempDir()
	cfgPath := nodeConfig(t, ms, dir, netip.AddrPortFrom(cp.Host.IPv4, caPort))
	ca := startCA(t, cp, ms, cfgPath, dir)

	kubeconfig := nodeKubeconfig(t, cp, dir)

	n1, n2 := c.Nodes[0], c.Nodes[1]
	p11, p12, p13 := n1.Pods[0], n1.Pods[1], n1.Pods[2]
	p21, p23 := n2.Pods[0], n2.Pods[2]
	k := kubelet{t: t, cs: cp.Admin}
	k.namespace("apps", true)
	k.namespace("live", true)
	k.run(p11, "apps", "client", "client", map[string]string{"app": "client"})
	k.run(p21, "apps", "server", "server", map[string]string{"app": "server"})
	k.run(p12, "apps", "opted", "opted", map[string]string{"app": "opted", "istio.io/dataplane-mode": "none"})
	k.run(p13, "live", "livec", "livec", nil)
	k.run(p23, "apps", "old", "old", nil)
	echo(t, p21, 8080)
	echo(t, p23, 8080)

	start := func(n *cluster.Node) *noderun.Process {
		sctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		m, err := noderun.Start(sctx, meshtunBin, n, "--kubernetes", "--kubeconfig", kubeconfig, "--config", cfgPath,
			"--ca-token-file", nodeToken(t, cp, n, dir), "--ca-roots", ca.roots)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Stop(9) })
		return m
	}
	m1, m2 := start(n1), start(n2)
	// The shipped RBAC must be enough: client-go logs a refused request
	// (403) as a warning. Checked up to the API server's restart, whose
	// authorizer refuses requests until its RBAC caches have synced.
	var checkUntil [2]int
	forbidden := func() {
		for i, m := range []*noderun.Process{m1, m2} {
			lines := m.Lines()
			if checkUntil[i] > 0 {
				lines = lines[:checkUntil[i]]
			}
			for _, l := range lines {
				if s := strings.ToLower(fmt.Sprint(l)); strings.Contains(s, "forbidden") || strings.Contains(s, " 403") {
					t.Errorf("%s: the API server refused the node a request: %v", m.Node.Name(), l)
				}
			}
		}
	}
	t.Cleanup(func() {
		forbidden()
		if t.Failed() {
			t.Logf("node 1 log:\n%s\nnode 2 log:\n%s", m1.Logs(), m2.Logs())
		}
	})

	t.Run("mesh TCP across nodes with both identities", func(t *testing.T) {
		for _, dst := range []netip.Addr{p21.IPv4, p21.IPv6} {
			src := roundTrip(t, p11, netip.AddrPortFrom(dst, 8080))
			out := waitLog(t, m1, 0, "outbound access log", accessLine(src))
			wantField(t, out, "route", "hbone")
			wantField(t, out, "src.identity", spiffe("apps", "client"))
			wantField(t, out, "dst.identity", spiffe("apps", "server"))
			in := waitLog(t, m2, 0, "inbound access log", accessLine(src))
			wantField(t, in, "direction", "inbound")
			wantField(t, in, "src.identity", spiffe("apps", "client"))
		}
	})

	t.Run("node certificates from meshtun ca by TokenReview", func(t *testing.T) {
		// The identities above came from the CA, to the node of their pod.
		for _, w := range []struct {
			n      *cluster.Node
			ns, sa string
		}{{n1, "apps", "client"}, {n2, "apps", "server"}} {
			node := noderun.NodeName(w.n)
			l := ca.wait(t, 0, "issued "+spiffe(w.ns, w.sa), func(l noderun.Line) bool {
				return l.Str("message") == "certificate issued" && l.Str("identity") == spiffe(w.ns, w.sa)
			})
			wantField(t, l, "node", node)
			wantField(t, l, "caller", "service account meshtun-system/meshtun (pod meshtun-system/meshtun-"+node+")")
		}
	})

	t.Run("token of a service account that is not a node account refused", func(t *testing.T) {
		// A pod-bound token of the right audience, of a workload's account.
		tok := boundToken(t, cp, "apps", "client", "client", noderun.NodeName(n1), filepath.Join(dir, "client.token"))
		mark := len(ca.lines())
		err := askCA(t, cp, ca, tok, spiffe("apps", "client"))
		if status.Code(err) != codes.Unauthenticated {
			t.Fatalf("certificate for a workload's own token: %v, want Unauthenticated", err)
		}
		l := ca.wait(t, mark, "refusal of the workload's token", func(l noderun.Line) bool {
			return l.Str("message") == "certificate request refused" && l.Str("asked_for") == spiffe("apps", "client")
		})
		if r := l.Str("reason"); !strings.Contains(r, "service account apps/client is not a node account") {
			t.Errorf("refusal reason %q does not say the account is not a node account", r)
		}
	})

	t.Run("node asking for a workload of another node refused", func(t *testing.T) {
		// Node 1's own token, asking for the server, which runs on node 2.
		tok := nodeToken(t, cp, n1, dir)
		mark := len(ca.lines())
		err := askCA(t, cp, ca, tok, spiffe("apps", "server"))
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("node 1 asking for node 2's workload: %v, want PermissionDenied", err)
		}
		l := ca.wait(t, mark, "refusal of another node's workload", func(l noderun.Line) bool {
			return l.Str("message") == "certificate request refused" && l.Str("asked_for") == spiffe("apps", "server")
		})
		wantField(t, l, "node", noderun.NodeName(n1))
		if r := l.Str("reason"); !strings.Contains(r, "no running pod of namespace apps with service account server is on node "+noderun.NodeName(n1)) {
			t.Errorf("refusal reason %q does not say the workload is not on the node", r)
		}
		// The same token gets node 1's own workload: the refusal was about
		// the node, not the token.
		if err := askCA(t, cp, ca, tok, spiffe("apps", "client")); err != nil {
			t.Errorf("node 1 asking for its own workload: %v", err)
		}
	})

	t.Run("pod opted out by label", func(t *testing.T) {
		waitLog(t, m1, 0, "opted-out pod", podLog("apps/opted", "pod not in the mesh"))
		src := roundTrip(t, p12, netip.AddrPortFrom(p21.IPv4, 8080))
		// A mesh connection after it, whose log marks that node 1 has
		// logged what it would have.
		mark := roundTrip(t, p11, netip.AddrPortFrom(p21.IPv4, 8080))
		waitLog(t, m1, 0, "mesh connection after", accessLine(mark))
		if hasLine(m1, accessLine(src)) {
			t.Errorf("node 1 proxied the opted-out pod's connection from %s", src)
		}
		// /config_dump says which pods the node captures, and why not.
		var dump struct {
			Source struct {
				Source    string
				LocalPods []struct {
					Pod    string
					Mesh   bool
					Reason string
				}
			}
		}
		getJSON(t, n1, "http://127.0.0.1:15000/config_dump", &dump)
		got := map[string]string{}
		for _, p := range dump.Source.LocalPods {
			got[p.Pod] = fmt.Sprint(p.Mesh, " ", p.Reason)
		}
		want := map[string]string{"apps/client": "true ", "apps/opted": "false pod labelled istio.io/dataplane-mode=none", "live/livec": "true "}
		if dump.Source.Source != "kubernetes" || fmt.Sprint(got) != fmt.Sprint(want) {
			t.Errorf("config_dump source %q, local pods %v; want kubernetes, %v", dump.Source.Source, got, want)
		}
	})

	t.Run("namespace label removed live", func(t *testing.T) {
		waitLog(t, m1, 0, "live pod captured", podLog("live/livec", "pod in the mesh"))
		src := roundTrip(t, p13, netip.AddrPortFrom(p21.IPv4, 8080))
		l := waitLog(t, m1, 0, "captured connection", accessLine(src))
		wantField(t, l, "src.identity", spiffe("live", "livec"))
		mark1 := m1.Len()
		ns, err := cp.Admin.CoreV1().Namespaces().Get(ctx, "live", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		delete(ns.Labels, "istio.io/dataplane-mode")
		if _, err := cp.Admin.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		waitLog(t, m1, mark1, "live pod released", podLog("live/livec", "pod not in the mesh"))
		// The source logs a change when it builds the model; the rules
		// follow when the node has installed it.
		waitRule(t, n1, netip.PrefixFrom(p13.IPv4, 32).String(), false)
		src = roundTrip(t, p13, netip.AddrPortFrom(p21.IPv4, 8080))
		mark := roundTrip(t, p11, netip.AddrPortFrom(p21.IPv4, 8080))
		waitLog(t, m1, 0, "mesh connection after", accessLine(mark))
		if hasLine(m1, accessLine(src)) {
			t.Errorf("node 1 still proxies the released pod's connection from %s", src)
		}
	})

	t.Run("pod deleted and its address reused", func(t *testing.T) {
		prefix := netip.PrefixFrom(p23.IPv4, 32).String()
		if !ruleFor(t, n2, prefix) {
			t.Fatalf("node 2 has no capture rule for %s before the pod is deleted", prefix)
		}
		src := roundTrip(t, p11, netip.AddrPortFrom(p23.IPv4, 8080))
		l := waitLog(t, m1, 0, "old pod connection", accessLine(src))
		wantField(t, l, "dst.identity", spiffe("apps", "old"))
		mark := m2.Len()
		if err := cp.Admin.CoreV1().Pods("apps").Delete(ctx, "old", metav1.DeleteOptions{GracePeriodSeconds: new(int64(0))}); err != nil {
			t.Fatal(err)
		}
		waitLog(t, m2, mark, "old pod gone", podLog("apps/old", "pod gone from this node"))
		waitRule(t, n2, prefix, false)
		mark = m2.Len()
		k.run(p23, "apps", "reuse", "reuse", nil)
		waitLog(t, m2, mark, "new pod captured", podLog("apps/reuse", "pod in the mesh"))
		waitRule(t, n2, prefix, true)
		// Node 1 learns of the new pod from its own informers: until then
		// it still has the old pod's identity for the address.
		deadline := time.Now().Add(20 * time.Second)
		for {
			if src = roundTripMaybe(p11, netip.AddrPortFrom(p23.IPv4, 8080)); src.IsValid() {
				l = waitLog(t, m1, 0, "new pod connection", accessLine(src))
				if l.Str("dst.identity") == spiffe("apps", "reuse") {
					break
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("no connection to the new pod at %s with its identity; last access log %v", p23.IPv4, l)
			}
			time.Sleep(200 * time.Millisecond)
		}
		wantField(t, l, "dst.identity", spiffe("apps", "reuse"))
		in := waitLog(t, m2, 0, "new pod inbound", accessLine(src))
		wantField(t, in, "dst.identity", spiffe("apps", "reuse"))
	})

	t.Run("service VIP with a named target port", func(t *testing.T) {
		svc, err := cp.Admin.CoreV1().Services("apps").Create(ctx, &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Name: "web"},
			Spec: corev1.ServiceSpec{
				Selector:       map[string]string{"app": "server"},
				IPFamilyPolicy: new(corev1.IPFamilyPolicyRequireDualStack),
				Ports:          []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
			},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		// No controller manager runs: the test writes the EndpointSlice
		// the endpoint-slice controller would.
		_, err = cp.Admin.DiscoveryV1().EndpointSlices("apps").Create(ctx, &discoveryv1.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Name: "web-v4", Labels: map[string]string{discoveryv1.LabelServiceName: "web"}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Ports:       []discoveryv1.EndpointPort{{Name: new("http"), Port: new(int32(8080))}},
			Endpoints: []discoveryv1.Endpoint{{Addresses: []string{p21.IPv4.String()}, Conditions: discoveryv1.EndpointConditions{Ready: new(true)},
				TargetRef: &corev1.ObjectReference{Kind: "Pod", Namespace: "apps", Name: "server"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(svc.Spec.ClusterIPs) != 2 {
			t.Fatalf("service cluster IPs %v, want both families", svc.Spec.ClusterIPs)
		}
		for _, ip := range svc.Spec.ClusterIPs {
			vip := netip.MustParseAddr(ip)
			var src netip.AddrPort
			deadline := time.Now().Add(20 * time.Second)
			for { // until node 1 knows the service (no log line says so per service)
				src = roundTripMaybe(p11, netip.AddrPortFrom(vip, 80))
				if src.IsValid() || time.Now().After(deadline) {
					break
				}
				time.Sleep(200 * time.Millisecond)
			}
			if !src.IsValid() {
				t.Fatalf("no connection to %s:80 through the service", vip)
			}
			l := waitLog(t, m1, 0, "service connection", accessLine(src))
			wantField(t, l, "dst.identity", spiffe("apps", "server"))
			wantField(t, l, "dst.service", "web.apps.svc.cluster.local")
		}
	})

	t.Run("Istio policies applied and removed live", func(t *testing.T) {
		// The CRDs appear while the nodes run: they find them.
		mark1, mark2 := m1.Len(), m2.Len()
		installIstioCRDs(t, cp)
		for i, m := range []*noderun.Process{m1, m2} {
			mark := []int{mark1, mark2}[i]
			ictx, cancel := context.WithTimeout(ctx, 40*time.Second)
			_, err := m.WaitLogSince(ictx, mark, func(l noderun.Line) bool { return strings.HasPrefix(l.Str("message"), "Istio's policy CRDs appeared") })
			cancel()
			if err != nil {
				t.Fatalf("%s did not find Istio's CRDs: %v", m.Node.Name(), err)
			}
		}
		dyn := dynamic.NewForConfigOrDie(cp.AdminConfig)
		dst := netip.AddrPortFrom(p21.IPv4, 8080)
		open, err := p11.Dial(ctx, "tcp", dst.String())
		if err != nil {
			t.Fatal(err)
		}
		defer open.Close()
		if _, err := open.Write([]byte("x")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(open, make([]byte, 1)); err != nil {
			t.Fatal(err)
		}
		deny := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
			"metadata": map[string]any{"name": "deny-client", "namespace": "apps"},
			"spec": map[string]any{
				"selector": map[string]any{"matchLabels": map[string]any{"app": "server"}},
				"action":   "DENY",
				"rules": []any{map[string]any{"from": []any{map[string]any{"source": map[string]any{
					"principals": []any{"cluster.local/ns/apps/sa/client"}}}}}},
			},
		}}
		apr := dyn.Resource(schema.GroupVersionResource{Group: "security.istio.io", Version: "v1", Resource: "authorizationpolicies"}).Namespace("apps")
		if _, err := apr.Create(ctx, deny, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		// The open connection is reset when node 2 enforces the policy.
		open.SetDeadline(time.Now().Add(20 * time.Second))
		if _, err := io.ReadFull(open, make([]byte, 1)); err == nil || strings.Contains(err.Error(), "timeout") {
			t.Errorf("the open connection was not reset after the DENY policy: %v", err)
		}
		if src := roundTripMaybe(p11, dst); src.IsValid() {
			t.Errorf("a new connection from %s went through the DENY policy", src)
		}
		if err := apr.Delete(ctx, "deny-client", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(20 * time.Second)
		for !roundTripMaybe(p11, dst).IsValid() {
			if time.Now().After(deadline) {
				t.Fatal("connections still refused 20s after the DENY policy was deleted")
			}
			time.Sleep(100 * time.Millisecond)
		}

		// PeerAuthentication STRICT for the namespace: plaintext from the
		// opted-out pod is refused; mesh traffic still flows.
		strict := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "security.istio.io/v1", "kind": "PeerAuthentication",
			"metadata": map[string]any{"name": "strict", "namespace": "apps"},
			"spec":     map[string]any{"mtls": map[string]any{"mode": "STRICT"}},
		}}
		par := dyn.Resource(schema.GroupVersionResource{Group: "security.istio.io", Version: "v1", Resource: "peerauthentications"}).Namespace("apps")
		if _, err := par.Create(ctx, strict, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		deadline = time.Now().Add(20 * time.Second)
		for roundTripMaybe(p12, dst).IsValid() {
			if time.Now().After(deadline) {
				t.Fatal("plaintext from the opted-out pod still reaches a STRICT pod 20s after the PeerAuthentication")
			}
			time.Sleep(100 * time.Millisecond)
		}
		roundTrip(t, p11, dst)
		if err := par.Delete(ctx, "strict", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		deadline = time.Now().Add(20 * time.Second)
		for !roundTripMaybe(p12, dst).IsValid() {
			if time.Now().After(deadline) {
				t.Fatal("plaintext still refused 20s after the PeerAuthentication was deleted")
			}
			time.Sleep(100 * time.Millisecond)
		}
	})

	t.Run("API server stopped for 30s", func(t *testing.T) {
		checkUntil = [2]int{m1.Len(), m2.Len()}
		cp.StopAPIServer()
		stopped := time.Now()
		for time.Since(stopped) < 30*time.Second {
			src := roundTrip(t, p11, netip.AddrPortFrom(p21.IPv4, 8080))
			waitLog(t, m1, 0, "connection while the API server is down", accessLine(src))
			time.Sleep(5 * time.Second)
		}
		sctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		if err := cp.StartAPIServer(sctx); err != nil {
			t.Fatal(err)
		}
		// The informers watch again: a change made now reaches the node.
		mark := m1.Len()
		ns, err := cp.Admin.CoreV1().Namespaces().Get(ctx, "live", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		ns.Labels["istio.io/dataplane-mode"] = "ambient"
		if _, err := cp.Admin.CoreV1().Namespaces().Update(ctx, ns, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		ictx, cancel2 := context.WithTimeout(ctx, 90*time.Second)
		defer cancel2()
		if _, err := m1.WaitLogSince(ictx, mark, podLog("live/livec", "pod in the mesh")); err != nil {
			t.Fatalf("node 1 did not see a change made after the API server came back: %v", err)
		}
	})
}

// roundTripMaybe is roundTrip that returns the zero AddrPort on failure.
func roundTripMaybe(p *cluster.Pod, dst netip.AddrPort) netip.AddrPort {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	c, err := p.Dial(ctx, "tcp", dst.String())
	if err != nil {
		return netip.AddrPort{}
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	msg := []byte("hello")
	if _, err := c.Write(msg); err != nil {
		return netip.AddrPort{}
	}
	buf := make([]byte, len(msg))
	if _, err := io.ReadFull(c, buf); err != nil {
		return netip.AddrPort{}
	}
	a := c.LocalAddr().(*net.TCPAddr).AddrPort()
	return netip.AddrPortFrom(a.Addr().Unmap(), a.Port())
}

// ruleFor reports whether node n has a policy rule for prefix.
func ruleFor(t testing.TB, n *cluster.Node, prefix string) bool {
	t.Helper()
	rules, err := n.IPRules(2) // AF_INET
	if err != nil {
		t.Fatal(err)
	}
	for _, r := range rules {
		if strings.Contains(r, "to "+prefix) {
			return true
		}
	}
	return false
}

// waitRule waits until node n has (want) or has not (!want) a capture rule
// for prefix. The kernel's rules have no change notification the test
// can wait on; they are polled.
func waitRule(t testing.TB, n *cluster.Node, prefix string, want bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for ruleFor(t, n, prefix) != want {
		if time.Now().After(deadline) {
			t.Fatalf("%s: capture rule for %s present = %v after 10s, want %v", n.Name(), prefix, !want, want)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// installIstioCRDs creates the two Istio security CRDs the node reads, with
// a schema that keeps any field (Istio's own CRDs validate more).
func installIstioCRDs(t testing.TB, cp *ControlPlane) {
	t.Helper()
	dyn := dynamic.NewForConfigOrDie(cp.AdminConfig)
	crds := dyn.Resource(schema.GroupVersionResource{Group: "apiextensions.k8s.io", Version: "v1", Resource: "customresourcedefinitions"})
	for _, kind := range []string{"AuthorizationPolicy", "PeerAuthentication"} {
		plural := strings.ToLower(kind) + "s"
		if kind == "AuthorizationPolicy" {
			plural = "authorizationpolicies"
		}
		crd := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
			"metadata": map[string]any{"name": plural + ".security.istio.io"},
			"spec": map[string]any{
				"group": "security.istio.io", "scope": "Namespaced",
				"names": map[string]any{"kind": kind, "plural": plural, "singular": strings.ToLower(kind), "listKind": kind + "List"},
				"versions": []any{map[string]any{"name": "v1", "served": true, "storage": true,
					"schema": map[string]any{"openAPIV3Schema": map[string]any{
						"type": "object", "x-kubernetes-preserve-unknown-fields": true}}}},
			},
		}}
		if _, err := crds.Create(context.Background(), crd, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
}

// getJSON fetches url from inside node n and decodes its JSON body.
func getJSON(t testing.TB, n *cluster.Node, url string, v any) {
	t.Helper()
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: n.Dial}}
	resp, err := hc.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if err := json.NewDecoder(resp.Body).Decode(v); err != nil {
		t.Fatalf("%s: %v", url, err)
	}
}
