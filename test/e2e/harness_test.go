package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
)

// meshtunBin is the binary under test, built once by TestMain.
var meshtunBin string

func TestMain(m *testing.M) {
	if spec := os.Getenv(flooderEnv); spec != "" {
		os.Exit(runFlooder(spec))
	}
	var remove func()
	var err error
	if meshtunBin, remove, err = noderun.Build("../.."); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
	code := m.Run()
	remove()
	os.Exit(code)
}

// nodeProc is a `meshtun node` under test.
type nodeProc struct{ *noderun.Process }

func (p nodeProc) stop(sig syscall.Signal) error { return p.Stop(sig) }
func (p nodeProc) dump() string                  { return p.Logs() }

// startMeshNode starts meshtun in n's namespace, capturing every pod,
// with the pods in outside left out of the mesh and those in strict in
// STRICT mode, and waits until it reports ready. It is stopped at the end
// of the test if still running.
func startMeshNode(t testing.TB, c *cluster.Cluster, n *cluster.Node, outside, strict map[string]bool, extra ...string) nodeProc {
	t.Helper()
	m := noderun.Mesh{Pods: map[string]noderun.Pod{}}
	for id := range outside {
		m.Pods[id] = noderun.Pod{Outside: true}
	}
	for id := range strict {
		m.Pods[id] = noderun.Pod{Strict: true}
	}
	return startWithConfig(t, n, writeConfig(t, c, m), extra...)
}

// writeConfig writes the config of cluster c with mesh m into the
// cluster's directory and returns its path. The first time, it starts
// `meshtun ca` on the cluster's control host with that file; the service
// follows later versions of it.
func writeConfig(t testing.TB, c *cluster.Cluster, m noderun.Mesh) string {
	t.Helper()
	path, err := noderun.WriteConfig(c, clusterDir(t, c), m)
	if err != nil {
		t.Fatal(err)
	}
	if !m.InsecureSharedCA {
		startCA(t, c, path)
	}
	return path
}

// harness is what the tests know about the clusters they made, for the
// helpers below: each cluster's directory (its config file and CA) and
// certificate service, and which cluster a config file belongs to. Tests
// that run in parallel share it; its lock makes "start the CA unless it
// runs" one step.
type harness struct {
	mu       sync.Mutex
	dirs     map[*cluster.Cluster]string
	cas      map[*cluster.Cluster]*noderun.Process // the cluster stops each when it closes
	clusters map[string]*cluster.Cluster           // config path → cluster whose CA serves it
}

// lab is the harness of this test binary.
var lab = &harness{
	dirs:     map[*cluster.Cluster]string{},
	cas:      map[*cluster.Cluster]*noderun.Process{},
	clusters: map[string]*cluster.Cluster{},
}

// dir returns the directory of c's config file and CA, a temporary
// directory of t the first time.
func (h *harness) dir(t testing.TB, c *cluster.Cluster) string {
	h.mu.Lock()
	defer h.mu.Unlock()
	d, ok := h.dirs[c]
	if !ok {
		d = t.TempDir()
		h.dirs[c] = d
	}
	return d
}

// startCA starts `meshtun ca` for c with the config at path unless it runs
// already, and returns it.
func (h *harness) startCA(t testing.TB, c *cluster.Cluster, path string) *noderun.Process {
	t.Helper()
	h.mu.Lock()
	defer h.mu.Unlock()
	if p, ok := h.cas[c]; ok {
		return p
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	p, err := noderun.StartCA(ctx, meshtunBin, c, path, "--log-level", "debug")
	if err != nil {
		t.Fatal(err)
	}
	h.cas[c] = p
	h.clusters[path] = c
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("meshtun ca log:\n%s", p.Logs())
		}
	})
	return p
}

// hasCA reports whether a certificate service serves the config at path:
// then a node started with it needs its credentials issued.
func (h *harness) hasCA(path string) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	_, ok := h.clusters[path]
	return ok
}

// startCA starts `meshtun ca` for c unless it runs already, and returns it.
func startCA(t testing.TB, c *cluster.Cluster, path string) *noderun.Process {
	t.Helper()
	return lab.startCA(t, c, path)
}

// startWithConfig starts meshtun in n's namespace with the config file at
// path and waits until it reports ready. It is stopped at the end of the
// test if still running, and its log is shown if the test failed.
func startWithConfig(t testing.TB, n *cluster.Node, path string, extra ...string) nodeProc {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	args := append([]string{"--config", path, "--log-level", "debug"}, extra...)
	if lab.hasCA(path) {
		cred := noderun.CredentialDir(path, n)
		if _, err := os.Stat(cred); err != nil {
			if cred, err = noderun.IssueNodeCredential(ctx, meshtunBin, path, n); err != nil {
				t.Fatal(err)
			}
		}
		args = append(args, "--credentials", cred)
	}
	p, err := noderun.Start(ctx, meshtunBin, n, args...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		p.Stop(syscall.SIGTERM)
		if t.Failed() {
			t.Logf("meshtun log of %s:\n%s", n.Name(), p.Logs())
		}
	})
	return nodeProc{p}
}

// clusterDir returns the directory of c's config file and CA.
func clusterDir(t testing.TB, c *cluster.Cluster) string { return lab.dir(t, c) }

// caDir returns the CA directory of c's certificate service.
func caDir(t testing.TB, c *cluster.Cluster) string {
	return filepath.Join(clusterDir(t, c), "ca")
}

// uninstall removes meshtun from n (`meshtun node --uninstall`), which a
// stopped proxy leaves blocking its pods' traffic.
func uninstall(t testing.TB, n *cluster.Node) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := noderun.Uninstall(ctx, meshtunBin, n); err != nil {
		t.Fatal(err)
	}
}

// waitCertified waits until every local workload of n holds its
// certificate (its readiness answers 200): a workload that joins the mesh
// is captured at once, and blocked for mesh connections until its
// certificate comes (the CA may read the same config change later, and
// the node retries).
func waitCertified(t testing.TB, n *cluster.Node) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		code, body := httpGet(t, n.NS, "http://127.0.0.1:15021/healthz/ready")
		if code == 200 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s not ready 10 s after the change: %d %s", n.Name(), code, body)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
