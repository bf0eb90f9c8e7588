package kube

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/restmapper"
)

// Manifest is one object of a manifest file.
type Manifest struct {
	File string
	Obj  *unstructured.Unstructured
}

// ReadManifests reads every Kubernetes object of the YAML files in dir,
// in file-name order; documents that are not Kubernetes objects (a kind
// cluster config) are left out.
func ReadManifests(dir string) ([]Manifest, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil {
		return nil, err
	}
	sort.Strings(files)
	var out []Manifest
	for _, f := range files {
		ms, err := readManifestFile(f)
		if err != nil {
			return nil, err
		}
		out = append(out, ms...)
	}
	return out, nil
}

// readManifestFile reads the Kubernetes objects of one YAML file.
func readManifestFile(f string) ([]Manifest, error) {
	var out []Manifest
	data, err := os.ReadFile(f)
	if err != nil {
		return nil, err
	}
	dec := yaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	for {
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			if errors.Is(err, io.EOF) {
				break
			}
			return nil, fmt.Errorf("%s: %w", f, err)
		}
		if len(m) == 0 {
			continue
		}
		u := &unstructured.Unstructured{Object: m}
		out = append(out, Manifest{File: filepath.Base(f), Obj: u})
	}
	return out, nil
}

// Apply server-side applies the manifests through the admin client (as a
// dry run if dryRun), and returns the first error naming file and object.
func (cp *ControlPlane) Apply(ctx context.Context, ms []Manifest, dryRun bool) error {
	dc, err := discovery.NewDiscoveryClientForConfig(cp.AdminConfig)
	if err != nil {
		return err
	}
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(dc))
	dyn, err := dynamic.NewForConfig(cp.AdminConfig)
	if err != nil {
		return err
	}
	opts := metav1.ApplyOptions{FieldManager: "meshtun-e2e", Force: true}
	if dryRun {
		opts.DryRun = []string{metav1.DryRunAll}
	}
	for _, m := range ms {
		gvk := m.Obj.GroupVersionKind()
		mapping, err := mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
		if err != nil {
			return fmt.Errorf("%s: %s %s: %w", m.File, gvk.Kind, m.Obj.GetName(), err)
		}
		var ri dynamic.ResourceInterface = dyn.Resource(mapping.Resource)
		if ns := m.Obj.GetNamespace(); ns != "" {
			ri = dyn.Resource(mapping.Resource).Namespace(ns)
		}
		if _, err := ri.Apply(ctx, m.Obj.GetName(), m.Obj, opts); err != nil {
			return fmt.Errorf("%s: %s %s: %w", m.File, gvk.Kind, m.Obj.GetName(), err)
		}
	}
	return nil
}
