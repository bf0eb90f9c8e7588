package kind

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// Prerequisites says what this machine lacks to run a kind cluster
// offline, or nil.
func Prerequisites() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("needs root (rootful podman)")
	}
	for _, p := range []string{"podman", "runc", "debootstrap", "pkg-config", "tar", "systemctl", "make"} {
		if _, err := exec.LookPath(p); err != nil {
			return fmt.Errorf("%s not found (.ci/run installs podman runc debootstrap libseccomp-dev pkg-config): %w", p, err)
		}
	}
	if _, err := os.Stat("/usr/include/seccomp.h"); err != nil {
		return fmt.Errorf("libseccomp-dev missing (runc is built with seccomp): %w", err)
	}
	return nil
}

// Up builds (or takes from the cache) everything, creates the cluster
// `name` with dir for its files, loads meshtun:dev, the probe image and
// the toolbox image (ToolboxImage, on the workers) and
// applies deploy/kubernetes/ as docs/kubernetes.md says, waiting until the
// DaemonSet is ready on every node. On error the returned Cluster, if not
// nil, is what must be deleted.
func Up(ctx context.Context, logf Logf, name, dir string) (*Cluster, error) {
	c, err := UpBare(ctx, logf, name, dir)
	if err != nil {
		return c, err
	}
	repo, err := RepoDir()
	if err != nil {
		return c, err
	}
	if err := c.InstallMeshtun(ctx, repo); err != nil {
		return c, err
	}
	return c, nil
}

// UpBare is Up without a mesh: the cluster with meshtun:dev and the probe
// image loaded on every node, nothing of meshtun applied (test/kind/istio
// installs istiod and deploy/istio instead).
func UpBare(ctx context.Context, logf Logf, name, dir string) (*Cluster, error) {
	if err := Prerequisites(); err != nil {
		return nil, err
	}
	repo, err := RepoDir()
	if err != nil {
		return nil, err
	}
	// The toolbox image (a debootstrap of its own, cached) is built
	// while the toolchain and the node image are.
	toolbox := make(chan error, 1)
	var toolboxTar string
	go func() {
		var err error
		toolboxTar, err = ToolboxArchive(ctx, logf)
		toolbox <- err
	}()
	t, err := BuildToolchain(ctx, logf)
	if err != nil {
		<-toolbox
		return nil, err
	}
	rootfs, err := BaseRootfs(ctx, logf)
	if err != nil {
		<-toolbox
		return nil, err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		<-toolbox
		return nil, err
	}
	pause, err := BuildLocal(ctx, dir, "pause")
	if err != nil {
		<-toolbox
		return nil, err
	}
	img, err := AssembleNodeImage(ctx, logf, t, rootfs, pause)
	if err != nil {
		<-toolbox
		return nil, err
	}
	if err := <-toolbox; err != nil {
		return nil, err
	}
	// meshtun:dev as its users build it, while the cluster starts.
	imageDone := make(chan error, 1)
	go func() {
		start := time.Now()
		cmd := exec.CommandContext(ctx, "make", "image")
		cmd.Dir = repo
		out, err := cmd.CombinedOutput()
		if err != nil {
			err = fmt.Errorf("make image: %w\n%s", err, tail(out, 3000))
		}
		logf("make image: %s", time.Since(start).Round(time.Second))
		imageDone <- err
	}()
	probeTar := filepath.Join(dir, "probe-image.tar")
	if err := WriteProbeImage(ctx, dir, probeTar); err != nil {
		<-imageDone
		return nil, err
	}
	c, err := Create(ctx, logf, t, Options{Name: name, Image: img, Config: filepath.Join(repo, "deploy/kind/cluster.yaml"), Dir: dir})
	if ierr := <-imageDone; err == nil && ierr != nil {
		err = ierr
	}
	if err != nil {
		return c, err
	}
	start := time.Now()
	for _, a := range []string{filepath.Join(repo, "bin/meshtun-image.tar"), probeTar} {
		if err := c.LoadImage(ctx, a); err != nil {
			return c, err
		}
	}
	// The toolbox only on the workers, where the test pods run.
	if err := c.LoadImage(ctx, toolboxTar, c.Workers()...); err != nil {
		return c, err
	}
	logf("images loaded: %s", time.Since(start).Round(time.Second))
	return c, nil
}

// InstallMeshtun runs docs/kubernetes.md's walk-through: deploy/kubernetes/
// applied unchanged (meshtun ca makes its own root on first start), then
// waits until the CA and the DaemonSet are ready on every node.
func (c *Cluster) InstallMeshtun(ctx context.Context, repo string) error {
	start := time.Now()
	for _, s := range [][]string{
		{"apply", "-f", filepath.Join(repo, "deploy/kubernetes") + "/"},
		{"-n", "meshtun-system", "rollout", "status", "deploy/meshtun-ca", "--timeout=10m"},
		{"-n", "meshtun-system", "rollout", "status", "ds/meshtun", "--timeout=10m"},
	} {
		if _, err := c.Kubectl(ctx, s...); err != nil {
			return err
		}
	}
	c.logf("meshtun ready on every node: %s", time.Since(start).Round(time.Second))
	return nil
}

// Attach returns the Cluster of an existing kind cluster made by Up with
// the same name and dir (for kindctl down).
func Attach(ctx context.Context, logf Logf, name, dir string) (*Cluster, error) {
	cache, err := CacheDir()
	if err != nil {
		return nil, err
	}
	t := Toolchain{Kind: filepath.Join(cache, "kind-"+KindVersion), Kube: filepath.Join(cache, "k8s-"+KubernetesVersion, "bin")}
	c := &Cluster{Name: name, Network: name, Tools: t, dir: dir, logf: logf, Kubeconfig: filepath.Join(dir, "kubeconfig")}
	out, err := c.Podman(ctx, "network", "inspect", c.Network, "--format", "{{.NetworkInterface}}")
	if err != nil {
		return c, err
	}
	c.Bridge = strings.TrimSpace(string(out))
	return c, nil
}

// ClusterSlot waits until no other test suite of this user holds a kind
// cluster of its own (an flock on CacheDir()/cluster-slot.lock) and
// takes the slot; release gives it back once the suite's cluster is
// deleted. `go test ./...` runs test/kind and test/kind/istio at once
// (-p); two three-node clusters on a two-core machine made kubeadm's API
// server miss its start, so the suites take turns for their clusters
// (builds still overlap).
func ClusterSlot(ctx context.Context, logf Logf) (release func(), err error) {
	cache, err := CacheDir()
	if err != nil {
		return nil, err
	}
	if err := os.MkdirAll(cache, 0o755); err != nil {
		return nil, err
	}
	start := time.Now()
	release, err = lockFile(ctx, filepath.Join(cache, "cluster-slot.lock"))
	if err != nil {
		return nil, fmt.Errorf("wait for the kind cluster slot: %w", err)
	}
	if d := time.Since(start); d > time.Second {
		logf("waited %s for another suite's kind cluster", d.Round(time.Second))
	}
	return release, nil
}
