package kind

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// ProbeImage is the test image: cmd/probe at /probe.
const ProbeImage = "meshtun-probe:dev"

// tarOneFile is an uncompressed tar of src at path, with its parent
// directories.
func tarOneFile(src, path string) (io.ReadCloser, error) {
	data, err := os.ReadFile(src)
	if err != nil {
		return nil, err
	}
	var b bytes.Buffer
	tw := tar.NewWriter(&b)
	parts := strings.Split(path, "/")
	for i := 1; i < len(parts); i++ {
		if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeDir, Name: strings.Join(parts[:i], "/") + "/", Mode: 0o755}); err != nil {
			return nil, err
		}
	}
	if err := tw.WriteHeader(&tar.Header{Typeflag: tar.TypeReg, Name: path, Mode: 0o755, Size: int64(len(data))}); err != nil {
		return nil, err
	}
	if _, err := tw.Write(data); err != nil {
		return nil, err
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	return io.NopCloser(&b), nil
}

// BuildLocal builds one of this module's commands (cmd/<name>) statically
// into dir and returns its path.
func BuildLocal(ctx context.Context, dir, cmdName string) (string, error) {
	src, err := moduleDir()
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, cmdName)
	cmd := exec.CommandContext(ctx, "go", "build", "-trimpath", "-ldflags=-s -w", "-o", out, "./cmd/"+cmdName)
	cmd.Dir = src
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0")
	if b, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/%s: %w\n%s", cmdName, err, b)
	}
	return out, nil
}

// moduleDir is test/kind's directory (this package's source directory,
// found from the working directory of a test or of make).
func moduleDir() (string, error) {
	wd, err := os.Getwd()
	if err != nil {
		return "", err
	}
	for d := wd; d != "/"; d = filepath.Dir(d) {
		if b, err := os.ReadFile(filepath.Join(d, "go.mod")); err == nil && bytes.HasPrefix(b, []byte("module github.com/meshtun/meshtun/test/kind\n")) {
			return d, nil
		}
		if _, err := os.Stat(filepath.Join(d, "test/kind/go.mod")); err == nil {
			return filepath.Join(d, "test/kind"), nil
		}
	}
	return "", fmt.Errorf("test/kind not found above %s", wd)
}

// RepoDir is the meshtun repository holding test/kind.
func RepoDir() (string, error) {
	d, err := moduleDir()
	if err != nil {
		return "", err
	}
	return filepath.Dir(filepath.Dir(d)), nil
}

// WriteProbeImage builds cmd/probe and writes ProbeImage as a
// docker-archive at out.
func WriteProbeImage(ctx context.Context, dir, out string) error {
	bin, err := BuildLocal(ctx, dir, "probe")
	if err != nil {
		return err
	}
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) { return tarOneFile(bin, "probe") })
	if err != nil {
		return err
	}
	return writeImage(out, ProbeImage, imageConfig{Entrypoint: []string{"/probe"}, Cmd: []string{"sleep"}}, l)
}

// imageConfig is what writeImage sets in an image's config besides
// linux/amd64.
type imageConfig struct {
	Entrypoint, Cmd, Env []string
}

// systemPath is the PATH of the images built on a Debian root.
var systemPath = []string{"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}

// writeImage writes the image of layers (on an empty base) as ref, a
// linux/amd64 docker-archive at out, for kind load image-archive.
func writeImage(out, ref string, cfg imageConfig, layers ...v1.Layer) error {
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
	cf.Config.Entrypoint, cf.Config.Cmd, cf.Config.Env = cfg.Entrypoint, cfg.Cmd, cfg.Env
	if img, err = mutate.ConfigFile(img, cf); err != nil {
		return err
	}
	r, err := name.ParseReference(ref)
	if err != nil {
		return fmt.Errorf("image reference %q: %w", ref, err)
	}
	return tarball.MultiRefWriteToFile(out, map[name.Reference]v1.Image{r: img})
}
