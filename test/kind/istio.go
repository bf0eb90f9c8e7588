package kind

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// IstiodImage is the istiod image the Istio suite loads into the nodes.
const IstiodImage = "meshtun-istiod:dev"

// IstioVersion is the istio.io/istio version test/interop requires (and
// test/kube's IstioVersion, which names the same cached pilot-discovery):
// read from test/interop/go.mod so that the three never disagree.
func IstioVersion() (string, error) {
	repo, err := RepoDir()
	if err != nil {
		return "", err
	}
	p := filepath.Join(repo, "test/interop/go.mod")
	f, err := os.Open(p)
	if err != nil {
		return "", err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fs := strings.Fields(sc.Text())
		if len(fs) >= 2 && fs[0] == "istio.io/istio" {
			return fs[1], nil
		}
		if len(fs) >= 3 && fs[0] == "require" && fs[1] == "istio.io/istio" {
			return fs[2], nil
		}
	}
	return "", fmt.Errorf("%s requires no istio.io/istio", p)
}

// testCacheDir is ~/.cache/meshtun-test, where test/kube caches its
// binaries (pilot-discovery among them): the Istio binaries are shared
// with it, under its lock.
func testCacheDir() (string, error) {
	d, err := os.UserCacheDir()
	if err != nil {
		return "", err
	}
	return filepath.Join(d, "meshtun-test"), nil
}

// BuildIstiod returns istiod's pilot-discovery at IstioVersion, built once
// into ~/.cache/meshtun-test/bin exactly as test/kube's BuildIstiod does
// (same scratch module, same output name, same lock): either suite
// reuses the other's binary.
func BuildIstiod(ctx context.Context, logf Logf) (string, error) {
	return buildIstioCommand(ctx, logf, "pilot-discovery", "pilotdiscovery", "istio.io/istio/pilot/cmd/pilot-discovery")
}

// BuildIstioctl returns istioctl at IstioVersion, built once into
// ~/.cache/meshtun-test/bin like BuildIstiod (most of its packages are
// pilot-discovery's, already in the Go build cache).
func BuildIstioctl(ctx context.Context, logf Logf) (string, error) {
	return buildIstioCommand(ctx, logf, "istioctl", "istioctl", "istio.io/istio/istioctl/cmd/istioctl")
}

func buildIstioCommand(ctx context.Context, logf Logf, cmdName, modName, pkg string) (string, error) {
	version, err := IstioVersion()
	if err != nil {
		return "", err
	}
	dir, err := testCacheDir()
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, "bin", cmdName+"-"+version)
	if isFile(out) {
		return out, nil
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return "", err
	}
	unlock, err := lockFile(ctx, filepath.Join(dir, "build.lock"))
	if err != nil {
		return "", err
	}
	defer unlock()
	if isFile(out) {
		return out, nil
	}
	src := filepath.Join(dir, "src", cmdName+"-"+version)
	if err := os.MkdirAll(src, 0o755); err != nil {
		return "", err
	}
	gomod := "module meshtuntest/" + modName + "\n\ngo 1.26.0\n\nrequire istio.io/istio " + version + "\n"
	if err := os.WriteFile(filepath.Join(src, "go.mod"), []byte(gomod), 0o644); err != nil {
		return "", err
	}
	start := time.Now()
	logf("building %s %s in %s (20 minutes or more when the Go build cache is cold)", cmdName, version, src)
	tmp := out + ".tmp"
	cmd := exec.CommandContext(ctx, "go", "build", "-o", tmp, pkg)
	cmd.Dir = src
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod")
	if b, err := cmd.CombinedOutput(); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("go build %s in %s: %w\n%s", pkg, src, err, tail(b, 3000))
	}
	if err := os.Rename(tmp, out); err != nil {
		return "", err
	}
	logf("built %s in %s", cmdName, time.Since(start).Round(time.Second))
	return out, nil
}

// IstioCRDs is the path of Istio's CRDs (manifests/charts/base/files/
// crd-all.gen.yaml) of IstioVersion in the Go module cache.
func IstioCRDs(ctx context.Context) (string, error) {
	version, err := IstioVersion()
	if err != nil {
		return "", err
	}
	dir, err := testCacheDir()
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", err
	}
	cmd := exec.CommandContext(ctx, "go", "mod", "download", "-json", "istio.io/istio@"+version)
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "GOWORK=off", "GOFLAGS=-mod=mod")
	out, err := cmd.Output()
	var info struct{ Dir, Error string }
	if jerr := json.Unmarshal(out, &info); err != nil || jerr != nil || info.Dir == "" {
		return "", fmt.Errorf("go mod download istio.io/istio@%s: %v %v %s", version, err, jerr, info.Error)
	}
	return filepath.Join(info.Dir, "manifests", "charts", "base", "files", "crd-all.gen.yaml"), nil
}

// WriteIstiodImage writes IstiodImage as a docker-archive at out:
// pilot-discovery (dynamically linked: it is built with cgo, as test/kube
// runs it) at /usr/local/bin on a layer of the nodes' Debian base, which
// has the C library it needs.
func WriteIstiodImage(ctx context.Context, logf Logf, pilotDiscovery, out string) error {
	rootfs, err := BaseRootfs(ctx, logf)
	if err != nil {
		return err
	}
	base, err := dirLayer(rootfs)
	if err != nil {
		return err
	}
	bin, err := fileLayer(pilotDiscovery, "usr/local/bin/pilot-discovery")
	if err != nil {
		return err
	}
	return writeImage(out, IstiodImage, imageConfig{Entrypoint: []string{"/usr/local/bin/pilot-discovery"}, Env: systemPath}, base, bin)
}

func isFile(p string) bool {
	st, err := os.Stat(p)
	return err == nil && st.Mode().IsRegular()
}
