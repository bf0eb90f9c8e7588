package kube

import (
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"testing"

	sigsyaml "sigs.k8s.io/yaml"
)

// TestDeployDirIsKubernetesOnly: `kubectl apply -f deploy/kubernetes/`
// reads every *.yaml, *.yml and *.json of the directory as Kubernetes
// objects, so nothing else may be there (a kind cluster config made it
// fail, issue 21); `-k` reads the Kustomization, which must list the same
// files; and no line starts with "kind: Cluster" (a pre-stop hook of the
// kind harness greps for a kind config that way, and would take a
// ClusterRole for one).
func TestDeployDirIsKubernetesOnly(t *testing.T) {
	var yamls []string
	for _, pat := range []string{"*.yaml", "*.yml", "*.json"} {
		m, err := filepath.Glob(filepath.Join(deployDir, pat))
		if err != nil {
			t.Fatal(err)
		}
		yamls = append(yamls, m...)
	}
	clusterLine := regexp.MustCompile(`(?m)^kind: *Cluster`)
	for i, f := range yamls {
		data, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		if loc := clusterLine.FindIndex(data); loc != nil {
			t.Errorf("%s has a line starting %q", f, data[loc[0]:loc[1]])
		}
		yamls[i] = filepath.Base(f)
	}
	ms, err := ReadManifests(deployDir)
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range ms {
		switch g := m.Obj.GroupVersionKind().Group; g {
		case "", "apps", "rbac.authorization.k8s.io":
		default:
			t.Errorf("%s: %s of group %q is not a built-in Kubernetes object", m.File, m.Obj.GetKind(), g)
		}
	}

	data, err := os.ReadFile(filepath.Join(deployDir, "Kustomization"))
	if err != nil {
		t.Fatal(err)
	}
	var k struct {
		Kind      string   `json:"kind"`
		Resources []string `json:"resources"`
	}
	if err := sigsyaml.Unmarshal(data, &k); err != nil {
		t.Fatalf("Kustomization: %v", err)
	}
	if k.Kind != "Kustomization" {
		t.Errorf("Kustomization has kind %q", k.Kind)
	}
	slices.Sort(yamls)
	slices.Sort(k.Resources)
	if !slices.Equal(yamls, k.Resources) {
		t.Errorf("Kustomization lists %v, the directory has %v: -k and -f would apply different objects", k.Resources, yamls)
	}
}
