package main

import (
	"archive/tar"
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/empty"
	"github.com/google/go-containerregistry/pkg/v1/mutate"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// BinaryPath is where the image holds the meshtun binary, PluginPath the
// startup gate's CNI plugin, which `meshtun node --cni` copies into the
// node's CNI bin directory (docs/kubernetes.md, "The startup gate").
const (
	BinaryPath = "/usr/local/bin/meshtun"
	PluginPath = "/usr/local/bin/meshtun-cni"
)

// Label keys of the OCI image spec's pre-defined annotations, set as image
// config labels (what `docker inspect` and registries show).
const (
	LabelSource   = "org.opencontainers.image.source"
	LabelVersion  = "org.opencontainers.image.version"
	LabelRevision = "org.opencontainers.image.revision"
	LabelCreated  = "org.opencontainers.image.created"
	LabelTitle    = "org.opencontainers.image.title"
)

// Meta is what the image says about the source it was built from.
type Meta struct {
	Source   string    // repository URL, the source label
	Version  string    // the version label, e.g. `git describe` output
	Revision string    // full commit hash, the revision label
	Created  time.Time // every timestamp in the image (layer entries, config, history)
}

// Platform is an OS and architecture the image is built for.
type Platform struct {
	OS, Arch, Variant string
}

func (p Platform) String() string {
	s := p.OS + "/" + p.Arch
	if p.Variant != "" {
		s += "/" + p.Variant
	}
	return s
}

// ParsePlatform parses "linux/amd64" or "linux/arm64/v8". Only linux is
// accepted: meshtun is a Linux program.
func ParsePlatform(s string) (Platform, error) {
	parts := strings.Split(strings.TrimSpace(s), "/")
	if len(parts) < 2 || len(parts) > 3 || parts[0] == "" || parts[1] == "" {
		return Platform{}, fmt.Errorf("platform %q: want os/arch[/variant], e.g. linux/amd64", s)
	}
	if parts[0] != "linux" {
		return Platform{}, fmt.Errorf("platform %q: meshtun runs on linux only", s)
	}
	p := Platform{OS: parts[0], Arch: parts[1]}
	if len(parts) == 3 {
		p.Variant = parts[2]
	} else if p.Arch == "arm64" {
		p.Variant = "v8" // what registries and runtimes match linux/arm64 against
	}
	return p, nil
}

// ParsePlatforms parses a comma-separated list of platforms.
func ParsePlatforms(s string) ([]Platform, error) {
	var ps []Platform
	seen := map[string]bool{}
	for f := range strings.SplitSeq(s, ",") {
		p, err := ParsePlatform(f)
		if err != nil {
			return nil, err
		}
		if seen[p.String()] {
			return nil, fmt.Errorf("platform %q listed twice", p)
		}
		seen[p.String()] = true
		ps = append(ps, p)
	}
	return ps, nil
}

// buildTags are the build tags of the image's binaries: grpcnotrace, as
// every meshtun build (the Makefile's GOTAGS, bench/noderun.BuildTags),
// keeps gRPC's x/net/trace, which turns off the linker's dead-code
// elimination of methods, out; nolab leaves out the lab commands (demo,
// bench: the namespace-cluster builder, traffic generators, the code that
// runs `go build`), which a node never runs: 962,560 bytes smaller and
// 1.1-1.5 MiB less RSS at start, all of it file pages (docs/decisions/
// 2026-12-04-node-binary-without-lab.md).
const buildTags = "grpcnotrace,nolab"

// BuildBinary builds a static, stripped meshtun for p from the module at
// repo into out, with the flags that make it reproducible: no cgo (static,
// runs on an empty base), -trimpath (no build paths), no build ID, and the
// VCS stamp when the checkout has one (`meshtun version` prints it).
func BuildBinary(ctx context.Context, repo, out string, p Platform) error {
	return buildCommand(ctx, repo, out, "./cmd/meshtun", p)
}

// BuildPlugin builds the CNI plugin (cmd/meshtun-cni) as BuildBinary
// builds meshtun.
func BuildPlugin(ctx context.Context, repo, out string, p Platform) error {
	return buildCommand(ctx, repo, out, "./cmd/meshtun-cni", p)
}

func buildCommand(ctx context.Context, repo, out, pkg string, p Platform) error {
	args := []string{"build", "-tags", buildTags, "-trimpath", "-buildvcs=auto", "-ldflags=-s -w -buildid=", "-o", out, pkg}
	cmd := exec.CommandContext(ctx, goCommand(), args...)
	cmd.Dir = repo
	cmd.Env = append(os.Environ(), "CGO_ENABLED=0", "GOOS="+p.OS, "GOARCH="+p.Arch)
	if p.Arch == "arm" && p.Variant != "" {
		cmd.Env = append(cmd.Env, "GOARM="+strings.TrimPrefix(p.Variant, "v"))
	}
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build %s for %s in %s: %w\n%s", pkg, p, repo, err, stderr.Bytes())
	}
	return nil
}

func goCommand() string {
	if g := os.Getenv("GO"); g != "" {
		return g
	}
	return "go"
}

// Layer returns the image's one layer: the binary at BinaryPath and the
// plugin at PluginPath, owned by root, mode 0755 (any user may run them),
// with their parent directories, every entry stamped with created.
func Layer(binary, plugin []byte, created time.Time) (v1.Layer, error) {
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	mtime := created.UTC().Truncate(time.Second)
	dir := strings.TrimPrefix(filepath.Dir(BinaryPath), "/")
	var parent string
	for d := range strings.SplitSeq(dir, "/") {
		parent = filepath.Join(parent, d)
		if err := tw.WriteHeader(&tar.Header{
			Typeflag: tar.TypeDir, Name: parent + "/", Mode: 0o755, ModTime: mtime, Format: tar.FormatPAX,
		}); err != nil {
			return nil, err
		}
	}
	for _, f := range []struct {
		path string
		data []byte
	}{{BinaryPath, binary}, {PluginPath, plugin}} {
		if err := tw.WriteHeader(&tar.Header{
			Typeflag: tar.TypeReg, Name: strings.TrimPrefix(f.path, "/"), Mode: 0o755,
			Size: int64(len(f.data)), ModTime: mtime, Format: tar.FormatPAX,
		}); err != nil {
			return nil, err
		}
		if _, err := tw.Write(f.data); err != nil {
			return nil, err
		}
	}
	if err := tw.Close(); err != nil {
		return nil, err
	}
	b := buf.Bytes()
	return tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(b)), nil
	}, tarball.WithMediaType(types.OCILayer))
}

// Image returns the image for p: an empty base (no shell, no libc, nothing
// to pull), one layer with binary, and a config that runs it.
//
// The config names no user: meshtun node needs CAP_NET_ADMIN in its
// effective set, which Kubernetes and Docker give to uid 0 only (they set no
// ambient capabilities), so deploy/kubernetes runs it as root with every
// other capability dropped. Nothing in the image needs root otherwise: the
// binary is world-executable and meshtun writes nothing to the root
// filesystem, so a read-only root and any runAsUser work for what needs no
// capability (`meshtun version`, `meshtun ca`).
func Image(binary, plugin []byte, p Platform, m Meta) (v1.Image, error) {
	layer, err := Layer(binary, plugin, m.Created)
	if err != nil {
		return nil, fmt.Errorf("layer: %w", err)
	}
	created := v1.Time{Time: m.Created.UTC().Truncate(time.Second)}
	img := mutate.MediaType(empty.Image, types.OCIManifestSchema1)
	img = mutate.ConfigMediaType(img, types.OCIConfigJSON)
	img, err = mutate.Append(img, mutate.Addendum{
		Layer: layer,
		History: v1.History{
			Created:   created,
			CreatedBy: "deploy/image: meshtun " + m.Version + " at " + BinaryPath,
		},
	})
	if err != nil {
		return nil, err
	}
	cf, err := img.ConfigFile()
	if err != nil {
		return nil, err
	}
	cf = cf.DeepCopy()
	cf.Created = created
	cf.OS, cf.Architecture, cf.Variant = p.OS, p.Arch, p.Variant
	labels := map[string]string{
		LabelTitle:    "meshtun",
		LabelVersion:  m.Version,
		LabelRevision: m.Revision,
		LabelCreated:  created.Format(time.RFC3339),
	}
	if m.Source != "" {
		labels[LabelSource] = m.Source
	}
	cf.Config = v1.Config{
		Entrypoint: []string{BinaryPath},
		Cmd:        []string{"version"},
		Env:        []string{"PATH=" + filepath.Dir(BinaryPath)},
		WorkingDir: "/",
		Labels:     labels,
		ExposedPorts: map[string]struct{}{
			"15008/tcp": {}, // HBONE
			"15020/tcp": {}, // metrics
			"15021/tcp": {}, // readiness
		},
		StopSignal: "SIGTERM", // drains, then removes its rules
	}
	return mutate.ConfigFile(img, cf)
}

// Index returns an OCI image index of imgs, one per platform, for pushing a
// multi-architecture image.
func Index(imgs map[Platform]v1.Image, order []Platform) (v1.ImageIndex, error) {
	idx := mutate.IndexMediaType(empty.Index, types.OCIImageIndex)
	for _, p := range order {
		img, ok := imgs[p]
		if !ok {
			return nil, fmt.Errorf("no image for %s", p)
		}
		idx = mutate.AppendManifests(idx, mutate.IndexAddendum{
			Add: img,
			Descriptor: v1.Descriptor{
				Platform: &v1.Platform{OS: p.OS, Architecture: p.Arch, Variant: p.Variant},
			},
		})
	}
	return idx, nil
}

// GitMeta reads the revision and, unless SOURCE_DATE_EPOCH is set, the
// commit time from the git checkout at repo, so that two builds of one
// commit give the same image. version, when empty, becomes `git describe
// --tags --always --dirty`. A checkout without git fails: without a
// revision the image could not say what it holds.
func GitMeta(ctx context.Context, repo, version string) (Meta, error) {
	git := func(args ...string) (string, error) {
		cmd := exec.CommandContext(ctx, "git", append([]string{"-C", repo}, args...)...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		out, err := cmd.Output()
		if err != nil {
			return "", fmt.Errorf("git %s in %s: %w: %s", strings.Join(args, " "), repo, err, strings.TrimSpace(stderr.String()))
		}
		return strings.TrimSpace(string(out)), nil
	}
	var m Meta
	var err error
	if m.Revision, err = git("rev-parse", "HEAD"); err != nil {
		return m, err
	}
	if version == "" {
		if version, err = git("describe", "--tags", "--always", "--dirty"); err != nil {
			return m, err
		}
	}
	m.Version = version
	epoch := os.Getenv("SOURCE_DATE_EPOCH")
	if epoch == "" {
		if epoch, err = git("log", "-1", "--format=%ct", "HEAD"); err != nil {
			return m, err
		}
	}
	secs, err := strconv.ParseInt(epoch, 10, 64)
	if err != nil || secs < 0 {
		return m, fmt.Errorf("SOURCE_DATE_EPOCH %q: want seconds since 1970", epoch)
	}
	m.Created = time.Unix(secs, 0).UTC()
	return m, nil
}

// ModuleSource returns the repository URL of the Go module at repo, from
// its module path (github.com/x/y → https://github.com/x/y).
func ModuleSource(repo string) (string, error) {
	b, err := os.ReadFile(filepath.Join(repo, "go.mod"))
	if err != nil {
		return "", err
	}
	for line := range strings.SplitSeq(string(b), "\n") {
		if rest, ok := strings.CutPrefix(strings.TrimSpace(line), "module "); ok {
			return "https://" + strings.Trim(strings.TrimSpace(rest), `"`), nil
		}
	}
	return "", fmt.Errorf("%s: no module line", filepath.Join(repo, "go.mod"))
}
