package kind

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// The NetworkPolicy controller of the kind tests (docs/kind.md,
// "NetworkPolicy"): kube-router in its firewall-only mode (iptables and
// ipset). kindnet's own, sigs.k8s.io/kube-network-policies (v0.7.0 and
// v0.8.0, the releases on the module proxy), sends packets to user space
// with the nftables `queue` statement, which needs CONFIG_NFT_QUEUE; this
// machine's kernel lacks it (it has the iptables NFQUEUE target, ipset and
// xt_set, which kube-router uses).
const (
	KubeRouterVersion = "v2.1.0"
	KubeRouterImage   = "meshtun-test/kube-router:" + KubeRouterVersion
	// ipsetVersion is of the Debian packages (the node base's suite) whose
	// files go into the image: kube-router runs the ipset program.
	ipsetVersion = "7.17-1"
)

var ipsetDebs = []string{"ipset_" + ipsetVersion + "_amd64.deb", "libipset13_" + ipsetVersion + "_amd64.deb"}

// WriteKubeRouterImage builds kube-router (cached in
// CacheDir()/kube-router-<version>), fetches Debian's ipset with
// `apt-get download` (cached next to it) and writes KubeRouterImage as a
// docker-archive at out: the node's Debian base (iptables), ipset and
// kube-router.
func WriteKubeRouterImage(ctx context.Context, logf Logf, rootfs, out string) error {
	cache, err := CacheDir()
	if err != nil {
		return err
	}
	dir := filepath.Join(cache, "kube-router-"+KubeRouterVersion)
	debs := filepath.Join(cache, "ipset-"+ipsetVersion)
	unlock, err := lockFile(ctx, filepath.Join(cache, "build.lock"))
	if err != nil {
		return err
	}
	parts := []part{
		{dir, []string{"kube-router"}, func(ctx context.Context, tmp string) error {
			return goInstall(ctx, tmp, []string{"CGO_ENABLED=0"}, nil, "github.com/cloudnativelabs/kube-router/v2/cmd/kube-router@"+KubeRouterVersion)
		}},
		{debs, ipsetDebs, func(ctx context.Context, tmp string) error {
			cmd := exec.CommandContext(ctx, "apt-get", "download", "ipset="+ipsetVersion, "libipset13="+ipsetVersion)
			cmd.Dir = tmp
			if b, err := cmd.CombinedOutput(); err != nil {
				return fmt.Errorf("apt-get download ipset: %w\n%s", err, b)
			}
			return nil
		}},
	}
	for _, p := range parts {
		if complete(p.dir, p.programs) {
			continue
		}
		tmp := p.dir + ".tmp"
		os.RemoveAll(tmp)
		if err := os.MkdirAll(tmp, 0o755); err != nil {
			unlock()
			return err
		}
		label := filepath.Base(p.dir)
		logf("building %s", label)
		start, cpu0 := time.Now(), childCPU()
		err := p.build(ctx, tmp)
		if err == nil && !complete(tmp, p.programs) {
			err = fmt.Errorf("not all of %v were made", p.programs)
		}
		if err == nil {
			os.RemoveAll(p.dir)
			err = os.Rename(tmp, p.dir)
		}
		if err != nil {
			os.RemoveAll(tmp)
			unlock()
			return fmt.Errorf("build %s: %w", label, err)
		}
		logf("built %s: wall %s, CPU %s", label, time.Since(start).Round(time.Second), (childCPU() - cpu0).Round(time.Second))
	}
	unlock()

	base, err := dirLayer(rootfs)
	if err != nil {
		return err
	}
	layers := []v1.Layer{base}
	for _, d := range ipsetDebs {
		deb := filepath.Join(debs, d)
		l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
			b, err := exec.Command("dpkg-deb", "--fsys-tarfile", deb).Output()
			if err != nil {
				return nil, fmt.Errorf("dpkg-deb --fsys-tarfile %s: %w", deb, err)
			}
			return io.NopCloser(bytes.NewReader(b)), nil
		})
		if err != nil {
			return err
		}
		layers = append(layers, l)
	}
	kr, err := fileLayer(filepath.Join(dir, "kube-router"), "usr/local/bin/kube-router")
	if err != nil {
		return err
	}
	layers = append(layers, kr)
	return writeImage(out, KubeRouterImage, imageConfig{Entrypoint: []string{"/usr/local/bin/kube-router"}, Env: systemPath}, layers...)
}
