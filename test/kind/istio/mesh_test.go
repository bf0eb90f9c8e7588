package istio_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/meshtun/meshtun/test/kind"
)

// shared is the workloads most tests use: an echo server on the first
// worker in an ambient namespace with a Service, a client there on the
// second worker (enrolled by its namespace), and in a namespace outside
// the mesh a client enrolled by its pod label and one not enrolled, both
// on the second worker.
type sharedWorkloads struct {
	mesh, other            string
	server, far, byLabel   pod
	plain                  pod
	svcV4                  netip.Addr
	serverNode, clientNode string
}

var (
	sharedOnce sync.Once
	shared     *sharedWorkloads
	sharedErr  error
)

const serviceYAML = `apiVersion: v1
kind: Service
metadata: {name: echo, namespace: {{NS}}}
spec:
  selector: {app: server}
  ports:
    - {name: tcp-echo, port: 8080, targetPort: 8080}
`

func workloads(t *testing.T) *sharedWorkloads {
	t.Helper()
	sharedOnce.Do(func() {
		// newPod fails the test that first asks; the others see sharedErr.
		sharedErr = fmt.Errorf("shared workloads failed in an earlier test")
		w := &sharedWorkloads{serverNode: worker(1), clientNode: worker(2)}
		w.mesh = namespace(t, "mesh", true)
		w.other = namespace(t, "other", false)
		if _, err := cl.KubectlIn(context.Background(), strings.ReplaceAll(serviceYAML, "{{NS}}", w.mesh), "apply", "-f", "-"); err != nil {
			t.Fatal(err)
		}
		w.server = newPod(t, w.mesh, "server", w.serverNode, true, false, "{app: server}")
		w.far = newPod(t, w.mesh, "far", w.clientNode, false, false, "")
		w.byLabel = newPod(t, w.other, "bylabel", w.clientNode, false, false, "{istio.io/dataplane-mode: ambient}")
		w.plain = newPod(t, w.other, "plain", w.clientNode, false, false, "")
		out, err := cl.Kubectl(context.Background(), "-n", w.mesh, "get", "svc", "echo", "-o", "jsonpath={.spec.clusterIP}")
		if err != nil {
			t.Fatal(err)
		}
		if w.svcV4, err = netip.ParseAddr(strings.TrimSpace(string(out))); err != nil {
			t.Fatalf("service %s/echo cluster IP %q: %v", w.mesh, out, err)
		}
		shared, sharedErr = w, nil
	})
	if sharedErr != nil {
		t.Fatal(sharedErr)
	}
	return shared
}

// redirected waits until p carries ambient.istio.io/redirection=enabled
// (meshtun's --redirect-pods, istio-cni's part): what makes istiod send
// it as an HBONE workload.
func redirected(t *testing.T, p pod) {
	t.Helper()
	ctx := context.Background()
	if err := waitFor(ctx, time.Minute, "redirection annotation on "+p.ns+"/"+p.name, func() error {
		out, err := cl.Kubectl(ctx, "-n", p.ns, "get", "pod", p.name, "-o", `jsonpath={.metadata.annotations.ambient\.istio\.io/redirection}`)
		if err != nil {
			return err
		}
		if string(out) != "enabled" {
			return fmt.Errorf("annotation %q", out)
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

// TestMesh: pods enrolled by their namespace's label and by their own
// label reach the server across nodes, to its address (both families) and
// through its Service, on istiod's certificates: the server's node logs
// both SPIFFE identities, and no marker crosses the kind network in
// plaintext, while a pod enrolled by neither is seen in plaintext by the
// same capture.
func TestMesh(t *testing.T) {
	ctx := context.Background()
	w := workloads(t)
	for _, p := range []pod{w.server, w.far, w.byLabel} {
		redirected(t, p)
	}
	out, err := cl.Kubectl(ctx, "-n", w.plain.ns, "get", "pod", w.plain.name, "-o", `jsonpath={.metadata.annotations.ambient\.istio\.io/redirection}`)
	if err != nil || len(out) != 0 {
		t.Fatalf("pod %s/plain (not enrolled) has redirection %q (%v), want none", w.plain.ns, out, err)
	}
	run := randHex(4)
	type tc struct {
		name   string
		client pod
		to     netip.AddrPort
		marker string
	}
	cases := []tc{
		{"namespace-label/pod-v4", w.far, netip.AddrPortFrom(w.server.ip(false), 8080), ""},
		{"namespace-label/pod-v6", w.far, netip.AddrPortFrom(w.server.ip(true), 8080), ""},
		{"namespace-label/service", w.far, netip.AddrPortFrom(w.svcV4, 8080), ""},
		{"pod-label/pod-v4", w.byLabel, netip.AddrPortFrom(w.server.ip(false), 8080), ""},
		{"pod-label/service", w.byLabel, netip.AddrPortFrom(w.svcV4, 8080), ""},
	}
	markers := []string{"MESHTUN-MARKER-" + run + "-plain"}
	for i := range cases {
		cases[i].marker = "MESHTUN-MARKER-" + run + "-" + strings.ReplaceAll(cases[i].name, "/", "-")
		markers = append(markers, cases[i].marker)
	}
	capture, err := kind.StartCapture(cl.Bridge, markers...)
	if err != nil {
		t.Fatal(err)
	}
	defer capture.Stop()
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if !c.to.Addr().IsValid() {
				t.Fatal("no address of this family")
			}
			eventually(t, c.client, c.to, c.marker)
			src := c.client.ip(c.to.Addr().Is6())
			waitAccess(t, w.serverNode, src, c.client.id(), w.server.id())
			if n := capture.Seen(c.marker); n != 0 {
				t.Errorf("marker %s seen %d times in plaintext on the kind network", c.marker, n)
			}
		})
	}
	// The control: a pod enrolled by nothing talks plaintext, and the
	// capture sees it.
	if err := send(ctx, w.plain, netip.AddrPortFrom(w.server.ip(false), 8080), markers[0]); err != nil {
		t.Fatalf("plaintext control exchange: %v", err)
	}
	if err := waitFor(ctx, 10*time.Second, "the plaintext control marker on the capture", func() error {
		if capture.Seen(markers[0]) == 0 {
			return fmt.Errorf("not seen")
		}
		return nil
	}); err != nil {
		frames, bytes := capture.Stats()
		t.Fatalf("%v (%d frames, %d bytes captured): the capture does not see the path between the nodes", err, frames, bytes)
	}
}

const strictYAML = `apiVersion: security.istio.io/v1
kind: PeerAuthentication
metadata: {name: strict, namespace: {{NS}}}
spec:
  mtls: {mode: STRICT}
`

// TestStrictProbes: PeerAuthentication STRICT from istiod: plaintext from
// a pod outside the mesh is refused, a mesh client gets through, and the
// kubelet's HTTP readiness and TCP liveness probes keep passing.
func TestStrictProbes(t *testing.T) {
	ctx := context.Background()
	w := workloads(t)
	ns := namespace(t, "strict", true)
	srv := newPod(t, ns, "strict", w.serverNode, true, true, "{app: strict}")
	to := netip.AddrPortFrom(srv.ip(false), 8080)
	eventually(t, w.plain, to, "plaintext-before")
	if _, err := cl.KubectlIn(ctx, strings.ReplaceAll(strictYAML, "{{NS}}", ns), "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	if err := waitFor(ctx, 90*time.Second, "STRICT refusing plaintext", func() error {
		if send(ctx, w.plain, to, "plaintext") == nil {
			return fmt.Errorf("plaintext still accepted")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	eventually(t, w.far, to, "mesh")
	waitAccess(t, w.serverNode, w.far.ip(false), w.far.id(), srv.id())
	// The kubelet probes every second, two failures fail: 20 s of probes.
	for until := time.Now().Add(20 * time.Second); time.Now().Before(until); {
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
	if err := send(ctx, w.plain, to, "plaintext-again"); err == nil {
		t.Fatal("plaintext from outside the mesh reached the STRICT pod")
	}
}

const authzYAML = `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: server, namespace: {{NS}}}
spec:
  selector: {matchLabels: {app: server}}
  action: {{ACTION}}
  rules:
    - from:
        - source: {principals: ["cluster.local/ns/{{NS}}/sa/far"]}
`

// TestAuthorizationPolicy: an AuthorizationPolicy from istiod that denies
// the client's principal refuses its connections to the server; replaced
// by one that allows only that principal, the client gets through again
// and the pod-label client (another principal) is refused.
func TestAuthorizationPolicy(t *testing.T) {
	ctx := context.Background()
	w := workloads(t)
	to := netip.AddrPortFrom(w.server.ip(false), 8080)
	eventually(t, w.far, to, "before")
	eventually(t, w.byLabel, to, "before")
	apply := func(action string) {
		y := strings.NewReplacer("{{NS}}", w.mesh, "{{ACTION}}", action).Replace(authzYAML)
		if _, err := cl.KubectlIn(ctx, y, "apply", "-f", "-"); err != nil {
			t.Fatal(err)
		}
	}
	defer cl.Kubectl(ctx, "-n", w.mesh, "delete", "authorizationpolicy", "server", "--ignore-not-found")
	apply("DENY")
	if err := waitFor(ctx, 90*time.Second, "DENY taking effect", func() error {
		if send(ctx, w.far, to, "denied") == nil {
			return fmt.Errorf("still allowed")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
	if err := send(ctx, w.byLabel, to, "other-principal"); err != nil {
		t.Fatalf("DENY of far's principal refused bylabel too: %v", err)
	}
	apply("ALLOW")
	eventually(t, w.far, to, "allowed")
	if err := waitFor(ctx, 90*time.Second, "ALLOW refusing the other principal", func() error {
		if send(ctx, w.byLabel, to, "not-allowed") == nil {
			return fmt.Errorf("bylabel still allowed")
		}
		return nil
	}); err != nil {
		t.Fatal(err)
	}
}

type loopResult struct {
	OK        int    `json:"ok"`
	Fail      int    `json:"fail"`
	MaxGapMs  int    `json:"maxGapMs"`
	LastError string `json:"lastError"`
}

// TestIstiodRestart: `kubectl rollout restart deploy/istiod` while the
// client exchanges with the server every 200 ms: the exchanges go on
// (meshtun keeps its model while istiod is away), and a pod created after
// the restart is reached over HBONE with both identities (the nodes
// follow the new istiod).
func TestIstiodRestart(t *testing.T) {
	ctx := context.Background()
	w := workloads(t)
	to := netip.AddrPortFrom(w.server.ip(false), 8080)
	eventually(t, w.far, to, "before")
	d := 60 * time.Second
	ch := make(chan struct {
		r   loopResult
		err error
	}, 1)
	go func() {
		lctx, cancel := context.WithTimeout(ctx, d+2*time.Minute)
		defer cancel()
		out, err := cl.Kubectl(lctx, "-n", w.far.ns, "exec", w.far.name, "--", "/probe", "loop", "-to", to.String(), "-msg", "during-restart", "-for", d.String(), "-every", "200ms")
		var r loopResult
		if err == nil {
			err = json.Unmarshal(trimmed(out), &r)
		}
		ch <- struct {
			r   loopResult
			err error
		}{r, err}
	}()
	start := time.Now()
	for _, s := range [][]string{
		{"-n", "istio-system", "rollout", "restart", "deploy/istiod"},
		{"-n", "istio-system", "rollout", "status", "deploy/istiod", "--timeout=5m"},
	} {
		if _, err := cl.Kubectl(ctx, s...); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("istiod rolled out again in %s", time.Since(start).Round(time.Second))
	res := <-ch
	if res.err != nil {
		t.Fatal(res.err)
	}
	t.Logf("exchanges during the restart: %+v", res.r)
	if res.r.Fail != 0 {
		t.Errorf("%d of %d exchanges failed while istiod restarted (last: %s)", res.r.Fail, res.r.OK+res.r.Fail, res.r.LastError)
	}
	ns := namespace(t, "after", true)
	srv := newPod(t, ns, "after", w.serverNode, true, false, "")
	redirected(t, srv)
	eventually(t, w.far, netip.AddrPortFrom(srv.ip(false), 8080), "after-restart")
	waitAccess(t, w.serverNode, w.far.ip(false), w.far.id(), srv.id())
}

func trimmed(b []byte) []byte { return []byte(strings.TrimSpace(string(b))) }
