package kube

import (
	"context"
	"strings"
	"testing"

	"golang.org/x/mod/modfile"
)

// The generated go.mod replaces every staging module, among them the ones
// kube-apiserver cannot build without, by its release.
func TestAPIServerGoMod(t *testing.T) {
	dir, err := CacheDir()
	if err != nil {
		t.Fatal(err)
	}
	gomod, err := apiServerGoMod(context.Background(), dir)
	if err != nil {
		t.Fatal(err)
	}
	f, err := modfile.Parse("go.mod", []byte(gomod), nil)
	if err != nil {
		t.Fatalf("%v\n%s", err, gomod)
	}
	got := map[string]string{}
	for _, r := range f.Replace {
		got[r.Old.Path] = r.New.Version
	}
	for _, m := range []string{"k8s.io/api", "k8s.io/apiserver", "k8s.io/client-go", "k8s.io/kube-aggregator", "k8s.io/apiextensions-apiserver"} {
		if got[m] != StagingVersion {
			t.Errorf("%s replaced by %q, want %s", m, got[m], StagingVersion)
		}
	}
	if _, ok := got["k8s.io/utils"]; ok || strings.Contains(gomod, "=> ../") {
		t.Errorf("replaces a module that is not a staging module, or a directory:\n%s", gomod)
	}
}
