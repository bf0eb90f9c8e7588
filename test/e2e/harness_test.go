package e2e

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/meshtun/meshtun/test/cluster"
	"github.com/meshtun/meshtun/test/noderun"
)

// meshtunBin is the binary under test, built once by TestMain.
var meshtunBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "meshtun-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
	meshtunBin = filepath.Join(dir, "meshtun")
	build := exec.Command("go", "build", "-o", meshtunBin, "github.com/meshtun/meshtun/cmd/meshtun")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "e2e: build meshtun:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// nodeProc is a `meshtun node` under test.
type nodeProc struct{ *noderun.Process }

func (p nodeProc) stop(sig syscall.Signal) error { return p.Stop(sig) }
func (p nodeProc) dump() string                  { return p.Logs() }

// startNode starts meshtun in n's namespace, capturing every pod, and waits
// until it reports ready. It is stopped at the end of the test if still
// running.
func startNode(t testing.TB, c *cluster.Cluster, n *cluster.Node, extra ...string) nodeProc {
	return startMeshNode(t, c, n, nil, nil, extra...)
}

// startMeshNode is startNode with the pods in outside left out of the mesh
// and those in strict in STRICT mode.
func startMeshNode(t testing.TB, c *cluster.Cluster, n *cluster.Node, outside, strict map[string]bool, extra ...string) nodeProc {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	args := append(noderun.MeshArgs(c, caDir(t, c), outside, strict), "--log-level", "debug")
	p, err := noderun.Start(ctx, meshtunBin, n, append(args, extra...)...)
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

var caDirs sync.Map // *cluster.Cluster → string

// caDir returns the CA directory shared by the nodes of c.
func caDir(t testing.TB, c *cluster.Cluster) string {
	if d, ok := caDirs.Load(c); ok {
		return d.(string)
	}
	d := t.TempDir()
	caDirs.Store(c, d)
	return d
}
