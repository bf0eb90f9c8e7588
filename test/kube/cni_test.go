package kube

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
	"github.com/meshtun/meshtun/mesh/cni"

	"net/netip"
)

// testConflist is the pod network's conflist on the test's node, as
// kindnet writes it.
const testConflist = `{"cniVersion": "1.0.0", "name": "kindnet", "plugins": [
  {"type": "ptp", "ipam": {"type": "host-local", "ranges": [[{"subnet": "198.18.0.0/16"}]]}, "mtu": 1500},
  {"type": "portmap", "capabilities": {"portMappings": true}}]}`

// cniHost is a node's CNI directories, as the DaemonSet mounts them.
type cniHost struct {
	binDir, confDir, dir string
}

// pluginConf returns the conflist's meshtun-cni entry, as the runtime
// passes it to the plugin (with prevResult added), failing if the node
// did not install it.
func (h cniHost) pluginConf(t *testing.T) map[string]any {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(h.confDir, cni.OwnConflist))
	if err != nil {
		t.Fatal(err)
	}
	var doc struct {
		CNIVersion string           `json:"cniVersion"`
		Name       string           `json:"name"`
		Plugins    []map[string]any `json:"plugins"`
	}
	if err := json.Unmarshal(data, &doc); err != nil {
		t.Fatal(err)
	}
	last := doc.Plugins[len(doc.Plugins)-1]
	if last["type"] != cni.PluginType {
		t.Fatalf("the node did not chain meshtun-cni last in its conflist:\n%s", data)
	}
	last["cniVersion"], last["name"] = doc.CNIVersion, doc.Name
	return last
}

// add runs the installed plugin's ADD for pod p (ns/name) in p's node's
// namespace, as the container runtime does after ptp made p's veth: it
// returns the exit code and stdout.
func (h cniHost) add(t *testing.T, p *cluster.Pod, ns, name string, uid string) (int, string) {
	t.Helper()
	conf := h.pluginConf(t)
	conf["prevResult"] = map[string]any{
		"cniVersion": "1.0.0",
		"interfaces": []map[string]any{{"name": p.HostLink}, {"name": p.Link, "sandbox": p.Path()}},
		"ips": []map[string]any{
			{"interface": 1, "address": netip.PrefixFrom(p.IPv4, 32).String()},
			{"interface": 1, "address": netip.PrefixFrom(p.IPv6, 128).String()},
		},
	}
	stdin, _ := json.Marshal(conf)
	cmd := p.Node.Command(context.Background(), filepath.Join(h.binDir, cni.PluginType))
	cmd.Env = []string{"CNI_COMMAND=ADD", "CNI_CONTAINERID=sandbox-" + name, "CNI_NETNS=" + p.Path(), "CNI_IFNAME=" + p.Link,
		"CNI_PATH=" + h.binDir, "CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=" + ns + ";K8S_POD_NAME=" + name + ";K8S_POD_UID=" + uid}
	cmd.Stdin = bytes.NewReader(stdin)
	var out bytes.Buffer
	cmd.Stdout = &out
	err := cmd.Run()
	if ee, ok := err.(*exec.ExitError); ok {
		return ee.ExitCode(), out.String()
	} else if err != nil {
		t.Fatal(err)
	}
	return 0, out.String()
}

// pendingPod creates pod ns/name scheduled to p's node, as the scheduler
// leaves it for the kubelet: no status yet (no IPs, not running).
func pendingPod(t *testing.T, k kubelet, p *cluster.Pod, ns, name, sa string) *corev1.Pod {
	t.Helper()
	ctx := context.Background()
	_, err := k.cs.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{})
	if err != nil && !strings.Contains(err.Error(), "already exists") {
		t.Fatal(err)
	}
	pod, err := k.cs.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
		Spec: corev1.PodSpec{
			NodeName: noderun.NodeName(p.Node), ServiceAccountName: sa, AutomountServiceAccountToken: new(bool),
			InitContainers: []corev1.Container{{Name: "init", Image: "example.invalid/init:1"}},
			Containers:     []corev1.Container{{Name: "app", Image: "example.invalid/app:1"}},
		},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return pod
}

// TestCNIGate runs `meshtun node --cni` against a real API server, playing
// the container runtime's CNI with the plugin the node installed: a pod's
// ADD fails while the node is down, and once it is up the ADD returns with
// the pod captured, so that the pod's first connection, made before the
// API server shows the pod running or its IPs (its init container's), is
// carried in HBONE with its identity; the model then takes the pod over
// without a flap, and the ADD fails again once the node is stopped.
func TestCNIGate(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "cni", Nodes: 2, PodsPerNode: 2})
	cp := controlPlaneT(t, c)
	ctx := context.Background()
	ms := applyDeploy(t, cp)
	dir := t.TempDir()
	cfgPath := nodeConfig(t, ms, dir, netip.AddrPortFrom(cp.Host.IPv4, caPort))
	ca := startCA(t, cp, ms, cfgPath, dir)
	kubeconfig := nodeKubeconfig(t, cp, dir)
	plugin := filepath.Join(dir, "meshtun-cni-build")
	if out, err := exec.Command("go", "build", "-C", "../..", "-o", plugin, "./cmd/meshtun-cni").CombinedOutput(); err != nil {
		t.Fatalf("build meshtun-cni: %v\n%s", err, out)
	}

	n1, n2 := c.Nodes[0], c.Nodes[1]
	p11, p12, p21 := n1.Pods[0], n1.Pods[1], n2.Pods[0]
	k := kubelet{t: t, cs: cp.Admin}
	k.namespace("apps", true)
	k.namespace("plain", false)
	k.run(p21, "apps", "server", "server", map[string]string{"app": "server"})
	echo(t, p21, 8080)

	h := cniHost{binDir: filepath.Join(dir, "bin"), confDir: filepath.Join(dir, "net.d"), dir: filepath.Join(dir, "cni")}
	for _, d := range []string{h.binDir, h.confDir} {
		os.MkdirAll(d, 0o755)
	}
	if err := os.WriteFile(filepath.Join(h.confDir, "10-kindnet.conflist"), []byte(testConflist), 0o644); err != nil {
		t.Fatal(err)
	}
	start := func(n *cluster.Node, extra ...string) *noderun.Process {
		sctx, cancel := context.WithTimeout(ctx, time.Minute)
		defer cancel()
		args := append([]string{"--kubernetes", "--kubeconfig", kubeconfig, "--config", cfgPath,
			"--ca-token-file", nodeToken(t, cp, n, dir), "--ca-roots", ca.roots}, extra...)
		m, err := noderun.Start(sctx, meshtunBin, n, args...)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Stop(9) })
		return m
	}
	m2 := start(n2)

	// Node 1's pod is scheduled while its proxy is not there yet: the
	// plugin (installed by an earlier run, here by hand with the entry
	// the node writes) fails its ADD for the enrolled pod.
	client := pendingPod(t, k, p11, "apps", "client", "client")
	gateArgs := []string{"--cni", "--cni-bin-dir", h.binDir, "--cni-conf-dir", h.confDir, "--cni-dir", h.dir,
		"--cni-plugin", plugin, "--cni-exempt-namespaces", "meshtun-system", "--drain-period", "1s"}
	if _, err := cni.InstallBinary(plugin, h.binDir); err != nil {
		t.Fatal(err)
	}
	pc := cni.PluginConf{Socket: filepath.Join(h.dir, "cni.sock"), StateFile: filepath.Join(h.dir, "state.json"), ExemptNamespaces: []string{"meshtun-system"}}
	if _, _, err := cni.EnsureInConflist(h.confDir, pc); err != nil {
		t.Fatal(err)
	}
	if code, out := h.add(t, p11, "apps", "client", string(client.UID)); code == 0 {
		t.Fatalf("ADD of an enrolled pod succeeded with the node down: %s", out)
	} else if !strings.Contains(out, "meshtun node not ready") {
		t.Errorf("ADD with the node down: %s", out)
	}

	m1 := start(n1, gateArgs...)
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("node 1 log:\n%s\nnode 2 log:\n%s", m1.Logs(), m2.Logs())
		}
	})
	// The gate serves from the node's readiness on, and says so.
	waitLog(t, m1, 0, "the gate serving", func(l noderun.Line) bool { return l.Str("message") == "CNI startup gate serving" })
	conf := h.pluginConf(t)
	if conf["socket"] != pc.Socket {
		t.Errorf("conflist entry socket %v, want %s", conf["socket"], pc.Socket)
	}
	if st, err := os.Stat(filepath.Join(h.dir, "cni.sock")); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("socket: %v, %v; want mode 0600", st, err)
	}
	if st, err := os.Stat(h.dir); err != nil || st.Mode().Perm() != 0o700 {
		t.Errorf("socket directory: %v, %v; want mode 0700", st, err)
	}

	t.Run("first connection after ADD is HBONE", func(t *testing.T) {
		code, out := h.add(t, p11, "apps", "client", string(client.UID))
		if code != 0 {
			t.Fatalf("ADD with the node up: exit %d: %s", code, out)
		}
		// The pod is still pending without IPs in the API server: only
		// the CNI's announcement made it a workload.
		got, err := cp.Admin.CoreV1().Pods("apps").Get(ctx, "client", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if len(got.Status.PodIPs) != 0 || got.Status.Phase == corev1.PodRunning {
			t.Fatalf("pod status %+v: the test needs it pending without IPs", got.Status)
		}
		mark2 := m2.Len()
		src := roundTrip(t, p11, netip.AddrPortFrom(p21.IPv4, 8080))
		out1 := waitLog(t, m1, 0, "outbound access log of the first connection", accessLine(src))
		wantField(t, out1, "route", "hbone")
		wantField(t, out1, "src.identity", spiffe("apps", "client"))
		// Node 2 does not know the pod's address yet (the API server
		// shows none): it verifies the client's identity from its
		// certificate, and does not repeat the address the tunnel claims
		// (the connection comes from node 1's address until it does).
		in := waitLog(t, m2, mark2, "inbound access log of the first connection", func(l noderun.Line) bool {
			return l.Str("log") == "access" && l.Str("direction") == "inbound" && l.Str("src.identity") == spiffe("apps", "client")
		})
		wantField(t, in, "route", "hbone")
	})

	t.Run("the model takes the pod over without a flap", func(t *testing.T) {
		prefix := netip.PrefixFrom(p11.IPv4, 32).String()
		if !ruleFor(t, n1, prefix) {
			t.Fatalf("no capture rule for %s after ADD", prefix)
		}
		mark := m1.Len()
		k.run2(t, client, p11)
		waitLog(t, m1, mark, "announcement dropped", func(l noderun.Line) bool {
			return l.Str("message") == "announcement dropped" && l.Str("pod") == "apps/client"
		})
		if !ruleFor(t, n1, prefix) {
			t.Errorf("capture rule for %s gone after the API server showed the pod", prefix)
		}
		for _, l := range m1.Lines()[mark:] {
			if l.Str("message") == "pod not in the mesh" && l.Str("pod") == "apps/client" {
				t.Errorf("pod left the mesh on the hand-over: %v", l)
			}
		}
		src := roundTrip(t, p11, netip.AddrPortFrom(p21.IPv4, 8080))
		wantField(t, waitLog(t, m1, 0, "connection after hand-over", accessLine(src)), "route", "hbone")
	})

	t.Run("pod outside the mesh passes at once", func(t *testing.T) {
		db := pendingPod(t, k, p12, "plain", "db", "db")
		if code, out := h.add(t, p12, "plain", "db", string(db.UID)); code != 0 {
			t.Fatalf("ADD of a pod outside the mesh: exit %d: %s", code, out)
		}
		if ruleFor(t, n1, netip.PrefixFrom(p12.IPv4, 32).String()) {
			t.Error("a pod outside the mesh got a capture rule")
		}
	})

	t.Run("copy follows when the pod network rewrites its conflist", func(t *testing.T) {
		mark := m1.Len()
		path := filepath.Join(h.confDir, "10-kindnet.conflist")
		own := filepath.Join(h.confDir, cni.OwnConflist)
		// As kindnet does at every start: a new file renamed over the old
		// one, here with a new MTU.
		rewritten := strings.Replace(testConflist, `"mtu": 1500`, `"mtu": 1400`, 1)
		tmp := filepath.Join(h.confDir, "kindnet.tmp")
		if err := os.WriteFile(tmp, []byte(rewritten), 0o644); err != nil {
			t.Fatal(err)
		}
		if err := os.Rename(tmp, path); err != nil {
			t.Fatal(err)
		}
		waitLog(t, m1, mark, "copy updated", func(l noderun.Line) bool {
			return l.Str("message") == "meshtun-cni's conflist written" && l.Str("conflist") == own && l.Str("pod_network") == path
		})
		data := mustRead(t, own)
		if !cni.HasPlugin(data) || !strings.Contains(string(data), "1400") {
			t.Errorf("meshtun's conflist after the pod network's rewrite:\n%s", data)
		}
		if string(mustRead(t, path)) != rewritten {
			t.Errorf("the node edited the pod network's own file:\n%s", mustRead(t, path))
		}
	})

	t.Run("ADD fails once the node stops", func(t *testing.T) {
		again := pendingPod(t, k, p12, "apps", "later", "later")
		if err := m1.Stop(syscall.SIGTERM); err != nil {
			t.Logf("stop: %v", err)
		}
		code, out := h.add(t, p12, "apps", "later", string(again.UID))
		if code == 0 {
			t.Fatalf("ADD of an enrolled pod succeeded after the node stopped: %s", out)
		}
		// The state file the node left lets a pod of a namespace outside
		// the mesh start.
		code, out = h.add(t, p12, "plain", "db", "")
		if code != 0 {
			t.Errorf("ADD of a pod outside the mesh with the node stopped: exit %d: %s", code, out)
		}
		if !cni.HasPlugin(mustRead(t, filepath.Join(h.confDir, cni.OwnConflist))) {
			t.Error("the stopping node removed meshtun's conflist: pods would start uncaptured before the next one")
		}
	})
}

func mustRead(t *testing.T, path string) []byte {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return data
}

// run2 reports pod (created pending) running and ready with p's
// addresses, as the kubelet does once its sandbox and containers started.
func (k kubelet) run2(t *testing.T, pod *corev1.Pod, p *cluster.Pod) {
	t.Helper()
	ctx := context.Background()
	cur, err := k.cs.CoreV1().Pods(pod.Namespace).Get(ctx, pod.Name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	now := metav1.Now()
	cur.Status = corev1.PodStatus{
		Phase: corev1.PodRunning, PodIP: p.IPv4.String(),
		PodIPs:    []corev1.PodIP{{IP: p.IPv4.String()}, {IP: p.IPv6.String()}},
		HostIP:    p.Node.IPv4.String(),
		StartTime: &now,
		Conditions: []corev1.PodCondition{
			{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
		},
	}
	if _, err := k.cs.CoreV1().Pods(pod.Namespace).UpdateStatus(ctx, cur, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
}
