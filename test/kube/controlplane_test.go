package kube

import (
	"context"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshtun/meshtun/bench/cluster"
)

// buildT builds (or finds in the cache) the control-plane binaries.
func buildT(t testing.TB) Binaries {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Minute)
	defer cancel()
	b, err := Build(ctx, t.Logf)
	if err != nil {
		t.Fatalf("build the control plane: %v", err)
	}
	return b
}

// controlPlaneT starts a control plane in c's external host and stops it
// in t.Cleanup.
func controlPlaneT(t testing.TB, c *cluster.Cluster) *ControlPlane {
	t.Helper()
	bins := buildT(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cp, err := StartControlPlane(ctx, bins, c.External, t.TempDir(), t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(cp.Stop)
	return cp
}

func TestControlPlane(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "kcp", Nodes: 1})
	cp := controlPlaneT(t, c)
	ctx := context.Background()
	ns, err := cp.Admin.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("namespace %s, uid %s", ns.Name, ns.UID)
	cp.StopAPIServer()
	if _, err := cp.Admin.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{}); err == nil {
		t.Fatal("the API server answers after StopAPIServer")
	}
	if err := cp.StartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := cp.Admin.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
}
