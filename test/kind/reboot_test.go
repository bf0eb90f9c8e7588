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

// bootClientYAML is a mesh pod on node that exchanges a marker with the
// server every 200 ms for as long as it runs, from its first moment on
// (so also from the first moment after its node restarts).
const bootClientYAML = `apiVersion: v1
kind: Pod
metadata: {name: {{NAME}}, namespace: {{NS}}}
spec:
  serviceAccountName: client
  nodeSelector: {kubernetes.io/hostname: {{NODE}}}
  terminationGracePeriodSeconds: 1
  containers:
    - {name: probe, image: meshtun-probe:dev, imagePullPolicy: Never,
       args: [loop, -to, "{{TO}}", -msg, "{{MSG}}", -for, 30m, -every, 200ms]}
`

// TestNodeReboot: `podman restart` of the far worker, whose mesh pod
// exchanges a marker with the server on the other worker every 200 ms from
// the moment its container runs. The restarted node comes back with its
// CNI configuration on disk; kindnet (played here: routes and its conflist
// written anew, as kindnetd does at every start) rewrites its conflist.
// Until the node's proxy is ready again the pod's new sandbox is held by
// meshtun-cni (meshtun's own conflist stays first on disk); the marker
// never crosses the kind network in plaintext; afterwards the pod's
// exchanges are carried over HBONE with both identities again.
func TestNodeReboot(t *testing.T) {
	ctx := context.Background()
	mesh, _ := meshWorkloads(t)
	node := mesh.farNode
	marker := "MESHTUN-MARKER-" + randHex(4) + "-reboot"
	capture, err := kind.StartCapture(cl.Bridge, marker)
	if err != nil {
		t.Fatal(err)
	}
	defer capture.Stop()
	name := "boot-" + randHex(3)
	y := strings.NewReplacer("{{NAME}}", name, "{{NS}}", mesh.ns, "{{NODE}}", node,
		"{{TO}}", netip.AddrPortFrom(mesh.server.ip(false), 8080).String(), "{{MSG}}", marker).Replace(bootClientYAML)
	if _, err := cl.KubectlIn(ctx, y, "apply", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	defer cl.Kubectl(context.Background(), "-n", mesh.ns, "delete", "pod", name, "--wait=false")
	clientID := "spiffe://cluster.local/ns/" + mesh.ns + "/sa/client"
	serverID := "spiffe://cluster.local/ns/" + mesh.ns + "/sa/server"
	ip := waitPodReady(t, mesh.ns, name)
	waitAccess(t, node, ip, clientID, serverID)

	restarted := time.Now()
	if _, err := cl.Podman(ctx, "restart", "--time", "5", node); err != nil {
		t.Fatal(err)
	}
	t.Logf("podman restart %s: %s", node, time.Since(restarted).Round(time.Millisecond))
	if n, err := capture.AddNewPorts(); err != nil || n == 0 {
		t.Errorf("capture on the restarted node's new bridge port: %d new, %v", n, err)
	}
	// podman may give the restarted node a new address: kindnet routes to
	// the address the Node object reports once its kubelet has updated it.
	out, err := cl.Podman(ctx, "inspect", node, "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")
	if err != nil {
		t.Fatal(err)
	}
	addr, err := netip.ParseAddr(strings.TrimSpace(string(out)))
	if err != nil {
		t.Fatalf("podman inspect %s: address %q: %v", node, out, err)
	}
	var nodes []kind.Node
	for deadline := time.Now().Add(5 * time.Minute); ; {
		if nodes, err = cl.Nodes(ctx); err != nil {
			t.Fatal(err)
		}
		if nodeHas(nodes, node, addr) {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("node %s does not report its address %s within 5 minutes of the restart: %+v", node, addr, nodes)
		}
		time.Sleep(time.Second) // the Node object is read again
	}
	t.Logf("%s is at %s after the restart", node, addr)
	if err := cl.PlayKindnet(ctx, nodes); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Kubectl(ctx, "wait", "--for=condition=Ready", "node/"+node, "--timeout=5m"); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Kubectl(ctx, "-n", "meshtun-system", "rollout", "status", "ds/meshtun", "--timeout=5m"); err != nil {
		t.Fatal(err)
	}
	// The pod runs again in a new sandbox (its address may be new: the
	// node's IPAM state is on a tmpfs).
	var newIP netip.Addr
	for deadline := time.Now().Add(5 * time.Minute); ; {
		out, err := cl.Kubectl(ctx, "-n", mesh.ns, "get", "pod", name, "-o",
			"jsonpath={.status.containerStatuses[0].restartCount} {.status.containerStatuses[0].ready} {.status.podIP}")
		if err != nil {
			t.Fatal(err)
		}
		var restarts int
		var ready, addr string
		fmt.Sscan(string(out), &restarts, &ready, &addr)
		if restarts > 0 && ready == "true" {
			if newIP, err = netip.ParseAddr(addr); err == nil {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("pod %s not running again within 5 minutes of the restart: %q", name, out)
		}
		time.Sleep(time.Second) // the pod's status is read again
	}
	waitAccess(t, node, newIP, clientID, serverID)
	events, _ := cl.Kubectl(ctx, "-n", mesh.ns, "get", "events", "--field-selector",
		"involvedObject.name="+name+",reason=FailedCreatePodSandBox", "-o", "jsonpath={.items[*].count}")
	if n := capture.Seen(marker); n > 0 {
		t.Errorf("the marker crossed the kind network in plaintext in %d frames around the node's restart", n)
	}
	frames, _ := capture.Stats()
	t.Logf("pod %s: %s before, %s after the restart; sandbox creations the gate refused: %q; %d frames captured",
		name, ip, newIP, strings.TrimSpace(string(events)), frames)

	// The shared workloads on the node have new sandboxes too: later
	// tests read their addresses again.
	if err := refreshWorkloads(mesh); err != nil {
		t.Fatal(err)
	}
	if sharedPlain != nil {
		if err := refreshWorkloads(sharedPlain); err != nil {
			t.Fatal(err)
		}
	}
}

// refreshWorkloads reads the addresses of w's pods again (a restarted
// node gives its pods new sandboxes).
func refreshWorkloads(w *workloads) error {
	ctx := context.Background()
	if _, err := cl.Kubectl(ctx, "-n", w.ns, "wait", "--for=condition=Ready", "pod", "--all", "--timeout=5m"); err != nil {
		return err
	}
	for _, p := range []*pod{&w.server, &w.near, &w.far} {
		out, err := cl.Kubectl(ctx, "-n", w.ns, "get", "pod", p.name, "-o", "jsonpath={.status.podIPs[*].ip}")
		if err != nil {
			return err
		}
		var ips []netip.Addr
		for _, s := range strings.Fields(string(out)) {
			a, err := netip.ParseAddr(s)
			if err != nil {
				return fmt.Errorf("pod %s/%s IP %q: %v", w.ns, p.name, s, err)
			}
			ips = append(ips, a)
		}
		p.ips = ips
	}
	return nil
}

func nodeHas(nodes []kind.Node, name string, addr netip.Addr) bool {
	for _, n := range nodes {
		if n.Name == name {
			for _, a := range n.IPs {
				if a == addr {
					return true
				}
			}
		}
	}
	return false
}
