package kind_test

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshtun/meshtun/test/kind"
)

// cl is the cluster every test runs on: made by TestMain (and deleted
// after), or an existing one named by MESHTUN_KIND_CLUSTER (made with
// `make kind-up`; left as it is).
var cl *kind.Cluster

func logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, time.Now().Format("15:04:05 ")+format+"\n", args...)
}

func randHex(n int) string {
	b := make([]byte, n)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func TestMain(m *testing.M) { os.Exit(run(m)) }

func run(m *testing.M) int {
	ctx, cancel := context.WithTimeout(context.Background(), 55*time.Minute)
	defer cancel()
	if name := os.Getenv("MESHTUN_KIND_CLUSTER"); name != "" {
		cache, err := kind.CacheDir()
		if err != nil {
			logf("FAIL: %v", err)
			return 1
		}
		if cl, err = kind.Attach(ctx, logf, name, filepath.Join(cache, "clusters", name)); err != nil {
			logf("FAIL: attach to %s: %v", name, err)
			return 1
		}
		return runTests(m)
	}
	// A name of this run's own: a user's cluster (`meshtun`, make kind-up)
	// and concurrent runs are never touched.
	name := "meshtun-e2e-" + randHex(3)
	dir, err := os.MkdirTemp("", "meshtun-kind-")
	if os.Getenv("MESHTUN_KIND_KEEP") == "1" {
		// A kept cluster's files (kubeconfig, podman's containers.conf) go
		// where kindctl looks for them: `make kind-down KIND_NAME=...` and
		// MESHTUN_KIND_CLUSTER=... find it later.
		var cache string
		if cache, err = kind.CacheDir(); err == nil {
			dir = filepath.Join(cache, "clusters", name)
			err = os.MkdirAll(dir, 0o755)
		}
	}
	if err != nil {
		logf("FAIL: %v", err)
		return 1
	}
	release, err := kind.ClusterSlot(ctx, logf)
	if err != nil {
		logf("FAIL: %v", err)
		return 1
	}
	defer release() // after the cluster's deletion below
	start := time.Now()
	c, err := kind.Up(ctx, logf, name, dir)
	defer func() {
		if c == nil {
			return
		}
		if os.Getenv("MESHTUN_KIND_KEEP") == "1" {
			logf("keeping cluster %s (kubeconfig %s; remove it with make kind-down KIND_NAME=%s)", c.Name, c.Kubeconfig, c.Name)
			return
		}
		if err := c.Delete(context.Background()); err != nil {
			logf("%v", err)
		}
		os.RemoveAll(dir)
	}()
	if err != nil {
		logf("FAIL: bring up the kind cluster: %v", err)
		if c != nil {
			diagnose(c)
		}
		return 1
	}
	logf("cluster %s up with meshtun in %s", name, time.Since(start).Round(time.Second))
	cl = c
	return runTests(m)
}

// runTests runs the tests and removes their namespaces (from a cluster
// that stays, MESHTUN_KIND_CLUSTER).
func runTests(m *testing.M) int {
	code := m.Run()
	if os.Getenv("MESHTUN_KIND_KEEP") != "1" {
		for _, ns := range sharedNamespaces {
			cl.Kubectl(context.Background(), "delete", "namespace", ns, "--wait=false")
		}
	}
	return code
}

// diagnose prints what explains a cluster that did not come up.
func diagnose(c *kind.Cluster) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, args := range [][]string{
		{"get", "nodes", "-o", "wide"},
		{"get", "pods", "-A", "-o", "wide"},
		{"-n", "meshtun-system", "logs", "ds/meshtun", "--tail=40"},
		{"-n", "meshtun-system", "describe", "pods"},
	} {
		out, err := c.Kubectl(ctx, args...)
		logf("kubectl %s:\n%s%v", strings.Join(args, " "), out, err)
	}
}

// TestDaemonSetOnEveryNode: the shipped DaemonSet is ready on each of the
// three nodes and each has the TUN.
func TestDaemonSetOnEveryNode(t *testing.T) {
	ctx := context.Background()
	nodes, err := cl.Nodes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(nodes) != 3 {
		t.Fatalf("%d nodes, want 3 (one control plane, two workers)", len(nodes))
	}
	out, err := cl.Kubectl(ctx, "-n", "meshtun-system", "get", "ds/meshtun", "-o", "json")
	if err != nil {
		t.Fatal(err)
	}
	var ds struct {
		Status struct{ DesiredNumberScheduled, NumberReady int }
	}
	if err := json.Unmarshal(out, &ds); err != nil {
		t.Fatal(err)
	}
	if ds.Status.DesiredNumberScheduled != 3 || ds.Status.NumberReady != 3 {
		t.Fatalf("DaemonSet meshtun: %d of %d ready, want 3 of 3", ds.Status.NumberReady, ds.Status.DesiredNumberScheduled)
	}
	for _, n := range nodes {
		if _, err := cl.Podman(ctx, "exec", n.Name, "ip", "link", "show", "meshtun0"); err != nil {
			t.Errorf("node %s has no meshtun0: %v", n.Name, err)
		}
		if len(n.IPs) < 2 || len(n.PodCIDRs) < 2 {
			t.Errorf("node %s: addresses %v, pod CIDRs %v, want both families (dual stack)", n.Name, n.IPs, n.PodCIDRs)
		}
	}
	// The CA prefers the control plane (deploy/kubernetes/ca.yaml): a
	// rebooting worker must not take certificates away from the cluster.
	out, err = cl.Kubectl(ctx, "-n", "meshtun-system", "get", "pods", "-l", "app.kubernetes.io/name=meshtun-ca",
		"-o", "jsonpath={.items[*].spec.nodeName}")
	if err != nil {
		t.Fatal(err)
	}
	if got, want := strings.TrimSpace(string(out)), cl.Name+"-control-plane"; got != want {
		t.Errorf("meshtun-ca runs on %q, want the control-plane node %q", got, want)
	}
}

// workloads is a namespace with an echo server on the first worker, a
// client next to it and one on the second worker, and a dual-stack
// Service in front of the server.
type workloads struct {
	ns                  string
	server, near, far   pod
	svcV4, svcV6        netip.Addr
	serverNode, farNode string
}

type pod struct {
	name string
	ips  []netip.Addr
}

func (p pod) ip(v6 bool) netip.Addr {
	for _, a := range p.ips {
		if a.Is6() == v6 {
			return a
		}
	}
	return netip.Addr{}
}

const workloadsYAML = `apiVersion: v1
kind: Namespace
metadata:
  name: {{NS}}
  labels: {{LABELS}}
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
  terminationGracePeriodSeconds: 1
  containers:
    - name: probe
      image: meshtun-probe:dev
      imagePullPolicy: Never
      args: [serve]
---
apiVersion: v1
kind: Pod
metadata: {name: near, namespace: {{NS}}}
spec:
  serviceAccountName: client
  nodeSelector: {kubernetes.io/hostname: {{W1}}}
  terminationGracePeriodSeconds: 1
  containers:
    - {name: probe, image: meshtun-probe:dev, imagePullPolicy: Never, args: [sleep]}
---
apiVersion: v1
kind: Pod
metadata: {name: far, namespace: {{NS}}}
spec:
  serviceAccountName: client
  nodeSelector: {kubernetes.io/hostname: {{W2}}}
  terminationGracePeriodSeconds: 1
  containers:
    - {name: probe, image: meshtun-probe:dev, imagePullPolicy: Never, args: [sleep]}
---
apiVersion: v1
kind: Service
metadata: {name: echo, namespace: {{NS}}}
spec:
  selector: {app: server}
  ipFamilyPolicy: RequireDualStack
  ipFamilies: [IPv4, IPv6]
  ports:
    - {name: tcp-echo, port: 8080, targetPort: 8080}
`

// deployWorkloads creates the namespace (in the mesh if mesh) and waits
// until its pods are ready; run deletes the namespaces at the end.
func deployWorkloads(prefix string, mesh bool) (*workloads, error) {
	ctx := context.Background()
	w := &workloads{ns: prefix + "-" + randHex(3), serverNode: cl.Name + "-worker", farNode: cl.Name + "-worker2"}
	labels := "{}"
	if mesh {
		labels = "{istio.io/dataplane-mode: ambient}"
	}
	y := strings.NewReplacer("{{NS}}", w.ns, "{{LABELS}}", labels, "{{W1}}", w.serverNode, "{{W2}}", w.farNode).Replace(workloadsYAML)
	sharedNamespaces = append(sharedNamespaces, w.ns)
	if _, err := cl.KubectlIn(ctx, y, "apply", "-f", "-"); err != nil {
		return nil, err
	}
	if _, err := cl.Kubectl(ctx, "-n", w.ns, "wait", "--for=condition=Ready", "pod", "--all", "--timeout=5m"); err != nil {
		return nil, err
	}
	for _, p := range []*pod{&w.server, &w.near, &w.far} {
		p.name = map[*pod]string{&w.server: "server", &w.near: "near", &w.far: "far"}[p]
		out, err := cl.Kubectl(ctx, "-n", w.ns, "get", "pod", p.name, "-o", "jsonpath={.status.podIPs[*].ip}")
		if err != nil {
			return nil, err
		}
		for _, s := range strings.Fields(string(out)) {
			a, err := netip.ParseAddr(s)
			if err != nil {
				return nil, fmt.Errorf("pod %s/%s IP %q: %v", w.ns, p.name, s, err)
			}
			p.ips = append(p.ips, a)
		}
		if !p.ip(false).IsValid() || !p.ip(true).IsValid() {
			return nil, fmt.Errorf("pod %s/%s has IPs %v, want both families", w.ns, p.name, p.ips)
		}
	}
	out, err := cl.Kubectl(ctx, "-n", w.ns, "get", "svc", "echo", "-o", "jsonpath={.spec.clusterIPs[*]}")
	if err != nil {
		return nil, err
	}
	for _, s := range strings.Fields(string(out)) {
		a, err := netip.ParseAddr(s)
		if err != nil {
			return nil, fmt.Errorf("service %s/echo cluster IP %q: %v", w.ns, s, err)
		}
		if a.Is6() {
			w.svcV6 = a
		} else {
			w.svcV4 = a
		}
	}
	if !w.svcV4.IsValid() || !w.svcV6.IsValid() {
		return nil, fmt.Errorf("service %s/echo has cluster IPs %q, want both families", w.ns, out)
	}
	return w, nil
}

// send runs the probe client in pod from: it sends msg to to, half-closes
// and checks the echo.
func send(ctx context.Context, ns, from string, to netip.AddrPort, msg string) error {
	_, err := cl.Kubectl(ctx, "-n", ns, "exec", from, "--", "/probe", "send", "-to", to.String(), "-msg", msg, "-timeout", "10s")
	return err
}

// accessRecord is the part of a node's access-log line the tests read.
type accessRecord struct {
	Log         string `json:"log"`
	SrcAddr     string `json:"src.addr"`
	DstAddr     string `json:"dst.addr"`
	SrcIdentity string `json:"src.identity"`
	DstIdentity string `json:"dst.identity"`
	Direction   string `json:"direction"`
	BytesSent   int64  `json:"bytes_sent"`
	BytesRecv   int64  `json:"bytes_recv"`
}

// accessLog returns the access records of the meshtun pod on node.
func accessLog(ctx context.Context, node string) ([]accessRecord, error) {
	out, err := cl.Kubectl(ctx, "-n", "meshtun-system", "get", "pods", "-l", "app.kubernetes.io/name=meshtun",
		"--field-selector", "spec.nodeName="+node, "-o", "jsonpath={.items[*].metadata.name}")
	if err != nil {
		return nil, err
	}
	var recs []accessRecord
	for _, p := range strings.Fields(string(out)) {
		logs, err := cl.Kubectl(ctx, "-n", "meshtun-system", "logs", p)
		if err != nil {
			return nil, err
		}
		sc := bufio.NewScanner(bytes.NewReader(logs))
		sc.Buffer(make([]byte, 1<<20), 1<<20)
		for sc.Scan() {
			var r accessRecord
			if json.Unmarshal(sc.Bytes(), &r) == nil && r.Log == "access" {
				recs = append(recs, r)
			}
		}
	}
	return recs, nil
}

// waitAccess waits until node's access log has a record from src with
// both identities, or fails.
func waitAccess(t *testing.T, node string, src netip.Addr, srcID, dstID string) accessRecord {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(time.Minute)
	var last []accessRecord
	for time.Now().Before(deadline) {
		recs, err := accessLog(ctx, node)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range recs {
			ap, err := netip.ParseAddrPort(r.SrcAddr)
			if err == nil && ap.Addr().Unmap() == src && r.SrcIdentity == srcID && r.DstIdentity == dstID {
				return r
			}
		}
		last = recs
		time.Sleep(500 * time.Millisecond) // the log is read again: no push signal from kubectl logs
	}
	t.Fatalf("node %s: no access record from %s with src.identity %s and dst.identity %s; %d records, last: %+v",
		node, src, srcID, dstID, len(last), lastN(last, 5))
	return accessRecord{}
}

func lastN(r []accessRecord, n int) []accessRecord {
	if len(r) > n {
		return r[len(r)-n:]
	}
	return r
}

// TestMesh: TCP between the mesh namespace's pods, across nodes and on one
// node, to the pod and through the Service VIP (kube-proxy's iptables
// DNAT), both families, arrives, is logged with both SPIFFE identities on
// the server's node, and never crosses the kind network in plaintext;
// the same exchange between two pods outside the mesh is seen in
// plaintext by the same capture (so the capture does see that path).
func TestMesh(t *testing.T) {
	ctx := context.Background()
	mesh, plain := meshWorkloads(t)
	td := "spiffe://cluster.local/ns/" + mesh.ns + "/sa/"
	clientID, serverID := td+"client", td+"server"

	run := randHex(4)
	type tc struct {
		name   string
		ns     string
		client pod
		to     netip.AddrPort
		marker string
	}
	var cases []tc
	for _, c := range []pod{mesh.near, mesh.far} {
		for _, v6 := range []bool{false, true} {
			fam := map[bool]string{false: "v4", true: "v6"}[v6]
			svc := mesh.svcV4
			if v6 {
				svc = mesh.svcV6
			}
			cases = append(cases,
				tc{c.name + "/pod-" + fam, mesh.ns, c, netip.AddrPortFrom(mesh.server.ip(v6), 8080), ""},
				tc{c.name + "/service-" + fam, mesh.ns, c, netip.AddrPortFrom(svc, 8080), ""})
		}
	}
	for i := range cases {
		cases[i].marker = "MESHTUN-MARKER-" + run + "-" + strings.NewReplacer("/", "-").Replace(cases[i].name)
	}
	plainMarker := "MESHTUN-MARKER-" + run + "-plain-far"
	markers := []string{plainMarker}
	for _, c := range cases {
		markers = append(markers, c.marker)
	}
	capture, err := kind.StartCapture(cl.Bridge, markers...)
	if err != nil {
		t.Fatal(err)
	}
	defer capture.Stop()

	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if err := send(ctx, c.ns, c.client.name, c.to, c.marker); err != nil {
				t.Fatal(err)
			}
			waitAccess(t, mesh.serverNode, c.client.ip(c.to.Addr().Is6()), clientID, serverID)
		})
	}
	// The control: the same bytes between two pods outside the mesh, across
	// the nodes, are on the wire.
	if err := send(ctx, plain.ns, "far", netip.AddrPortFrom(plain.server.ip(false), 8080), plainMarker); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for capture.Seen(plainMarker) == 0 && time.Now().Before(deadline) {
		time.Sleep(100 * time.Millisecond)
	}
	frames, nbytes := capture.Stats()
	if capture.Seen(plainMarker) == 0 {
		t.Fatalf("capture on %s (%d frames, %d bytes) never saw the plaintext marker between two pods outside the mesh: it does not see the path between the nodes", cl.Bridge, frames, nbytes)
	}
	for _, c := range cases {
		if n := capture.Seen(c.marker); n > 0 {
			t.Errorf("%s: marker %q crossed the kind network in plaintext (%d frames)", c.name, c.marker, n)
		}
	}
	t.Logf("capture on %s: %d frames, %d bytes; plaintext control marker seen in %d frames", cl.Bridge, frames, nbytes, capture.Seen(plainMarker))
}

var (
	sharedOnce       sync.Once
	sharedMesh       *workloads
	sharedPlain      *workloads
	sharedErr        error
	sharedNamespaces []string
)

// meshWorkloads deploys, once for all tests, the workloads of an ambient
// namespace and of one outside the mesh, and waits until both mesh clients
// are captured.
func meshWorkloads(t *testing.T) (mesh, plain *workloads) {
	sharedOnce.Do(func() {
		sharedMesh, sharedErr = deployWorkloads("mesh", true)
		if sharedErr == nil {
			sharedPlain, sharedErr = deployWorkloads("plain", false)
		}
		if sharedErr == nil {
			sharedErr = waitCaptured(sharedMesh)
		}
	})
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	return sharedMesh, sharedPlain
}

// waitCaptured waits until a first exchange of each client of w was proxied
// (its access record with the client's identity is on the server's node):
// the node captures a pod after it is Running (an API watch; issue 21 §3),
// and the tests' captures must start after that.
func waitCaptured(w *workloads) error {
	ctx := context.Background()
	clientID := "spiffe://cluster.local/ns/" + w.ns + "/sa/client"
	for _, c := range []pod{w.near, w.far} {
		deadline := time.Now().Add(2 * time.Minute)
		for {
			err := send(ctx, w.ns, c.name, netip.AddrPortFrom(w.server.ip(false), 8080), "warm-up")
			if err == nil {
				recs, lerr := accessLog(ctx, w.serverNode)
				if lerr != nil {
					return lerr
				}
				if hasFrom(recs, c.ip(false), clientID) {
					break
				}
			}
			if time.Now().After(deadline) {
				return fmt.Errorf("client %s/%s: no proxied exchange with the server within 2 minutes (last error %v)", w.ns, c.name, err)
			}
			time.Sleep(time.Second) // retry: the capture follows an API watch
		}
	}
	return nil
}

func hasFrom(recs []accessRecord, src netip.Addr, srcID string) bool {
	for _, r := range recs {
		ap, err := netip.ParseAddrPort(r.SrcAddr)
		if err == nil && ap.Addr().Unmap() == src && r.SrcIdentity == srcID {
			return true
		}
	}
	return false
}

// loopResult is probe loop's summary.
type loopResult struct {
	OK        int    `json:"ok"`
	Fail      int    `json:"fail"`
	MaxGapMs  int64  `json:"maxGapMs"`
	LastError string `json:"lastError"`
}

// startLoop runs `probe loop` in pod from of ns for d in the background.
func startLoop(ns, from string, to netip.AddrPort, msg string, d time.Duration) <-chan struct {
	r   loopResult
	err error
} {
	ch := make(chan struct {
		r   loopResult
		err error
	}, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), d+2*time.Minute)
		defer cancel()
		out, err := cl.Kubectl(ctx, "-n", ns, "exec", from, "--", "/probe", "loop", "-to", to.String(), "-msg", msg, "-for", d.String())
		var r loopResult
		if err == nil {
			err = json.Unmarshal(bytes.TrimSpace(out), &r)
		}
		ch <- struct {
			r   loopResult
			err error
		}{r, err}
	}()
	return ch
}

// nodeProxyPod is the name of the meshtun pod on node, and its restarts.
func nodeProxyPod(ctx context.Context, node string) (string, int, error) {
	out, err := cl.Kubectl(ctx, "-n", "meshtun-system", "get", "pods", "-l", "app.kubernetes.io/name=meshtun",
		"--field-selector", "spec.nodeName="+node, "-o", "jsonpath={.items[0].metadata.name} {.items[0].status.containerStatuses[0].restartCount}")
	if err != nil {
		return "", 0, err
	}
	var name string
	var restarts int
	if _, err := fmt.Sscan(string(out), &name, &restarts); err != nil {
		return "", 0, fmt.Errorf("meshtun pod on %s: %q: %v", node, out, err)
	}
	return name, restarts, nil
}

// nodeProxyPID is the process ID, inside node, of its one meshtun node
// process.
func nodeProxyPID(t testing.TB, node string) string {
	t.Helper()
	out, err := cl.Podman(context.Background(), "exec", node, "pgrep", "-f", " node --kubernetes")
	if err != nil {
		t.Fatal(err)
	}
	pids := strings.Fields(string(out))
	if len(pids) != 1 {
		t.Fatalf("node %s: pgrep found %q, want one meshtun node process", node, out)
	}
	return pids[0]
}

// TestNodeProxyKilled: the far client's node proxy is killed with SIGKILL
// (as the OOM killer would) while the client exchanges a marker with the
// server every 100 ms: nothing crosses in plaintext while it is gone, the
// kubelet restarts it and exchanges work again.
func TestNodeProxyKilled(t *testing.T) {
	ctx := context.Background()
	mesh, _ := meshWorkloads(t)
	marker := "MESHTUN-MARKER-" + randHex(4) + "-killed"
	capture, err := kind.StartCapture(cl.Bridge, marker)
	if err != nil {
		t.Fatal(err)
	}
	defer capture.Stop()
	_, restarts, err := nodeProxyPod(ctx, mesh.farNode)
	if err != nil {
		t.Fatal(err)
	}
	before, err := countFrom(ctx, mesh.serverNode, mesh.far.ip(false))
	if err != nil {
		t.Fatal(err)
	}
	loop := startLoop(mesh.ns, "far", netip.AddrPortFrom(mesh.server.ip(false), 8080), marker, 45*time.Second)
	// The kill comes once the loop is exchanging: two more access records
	// from the client on the server's node.
	for deadline := time.Now().Add(time.Minute); ; {
		n, err := countFrom(ctx, mesh.serverNode, mesh.far.ip(false))
		if err != nil {
			t.Fatal(err)
		}
		if n >= before+2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the probe loop made no exchange within a minute (%d access records from the client, %d before)", n, before)
		}
		time.Sleep(300 * time.Millisecond) // the log is read again
	}
	pid := nodeProxyPID(t, mesh.farNode)
	killed := time.Now()
	if _, err := cl.Podman(ctx, "exec", mesh.farNode, "kill", "-9", pid); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Kubectl(ctx, "-n", "meshtun-system", "rollout", "status", "ds/meshtun", "--timeout=5m"); err != nil {
		t.Fatal(err)
	}
	res := <-loop
	if res.err != nil {
		t.Fatalf("probe loop: %v", res.err)
	}
	_, after, err := nodeProxyPod(ctx, mesh.farNode)
	if err != nil {
		t.Fatal(err)
	}
	if after <= restarts {
		t.Fatalf("meshtun on %s: restart count %d after SIGKILL, was %d: the kill did not happen", mesh.farNode, after, restarts)
	}
	if n := capture.Seen(marker); n > 0 {
		t.Errorf("marker crossed the kind network in plaintext in %d frames while the node proxy was down", n)
	}
	if err := send(ctx, mesh.ns, "far", netip.AddrPortFrom(mesh.server.ip(false), 8080), "after-kill"); err != nil {
		t.Fatalf("after the restart: %v", err)
	}
	t.Logf("SIGKILL at %s: loop %d ok, %d failed, longest gap %d ms (last error %q)", killed.Format("15:04:05.000"), res.r.OK, res.r.Fail, res.r.MaxGapMs, res.r.LastError)
}

// TestRolloutRestart: `kubectl rollout restart ds/meshtun` while a client
// exchanges a marker every 100 ms across nodes: no plaintext on the wire,
// exchanges work again after, the longest gap is reported.
func TestRolloutRestart(t *testing.T) {
	ctx := context.Background()
	mesh, _ := meshWorkloads(t)
	marker := "MESHTUN-MARKER-" + randHex(4) + "-rollout"
	capture, err := kind.StartCapture(cl.Bridge, marker)
	if err != nil {
		t.Fatal(err)
	}
	defer capture.Stop()
	loop := startLoop(mesh.ns, "far", netip.AddrPortFrom(mesh.server.ip(false), 8080), marker, 2*time.Minute)
	start := time.Now()
	if _, err := cl.Kubectl(ctx, "-n", "meshtun-system", "rollout", "restart", "ds/meshtun"); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Kubectl(ctx, "-n", "meshtun-system", "rollout", "status", "ds/meshtun", "--timeout=10m"); err != nil {
		t.Fatal(err)
	}
	rolled := time.Since(start)
	res := <-loop
	if res.err != nil {
		t.Fatalf("probe loop: %v", res.err)
	}
	if n := capture.Seen(marker); n > 0 {
		t.Errorf("marker crossed the kind network in plaintext in %d frames during the rollout", n)
	}
	if res.r.OK == 0 {
		t.Fatalf("no exchange succeeded during or after the rollout: %+v", res.r)
	}
	if err := send(ctx, mesh.ns, "far", netip.AddrPortFrom(mesh.server.ip(false), 8080), "after-rollout"); err != nil {
		t.Fatalf("after the rollout: %v", err)
	}
	t.Logf("rollout of 3 nodes took %s; loop %d ok, %d failed, longest gap %d ms (last error %q)", rolled.Round(time.Second), res.r.OK, res.r.Fail, res.r.MaxGapMs, res.r.LastError)
}

// countFrom is the number of access records on node from src.
func countFrom(ctx context.Context, node string, src netip.Addr) (int, error) {
	recs, err := accessLog(ctx, node)
	if err != nil {
		return 0, err
	}
	n := 0
	for _, r := range recs {
		if ap, err := netip.ParseAddrPort(r.SrcAddr); err == nil && ap.Addr().Unmap() == src {
			n++
		}
	}
	return n, nil
}

const istioCRDs = `apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: peerauthentications.security.istio.io}
spec:
  group: security.istio.io
  scope: Namespaced
  names: {kind: PeerAuthentication, plural: peerauthentications, singular: peerauthentication, listKind: PeerAuthenticationList}
  versions:
    - name: v1
      served: true
      storage: true
      schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
---
apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: authorizationpolicies.security.istio.io}
spec:
  group: security.istio.io
  scope: Namespaced
  names: {kind: AuthorizationPolicy, plural: authorizationpolicies, singular: authorizationpolicy, listKind: AuthorizationPolicyList}
  versions:
    - name: v1
      served: true
      storage: true
      schema: {openAPIV3Schema: {type: object, x-kubernetes-preserve-unknown-fields: true}}
`

const strictYAML = `apiVersion: v1
kind: Namespace
metadata:
  name: {{NS}}
  labels: {istio.io/dataplane-mode: ambient}
---
apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: {{NS}}}
spec:
  mtls: {mode: STRICT}
---
apiVersion: v1
kind: Pod
metadata: {name: strict, namespace: {{NS}}, labels: {app: strict}}
spec:
  nodeSelector: {kubernetes.io/hostname: {{W1}}}
  terminationGracePeriodSeconds: 1
  containers:
    - name: probe
      image: meshtun-probe:dev
      imagePullPolicy: Never
      args: [serve]
      readinessProbe:
        httpGet: {path: /, port: 8081}
        periodSeconds: 1
        failureThreshold: 2
      livenessProbe:
        tcpSocket: {port: 8080}
        periodSeconds: 1
        failureThreshold: 2
`

// TestStrictPodProbes: under PeerAuthentication STRICT, a pod outside the
// mesh is refused in plaintext, a mesh client gets through, and the
// kubelet's HTTP readiness and TCP liveness probes (plaintext from the
// node) keep passing: the pod stays Ready and is never restarted.
//
// It failed on kind until the TUN's route got scope global: kube-proxy
// sets net.ipv4.conf.all.route_localnet=1, with which the kernel chose
// the TUN's scope-host address 127.109.116.1 as the source of the node's
// connections to a captured pod, and the pod answered on its own loopback.
func TestStrictPodProbes(t *testing.T) {
	ctx := context.Background()
	mesh, plain := meshWorkloads(t)
	if _, err := cl.KubectlIn(ctx, istioCRDs, "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Kubectl(ctx, "wait", "--for=condition=Established", "crd/peerauthentications.security.istio.io", "--timeout=2m"); err != nil {
		t.Fatal(err)
	}
	ns := "strict-" + randHex(3)
	sharedNamespaces = append(sharedNamespaces, ns)
	y := strings.NewReplacer("{{NS}}", ns, "{{W1}}", mesh.serverNode).Replace(strictYAML)
	if _, err := cl.KubectlIn(ctx, y, "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Kubectl(ctx, "-n", ns, "wait", "--for=condition=Ready", "pod/strict", "--timeout=5m"); err != nil {
		t.Fatal(err)
	}
	out, err := cl.Kubectl(ctx, "-n", ns, "get", "pod", "strict", "-o", "jsonpath={.status.podIP}")
	if err != nil {
		t.Fatal(err)
	}
	ip, err := netip.ParseAddr(strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatalf("pod %s/strict IP %q: %v", ns, out, err)
	}
	to := netip.AddrPortFrom(ip, 8080)
	// The node reads PeerAuthentication once its CRD is there (it looks
	// every 10 s): plaintext from outside the mesh is refused from then on.
	for deadline := time.Now().Add(90 * time.Second); ; {
		err := send(ctx, plain.ns, "far", to, "plaintext")
		if err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("plaintext from a pod outside the mesh still reaches the STRICT pod 90 s after the PeerAuthentication")
		}
		time.Sleep(time.Second) // the policy arrives through an API watch
	}
	if err := send(ctx, mesh.ns, "far", to, "mesh"); err != nil {
		t.Fatalf("mesh client to the STRICT pod: %v", err)
	}
	// The kubelet probes every second, two failures fail: 20 s of probes.
	watchUntil := time.Now().Add(20 * time.Second)
	for time.Now().Before(watchUntil) {
		out, err := cl.Kubectl(ctx, "-n", ns, "get", "pod", "strict", "-o",
			`jsonpath={.status.conditions[?(@.type=="Ready")].status} {.status.containerStatuses[0].restartCount}`)
		if err != nil {
			t.Fatal(err)
		}
		if got := strings.TrimSpace(string(out)); got != "True 0" {
			t.Fatalf("STRICT pod: Ready and restarts %q, want \"True 0\": the kubelet's probes failed", got)
		}
		time.Sleep(2 * time.Second) // sampling the pod's status
	}
	if err := send(ctx, plain.ns, "far", to, "plaintext-again"); err == nil {
		t.Fatal("plaintext from outside the mesh reached the STRICT pod")
	}
}
