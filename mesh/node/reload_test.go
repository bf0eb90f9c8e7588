package node

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/config"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/test/fixture"
)

// meshFile is a valid config whose only workload has address 198.18.1.<n>.
func meshFile(td string, n int) string {
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
	write(t, path, initial)
	c, err := config.Load(path)
	if err != nil {
		t.Fatal(err)
	}
	snap, err := c.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	rig := &reloadRig{path: path, applied: make(chan string, 16), errs: make(chan error, 16), log: &syncBuffer{}}
	rig.r = &reloader{
		path: path, inForce: c.Sum(), td: snap.TrustDomain, log: zerolog.New(rig.log),
		apply: func(c *config.Config, s *registry.Snapshot) {
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
		done <- config.Watch(ctx, rig.path, rig.r.onChange, func(err error) {
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

func write(t *testing.T, path, content string) {
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
	case <-time.After(2 * config.Debounce):
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
	rig := newReloadRig(t, meshFile("cluster.local", 1))
	write(t, rig.path, meshFile("cluster.local", 2))
	rig.start(t)
	rig.wantApplied(t, "198.18.1.2")
}

// TestReloadValidAfterInvalidFirstRead: after an invalid first read, the
// next valid change is applied.
func TestReloadValidAfterInvalidFirstRead(t *testing.T) {
	rig := newReloadRig(t, meshFile("cluster.local", 1))
	write(t, rig.path, "workloads: [{name: a, addresses: [not-an-ip]}]\n")
	rig.start(t)
	rig.wantError(t)
	write(t, rig.path, meshFile("cluster.local", 3))
	rig.wantApplied(t, "198.18.1.3")
}

// TestReloadUnchanged: the watcher's first read of the config in force
// applies nothing; a later change is applied, and a change back to the
// same content as the one in force is not applied again.
func TestReloadUnchanged(t *testing.T) {
	rig := newReloadRig(t, meshFile("cluster.local", 1))
	rig.start(t)
	rig.wantNothingApplied(t)
	write(t, rig.path, meshFile("cluster.local", 4))
	rig.wantApplied(t, "198.18.1.4")
	// Same model, another byte: a comment makes another content.
	write(t, rig.path, meshFile("cluster.local", 4)+"# touched\n")
	rig.wantApplied(t, "198.18.1.4")
}

// TestReloadRefusesTrustDomainChange: a new trust domain is not applied
// (the CA, SVIDs and TLS verification are the running one's) and the log
// says why; a later valid change in the old trust domain is applied.
func TestReloadRefusesTrustDomainChange(t *testing.T) {
	rig := newReloadRig(t, meshFile("cluster.local", 1))
	rig.start(t)
	write(t, rig.path, meshFile("other.example", 5))
	rig.wantNothingApplied(t)
	deadline := time.Now().Add(5 * time.Second)
	for !strings.Contains(rig.log.String(), "the trust domain changed from cluster.local to other.example, which needs a restart") {
		if time.Now().After(deadline) {
			t.Fatalf("no error for the trust domain change; log:\n%s", rig.log)
		}
		time.Sleep(10 * time.Millisecond)
	}
	write(t, rig.path, meshFile("cluster.local", 6))
	rig.wantApplied(t, "198.18.1.6")
}

// fakeSVIDs records the identities syncSVIDs keeps.
type fakeSVIDs struct{ ids []spiffeid.ID }

func (f *fakeSVIDs) IDs() []spiffeid.ID { return slices.Clone(f.ids) }
func (f *fakeSVIDs) Remove(id spiffeid.ID) {
	f.ids = slices.DeleteFunc(f.ids, func(x spiffeid.ID) bool { return x == id })
}

// TestSyncSVIDsRemovesGone: a reload that removes a node's workload
// removes its identity's SVID; an identity another local workload still
// has is kept, and so is one whose first issuance is under way.
func TestSyncSVIDsRemovesGone(t *testing.T) {
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	a := spiffeid.RequireFromSegments(td, "ns", "default", "sa", "a")
	b := spiffeid.RequireFromSegments(td, "ns", "default", "sa", "b")
	c := spiffeid.RequireFromSegments(td, "ns", "default", "sa", "c")
	src := &fakeSVIDs{ids: []spiffeid.ID{a, b, c}}
	want := []*registry.Workload{{Name: "a1", Identity: a}, {Name: "a2", Identity: a}, {Name: "c", Identity: c}}
	if n := syncSVIDs(src, want, zerolog.Nop()); n != 1 {
		t.Errorf("removed %d, want 1", n)
	}
	got := src.IDs()
	slices.SortFunc(got, func(x, y spiffeid.ID) int { return strings.Compare(x.String(), y.String()) })
	if !slices.Equal(got, []spiffeid.ID{a, c}) {
		t.Errorf("identities %v, want [%v %v]", got, a, c)
	}
}

// TestNoInterceptWarns: --no-intercept installs no policy and warns that
// nothing is enforced.
func TestNoInterceptWarns(t *testing.T) {
	var buf bytes.Buffer
	if p := interceptPolicy(nil, Config{Name: "n1", NoIntercept: true}, nil, zerolog.New(&buf)); p != nil {
		t.Errorf("policy %v with NoIntercept, want nil", p)
	}
	if out := buf.String(); !strings.Contains(out, `"level":"warn"`) || !strings.Contains(out, "NOTHING IS ENFORCED") {
		t.Errorf("log %q, want a warning that nothing is enforced", out)
	}
}
