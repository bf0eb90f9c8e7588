package config

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// meshFile is a valid config whose only workload has address 198.18.1.<n>.
func meshFile(n int) string {
	return fmt.Sprintf("nodes: [{name: n1}]\nworkloads: [{name: a, node: n1, addresses: [198.18.1.%d]}]\n", n)
}

// watcher runs Watch and hands its callbacks to the test.
type watcher struct {
	changes chan *Config
	errs    chan error
	done    chan error
	cancel  context.CancelFunc
}

func startWatch(t *testing.T, path string) *watcher {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	w := &watcher{changes: make(chan *Config, 16), errs: make(chan error, 16), done: make(chan error, 1), cancel: cancel}
	go func() {
		w.done <- Watch(ctx, path, func(c *Config) { w.changes <- c }, func(err error) { w.errs <- err })
	}()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-w.done:
			if !errors.Is(err, context.Canceled) {
				t.Errorf("Watch returned %v, want context.Canceled", err)
			}
		case <-time.After(5 * time.Second):
			t.Error("Watch did not return after cancel")
		}
	})
	return w
}

const wait = 5 * time.Second

// change waits for the next onChange and checks the workload's address.
func (w *watcher) change(t *testing.T, n int) {
	t.Helper()
	select {
	case c := <-w.changes:
		if got, want := c.Workloads[0].Addresses[0].String(), fmt.Sprintf("198.18.1.%d", n); got != want {
			t.Fatalf("onChange with address %s, want %s", got, want)
		}
	case err := <-w.errs:
		t.Fatalf("onError(%v), want onChange", err)
	case <-time.After(wait):
		t.Fatalf("no onChange within %v", wait)
	}
}

// failure waits for the next onError and checks its text.
func (w *watcher) failure(t *testing.T, want string) {
	t.Helper()
	select {
	case c := <-w.changes:
		t.Fatalf("onChange(%v), want onError", c.Workloads)
	case err := <-w.errs:
		if !strings.Contains(err.Error(), want) {
			t.Fatalf("onError(%v), want it to contain %q", err, want)
		}
	case <-time.After(wait):
		t.Fatalf("no onError within %v", wait)
	}
}

// replace writes content to a temporary file and renames it over path, as
// editors and config management do.
func replace(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

func TestWatchReloads(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "mesh.yaml")
	if err := os.WriteFile(path, []byte(meshFile(1)), 0o644); err != nil {
		t.Fatal(err)
	}
	w := startWatch(t, path)
	w.change(t, 1) // the file as it is when the watch starts

	replace(t, path, meshFile(2)) // rename over the file
	w.change(t, 2)

	// Invalid: reported with its line, and no onChange: the caller keeps
	// the last good config.
	replace(t, path, "nodes: [{name: n1}]\nworkloads: [{name: a, node: n1, addresses: [198.18.1.300]}]\n")
	w.failure(t, `mesh.yaml:2:45: workloads[0].addresses[0]: "198.18.1.300" is not an IP address`)

	// Written in place (truncate and write).
	if err := os.WriteFile(path, []byte(meshFile(3)), 0o644); err != nil {
		t.Fatal(err)
	}
	w.change(t, 3)

	// The same content again is not reported; the next change is.
	replace(t, path, meshFile(3))
	if err := os.WriteFile(filepath.Join(dir, "other.yaml"), []byte("x: ["), 0o644); err != nil {
		t.Fatal(err) // another file in the directory: ignored
	}
	replace(t, path, meshFile(4))
	w.change(t, 4)

	// Removed, then back.
	if err := os.Remove(path); err != nil {
		t.Fatal(err)
	}
	w.failure(t, "no such file or directory")
	replace(t, path, meshFile(4))
	w.change(t, 4) // content equal to the last good one, but the file was gone
}

func TestWatchInitialInvalid(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "mesh.yaml")
	if err := os.WriteFile(path, []byte("trustDomian: x\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	w := startWatch(t, path)
	w.failure(t, `mesh.yaml:1:1: trustDomian: unknown field "trustDomian"`)
	replace(t, path, meshFile(5))
	w.change(t, 5)
}

// TestWatchConfigMap: a Kubernetes ConfigMap volume swaps a "..data"
// symlink; the file is a symlink through it.
func TestWatchConfigMap(t *testing.T) {
	dir := t.TempDir()
	for i, content := range []string{meshFile(6), meshFile(7)} {
		d := filepath.Join(dir, fmt.Sprintf("..v%d", i))
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, "mesh.yaml"), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Symlink("..v0", filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(dir, "mesh.yaml")
	if err := os.Symlink("..data/mesh.yaml", path); err != nil {
		t.Fatal(err)
	}
	w := startWatch(t, path)
	w.change(t, 6)
	if err := os.Symlink("..v1", filepath.Join(dir, "..data_tmp")); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(filepath.Join(dir, "..data_tmp"), filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	w.change(t, 7)
}

func TestWatchMissingDirectory(t *testing.T) {
	err := Watch(context.Background(), filepath.Join(t.TempDir(), "nope", "mesh.yaml"), func(*Config) {}, func(error) {})
	if err == nil || !strings.Contains(err.Error(), "nope") {
		t.Errorf("Watch = %v, want an error naming the directory", err)
	}
}
