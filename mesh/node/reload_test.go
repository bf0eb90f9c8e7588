package node

import (
	"bytes"
	"slices"
	"strings"
	"testing"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/registry"
)

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
