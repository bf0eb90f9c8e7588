// Package istio_test runs Istio ambient on a kind cluster of its own with
// meshtun in place of ztunnel: istiod (pilot-discovery of the interop
// module's istio.io/istio, as an image written without a registry),
// Istio's CRDs, deploy/istio applied unchanged, and istioctl used as a
// user would (docs/istio.md, "On kind").
package istio_test

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
	"testing"
	"time"

	"github.com/meshtun/meshtun/test/kind"
)

var (
	cl *kind.Cluster
	// istioctl is built while the cluster comes up; the istioctl test
	// waits for it.
	istioctl = make(chan result, 1)
	// namespaces the tests made, removed at the end on a kept cluster.
	namespaces []string
)

type result struct {
	path string
	err  error
}

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
	go func() {
		p, err := kind.BuildIstioctl(ctx, logf)
		istioctl <- result{p, err}
	}()
	if name := os.Getenv("MESHTUN_KIND_CLUSTER"); name != "" {
		cache, err := kind.CacheDir()
		if err != nil {
			logf("FAIL: %v", err)
			return 1
		}
		dir := filepath.Join(cache, "clusters", name)
		if cl, err = kind.Attach(ctx, logf, name, dir); err != nil {
			logf("FAIL: attach to %s: %v", name, err)
			return 1
		}
		if os.Getenv("MESHTUN_KIND_ISTIO_INSTALL") == "1" {
			// A kept cluster whose bring-up stopped before Istio: load the
			// images its run wrote and install.
			if err := loadAndInstall(ctx, cl, dir); err != nil {
				logf("FAIL: install Istio on %s: %v", name, err)
				diagnose(cl)
				return 1
			}
		}
		return runTests(m)
	}
	name := "meshtun-istio-" + randHex(3)
	dir, err := os.MkdirTemp("", "meshtun-kind-istio-")
	keep := os.Getenv("MESHTUN_KIND_KEEP") == "1"
	if keep {
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
	start := time.Now()
	// istiod's binary and image while nothing else needs the disk.
	istiodTar := filepath.Join(dir, "istiod-image.tar")
	imgDone := make(chan error, 1)
	go func() {
		bin, err := kind.BuildIstiod(ctx, logf)
		if err == nil {
			err = kind.WriteIstiodImage(ctx, logf, bin, istiodTar)
		}
		imgDone <- err
	}()
	// The wait for the slot (the other suite's whole run, under go
	// test ./...) is bounded by go test's -timeout, not by the bring-up's
	// deadline, which starts once this suite has the slot.
	release, err := kind.ClusterSlot(context.Background(), logf)
	if err != nil {
		<-imgDone
		logf("FAIL: %v", err)
		return 1
	}
	defer release() // after the cluster's deletion below
	upCtx, upCancel := context.WithTimeout(context.Background(), 50*time.Minute)
	defer upCancel()
	c, err := kind.UpBare(upCtx, logf, name, dir)
	if ierr := <-imgDone; err == nil && ierr != nil {
		err = ierr
	}
	defer func() {
		if c == nil {
			return
		}
		if keep {
			logf("keeping cluster %s (kubeconfig %s; remove it with make kind-down KIND_NAME=%s)", c.Name, c.Kubeconfig, c.Name)
			return
		}
		if err := c.Delete(context.Background()); err != nil {
			logf("%v", err)
		}
		os.RemoveAll(dir)
	}()
	if err == nil {
		logf("cluster %s up in %s", name, time.Since(start).Round(time.Second))
		err = installIstio(upCtx, c, istiodTar)
	}
	if err != nil {
		logf("FAIL: bring up the kind cluster with istiod and meshtun: %v", err)
		if c != nil {
			diagnose(c)
		}
		return 1
	}
	logf("cluster %s up with istiod and meshtun in %s", name, time.Since(start).Round(time.Second))
	cl = c
	return runTests(m)
}

func runTests(m *testing.M) int {
	code := m.Run()
	if os.Getenv("MESHTUN_KIND_KEEP") != "1" {
		for _, ns := range namespaces {
			cl.Kubectl(context.Background(), "delete", "namespace", ns, "--wait=false")
		}
	}
	return code
}

// loadAndInstall loads meshtun:dev (make image's archive), the probe
// image and istiod's image from a kept run's dir, and installs Istio.
func loadAndInstall(ctx context.Context, c *kind.Cluster, dir string) error {
	repo, err := kind.RepoDir()
	if err != nil {
		return err
	}
	for _, a := range []string{filepath.Join(repo, "bin/meshtun-image.tar"), filepath.Join(dir, "probe-image.tar")} {
		if err := c.LoadImage(ctx, a); err != nil {
			return err
		}
	}
	return installIstio(ctx, c, filepath.Join(dir, "istiod-image.tar"))
}

// installIstio loads istiod's image, applies Istio's CRDs, istio-system,
// testdata's istiod and then deploy/istio unchanged, and waits until
// istiod is ready and meshtun's DaemonSet is ready on every node.
func installIstio(ctx context.Context, c *kind.Cluster, istiodTar string) error {
	start := time.Now()
	if err := c.LoadImage(ctx, istiodTar); err != nil {
		return err
	}
	crds, err := kind.IstioCRDs(ctx)
	if err != nil {
		return err
	}
	repo, err := kind.RepoDir()
	if err != nil {
		return err
	}
	for _, s := range [][]string{
		{"apply", "--server-side", "-f", crds},
		{"create", "namespace", "istio-system"},
		{"wait", "--for=condition=Established", "crd", "--all", "--timeout=2m"},
		{"apply", "-f", "istiod.yaml"},
		{"-n", "istio-system", "rollout", "status", "deploy/istiod", "--timeout=10m"},
	} {
		if _, err := c.Kubectl(ctx, s...); err != nil {
			return err
		}
	}
	logf("istiod ready: %s", time.Since(start).Round(time.Second))
	// deploy/istio mounts istiod's root certificate, which istiod writes
	// into every namespace once its CA is up.
	if err := waitFor(ctx, 2*time.Minute, "istio-ca-root-cert in istio-system", func() error {
		_, err := c.Kubectl(ctx, "-n", "istio-system", "get", "configmap", "istio-ca-root-cert")
		return err
	}); err != nil {
		return err
	}
	for _, s := range [][]string{
		{"apply", "-f", filepath.Join(repo, "deploy/istio") + "/"},
		{"-n", "istio-system", "rollout", "status", "ds/meshtun", "--timeout=10m"},
	} {
		if _, err := c.Kubectl(ctx, s...); err != nil {
			return err
		}
	}
	logf("istiod and meshtun ready on every node: %s", time.Since(start).Round(time.Second))
	return nil
}

// waitFor polls f every second (a kubectl read: no push signal) until it
// succeeds or d has passed.
func waitFor(ctx context.Context, d time.Duration, what string, f func() error) error {
	deadline := time.Now().Add(d)
	for {
		err := f()
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%s not there after %s: %w", what, d, err)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

func diagnose(c *kind.Cluster) {
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	for _, args := range [][]string{
		{"get", "pods", "-A", "-o", "wide"},
		{"-n", "istio-system", "logs", "deploy/istiod", "--tail=40"},
		{"-n", "istio-system", "logs", "ds/meshtun", "--tail=40"},
		{"-n", "istio-system", "describe", "pods"},
	} {
		out, err := c.Kubectl(ctx, args...)
		logf("kubectl %s:\n%s%v", strings.Join(args, " "), out, err)
	}
}

type pod struct {
	ns, name string
	ips      []netip.Addr
}

func (p pod) ip(v6 bool) netip.Addr {
	for _, a := range p.ips {
		if a.Is6() == v6 {
			return a
		}
	}
	return netip.Addr{}
}

func (p pod) id() string { return "spiffe://cluster.local/ns/" + p.ns + "/sa/" + p.name }

// podYAML is a probe pod named as its service account (so its SPIFFE id
// names it).
const podYAML = `apiVersion: v1
kind: ServiceAccount
metadata: {name: {{NAME}}, namespace: {{NS}}}
---
apiVersion: v1
kind: Pod
metadata: {name: {{NAME}}, namespace: {{NS}}, labels: {{LABELS}}}
spec:
  serviceAccountName: {{NAME}}
  nodeSelector: {kubernetes.io/hostname: {{NODE}}}
  terminationGracePeriodSeconds: 1
  containers:
    - name: probe
      image: meshtun-probe:dev
      imagePullPolicy: Never
      args: [{{ARGS}}]
{{PROBES}}`

const probesYAML = `      readinessProbe:
        httpGet: {path: /, port: 8081}
        periodSeconds: 1
        failureThreshold: 2
      livenessProbe:
        tcpSocket: {port: 8080}
        periodSeconds: 1
        failureThreshold: 2
`

// namespace creates a namespace (enrolled if ambient) for the test.
func namespace(t *testing.T, prefix string, ambient bool) string {
	t.Helper()
	ns := prefix + "-" + randHex(3)
	labels := ""
	if ambient {
		labels = "\n  labels: {istio.io/dataplane-mode: ambient}"
	}
	namespaces = append(namespaces, ns)
	if _, err := cl.KubectlIn(context.Background(), "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: "+ns+labels+"\n", "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	return ns
}

// newPod creates a probe pod on node (a server if serve, with the probes
// if probes) and waits until it is ready.
func newPod(t *testing.T, ns, name, node string, serve, probes bool, labels string) pod {
	t.Helper()
	ctx := context.Background()
	args, pr := "sleep", ""
	if serve {
		args = "serve"
	}
	if probes {
		pr = probesYAML
	}
	if labels == "" {
		labels = "{}"
	}
	y := strings.NewReplacer("{{NAME}}", name, "{{NS}}", ns, "{{NODE}}", node, "{{ARGS}}", args, "{{PROBES}}", pr, "{{LABELS}}", labels).Replace(podYAML)
	if _, err := cl.KubectlIn(ctx, y, "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Kubectl(ctx, "-n", ns, "wait", "--for=condition=Ready", "pod/"+name, "--timeout=5m"); err != nil {
		t.Fatal(err)
	}
	out, err := cl.Kubectl(ctx, "-n", ns, "get", "pod", name, "-o", "jsonpath={.status.podIPs[*].ip}")
	if err != nil {
		t.Fatal(err)
	}
	p := pod{ns: ns, name: name}
	for _, s := range strings.Fields(string(out)) {
		a, err := netip.ParseAddr(s)
		if err != nil {
			t.Fatalf("pod %s/%s IP %q: %v", ns, name, s, err)
		}
		p.ips = append(p.ips, a)
	}
	if !p.ip(false).IsValid() {
		t.Fatalf("pod %s/%s has IPs %v, want an IPv4 one", ns, name, p.ips)
	}
	return p
}

func worker(i int) string {
	if i == 1 {
		return cl.Name + "-worker"
	}
	return cl.Name + "-worker" + fmt.Sprint(i)
}

// send runs the probe client in from: it sends msg to to, half-closes and
// checks the echo.
func send(ctx context.Context, from pod, to netip.AddrPort, msg string) error {
	_, err := cl.Kubectl(ctx, "-n", from.ns, "exec", from.name, "--", "/probe", "send", "-to", to.String(), "-msg", msg, "-timeout", "10s")
	return err
}

// eventually retries send until it succeeds (istiod's push of a new pod
// or policy reaching the nodes has no signal a test can wait on).
func eventually(t *testing.T, from pod, to netip.AddrPort, msg string) {
	t.Helper()
	ctx := context.Background()
	if err := waitFor(ctx, 90*time.Second, fmt.Sprintf("exchange %s/%s -> %s", from.ns, from.name, to), func() error {
		return send(ctx, from, to, msg)
	}); err != nil {
		t.Fatal(err)
	}
}

type accessRecord struct {
	Log         string `json:"log"`
	SrcAddr     string `json:"src.addr"`
	DstAddr     string `json:"dst.addr"`
	SrcIdentity string `json:"src.identity"`
	DstIdentity string `json:"dst.identity"`
	Direction   string `json:"direction"`
}

// proxyPod is the meshtun pod on node.
func proxyPod(ctx context.Context, node string) (string, error) {
	out, err := cl.Kubectl(ctx, "-n", "istio-system", "get", "pods", "-l", "app.kubernetes.io/name=meshtun",
		"--field-selector", "spec.nodeName="+node, "-o", "jsonpath={.items[*].metadata.name}")
	if err != nil {
		return "", err
	}
	f := strings.Fields(string(out))
	if len(f) != 1 {
		return "", fmt.Errorf("meshtun pods on %s: %q, want one", node, out)
	}
	return f[0], nil
}

func accessLog(ctx context.Context, node string) ([]accessRecord, error) {
	p, err := proxyPod(ctx, node)
	if err != nil {
		return nil, err
	}
	logs, err := cl.Kubectl(ctx, "-n", "istio-system", "logs", p)
	if err != nil {
		return nil, err
	}
	var recs []accessRecord
	sc := bufio.NewScanner(bytes.NewReader(logs))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		var r accessRecord
		if json.Unmarshal(sc.Bytes(), &r) == nil && r.Log == "access" {
			recs = append(recs, r)
		}
	}
	return recs, nil
}

// waitAccess waits until node's access log has an inbound record from src
// with both identities.
func waitAccess(t *testing.T, node string, src netip.Addr, srcID, dstID string) {
	t.Helper()
	ctx := context.Background()
	var last []accessRecord
	err := waitFor(ctx, time.Minute, "access record", func() error {
		recs, err := accessLog(ctx, node)
		if err != nil {
			return err
		}
		for _, r := range recs {
			ap, err := netip.ParseAddrPort(r.SrcAddr)
			if err == nil && ap.Addr().Unmap() == src && r.SrcIdentity == srcID && r.DstIdentity == dstID {
				return nil
			}
		}
		last = recs
		return fmt.Errorf("none yet")
	})
	if err != nil {
		if len(last) > 5 {
			last = last[len(last)-5:]
		}
		t.Fatalf("node %s: no access record from %s with src.identity %s and dst.identity %s; last: %+v", node, src, srcID, dstID, last)
	}
}
