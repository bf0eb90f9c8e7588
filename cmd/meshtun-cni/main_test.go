package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/cni"
	"github.com/meshtun/meshtun/mesh/gate"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/test/fixture"
)

// pluginBin is the plugin as the runtime execs it, built by TestMain.
var pluginBin string

func TestMain(m *testing.M) { fixture.MainWithBinary(m, &pluginBin, cni.PluginType, ".", "-trimpath") }

// fakeNode is the node proxy's part the gate asks (its API server caches)
// and reports to (its capture), in memory: a pod of an enrolled
// namespace is captured at the first rebuild after its announcement,
// unless capture is off.
type fakeNode struct {
	mu       sync.Mutex
	g        *gate.Gate
	pods     map[string]gate.Pod
	enrolled map[string]bool
	capture  bool
	rebuilds int
}

func (f *fakeNode) Pod(ns, name string) (gate.Pod, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	p, ok := f.pods[ns+"/"+name]
	return p, ok
}

func (f *fakeNode) Exempt() []string {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []string
	for ns, e := range f.enrolled {
		if !e {
			out = append(out, ns)
		}
	}
	return out
}

// Rebuild plays the model's rebuild and the node's install: the
// announced pods become captured workloads.
func (f *fakeNode) Rebuild() {
	go func() {
		f.mu.Lock()
		f.rebuilds++
		var ws []*registry.Workload
		if f.capture {
			for key, p := range f.pods {
				ns, name, _ := strings.Cut(key, "/")
				if addrs := f.g.Announced(ns, name, p.UID); len(addrs) > 0 && p.InMesh {
					ws = append(ws, &registry.Workload{Namespace: ns, Name: name, Addresses: addrs})
				}
			}
		}
		f.mu.Unlock()
		f.g.Captured(ws)
	}()
}

func (f *fakeNode) addPod(ns, name string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	inMesh := f.enrolled[ns]
	f.pods[ns+"/"+name] = gate.Pod{UID: "uid-" + name, Node: "n1", InMesh: inMesh, Reason: map[bool]string{false: "namespace not enrolled"}[inMesh]}
}

// startNode serves a gate on a socket in dir, as `meshtun node --cni`
// does once ready; the returned function stops it (the socket goes).
func startNode(t *testing.T, dir string, timeout time.Duration) (*fakeNode, func()) {
	t.Helper()
	f := &fakeNode{pods: map[string]gate.Pod{}, enrolled: map[string]bool{"mesh": true, "plain": false, "kube-system": false}, capture: true}
	f.g = gate.New(gate.Config{
		Node: "n1", Socket: filepath.Join(dir, "cni.sock"), StateFile: filepath.Join(dir, "state.json"),
		Pods: f, Timeout: timeout, Logger: zerolog.New(zerolog.NewTestWriter(t)),
	})
	if err := f.g.WriteState(); err != nil {
		t.Fatal(err)
	}
	l, err := f.g.Listen()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- f.g.ServeListener(ctx, l) }()
	stop := func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	}
	t.Cleanup(func() {
		if ctx.Err() == nil {
			stop()
		}
	})
	return f, stop
}

// ptpResult is what the ptp plugin returns for a pod: its veth's host end
// (no sandbox) and the pod's eth0, and both addresses.
const ptpResult = `{"cniVersion":"1.0.0","interfaces":[{"name":"veth1a2b3c4d","mac":"aa:bb:cc:dd:ee:01"},` +
	`{"name":"eth0","mac":"aa:bb:cc:dd:ee:02","sandbox":"/var/run/netns/cni-1234"}],` +
	`"ips":[{"interface":1,"address":"10.244.1.7/24","gateway":"10.244.1.1"},{"interface":1,"address":"fd00:10:244:1::7/64"}],` +
	`"dns":{}}`

type result struct {
	code   int
	stdout string
	stderr string
}

// execPlugin runs the plugin binary as the runtime does: CNI_* variables
// and the network configuration (with prevResult) on stdin.
func execPlugin(t *testing.T, command, dir, ns, name string, extra map[string]any) result {
	t.Helper()
	conf := map[string]any{
		"cniVersion": "1.0.0", "name": "kindnet", "type": cni.PluginType,
		"socket": filepath.Join(dir, "cni.sock"), "stateFile": filepath.Join(dir, "state.json"),
		"exemptNamespaces": []string{"meshtun-system"}, "timeoutSeconds": 20,
		"prevResult": json.RawMessage(ptpResult),
	}
	for k, v := range extra {
		conf[k] = v
	}
	stdin, _ := json.Marshal(conf)
	cmd := exec.Command(pluginBin)
	cmd.Env = []string{
		"CNI_COMMAND=" + command, "CNI_CONTAINERID=sandbox-" + name, "CNI_NETNS=/var/run/netns/cni-1234",
		"CNI_IFNAME=eth0", "CNI_PATH=/opt/cni/bin",
		"CNI_ARGS=IgnoreUnknown=1;K8S_POD_NAMESPACE=" + ns + ";K8S_POD_NAME=" + name + ";K8S_POD_INFRA_CONTAINER_ID=sandbox-" + name + ";K8S_POD_UID=uid-" + name,
	}
	cmd.Stdin = bytes.NewReader(stdin)
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	err := cmd.Run()
	code := 0
	if ee, ok := err.(*exec.ExitError); ok {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return result{code: code, stdout: out.String(), stderr: errb.String()}
}

// passedThrough checks that the plugin printed the previous result.
func passedThrough(t *testing.T, r result) {
	t.Helper()
	if r.code != 0 {
		t.Fatalf("exit %d, stdout %s, stderr %s", r.code, r.stdout, r.stderr)
	}
	var got, want any
	if err := json.Unmarshal([]byte(r.stdout), &got); err != nil {
		t.Fatalf("stdout %q: %v", r.stdout, err)
	}
	json.Unmarshal([]byte(ptpResult), &want)
	g, _ := json.Marshal(got)
	w, _ := json.Marshal(want)
	if !bytes.Equal(g, w) {
		t.Errorf("result %s, want the previous result %s", g, w)
	}
}

// failedRetry checks that the plugin failed the ADD with CNI's "try again
// later" and that the reason names want.
func failedRetry(t *testing.T, r result, want string) {
	t.Helper()
	if r.code == 0 {
		t.Fatalf("exit 0 (stdout %s): the ADD must fail", r.stdout)
	}
	var e cniError
	if err := json.Unmarshal([]byte(r.stdout), &e); err != nil {
		t.Fatalf("stdout %q is not a CNI error: %v", r.stdout, err)
	}
	if e.Code != codeTryAgainLater {
		t.Errorf("code %d, want %d", e.Code, codeTryAgainLater)
	}
	if !strings.Contains(e.Msg+": "+e.Details, want) {
		t.Errorf("error %q: want it to say %q", e.Msg+": "+e.Details, want)
	}
}

// TestAddEnrolled: an enrolled pod's ADD returns only once the node has
// captured the addresses and host link of the previous result, and then
// passes that result on.
func TestAddEnrolled(t *testing.T) {
	fixture.RequireRoot(t, "the gate answers only root peers: the plugin runs as root")
	dir := t.TempDir()
	f, _ := startNode(t, dir, 10*time.Second)
	f.addPod("mesh", "web")
	r := execPlugin(t, "ADD", dir, "mesh", "web", nil)
	passedThrough(t, r)
	addrs := f.g.Announced("mesh", "web", "uid-web")
	if fmt.Sprint(addrs) != "[10.244.1.7 fd00:10:244:1::7]" {
		t.Errorf("announced %v, want both addresses of prevResult", addrs)
	}
	if link, ok := f.g.LinkHint(netip.MustParseAddr("10.244.1.7")); !ok || link != "veth1a2b3c4d" {
		t.Errorf("host link %q %v, want veth1a2b3c4d", link, ok)
	}

	// DEL of that sandbox withdraws the announcement.
	if r := execPlugin(t, "DEL", dir, "mesh", "web", nil); r.code != 0 {
		t.Fatalf("DEL: exit %d: %s", r.code, r.stdout)
	}
	if addrs := f.g.Announced("mesh", "web", ""); addrs != nil {
		t.Errorf("after DEL: announced %v", addrs)
	}
}

// TestAddNotEnrolled: a pod outside the mesh passes at once, with nothing
// announced.
func TestAddNotEnrolled(t *testing.T) {
	dir := t.TempDir()
	f, _ := startNode(t, dir, 10*time.Second)
	f.addPod("plain", "db")
	passedThrough(t, execPlugin(t, "ADD", dir, "plain", "db", nil))
	if f.g.Pending() != 0 {
		t.Errorf("%d announcements for a pod outside the mesh", f.g.Pending())
	}
}

// TestAddNotCaptured: a node that cannot capture the pod (no certificate,
// no link) fails the ADD after its timeout, and withdraws what it
// announced.
func TestAddNotCaptured(t *testing.T) {
	fixture.RequireRoot(t, "the gate answers only root peers: the plugin runs as root")
	dir := t.TempDir()
	f, _ := startNode(t, dir, 300*time.Millisecond)
	f.capture = false
	f.addPod("mesh", "web")
	failedRetry(t, execPlugin(t, "ADD", dir, "mesh", "web", nil), "not captured in time")
	if f.g.Pending() != 0 {
		t.Errorf("%d announcements left after a failed ADD", f.g.Pending())
	}
}

// TestAddUnknownPod: a pod the node's caches do not hold yet fails (the
// kubelet retries), it does not pass.
func TestAddUnknownPod(t *testing.T) {
	fixture.RequireRoot(t, "the gate answers only root peers: the plugin runs as root")
	dir := t.TempDir()
	startNode(t, dir, 200*time.Millisecond)
	failedRetry(t, execPlugin(t, "ADD", dir, "mesh", "new", nil), "not in the node's API server caches")
}

// TestAddNodeDown: while the node does not answer, the ADD of a pod that
// may be in the mesh fails; pods of namespaces the node listed as outside
// the mesh, and of the conflist's exempt namespaces, pass. Without a state
// file only the exempt namespaces pass.
func TestAddNodeDown(t *testing.T) {
	dir := t.TempDir()
	_, stop := startNode(t, dir, time.Second)
	stop()
	if _, err := os.Stat(filepath.Join(dir, "cni.sock")); !os.IsNotExist(err) {
		t.Fatalf("socket still there after the node stopped: %v", err)
	}
	failedRetry(t, execPlugin(t, "ADD", dir, "mesh", "web", nil), "meshtun node not ready")
	failedRetry(t, execPlugin(t, "ADD", dir, "brand-new-namespace", "x", nil), "has not listed namespace brand-new-namespace")
	passedThrough(t, execPlugin(t, "ADD", dir, "plain", "db", nil))
	passedThrough(t, execPlugin(t, "ADD", dir, "meshtun-system", "ca", nil))

	// A socket nobody listens on (the node crashed) is the same.
	os.WriteFile(filepath.Join(dir, "cni.sock"), nil, 0o600)
	failedRetry(t, execPlugin(t, "ADD", dir, "mesh", "web", nil), "meshtun node not ready")

	os.Remove(filepath.Join(dir, "state.json"))
	failedRetry(t, execPlugin(t, "ADD", dir, "plain", "db", nil), "no state file")
	passedThrough(t, execPlugin(t, "ADD", dir, "meshtun-system", "ca", nil))

	// DEL succeeds whatever the node's state.
	if r := execPlugin(t, "DEL", dir, "mesh", "web", nil); r.code != 0 {
		t.Errorf("DEL with the node down: exit %d: %s", r.code, r.stdout)
	}
}

// TestNotChained: without a previous result the plugin refuses (it must
// come after the plugin that makes the pod's network); without pod
// arguments it passes (not a Kubernetes pod); VERSION answers.
func TestNotChained(t *testing.T) {
	dir := t.TempDir()
	startNode(t, dir, time.Second)
	r := execPlugin(t, "ADD", dir, "mesh", "web", map[string]any{"prevResult": nil})
	if r.code == 0 || !strings.Contains(r.stdout, "chained") {
		t.Errorf("no prevResult: exit %d, %s", r.code, r.stdout)
	}
	passedThrough(t, execPlugin(t, "ADD", dir, "", "", nil))
	cmd := exec.Command(pluginBin)
	cmd.Env = []string{"CNI_COMMAND=VERSION"}
	out, err := cmd.Output()
	if err != nil || !strings.Contains(string(out), `"1.1.0"`) {
		t.Errorf("VERSION: %s, %v", out, err)
	}
}
