package kind_test

import (
	"context"
	"fmt"
	"net/netip"
	"strings"
	"testing"
	"time"

	"github.com/meshtun/meshtun/test/kind"
)

// gatedPodYAML is a pod of the mesh namespace on node whose init container
// sends a marker to the server before anything else of the pod runs.
const gatedPodYAML = `apiVersion: v1
kind: Pod
metadata: {name: {{NAME}}, namespace: {{NS}}}
spec:
  serviceAccountName: client
  nodeSelector: {kubernetes.io/hostname: {{NODE}}}
  terminationGracePeriodSeconds: 1
  restartPolicy: Never
  initContainers:
    - {name: first-packets, image: meshtun-probe:dev, imagePullPolicy: Never,
       args: [send, -to, "{{TO}}", -msg, "{{MSG}}", -timeout, 20s]}
  containers:
    - {name: probe, image: meshtun-probe:dev, imagePullPolicy: Never, args: [sleep]}
`

// createGatedPod creates the pod (not waiting for it) and returns its name.
func createGatedPod(t *testing.T, w *workloads, node, prefix, marker string) string {
	t.Helper()
	name := prefix + "-" + randHex(3)
	y := strings.NewReplacer("{{NAME}}", name, "{{NS}}", w.ns, "{{NODE}}", node,
		"{{TO}}", netip.AddrPortFrom(w.server.ip(false), 8080).String(), "{{MSG}}", marker).Replace(gatedPodYAML)
	if _, err := cl.KubectlIn(context.Background(), y, "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cl.Kubectl(context.Background(), "-n", w.ns, "delete", "pod", name, "--wait=false")
	})
	return name
}

// waitPodReady waits until the pod is Ready (its init container, which
// exits 1 when its exchange fails, succeeded: restartPolicy Never) and
// returns its IPv4 address.
func waitPodReady(t *testing.T, ns, name string) netip.Addr {
	t.Helper()
	ctx := context.Background()
	if _, err := cl.Kubectl(ctx, "-n", ns, "wait", "--for=condition=Ready", "pod/"+name, "--timeout=4m"); err != nil {
		st, _ := cl.Kubectl(ctx, "-n", ns, "get", "pod", name, "-o", "jsonpath={.status}")
		t.Fatalf("pod %s/%s not ready: %v\nstatus: %s", ns, name, err, st)
	}
	out, err := cl.Kubectl(ctx, "-n", ns, "get", "pod", name, "-o", "jsonpath={.status.podIPs[*].ip}")
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range strings.Fields(string(out)) {
		if a, err := netip.ParseAddr(s); err == nil && a.Is4() {
			return a
		}
	}
	t.Fatalf("pod %s/%s has IPs %q, want an IPv4 one", ns, name, out)
	return netip.Addr{}
}

// TestGateInitContainer: a new pod of a mesh namespace on the far node
// whose init container's one exchange with the server (on the other
// worker) is its first packet: that exchange is carried over HBONE (the
// client's node logs it with both SPIFFE identities) and its marker
// never crosses the kind network in plaintext. Without the startup gate
// the init container runs before the node has captured the pod: the
// exchange goes out in plaintext and arrives without an identity.
func TestGateInitContainer(t *testing.T) {
	mesh, _ := meshWorkloads(t)
	marker := "MESHTUN-MARKER-" + randHex(4) + "-init"
	capture, err := kind.StartCapture(cl.Bridge, marker)
	if err != nil {
		t.Fatal(err)
	}
	defer capture.Stop()
	name := createGatedPod(t, mesh, mesh.farNode, "init", marker)
	ip := waitPodReady(t, mesh.ns, name)
	// The client's node logs the exchange with the pod's address and both
	// identities.
	client, server := "spiffe://cluster.local/ns/"+mesh.ns+"/sa/client", "spiffe://cluster.local/ns/"+mesh.ns+"/sa/server"
	rec := waitAccess(t, mesh.farNode, ip, client, server)
	// So does the server's node, although it may not know the new pod
	// yet: the HBONE connection itself comes from the pod's address
	// (decisions/2026-12-04-hbone-from-pod-address.md), which is the
	// source it names; a node-address dial named the client node here.
	waitAccess(t, mesh.serverNode, ip, client, server)
	if n := capture.Seen(marker); n > 0 {
		t.Errorf("the init container's marker crossed the kind network in plaintext in %d frames", n)
	}
	t.Logf("init container's exchange: %+v", rec)
}

// TestGatePodWhileProxyDown: the far node's proxy is stopped (SIGSTOP: it
// holds its sockets but answers nothing, as a hung or not yet ready proxy
// would; the DaemonSet has no liveness probe, so the kubelet leaves it) and
// a mesh pod is scheduled there: the kubelet cannot create its sandbox
// (FailedCreatePodSandBox from meshtun-cni) while the proxy is down, none
// of its containers starts before the proxy runs again, and then its init
// container's first exchange is carried over HBONE with its identity;
// its marker is never on the kind network in plaintext.
func TestGatePodWhileProxyDown(t *testing.T) {
	ctx := context.Background()
	mesh, _ := meshWorkloads(t)
	marker := "MESHTUN-MARKER-" + randHex(4) + "-held"
	capture, err := kind.StartCapture(cl.Bridge, marker)
	if err != nil {
		t.Fatal(err)
	}
	defer capture.Stop()
	pid := nodeProxyPID(t, mesh.farNode)
	if _, err := cl.Podman(ctx, "exec", mesh.farNode, "kill", "-STOP", pid); err != nil {
		t.Fatal(err)
	}
	resumed := false
	resume := func() {
		if !resumed {
			resumed = true
			if _, err := cl.Podman(context.Background(), "exec", mesh.farNode, "kill", "-CONT", pid); err != nil {
				t.Errorf("resume the node proxy: %v", err)
			}
		}
	}
	defer resume()

	name := createGatedPod(t, mesh, mesh.farNode, "held", marker)
	// The gate's refusal is the kubelet's event for the pod.
	var refusal string
	for deadline := time.Now().Add(3 * time.Minute); refusal == ""; {
		out, err := cl.Kubectl(ctx, "-n", mesh.ns, "get", "events",
			"--field-selector", "involvedObject.name="+name+",reason=FailedCreatePodSandBox",
			"-o", "jsonpath={.items[*].message}")
		if err != nil {
			t.Fatal(err)
		}
		refusal = strings.TrimSpace(string(out))
		if refusal != "" {
			break
		}
		if time.Now().After(deadline) {
			st, _ := cl.Kubectl(ctx, "-n", mesh.ns, "get", "pod", name, "-o", "jsonpath={.status}")
			t.Fatalf("pod %s: no FailedCreatePodSandBox within 3 minutes while the node proxy is stopped; status %s", name, st)
		}
		time.Sleep(time.Second) // events are read again: no watch on kubectl get
	}
	if !strings.Contains(refusal, "meshtun") {
		t.Errorf("the sandbox failure does not come from meshtun-cni: %q", refusal)
	}
	st, err := cl.Kubectl(ctx, "-n", mesh.ns, "get", "pod", name, "-o", "jsonpath={.status.initContainerStatuses[0].state}")
	if err != nil {
		t.Fatal(err)
	}
	if s := string(st); strings.Contains(s, "running") || strings.Contains(s, "terminated") {
		t.Fatalf("pod %s's init container ran while the node proxy was stopped: %s", name, s)
	}
	// Kubernetes' timestamps have whole seconds.
	back := time.Now().Truncate(time.Second)
	resume()
	ip := waitPodReady(t, mesh.ns, name)
	out, err := cl.Kubectl(ctx, "-n", mesh.ns, "get", "pod", name, "-o", "jsonpath={.status.initContainerStatuses[0].state.terminated.startedAt}")
	if err != nil {
		t.Fatal(err)
	}
	started, err := time.Parse(time.RFC3339, strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatalf("init container's startedAt %q: %v", out, err)
	}
	if started.Before(back) {
		t.Errorf("pod %s's init container started at %s, before the node proxy was back (%s)", name, started, back)
	}
	waitAccess(t, mesh.farNode, ip,
		"spiffe://cluster.local/ns/"+mesh.ns+"/sa/client", "spiffe://cluster.local/ns/"+mesh.ns+"/sa/server")
	if n := capture.Seen(marker); n > 0 {
		t.Errorf("the held pod's marker crossed the kind network in plaintext in %d frames", n)
	}
	t.Logf("refused while stopped: %q; init container started %s after the proxy was back",
		clip(refusal, 300), started.Sub(back))
}

func clip(s string, n int) string {
	if len(s) > n {
		return s[:n] + fmt.Sprintf("… (%d bytes)", len(s))
	}
	return s
}
