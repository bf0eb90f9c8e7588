package istio_test

import (
	"context"
	"fmt"
	"net/netip"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"
)

var (
	istioctlOnce sync.Once
	istioctlBin  result
)

// runIstioctl runs istioctl (built from the interop module's istio.io/istio)
// against the cluster as a user would, with the cluster's kubeconfig.
func runIstioctl(t *testing.T, args ...string) (string, error) {
	t.Helper()
	istioctlOnce.Do(func() { istioctlBin = <-istioctl })
	if istioctlBin.err != nil {
		t.Fatalf("build istioctl: %v", istioctlBin.err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, istioctlBin.path, append([]string{"--kubeconfig", cl.Kubeconfig}, args...)...)
	out, err := cmd.CombinedOutput()
	t.Logf("istioctl %s:\n%s", strings.Join(args, " "), out)
	if err != nil {
		return string(out), fmt.Errorf("istioctl %s: %w\n%s", strings.Join(args, " "), err, out)
	}
	return string(out), nil
}

// wantAll fails unless out has every one of want.
func wantAll(t *testing.T, view, out string, want ...string) {
	t.Helper()
	for _, w := range want {
		if !strings.Contains(out, w) {
			t.Errorf("%s: output lacks %q", view, w)
		}
	}
}

const viewPolicyYAML = `apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: istioctl-view, namespace: {{NS}}}
spec:
  selector: {matchLabels: {app: server}}
  action: DENY
  rules:
    - from:
        - source: {principals: ["cluster.local/ns/nowhere/sa/nobody"]}
`

// TestIstioctlZtunnelConfig: `istioctl ztunnel-config` views against the
// meshtun pod of the server's node, named as <pod>.istio-system (meshtun's
// pods carry app=ztunnel, which is how istioctl tells a ztunnel pod).
// Each view must name what the node has: the workloads of both enrolled
// namespaces, the echo Service, an AuthorizationPolicy, the server's
// certificate, the open connection and the log levels. docs/istio.md has
// the table.
func TestIstioctlZtunnelConfig(t *testing.T) {
	ctx := context.Background()
	w := workloads(t)
	eventually(t, w.far, netip.AddrPortFrom(w.server.ip(false), 8080), "istioctl-warmup")
	proxy, err := proxyPod(ctx, w.serverNode)
	if err != nil {
		t.Fatal(err)
	}
	target := proxy + ".istio-system"
	y := strings.ReplaceAll(viewPolicyYAML, "{{NS}}", w.mesh)
	if _, err := cl.KubectlIn(ctx, y, "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	defer cl.Kubectl(ctx, "-n", w.mesh, "delete", "authorizationpolicy", "istioctl-view", "--ignore-not-found")

	t.Run("workload", func(t *testing.T) {
		out, err := runIstioctl(t, "ztunnel-config", "workload", target)
		if err != nil {
			t.Fatal(err)
		}
		wantAll(t, "workload", out, "server", "far", "bylabel", w.mesh, w.other, w.server.ip(false).String(), "HBONE")
	})
	t.Run("service", func(t *testing.T) {
		out, err := runIstioctl(t, "ztunnel-config", "service", target)
		if err != nil {
			t.Fatal(err)
		}
		wantAll(t, "service", out, "echo", w.mesh, w.svcV4.String())
	})
	t.Run("policy", func(t *testing.T) {
		var out string
		if err := waitFor(ctx, time.Minute, "policy istioctl-view in the view", func() error {
			var err error
			if out, err = runIstioctl(t, "ztunnel-config", "policy", target); err != nil {
				return err
			}
			if !strings.Contains(out, "istioctl-view") {
				return fmt.Errorf("not listed")
			}
			return nil
		}); err != nil {
			t.Fatal(err)
		}
		wantAll(t, "policy", out, w.mesh, "Deny")
	})
	t.Run("certificate", func(t *testing.T) {
		out, err := runIstioctl(t, "ztunnel-config", "certificate", target)
		if err != nil {
			t.Fatal(err)
		}
		wantAll(t, "certificate", out, w.server.id(), "Available")
	})
	t.Run("all", func(t *testing.T) {
		out, err := runIstioctl(t, "ztunnel-config", "all", target)
		if err != nil {
			t.Fatal(err)
		}
		wantAll(t, "all", out, "server", "echo", "istioctl-view", w.server.id())
	})
	t.Run("connections", func(t *testing.T) {
		hctx, cancel := context.WithCancel(ctx)
		defer cancel()
		held := make(chan error, 1)
		go func() {
			_, err := cl.Kubectl(hctx, "-n", w.far.ns, "exec", w.far.name, "--", "/probe", "hold",
				"-to", netip.AddrPortFrom(w.server.ip(false), 8080).String(), "-msg", "held", "-for", "40s")
			held <- err
		}()
		var out string
		err := waitFor(ctx, 30*time.Second, "the held connection in the view", func() error {
			select {
			case err := <-held:
				return fmt.Errorf("the held connection ended early: %v", err)
			default:
			}
			var err error
			if out, err = runIstioctl(t, "ztunnel-config", "connections", target); err != nil {
				return err
			}
			if !strings.Contains(out, "server."+w.mesh) {
				return fmt.Errorf("server.%s not listed", w.mesh)
			}
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
		wantAll(t, "connections", out, "Inbound", "far."+w.mesh)
	})
	t.Run("log", func(t *testing.T) {
		out, err := runIstioctl(t, "ztunnel-config", "log", target)
		if err != nil {
			t.Fatal(err)
		}
		wantAll(t, "log", out, proxy, `"level":"info"`, `"access":"on"`)
		// Changing levels is root's, on the node's admin socket: the
		// port istioctl forwards to (127.0.0.1:15000) is reachable by
		// every process of the node's network namespace.
		out, err = runIstioctl(t, "ztunnel-config", "log", target, "--level", "access:debug")
		if err == nil {
			t.Fatalf("--level access:debug through the TCP admin port was accepted: %s", out)
		}
		wantAll(t, "log --level access:debug", out, "403") // istioctl shows the status, not the body
	})
	// The ways to name the node proxy, and what each needs.
	t.Run("by-daemonset", func(t *testing.T) {
		out, err := runIstioctl(t, "ztunnel-config", "workload", "daemonset/meshtun", "-n", "istio-system")
		if err != nil {
			t.Fatal(err)
		}
		wantAll(t, "workload daemonset/meshtun", out, "server", w.mesh)
	})
	t.Run("default-daemonset", func(t *testing.T) {
		// Without a pod istioctl looks for daemonset/ztunnel, which
		// deploy/istio does not name (docs/istio.md).
		out, err := runIstioctl(t, "ztunnel-config", "workload")
		if err == nil {
			t.Fatalf("istioctl found a node proxy without a name: %s", out)
		}
		wantAll(t, "workload (no pod)", out, "ztunnel")
	})
}
