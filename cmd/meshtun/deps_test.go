package main

import (
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/meshtun/meshtun/bench/noderun"
)

// TestBinaryLeavesOut checks that packages that cost the binary its size
// and its RSS at start stay out of meshtun as every build makes it (with
// noderun.BuildTags): see
// docs/decisions/2026-12-01-binary-size-rss.md.
func TestBinaryLeavesOut(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "-tags", noderun.BuildTags, ".").Output()
	if err != nil {
		t.Fatalf("go list: %v", err)
	}
	deps := map[string]bool{}
	for _, p := range strings.Fields(string(out)) {
		deps[p] = true
	}
	if !deps["github.com/meshtun/meshtun/mesh/node"] {
		t.Fatalf("go list -deps does not list mesh/node: %q", out)
	}
	for p, why := range map[string]string{
		// Its html/template calls reflect.Value.MethodByName with a
		// name known only at run time: the linker then keeps every
		// exported method of every reachable type.
		"golang.org/x/net/trace": "gRPC's tracing (build tag grpcnotrace)",
		"text/template":          "dynamic method lookup, which turns off the linker's dead-code elimination of methods",
		// Its init registers every built-in API group: use package
		// mesh/kube/kubeapi, not client-go's clientset, informer
		// factory, discovery or typed clients.
		"k8s.io/client-go/kubernetes/scheme": "all of Kubernetes' API types, registered at start",
		// The DaemonSet image ships this binary: no test code in it.
		"testing": "test code (bench/cluster's NewT takes cluster.TB for this)",
	} {
		if deps[p] {
			t.Errorf("meshtun links %s: %s", p, why)
		}
	}
	for p := range deps {
		if strings.HasPrefix(p, "github.com/meshtun/meshtun/test/") {
			t.Errorf("meshtun links %s: test code; what demo and bench need belongs in a product package", p)
		}
	}
	// The node image's build (deploy/image: -tags nolab) has no lab
	// commands: no namespace-cluster builder, no bench, no demo.
	out, err = exec.Command("go", "list", "-deps", "-tags", noderun.BuildTags+",nolab", ".").Output()
	if err != nil {
		t.Fatalf("go list -tags nolab: %v", err)
	}
	for _, p := range strings.Fields(string(out)) {
		if strings.HasPrefix(p, "github.com/meshtun/meshtun/bench") || p == "github.com/meshtun/meshtun/cmd/meshtun/internal/demo" {
			t.Errorf("meshtun -tags nolab links %s: a lab package in the node image's binary", p)
		}
	}
	mk, err := os.ReadFile("../../Makefile")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(mk), "GOTAGS  := "+noderun.BuildTags+"\n") {
		t.Errorf("the Makefile's GOTAGS is not noderun.BuildTags (%q)", noderun.BuildTags)
	}
}
