package kind

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"io/fs"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// BaseSuite and BasePackages make the node's Debian base: kind's base image
// packages (images/base/Dockerfile) minus nfs-common and open-iscsi, plus
// socat for kubectl port-forward.
const BaseSuite = "bookworm"

var BasePackages = []string{
	"systemd", "systemd-sysv", "dbus", "iproute2", "iptables", "nftables", "conntrack", "ethtool", "kmod",
	"libseccomp2", "mount", "util-linux", "pigz", "fuse-overlayfs", "e2fsprogs", "ca-certificates", "curl",
	"jq", "procps", "socat",
}

// DebianMirror is where debootstrap fetches the base from.
var DebianMirror = "http://deb.debian.org/debian"

// nodeRecipe changes whenever AssembleNodeImage's steps change, so that a
// cached node image built by older steps is not reused.
const nodeRecipe = "3"

func shortHash(parts ...string) string {
	h := sha256.New()
	for _, p := range parts {
		io.WriteString(h, p)
		h.Write([]byte{0})
	}
	return hex.EncodeToString(h.Sum(nil))[:12]
}

// BaseRootfs debootstraps the Debian base once into
// CacheDir()/base-<suite>-<hash of the package list>/rootfs.
func BaseRootfs(ctx context.Context, logf Logf) (string, error) {
	dir, err := debootstrapOnce(ctx, logf, "base-"+BaseSuite+"-"+shortHash(append([]string{BaseSuite}, BasePackages...)...),
		"base.lock", "rootfs/usr/bin/systemctl", BasePackages, nil)
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, "rootfs"), nil
}

// debootstrapOnce makes CacheDir()/name once: a debootstrap
// --variant=minbase of BaseSuite with pkgs into its rootfs/, then finish
// (if not nil) on the temporary directory, which is renamed into place
// only when both succeed (a directory that exists is complete). check is
// a file of the rootfs that a complete one has. lock serialises
// concurrent runs.
func debootstrapOnce(ctx context.Context, logf Logf, name, lock, check string, pkgs []string, finish func(tmp string) error) (string, error) {
	cache, err := CacheDir()
	if err != nil {
		return "", err
	}
	dir := filepath.Join(cache, name)
	complete := func() bool {
		_, err := os.Stat(filepath.Join(dir, check))
		return err == nil
	}
	if complete() {
		return dir, nil
	}
	if _, err := exec.LookPath("debootstrap"); err != nil {
		return "", fmt.Errorf("debootstrap not found (apt-get install debootstrap): %w", err)
	}
	unlock, err := lockFile(ctx, filepath.Join(cache, lock))
	if err != nil {
		return "", err
	}
	defer unlock()
	if complete() {
		return dir, nil
	}
	tmp := dir + ".tmp"
	os.RemoveAll(tmp)
	if err := os.MkdirAll(tmp, 0o755); err != nil {
		return "", err
	}
	logf("debootstrap %s with %s into %s (minutes)", BaseSuite, strings.Join(pkgs, ","), tmp)
	start, cpu0 := time.Now(), childCPU()
	cmd := exec.CommandContext(ctx, "nice", "-n", "5", "debootstrap", "--variant=minbase",
		"--include="+strings.Join(pkgs, ","), BaseSuite, filepath.Join(tmp, "rootfs"), DebianMirror)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("debootstrap %s for %s: %w\n%s", BaseSuite, name, err, tail(out, 4000))
	}
	// apt's downloaded packages are not needed in the node.
	os.RemoveAll(filepath.Join(tmp, "rootfs/var/cache/apt/archives"))
	if finish != nil {
		if err := finish(tmp); err != nil {
			return "", fmt.Errorf("%s: %w", name, err)
		}
	}
	os.RemoveAll(dir)
	if err := os.Rename(tmp, dir); err != nil {
		return "", err
	}
	logf("%s: wall %s, CPU %s", name, time.Since(start).Round(time.Second), (childCPU() - cpu0).Round(time.Second))
	return dir, nil
}

// NodeImageName is the podman image the nodes run, named by a hash of
// everything in it.
func NodeImageName(t Toolchain, rootfs string) string {
	return "localhost/meshtun/kind-node:" + KubernetesVersion + "-" + shortHash(nodeRecipe, t.Kind, t.Containerd, t.Runc, t.Crictl, t.CNI, t.Kube, t.Etcd, t.CoreDNS, rootfs)
}

// AssembleNodeImage does what `kind build node-image` does, without a
// registry or Docker: the base rootfs with kind's base files, the
// toolchain's programs and the control plane's images imported into the
// node's containerd store, imported into podman as image. It returns the
// image name; an image of that name already in podman is reused.
func AssembleNodeImage(ctx context.Context, logf Logf, t Toolchain, rootfs, pause string) (string, error) {
	img := NodeImageName(t, rootfs)
	if exec.CommandContext(ctx, "podman", "image", "exists", img).Run() == nil {
		return img, nil
	}
	cache, err := CacheDir()
	if err != nil {
		return "", err
	}
	unlock, err := lockFile(ctx, filepath.Join(cache, "node.lock"))
	if err != nil {
		return "", err
	}
	defer unlock()
	if exec.CommandContext(ctx, "podman", "image", "exists", img).Run() == nil {
		return img, nil
	}
	start, cpu0 := time.Now(), childCPU()
	work, err := os.MkdirTemp(cache, "node-assembly-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(work)
	root := filepath.Join(work, "rootfs")
	logf("assembling node image %s in %s", img, work)
	if out, err := exec.CommandContext(ctx, "cp", "-a", rootfs, root).CombinedOutput(); err != nil {
		return "", fmt.Errorf("copy base %s: %w: %s", rootfs, err, out)
	}
	if err := installKindBaseFiles(ctx, root); err != nil {
		return "", err
	}
	copies := []struct{ from, to string }{
		{filepath.Join(t.Containerd, "containerd"), "usr/local/bin/containerd"},
		{filepath.Join(t.Containerd, "containerd-shim-runc-v2"), "usr/local/bin/containerd-shim-runc-v2"},
		{filepath.Join(t.Containerd, "ctr"), "usr/local/bin/ctr"},
		{filepath.Join(t.Runc, "runc"), "usr/local/sbin/runc"},
		{filepath.Join(t.Crictl, "crictl"), "usr/local/bin/crictl"},
		{filepath.Join(t.Kube, "kubeadm"), "usr/bin/kubeadm"},
		{filepath.Join(t.Kube, "kubelet"), "usr/bin/kubelet"},
		{filepath.Join(t.Kube, "kubectl"), "usr/bin/kubectl"},
	}
	for _, p := range []string{"ptp", "loopback", "host-local", "portmap"} {
		copies = append(copies, struct{ from, to string }{filepath.Join(t.CNI, p), "opt/cni/bin/" + p})
	}
	for _, c := range copies {
		if err := copyFile(c.from, filepath.Join(root, c.to), 0o755); err != nil {
			return "", err
		}
	}
	// cri-base.json: containerd's default spec with kind's product-files hook
	// and without rlimits, as kind's base Dockerfile makes it.
	spec, err := exec.CommandContext(ctx, filepath.Join(t.Containerd, "ctr"), "oci", "spec").Output()
	if err != nil {
		return "", fmt.Errorf("ctr oci spec: %w", err)
	}
	var s map[string]any
	if err := json.Unmarshal(spec, &s); err != nil {
		return "", fmt.Errorf("ctr oci spec: %w", err)
	}
	hooks, _ := s["hooks"].(map[string]any)
	if hooks == nil {
		hooks = map[string]any{}
	}
	cc, _ := hooks["createContainer"].([]any)
	hooks["createContainer"] = append(cc, map[string]any{"path": "/kind/bin/mount-product-files.sh"})
	s["hooks"] = hooks
	if p, ok := s["process"].(map[string]any); ok {
		delete(p, "rlimits")
	}
	spec, _ = json.MarshalIndent(s, "", "  ")
	if err := os.WriteFile(filepath.Join(root, "etc/containerd/cri-base.json"), spec, 0o644); err != nil {
		return "", err
	}
	// This host lacks CAP_SYS_RESOURCE in the node: runc cannot raise a
	// pod's oom_score_adj (docs/kind.md).
	cfgPath := filepath.Join(root, "etc/containerd/config.toml")
	cfg, err := os.ReadFile(cfgPath)
	if err != nil {
		return "", err
	}
	if !bytes.Contains(cfg, []byte("restrict_oom_score_adj = false")) {
		return "", fmt.Errorf("%s: no restrict_oom_score_adj = false to turn on (kind's config changed)", cfgPath)
	}
	cfg = bytes.Replace(cfg, []byte("restrict_oom_score_adj = false"), []byte("restrict_oom_score_adj = true"), 1)
	if err := os.WriteFile(cfgPath, cfg, 0o644); err != nil {
		return "", err
	}
	if err := os.MkdirAll(filepath.Join(root, "kind/manifests"), 0o755); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(root, "kind/version"), []byte(KubernetesVersion), 0o644); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(root, "kind/manifests/default-cni.yaml"), []byte(defaultCNI), 0o644); err != nil {
		return "", err
	}
	if err := os.WriteFile(filepath.Join(root, "kind/manifests/default-storage.yaml"), []byte(defaultStorage), 0o644); err != nil {
		return "", err
	}
	tars := filepath.Join(work, "images.tar")
	if err := writeControlPlaneImages(rootfs, t, pause, tars); err != nil {
		return "", err
	}
	if err := importIntoNodeStore(ctx, t, root, work, tars); err != nil {
		return "", err
	}
	os.Remove(tars)
	logf("importing the node rootfs into podman as %s", img)
	cmd := exec.CommandContext(ctx, "sh", "-c", `tar -C "$1" -c . | podman import --change 'ENTRYPOINT ["/usr/local/bin/entrypoint", "/sbin/init"]' --change 'STOPSIGNAL SIGRTMIN+3' --change 'ENV container=docker' - "$2"`, "sh", root, img)
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("podman import %s: %w\n%s", img, err, tail(out, 2000))
	}
	logf("node image %s: wall %s, CPU of children %s", img, time.Since(start).Round(time.Second), (childCPU() - cpu0).Round(time.Second))
	return img, nil
}

// defaultCNI is /kind/manifests/default-cni.yaml, which kind applies when
// the cluster config does not disable the default CNI. kindnetd is not on
// the Go module proxy; the pod network is written by WritePodNetwork
// instead, and this manifest only says so.
const defaultCNI = `apiVersion: v1
kind: ConfigMap
metadata:
  name: meshtun-kind-pod-network
  namespace: kube-system
data:
  README: |
    kindnetd is not part of this offline node image. The meshtun test
    harness (test/kind, WritePodNetwork) writes each node's ptp+host-local
    CNI configuration for its spec.podCIDRs and the routes to the other
    nodes' pod CIDRs, as kindnetd does.
`

// defaultStorage replaces kind's local-path provisioner (its image is not
// in the node): the StorageClass only, no provisioner.
const defaultStorage = `apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata:
  name: standard
  annotations:
    storageclass.kubernetes.io/is-default-class: "true"
provisioner: rancher.io/local-path
volumeBindingMode: WaitForFirstConsumer
reclaimPolicy: Delete
`

// installKindBaseFiles copies kind's images/base/files from the kind module
// and repeats its base Dockerfile's systemd steps.
func installKindBaseFiles(ctx context.Context, root string) error {
	cmd := exec.CommandContext(ctx, "go", "mod", "download", "-json", "sigs.k8s.io/kind@"+KindVersion)
	cmd.Dir = root
	cmd.Env = goEnv([]string{"GOFLAGS="})
	j, err := cmd.Output()
	if err != nil {
		return fmt.Errorf("go mod download sigs.k8s.io/kind@%s: %w", KindVersion, err)
	}
	var info struct{ Dir string }
	if err := json.Unmarshal(j, &info); err != nil || info.Dir == "" {
		return fmt.Errorf("go mod download sigs.k8s.io/kind@%s: no directory (%v)", KindVersion, err)
	}
	files := filepath.Join(info.Dir, "images/base/files")
	err = filepath.WalkDir(files, func(p string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(files, p)
		mode := os.FileMode(0o644)
		if strings.HasPrefix(rel, "usr/local/bin/") || strings.HasPrefix(rel, "kind/bin/") {
			mode = 0o755
		}
		return copyFile(p, filepath.Join(root, rel), mode)
	})
	if err != nil {
		return err
	}
	for _, g := range []string{
		"lib/systemd/system/sysinit.target.wants/systemd-tmpfiles-setup.service",
		"lib/systemd/system/multi-user.target.wants/*",
		"etc/systemd/system/*.wants/*",
		"lib/systemd/system/local-fs.target.wants/*",
		"lib/systemd/system/sockets.target.wants/*udev*",
		"lib/systemd/system/sockets.target.wants/*initctl*",
		"lib/systemd/system/basic.target.wants/*",
	} {
		m, _ := filepath.Glob(filepath.Join(root, g))
		for _, f := range m {
			os.Remove(f)
		}
	}
	j2, err := os.OpenFile(filepath.Join(root, "etc/systemd/journald.conf"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		return err
	}
	_, err = j2.WriteString("ReadKMsg=no\n")
	j2.Close()
	if err != nil {
		return err
	}
	os.Remove(filepath.Join(root, "sbin/init"))
	if err := os.Symlink("/usr/lib/systemd/systemd", filepath.Join(root, "sbin/init")); err != nil {
		return err
	}
	for _, args := range [][]string{
		{"--root=" + root, "enable", "kubelet.service", "containerd.service", "undo-mount-hacks.service"},
		{"--root=" + root, "mask", "systemd-binfmt.service"},
	} {
		if out, err := exec.CommandContext(ctx, "systemctl", args...).CombinedOutput(); err != nil {
			return fmt.Errorf("systemctl %s: %w: %s", strings.Join(args, " "), err, out)
		}
	}
	for _, d := range []string{"etc/kubernetes/manifests", "opt/cni/bin", "kind/bin"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			return err
		}
	}
	return os.Chmod(filepath.Join(root, "kind"), 0o755)
}

// writeControlPlaneImages writes the images kubeadm and containerd expect,
// as one docker-archive: the control-plane programs on a layer of the
// Debian base (kube-proxy runs iptables from it), etcd, CoreDNS and pause
// on their own.
func writeControlPlaneImages(rootfs string, t Toolchain, pause, out string) error {
	base, err := dirLayer(rootfs)
	if err != nil {
		return err
	}
	refs := map[name.Reference]v1.Image{}
	add := func(ref string, layers []v1.Layer, entrypoint []string) error {
		r, err := name.ParseReference(ref)
		if err != nil {
			return err
		}
		img, err := mutate.AppendLayers(empty.Image, layers...)
		if err != nil {
			return err
		}
		cf, err := img.ConfigFile()
		if err != nil {
			return err
		}
		cf = cf.DeepCopy()
		cf.OS, cf.Architecture = "linux", "amd64"
		cf.Config.Entrypoint = entrypoint
		cf.Config.Env = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
		img, err = mutate.ConfigFile(img, cf)
		if err != nil {
			return err
		}
		refs[r] = img
		return nil
	}
	for _, c := range []string{"kube-apiserver", "kube-controller-manager", "kube-scheduler", "kube-proxy"} {
		l, err := fileLayer(filepath.Join(t.Kube, c), "usr/local/bin/"+c)
		if err != nil {
			return err
		}
		if err := add("registry.k8s.io/"+c+":"+KubernetesVersion, []v1.Layer{base, l}, nil); err != nil {
			return err
		}
	}
	etcd, err := fileLayer(filepath.Join(t.Etcd, "etcd"), "usr/local/bin/etcd")
	if err != nil {
		return err
	}
	if err := add("registry.k8s.io/etcd:"+EtcdImageTag, []v1.Layer{etcd}, []string{"/usr/local/bin/etcd"}); err != nil {
		return err
	}
	coredns, err := fileLayer(filepath.Join(t.CoreDNS, "coredns"), "coredns")
	if err != nil {
		return err
	}
	if err := add("registry.k8s.io/coredns/coredns:"+CoreDNSVersion, []v1.Layer{coredns}, []string{"/coredns"}); err != nil {
		return err
	}
	pl, err := fileLayer(pause, "pause")
	if err != nil {
		return err
	}
	for _, tag := range []string{PauseImageTag, KubeadmPauseTag} {
		if err := add("registry.k8s.io/pause:"+tag, []v1.Layer{pl}, []string{"/pause"}); err != nil {
			return err
		}
	}
	return tarball.MultiRefWriteToFile(out, refs)
}

// dirLayer is a layer of a whole directory tree, tarred by tar(1) (owners,
// devices and links as they are).
func dirLayer(dir string) (v1.Layer, error) {
	tarPath := dir + ".layer.tar"
	if _, err := os.Stat(tarPath); err != nil {
		tmp := tarPath + ".tmp"
		if out, err := exec.Command("tar", "-C", dir, "--exclude=./var/cache/apt", "--exclude=./usr/share/doc", "--exclude=./usr/share/man", "-cf", tmp, ".").CombinedOutput(); err != nil {
			return nil, fmt.Errorf("tar %s: %w: %s", dir, err, out)
		}
		if err := os.Rename(tmp, tarPath); err != nil {
			return nil, err
		}
	}
	return tarball.LayerFromFile(tarPath)
}

// fileLayer is a layer holding one executable at path (relative).
func fileLayer(src, path string) (v1.Layer, error) {
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return tarOneFile(src, path)
	})
}

// importIntoNodeStore runs the toolchain's containerd on this host with its
// root in the node's /var/lib/containerd (no CRI, no snapshots) and imports
// the images with ctr as kind's node-image build does: pinned, not unpacked.
func importIntoNodeStore(ctx context.Context, t Toolchain, root, work, images string) error {
	state := filepath.Join(work, "containerd-state")
	sock := filepath.Join(state, "c.sock")
	if err := os.MkdirAll(state, 0o700); err != nil {
		return err
	}
	cfg := fmt.Sprintf(`version = 3
root = %q
state = %q
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.cri.v1.runtime", "io.containerd.cri.v1.images", "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.blockfile", "io.containerd.snapshotter.v1.erofs"]
[grpc]
  address = %q
`, filepath.Join(root, "var/lib/containerd"), state, sock)
	cfgPath := filepath.Join(work, "containerd.toml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return err
	}
	var logb bytes.Buffer
	d := exec.Command(filepath.Join(t.Containerd, "containerd"), "--config", cfgPath)
	d.Stdout, d.Stderr = &logb, &logb
	if err := d.Start(); err != nil {
		return err
	}
	defer func() { d.Process.Kill(); d.Wait() }()
	deadline := time.Now().Add(2 * time.Minute)
	for {
		if c, err := net.Dial("unix", sock); err == nil {
			c.Close()
			break
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("containerd for the node store did not listen on %s: %s", sock, tail(logb.Bytes(), 2000))
		}
		time.Sleep(100 * time.Millisecond)
	}
	f, err := os.Open(images)
	if err != nil {
		return err
	}
	defer f.Close()
	imp := exec.CommandContext(ctx, filepath.Join(t.Containerd, "ctr"), "--address", sock, "--namespace=k8s.io", "images", "import",
		"--label=io.cri-containerd.pinned=pinned", "--all-platforms", "--no-unpack", "--digests", "-")
	imp.Stdin = f
	if out, err := imp.CombinedOutput(); err != nil {
		return fmt.Errorf("ctr images import: %w\n%s\ncontainerd: %s", err, out, tail(logb.Bytes(), 2000))
	}
	return nil
}

func copyFile(from, to string, mode os.FileMode) error {
	in, err := os.Open(from)
	if err != nil {
		return err
	}
	defer in.Close()
	if err := os.MkdirAll(filepath.Dir(to), 0o755); err != nil {
		return err
	}
	os.Remove(to)
	out, err := os.OpenFile(to, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return fmt.Errorf("copy %s to %s: %w", from, to, err)
	}
	if err := out.Close(); err != nil {
		return err
	}
	return os.Chmod(to, mode)
}
