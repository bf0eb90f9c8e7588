package kube

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"golang.org/x/mod/modfile"
)

// Versions of the control plane the tests run. kube-apiserver is built
// from k8s.io/kubernetes, whose go.mod requires its staging modules
// (k8s.io/api, k8s.io/client-go, …) at v0.0.0 and replaces them with
// directories of its own repository; the scratch module replaces each with
// its published release instead.
const (
	KubernetesVersion = "v1.37.2"
	StagingVersion    = "v0.37.2"
	EtcdVersion       = "v3.6.5"
)

// Binaries are the paths of the built control-plane programs.
type Binaries struct {
	APIServer, Etcd string
}

// CacheDir is where the binaries and their scratch modules live:
// $XDG_CACHE_HOME/meshtun-test (~/.cache/meshtun-test).
func CacheDir() (string, error) {
	d, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(d, "meshtun-test"), nil
}

// Build builds kube-apiserver and etcd from the Go module proxy into
// CacheDir()/bin, once per version: a binary already there is reused. A
// lock file serialises concurrent builds (parallel test runs share the
// cache). logf receives progress.
func Build(ctx context.Context, logf func(format string, args ...any)) (Binaries, error) {
	dir, err := CacheDir()
	if err != nil {
		return Binaries{}, err
	}
	bin := filepath.Join(dir, "bin")
	b := Binaries{
		APIServer: filepath.Join(bin, "kube-apiserver-"+KubernetesVersion),
		Etcd:      filepath.Join(bin, "etcd-"+EtcdVersion),
	}
	if exists(b.APIServer) && exists(b.Etcd) {
		return b, nil
	}
	if err := os.MkdirAll(bin, 0o755); err != nil {
		return b, err
	}
	unlock, err := lockFile(ctx, filepath.Join(dir, "build.lock"))
	if err != nil {
		return b, err
	}
	defer unlock()
	if !exists(b.Etcd) {
		src := filepath.Join(dir, "src", "etcd-"+EtcdVersion)
		gomod := "module meshtuntest/etcd\n\ngo 1.26.0\n\nrequire go.etcd.io/etcd/server/v3 " + EtcdVersion + "\n"
		if err := buildModule(ctx, logf, src, gomod, etcdMain, b.Etcd); err != nil {
			return b, err
		}
	}
	if !exists(b.APIServer) {
		gomod, err := apiServerGoMod(ctx, dir)
		if err != nil {
			return b, err
		}
		src := filepath.Join(dir, "src", "kube-apiserver-"+KubernetesVersion)
		if err := buildModule(ctx, logf, src, gomod, apiServerMain, b.APIServer); err != nil {
			return b, err
		}
	}
	return b, nil
}

const etcdMain = `package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
`

const apiServerMain = `package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/kubernetes/cmd/kube-apiserver/app"
)

func main() { os.Exit(cli.Run(app.NewAPIServerCommand())) }
`

// apiServerGoMod returns the go.mod of the kube-apiserver scratch module:
// it requires k8s.io/kubernetes and replaces every k8s.io module that
// kubernetes requires at v0.0.0 (its staging modules) by StagingVersion.
func apiServerGoMod(ctx context.Context, dir string) (string, error) {
	cmd := exec.CommandContext(ctx, "go", "mod", "download", "-json", "k8s.io/kubernetes@"+KubernetesVersion)
	cmd.Dir = dir
	cmd.Env = goEnv()
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go mod download k8s.io/kubernetes@%s: %w: %s", KubernetesVersion, err, stderrOf(err))
	}
	var info struct{ GoMod, Error string }
	if err := json.Unmarshal(out, &info); err != nil || info.GoMod == "" {
		return "", fmt.Errorf("go mod download k8s.io/kubernetes@%s: no go.mod (%v %s)", KubernetesVersion, err, info.Error)
	}
	data, err := os.ReadFile(info.GoMod)
	if err != nil {
		return "", err
	}
	upstream, err := modfile.ParseLax(info.GoMod, data, nil)
	if err != nil {
		return "", err
	}
	f := &modfile.File{}
	if err := f.AddModuleStmt("meshtuntest/kubeapiserver"); err != nil {
		return "", err
	}
	if err := f.AddGoStmt("1.26.0"); err != nil {
		return "", err
	}
	if err := f.AddRequire("k8s.io/kubernetes", KubernetesVersion); err != nil {
		return "", err
	}
	n := 0
	for _, r := range upstream.Require {
		if strings.HasPrefix(r.Mod.Path, "k8s.io/") && r.Mod.Version == "v0.0.0" {
			if err := f.AddReplace(r.Mod.Path, "", r.Mod.Path, StagingVersion); err != nil {
				return "", err
			}
			n++
		}
	}
	if n == 0 {
		return "", fmt.Errorf("k8s.io/kubernetes@%s requires no staging module at v0.0.0: its go.mod changed shape", KubernetesVersion)
	}
	f.Cleanup()
	out, err = f.Format()
	return string(out), err
}

// buildModule writes go.mod and main.go into src, resolves the module
// graph and builds the program to out (through a temporary name, so that a
// failed or interrupted build never leaves a binary behind).
func buildModule(ctx context.Context, logf func(string, ...any), src, gomod, main, out string) error {
	if err := os.MkdirAll(src, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(src, "go.mod"), []byte(gomod), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(src, "main.go"), []byte(main), 0o644); err != nil {
		return err
	}
	start := time.Now()
	logf("building %s in %s (several minutes when the Go build cache is cold)", filepath.Base(out), src)
	tmp := out + ".tmp"
	for _, args := range [][]string{{"mod", "tidy"}, {"build", "-o", tmp, "."}} {
		cmd := exec.CommandContext(ctx, "go", args...)
		cmd.Dir = src
		cmd.Env = goEnv()
		if b, err := cmd.CombinedOutput(); err != nil {
			os.Remove(tmp)
			return fmt.Errorf("go %s in %s: %w\n%s", strings.Join(args, " "), src, err, b)
		}
	}
	if err := os.Rename(tmp, out); err != nil {
		return err
	}
	logf("built %s in %s", filepath.Base(out), time.Since(start).Round(time.Second))
	return nil
}

// goEnv is the environment of the go commands: the scratch modules are
// outside any workspace and resolve their own dependencies.
func goEnv() []string {
	return append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod")
}

func stderrOf(err error) string {
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return strings.TrimSpace(string(ee.Stderr))
	}
	return ""
}

func exists(path string) bool {
	st, err := os.Stat(path)
	return err == nil && st.Mode().IsRegular()
}

// lockFile takes an exclusive flock on path, waiting until ctx ends.
func lockFile(ctx context.Context, path string) (func(), error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		return nil, err
	}
	for {
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { syscall.Flock(int(f.Fd()), syscall.LOCK_UN); f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) {
			f.Close()
			return nil, fmt.Errorf("lock %s: %w", path, err)
		}
		select {
		case <-ctx.Done():
			f.Close()
			return nil, ctx.Err()
		case <-time.After(time.Second):
		}
	}
}
