package workloadid

import (
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
)

func TestNewSplit(t *testing.T) {
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	id, err := New(td, "default", "client")
	if err != nil || id.String() != "spiffe://cluster.local/ns/default/sa/client" {
		t.Fatalf("New = %v, %v", id, err)
	}
	if ns, sa, ok := Split(id.Path()); !ok || ns != "default" || sa != "client" {
		t.Errorf("Split(%q) = %q, %q, %v", id.Path(), ns, sa, ok)
	}
	if _, err := New(td, "a/b", "c"); err == nil {
		t.Error("New accepted a namespace with '/'")
	}
	for _, p := range []string{"", "/", "/ns/a", "/ns//sa/b", "/ns/a/sa/", "/ns/a/sa/b/c", "/ns/a/b/sa/c", "/meshtun/node/n1", "/sa/b/ns/a"} {
		if ns, sa, ok := Split(p); ok {
			t.Errorf("Split(%q) = %q, %q, ok; want not a workload path", p, ns, sa)
		}
	}
	if n := testing.AllocsPerRun(100, func() { Split("/ns/default/sa/client") }); n != 0 {
		t.Errorf("Split allocates %v times", n)
	}
}
