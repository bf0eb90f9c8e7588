package config

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/test/fixture"
)

// reloadFile is a valid config whose only workload has address 198.18.1.<n>.
func reloadFile(td string, n int) string {
	return fmt.Sprintf("trustDomain: %s\nnodes: [{name: n1}]\nworkloads: [{name: a, node: n1, addresses: [198.18.1.%d]}]\n", td, n)
}

// syncBuffer is the shared log sink of test/fixture.
type syncBuffer = fixture.SyncBuffer

// reloadRig runs config.Watch on a temporary file with a reloader whose
// start-up config is the file's content when the rig is made.
type reloadRig struct {
	path    string
	applied chan string // the first workload address of each applied config
	errs    chan error
	log     *syncBuffer
	r       *reloader
}

func newReloadRig(t *testing.T, initial string) *reloadRig {
	t.Helper()
	path := filepath.Join(t.TempDir(), "mesh.yaml")
	writeFile(t, path, initial)
	c, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	snap, err := c.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	rig := &reloadRig{path: path, applied: make(chan string, 16), errs: make(chan error, 16), log: &syncBuffer{}}
	rig.r = &reloader{
		path: path, node: "n1", inForce: c.Sum(), td: snap.TrustDomain, log: zerolog.New(rig.log),
		apply: func(c *Config, s *registry.Snapshot) {
			rig.applied <- c.Workloads[0].Addresses[0].String()
		},
	}
	return rig
}

// start starts the watch; it reads the file once the watch is in place.
func (rig *reloadRig) start(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Watch(ctx, rig.path, rig.r.onChange, func(err error) {
			rig.r.onError(err)
			rig.errs <- err
		})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; !errors.Is(err, context.Canceled) {
			t.Errorf("Watch: %v", err)
		}
	})
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
}

func (rig *reloadRig) wantApplied(t *testing.T, addr string) {
	t.Helper()
	select {
	case got := <-rig.applied:
		if got != addr {
			t.Fatalf("applied the config with %s, want %s", got, addr)
		}
	case <-time.After(5 * time.Second):
		t.Fatalf("the config with %s was never applied; log:\n%s", addr, rig.log)
	}
}

func (rig *reloadRig) wantNothingApplied(t *testing.T) {
	t.Helper()
	select {
	case got := <-rig.applied:
		t.Fatalf("applied the config with %s, want nothing applied", got)
	case <-time.After(2 * Debounce):
	}
}

func (rig *reloadRig) wantError(t *testing.T) {
	t.Helper()
	select {
	case <-rig.errs:
	case <-time.After(5 * time.Second):
		t.Fatal("no error reported for an invalid file")
	}
}

// TestReloadChangeBeforeWatch: a change made between the start-up load and
// the watch is applied by the watcher's first read (it was dropped when
// the first delivery was skipped by position, not by content).
func TestReloadChangeBeforeWatch(t *testing.T) {
	rig := newReloadRig(t, reloadFile("cluster.local", 1))
	writeFile(t, rig.path, reloadFile("cluster.local", 2))
	rig.start(t)
	rig.wantApplied(t, "198.18.1.2")
}

// TestReloadValidAfterInvalidFirstRead: after an invalid first read, the
// next valid change is applied.
func TestReloadValidAfterInvalidFirstRead(t *testing.T) {
	rig := newReloadRig(t, reloadFile("cluster.local", 1))
	writeFile(t, rig.path, "workloads: [{name: a, addresses: [not-an-ip]}]\n")
	rig.start(t)
	rig.wantError(t)
	writeFile(t, rig.path, reloadFile("cluster.local", 3))
	rig.wantApplied(t, "198.18.1.3")
}

// TestReloadUnchanged: the watcher's first read of the config in force
// applies nothing; a later change is applied, and a change back to the
// same content as the one in force is not applied again.
func TestReloadUnchanged(t *testing.T) {
	rig := newReloadRig(t, reloadFile("cluster.local", 1))
	rig.start(t)
	rig.wantNothingApplied(t)
	writeFile(t, rig.path, reloadFile("cluster.local", 4))
	rig.wantApplied(t, "198.18.1.4")
	// Same model, another byte: a comment makes another content.
	writeFile(t, rig.path, reloadFile("cluster.local", 4)+"# touched\n")
	rig.wantApplied(t, "198.18.1.4")
}

// TestReloadRefusesTrustDomainChange: a new trust domain is not applied
// (the CA, SVIDs and TLS verification are the running one's) and the log
// says why; a later valid change in the old trust domain is applied.
func TestReloadRefusesTrustDomainChange(t *testing.T) {
	rig := newReloadRig(t, reloadFile("cluster.local", 1))
	rig.start(t)
	writeFile(t, rig.path, reloadFile("other.example", 5))
	rig.wantNothingApplied(t)
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(rig.log.String(), "the trust domain changed from cluster.local to other.example, which needs a restart") {
		if time.Now().After(deadline) {
			t.Fatalf("no error for the trust domain change; log:\n%s", rig.log)
		}
		time.Sleep(10 * time.Millisecond)
	}
	writeFile(t, rig.path, reloadFile("cluster.local", 6))
	rig.wantApplied(t, "198.18.1.6")
}

// TestReloadRefusesNodeGone: a change that removes the node from the file
// is not applied (its capture would go with it); the log says why.
func TestReloadRefusesNodeGone(t *testing.T) {
	rig := newReloadRig(t, reloadFile("cluster.local", 1))
	rig.start(t)
	writeFile(t, rig.path, strings.ReplaceAll(reloadFile("cluster.local", 7), "n1", "n2"))
	rig.wantNothingApplied(t)
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(rig.log.String(), "this node is gone from the file") {
		if time.Now().After(deadline) {
			t.Fatalf("the log does not say the node is gone:\n%s", rig.log)
		}
		time.Sleep(10 * time.Millisecond)
	}
	writeFile(t, rig.path, reloadFile("cluster.local", 8))
	rig.wantApplied(t, "198.18.1.8")
}

// TestFileSource: Start delivers the start-up config's model with its
// capture links known; a valid change of the file arrives on Updates and
// is counted in the status.
func TestFileSource(t *testing.T) {
	path := filepath.Join(t.TempDir(), "mesh.yaml")
	writeFile(t, path, reloadFile("cluster.local", 1))
	c, err := Load(path)
	if err != nil {
		t.Fatal(err)
	}
	src := NewFileSource(c, "n1", zerolog.Nop())
	var _ registry.Source = src
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	snap, err := src.Start(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !snap.LinksKnown || snap.Workload(netip.MustParseAddr("198.18.1.1")) == nil {
		t.Fatalf("first snapshot: links known %v, workloads %v", snap.LinksKnown, snap.Workloads)
	}
	writeFile(t, path, reloadFile("cluster.local", 2))
	select {
	case snap = <-src.Updates():
	case <-time.After(5 * time.Second):
		t.Fatal("no snapshot after a change of the file")
	}
	if snap.Workload(netip.MustParseAddr("198.18.1.2")) == nil {
		t.Errorf("update %v: want the workload at 198.18.1.2", snap.Workloads)
	}
	if st := src.SourceStatus().(FileStatus); st.Reloads != 1 || st.Path != path {
		t.Errorf("status %+v: want 1 reload of %s", st, path)
	}
}

// TestSnapshotCaptureLinks: a mesh workload's capture links are the one
// it names or, if it names none, its node's links no workload names;
// never another node's, and none for a workload outside the mesh.
func TestSnapshotCaptureLinks(t *testing.T) {
	c, err := Parse("mesh.yaml", []byte(`
nodes:
  - {name: n1, captureLinks: [spare]}
  - {name: n2}
workloads:
  - {name: a, node: n1, addresses: [198.18.1.11, "fd00:6d74:1::11"], captureLink: va}
  - {name: b, node: n1, addresses: [198.18.1.12], captureLink: vb}
  - {name: c, node: n1, addresses: [198.18.1.13]}
  - {name: d, node: n1, addresses: [198.18.1.14], mesh: false}
  - {name: e, node: n2, addresses: [198.18.2.11], captureLink: va}
  - {name: f, node: n2, addresses: [198.18.2.12]}
`))
	if err != nil {
		t.Fatal(err)
	}
	snap, err := c.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string][]string{}
	for _, w := range snap.Workloads {
		got[w.Name] = w.CaptureLinks
	}
	want := map[string][]string{"a": {"va"}, "b": {"vb"}, "c": {"spare"}, "d": nil, "e": {"va"}, "f": nil}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Errorf("capture links %v, want %v", got, want)
	}
}
