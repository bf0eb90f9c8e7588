package kind

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
)

// Versions of everything the cluster is made of. kind v0.33.0's base image
// pins containerd, runc, crictl and the CNI plugins; kubeadm v1.37.2 wants
// etcd 3.7.0 and CoreDNS v1.14.6.
const (
	KindVersion       = "v0.33.0"
	ContainerdVersion = "v2.3.4"
	RuncVersion       = "v1.4.3"
	CrictlVersion     = "v1.36.0"
	CNIVersion        = "v1.9.1"
	KubernetesVersion = "v1.37.2"
	StagingVersion    = "v0.37.2" // k8s.io/* staging modules matching KubernetesVersion
	EtcdVersion       = "v3.7.0"
	EtcdImageTag      = "3.7.0-0"
	CoreDNSVersion    = "v1.14.6"
	PauseImageTag     = "3.10" // containerd's sandbox_image in kind's config.toml
	KubeadmPauseTag   = "3.10.2"
)

// KubeBinaries are the seven programs built from k8s.io/kubernetes.
var KubeBinaries = []string{"kubeadm", "kubelet", "kubectl", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy"}

// Toolchain holds the directories of the built parts.
type Toolchain struct {
	Kind       string // the kind binary
	Containerd string // containerd, containerd-shim-runc-v2, ctr
	Runc       string // runc
	Crictl     string // crictl
	CNI        string // ptp, loopback, host-local, portmap
	Kube       string // KubeBinaries
	Etcd       string // etcd
	CoreDNS    string // coredns
}

// Kubectl is the path of the kubectl binary.
func (t Toolchain) Kubectl() string { return filepath.Join(t.Kube, "kubectl") }

// CacheDir is ~/.cache/meshtun-test/kind (XDG_CACHE_HOME honoured).
func CacheDir() (string, error) {
	d, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(d, "meshtun-test", "kind"), nil
}

// Logf receives progress lines.
type Logf func(format string, args ...any)

// part is one cached build: a directory named after its version holding
// the programs it lists; it is built into a temporary directory and renamed,
// so a directory that exists is complete.
type part struct {
	dir      string
	programs []string
	build    func(ctx context.Context, tmp string) error
}

// BuildToolchain builds every missing part into CacheDir(), one at a time
// under a lock shared by concurrent runs, and reports each cold build's
// wall and CPU time through logf.
func BuildToolchain(ctx context.Context, logf Logf) (Toolchain, error) {
	cache, err := CacheDir()
	if err != nil {
		return Toolchain{}, err
	}
	t := Toolchain{
		Kind:       filepath.Join(cache, "kind-"+KindVersion),
		Containerd: filepath.Join(cache, "containerd-"+ContainerdVersion),
		Runc:       filepath.Join(cache, "runc-"+RuncVersion),
		Crictl:     filepath.Join(cache, "crictl-"+CrictlVersion),
		CNI:        filepath.Join(cache, "cni-"+CNIVersion),
		Kube:       filepath.Join(cache, "k8s-"+KubernetesVersion, "bin"),
		Etcd:       filepath.Join(cache, "etcd-"+EtcdVersion),
		CoreDNS:    filepath.Join(cache, "coredns-"+CoreDNSVersion),
	}
	static := []string{"CGO_ENABLED=0"}
	parts := []part{
		{t.Kind, []string{"kind"}, func(ctx context.Context, tmp string) error {
			return goInstall(ctx, tmp, static, nil, "sigs.k8s.io/kind@"+KindVersion)
		}},
		{t.Containerd, []string{"containerd", "containerd-shim-runc-v2", "ctr"}, func(ctx context.Context, tmp string) error {
			m := "github.com/containerd/containerd/v2/cmd/"
			return goInstall(ctx, tmp, static, []string{"-tags", "no_aufs no_zfs no_btrfs no_devmapper"},
				m+"containerd@"+ContainerdVersion, m+"containerd-shim-runc-v2@"+ContainerdVersion, m+"ctr@"+ContainerdVersion)
		}},
		{t.Runc, []string{"runc"}, func(ctx context.Context, tmp string) error {
			// seccomp needs cgo and Debian's libseccomp-dev and pkg-config.
			return goInstall(ctx, tmp, []string{"CGO_ENABLED=1"}, []string{"-tags", "seccomp"}, "github.com/opencontainers/runc@"+RuncVersion)
		}},
		{t.Crictl, []string{"crictl"}, func(ctx context.Context, tmp string) error {
			return goInstall(ctx, tmp, static, nil, "sigs.k8s.io/cri-tools/cmd/crictl@"+CrictlVersion)
		}},
		{t.CNI, []string{"ptp", "loopback", "host-local", "portmap"}, func(ctx context.Context, tmp string) error {
			m := "github.com/containernetworking/plugins/plugins/"
			return goInstall(ctx, tmp, static, nil, m+"main/ptp@"+CNIVersion, m+"main/loopback@"+CNIVersion,
				m+"ipam/host-local@"+CNIVersion, m+"meta/portmap@"+CNIVersion)
		}},
		{t.Etcd, []string{"etcd"}, func(ctx context.Context, tmp string) error {
			gomod := "module meshtuntest/kind/etcd\n\ngo 1.26.0\n\nrequire go.etcd.io/etcd/server/v3 " + EtcdVersion + "\n"
			return buildScratch(ctx, filepath.Join(cache, "src", "etcd-"+EtcdVersion), gomod, etcdMain, static, filepath.Join(tmp, "etcd"))
		}},
		{t.CoreDNS, []string{"coredns"}, func(ctx context.Context, tmp string) error {
			gomod := "module meshtuntest/kind/coredns\n\ngo 1.26.0\n\nrequire github.com/coredns/coredns " + CoreDNSVersion + "\n"
			return buildScratch(ctx, filepath.Join(cache, "src", "coredns-"+CoreDNSVersion), gomod, corednsMain, static, filepath.Join(tmp, "coredns"))
		}},
		{t.Kube, KubeBinaries, func(ctx context.Context, tmp string) error {
			return buildKubernetes(ctx, filepath.Join(cache, "k8s-"+KubernetesVersion, "src"), tmp)
		}},
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return t, err
	}
	unlock, err := lockFile(ctx, filepath.Join(cache, "build.lock"))
	if err != nil {
		return t, err
	}
	defer unlock()
	for _, p := range parts {
		if complete(p.dir, p.programs) {
			continue
		}
		tmp := p.dir + ".tmp"
		os.RemoveAll(tmp)
		if err := os.MkdirAll(tmp, 0o755); err != nil {
			return t, err
		}
		label, _ := filepath.Rel(cache, p.dir)
		logf("building %s (minutes when the Go build cache is cold)", label)
		start, cpu0 := time.Now(), childCPU()
		if err := p.build(ctx, tmp); err != nil {
			os.RemoveAll(tmp)
			return t, fmt.Errorf("build %s: %w", label, err)
		}
		if !complete(tmp, p.programs) {
			os.RemoveAll(tmp)
			return t, fmt.Errorf("build %s: not all of %v were built", label, p.programs)
		}
		os.RemoveAll(p.dir)
		if err := os.Rename(tmp, p.dir); err != nil {
			return t, err
		}
		logf("built %s: wall %s, CPU %s", label, time.Since(start).Round(time.Second), (childCPU() - cpu0).Round(time.Second))
	}
	return t, nil
}

// childCPU is the user+system CPU time of the finished children of this
// process (the go commands), for the cost report.
func childCPU() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_CHILDREN, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

func complete(dir string, programs []string) bool {
	for _, p := range programs {
		st, err := os.Stat(filepath.Join(dir, p))
		if err != nil || !st.Mode().IsRegular() {
			return false
		}
	}
	return true
}

// goEnv is the environment of the go commands: outside any workspace,
// nice'd by the caller.
func goEnv(extra []string) []string {
	return append(append(os.Environ(), "GOWORK=off"), extra...)
}

// goCmd runs go at lowered priority (the machine is shared).
func goCmd(ctx context.Context, dir string, env []string, args ...string) error {
	cmd := exec.CommandContext(ctx, "nice", append([]string{"-n", "5", "go"}, args...)...)
	cmd.Dir = dir
	cmd.Env = env
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("go %s: %w\n%s", strings.Join(args, " "), err, tail(b, 4000))
	}
	return nil
}

func goInstall(ctx context.Context, gobin string, env, flags []string, pkgs ...string) error {
	args := append([]string{"install"}, flags...)
	args = append(args, pkgs...)
	return goCmd(ctx, gobin, goEnv(append(env, "GOBIN="+gobin, "GOFLAGS=")), args...)
}

// buildScratch writes a module of one main package into src and builds it.
func buildScratch(ctx context.Context, src, gomod, main string, env []string, out string) error {
	if err := os.MkdirAll(src, 0o755); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(src, "go.mod"), []byte(gomod), 0o644); err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(src, "main.go"), []byte(main), 0o644); err != nil {
		return err
	}
	e := goEnv(append(env, "GOFLAGS=-mod=mod"))
	if err := goCmd(ctx, src, e, "mod", "tidy"); err != nil {
		return err
	}
	return goCmd(ctx, src, e, "build", "-ldflags=-s -w", "-o", out, ".")
}

const etcdMain = `package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() { etcdmain.Main(os.Args) }
`

const corednsMain = `package main

import (
	_ "github.com/coredns/coredns/core/plugin"
	"github.com/coredns/coredns/coremain"
)

func main() { coremain.Run() }
`

// buildKubernetes builds KubeBinaries from k8s.io/kubernetes in a scratch
// module that requires it and replaces every staging module it requires at
// v0.0.0 by StagingVersion (test/kube builds kube-apiserver the same way,
// with the same build flags, so the two share the Go build cache). The
// version variables are set as Kubernetes' own build does: kubeadm refuses
// a v0.0.0 kubelet.
func buildKubernetes(ctx context.Context, src, out string) error {
	if err := os.MkdirAll(src, 0o755); err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "go", "mod", "download", "-json", "k8s.io/kubernetes@"+KubernetesVersion)
	cmd.Dir = src
	cmd.Env = goEnv(nil)
	j, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("go mod download k8s.io/kubernetes@%s: %w", KubernetesVersion, err)
	}
	var info struct{ GoMod string }
	if err := json.Unmarshal(j, &info); err != nil || info.GoMod == "" {
		return fmt.Errorf("go mod download k8s.io/kubernetes@%s: no go.mod (%v)", KubernetesVersion, err)
	}
	upstream, err := os.ReadFile(info.GoMod)
	if err != nil {
		return err
	}
	var b strings.Builder
	fmt.Fprintf(&b, "module meshtuntest/kind/kubernetes\n\ngo 1.26.0\n\nrequire k8s.io/kubernetes %s\n\n", KubernetesVersion)
	n := 0
	for _, line := range strings.Split(string(upstream), "\n") {
		f := strings.Fields(line)
		if len(f) == 2 && strings.HasPrefix(f[0], "k8s.io/") && f[1] == "v0.0.0" && strings.HasPrefix(line, "\t") {
			fmt.Fprintf(&b, "replace %s => %s %s\n", f[0], f[0], StagingVersion)
			n++
		}
	}
	if n == 0 {
		return fmt.Errorf("k8s.io/kubernetes@%s requires no staging module at v0.0.0: its go.mod changed shape", KubernetesVersion)
	}
	var pkgs []string
	for _, c := range KubeBinaries {
		fmt.Fprintf(&b, "tool k8s.io/kubernetes/cmd/%s\n", c)
		pkgs = append(pkgs, "k8s.io/kubernetes/cmd/"+c)
	}
	if err := os.WriteFile(filepath.Join(src, "go.mod"), []byte(b.String()), 0o644); err != nil {
		return err
	}
	e := goEnv([]string{"GOFLAGS=-mod=mod"})
	if err := goCmd(ctx, src, e, "mod", "tidy"); err != nil {
		return err
	}
	major, minor, _ := strings.Cut(strings.TrimPrefix(KubernetesVersion, "v"), ".")
	minor, _, _ = strings.Cut(minor, ".")
	ld := "-s -w"
	for _, p := range []string{"k8s.io/component-base/version", "k8s.io/client-go/pkg/version"} {
		ld += fmt.Sprintf(" -X %[1]s.gitVersion=%[2]s -X %[1]s.gitMajor=%[3]s -X %[1]s.gitMinor=%[4]s -X %[1]s.gitTreeState=clean"+
			" -X %[1]s.gitCommit=0000000000000000000000000000000000000000 -X %[1]s.buildDate=2026-01-01T00:00:00Z",
			p, KubernetesVersion, major, minor)
	}
	return goCmd(ctx, src, e, append([]string{"build", "-ldflags=" + ld, "-o", out + "/"}, pkgs...)...)
}

func tail(b []byte, n int) []byte {
	if len(b) > n {
		return b[len(b)-n:]
	}
	return b
}

// lockFile takes an exclusive flock on path, waiting until ctx ends
// (test/kube takes the same kind of lock on the same build.lock).
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
