package main

import (
	"archive/tar"
	"bytes"
	"context"
	"debug/elf"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/google/go-containerregistry/pkg/name"
	"github.com/google/go-containerregistry/pkg/registry"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/rs/zerolog"
)

// testEpoch stands for a commit time: every timestamp in the image must be it.
const testEpoch = 1700000000

func repoRoot(t *testing.T) string {
	t.Helper()
	r, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func gitHead(t *testing.T, repo string) string {
	t.Helper()
	out, err := exec.Command("git", "-C", repo, "rev-parse", "HEAD").Output()
	if err != nil {
		t.Fatalf("git rev-parse HEAD: %v", err)
	}
	return strings.TrimSpace(string(out))
}

func build(t *testing.T, platforms ...Platform) map[Platform]v1.Image {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	imgs, _, err := Build(ctx, zerolog.New(zerolog.NewTestWriter(t)), Options{Repo: repoRoot(t), Platforms: platforms})
	if err != nil {
		t.Fatal(err)
	}
	return imgs
}

// layerFiles reads the image's only layer: its tar headers and the bytes of
// the binary.
func layerFiles(t *testing.T, img v1.Image) ([]*tar.Header, []byte) {
	t.Helper()
	layers, err := img.Layers()
	if err != nil {
		t.Fatal(err)
	}
	if len(layers) != 1 {
		t.Fatalf("image has %d layers, want 1 (the binary on an empty base)", len(layers))
	}
	rc, err := layers[0].Uncompressed()
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	var hdrs []*tar.Header
	var bin []byte
	tr := tar.NewReader(rc)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("layer: %v", err)
		}
		hdrs = append(hdrs, h)
		if "/"+h.Name == BinaryPath {
			if bin, err = io.ReadAll(tr); err != nil {
				t.Fatal(err)
			}
		}
	}
	return hdrs, bin
}

// staticELF says why bin is not an ELF executable for machine without a
// program interpreter (statically linked: it runs on an empty base), or nil.
func staticELF(bin []byte, machine elf.Machine) error {
	f, err := elf.NewFile(bytes.NewReader(bin))
	if err != nil {
		return fmt.Errorf("binary is not ELF: %w", err)
	}
	if f.Machine != machine {
		return fmt.Errorf("binary is for %v, want %v", f.Machine, machine)
	}
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			return errors.New("binary has a program interpreter (dynamically linked): it cannot run on an empty base")
		}
	}
	return nil
}

func checkStaticELF(t *testing.T, bin []byte, machine elf.Machine) {
	t.Helper()
	if err := staticELF(bin, machine); err != nil {
		t.Error(err)
	}
}

// TestStaticELFCatchesDynamic shows the static check fails on what it must:
// a dynamically linked program (the system's own) and the wrong machine.
func TestStaticELFCatchesDynamic(t *testing.T) {
	exe, err := exec.LookPath("git")
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(exe)
	if err != nil {
		t.Fatal(err)
	}
	native := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[runtime.GOARCH]
	if err := staticELF(b, native); err == nil || !strings.Contains(err.Error(), "dynamically linked") {
		t.Errorf("%s: staticELF = %v, want it called dynamically linked", exe, err)
	}
	if err := staticELF(b, elf.EM_RISCV); err == nil {
		t.Errorf("%s: staticELF for RISC-V passed", exe)
	}
}

// TestArchive builds the docker archive `make image` writes and checks it
// the way `docker load`/`kind load image-archive` and the DaemonSet use it:
// the tag in manifest.json, one layer with the binary at BinaryPath (root,
// 0755, static), the entrypoint, labels and timestamps, and that the binary
// from the layer runs. A second build must give the same bytes.
func TestArchive(t *testing.T) {
	t.Setenv("SOURCE_DATE_EPOCH", "1700000000")
	repo := repoRoot(t)
	host, err := ParsePlatform("linux/" + runtime.GOARCH)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	const tag = "meshtun-test/meshtun:t1"
	archive := filepath.Join(dir, "img.tar")
	if err := WriteArchive(archive, tag, build(t, host)[host]); err != nil {
		t.Fatal(err)
	}

	// manifest.json: what docker load and containerd's import read the tag from.
	f, err := os.Open(archive)
	if err != nil {
		t.Fatal(err)
	}
	var manifest tarball.Manifest
	tr := tar.NewReader(f)
	for {
		h, err := tr.Next()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("archive: %v", err)
		}
		if h.Name == "manifest.json" {
			if err := json.NewDecoder(tr).Decode(&manifest); err != nil {
				t.Fatalf("manifest.json: %v", err)
			}
		}
	}
	f.Close()
	if len(manifest) != 1 || !slices.Equal(manifest[0].RepoTags, []string{tag}) {
		t.Fatalf("manifest.json = %+v, want one image tagged %q", manifest, tag)
	}

	img, err := tarball.ImageFromPath(archive, nil)
	if err != nil {
		t.Fatalf("read archive back: %v", err)
	}
	cf, err := img.ConfigFile()
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(cf.Config.Entrypoint, []string{BinaryPath}) {
		t.Errorf("entrypoint %q, want [%s]", cf.Config.Entrypoint, BinaryPath)
	}
	if cf.OS != "linux" || cf.Architecture != runtime.GOARCH {
		t.Errorf("config platform %s/%s, want linux/%s", cf.OS, cf.Architecture, runtime.GOARCH)
	}
	if cf.Config.User != "" && cf.Config.User != "0" {
		t.Errorf("config user %q: deploy/kubernetes needs root for CAP_NET_ADMIN", cf.Config.User)
	}
	created := time.Unix(testEpoch, 0).UTC()
	if !cf.Created.Time.Equal(created) {
		t.Errorf("created %v, want SOURCE_DATE_EPOCH %v", cf.Created.Time, created)
	}
	wantLabels := map[string]string{
		LabelRevision: gitHead(t, repo),
		LabelSource:   "https://github.com/meshtun/meshtun",
	}
	for k, v := range wantLabels {
		if got := cf.Config.Labels[k]; got != v {
			t.Errorf("label %s = %q, want %q", k, got, v)
		}
	}
	if cf.Config.Labels[LabelVersion] == "" {
		t.Errorf("label %s empty", LabelVersion)
	}

	hdrs, bin := layerFiles(t, img)
	var names []string
	for _, h := range hdrs {
		names = append(names, h.Name)
		if !h.ModTime.Equal(created) {
			t.Errorf("layer %s: mtime %v, want %v", h.Name, h.ModTime, created)
		}
		if h.Uid != 0 || h.Gid != 0 {
			t.Errorf("layer %s: owner %d:%d, want 0:0", h.Name, h.Uid, h.Gid)
		}
		if h.Name == strings.TrimPrefix(BinaryPath, "/") || h.Name == strings.TrimPrefix(PluginPath, "/") {
			if h.Typeflag != tar.TypeReg || h.FileInfo().Mode().Perm() != 0o755 {
				t.Errorf("layer %s: type %q mode %v, want a regular file 0755", h.Name, h.Typeflag, h.FileInfo().Mode())
			}
		}
	}
	if want := []string{"usr/", "usr/local/", "usr/local/bin/", "usr/local/bin/meshtun", "usr/local/bin/meshtun-cni"}; !slices.Equal(names, want) {
		t.Errorf("layer holds %q, want %q", names, want)
	}
	if bin == nil {
		t.Fatalf("layer has no %s", BinaryPath)
	}
	checkStaticELF(t, bin, map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}[runtime.GOARCH])

	// Run what the config runs (entrypoint, then the default command), with
	// the binary taken from the layer.
	exe := filepath.Join(dir, "meshtun")
	if err := os.WriteFile(exe, bin, 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(exe, cf.Config.Cmd...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %q from the layer: %v\n%s", BinaryPath, cf.Config.Cmd, err, out)
	}
	if !strings.HasPrefix(string(out), "meshtun ") {
		t.Errorf("meshtun %q printed %q, want its version", cf.Config.Cmd, out)
	}
	// The node image's binary has no lab commands (build tag nolab).
	out, err = exec.Command(exe, "demo").CombinedOutput()
	if err == nil || !strings.Contains(string(out), "nolab") {
		t.Errorf("meshtun demo from the layer: %v %q, want it refused (built with -tags nolab)", err, out)
	}

	// Reproducible: a second build of the same commit is the same archive.
	archive2 := filepath.Join(dir, "img2.tar")
	if err := WriteArchive(archive2, tag, build(t, host)[host]); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(archive)
	b, _ := os.ReadFile(archive2)
	if !bytes.Equal(a, b) {
		t.Errorf("two builds of one commit differ (%d and %d bytes)", len(a), len(b))
	}
}

// TestPushIndex pushes the two-platform image, as make image-push does, to
// a registry on loopback and pulls each platform back: the index lists
// linux/amd64 and linux/arm64/v8, and each platform's binary is a static
// ELF for that machine.
func TestPushIndex(t *testing.T) {
	t.Setenv("SOURCE_DATE_EPOCH", "1700000000")
	platforms, err := ParsePlatforms("linux/amd64,linux/arm64")
	if err != nil {
		t.Fatal(err)
	}
	imgs := build(t, platforms...)
	srv := httptest.NewServer(registry.New(registry.Logger(log.New(io.Discard, "", 0))))
	defer srv.Close()
	ref := strings.TrimPrefix(srv.URL, "http://") + "/meshtun/meshtun:test"
	ctx := context.Background()
	digest, err := Push(ctx, ref, imgs, platforms)
	if err != nil {
		t.Fatal(err)
	}

	r, err := name.ParseReference(ref)
	if err != nil {
		t.Fatal(err)
	}
	idx, err := remote.Index(r, remote.WithContext(ctx))
	if err != nil {
		t.Fatalf("pull index: %v", err)
	}
	if d, _ := idx.Digest(); d != digest {
		t.Errorf("pulled index %v, pushed %v", d, digest)
	}
	im, err := idx.IndexManifest()
	if err != nil {
		t.Fatal(err)
	}
	if len(im.Manifests) != 2 {
		t.Fatalf("index has %d manifests, want 2", len(im.Manifests))
	}
	machines := map[string]elf.Machine{"amd64": elf.EM_X86_64, "arm64": elf.EM_AARCH64}
	for i, p := range platforms {
		desc := im.Manifests[i]
		if desc.Platform == nil || desc.Platform.OS != p.OS || desc.Platform.Architecture != p.Arch || desc.Platform.Variant != p.Variant {
			t.Errorf("index entry %d platform %+v, want %s", i, desc.Platform, p)
			continue
		}
		img, err := idx.Image(desc.Digest)
		if err != nil {
			t.Fatalf("%s: %v", p, err)
		}
		cf, err := img.ConfigFile()
		if err != nil {
			t.Fatal(err)
		}
		if cf.Architecture != p.Arch || cf.Variant != p.Variant {
			t.Errorf("%s: config says %s/%s", p, cf.Architecture, cf.Variant)
		}
		_, bin := layerFiles(t, img)
		if bin == nil {
			t.Fatalf("%s: layer has no %s", p, BinaryPath)
		}
		checkStaticELF(t, bin, machines[p.Arch])
	}
}

// TestRunRejects checks the command's refusals, each naming what is wrong.
func TestRunRejects(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{nil, "nothing to do"},
		{[]string{"--out", "x.tar", "--platforms", "linux/amd64,linux/arm64"}, "one platform"},
		{[]string{"--out", "x.tar", "--platforms", "windows/amd64"}, "linux only"},
		{[]string{"--out", "x.tar", "--platforms", "amd64"}, "os/arch"},
		{[]string{"--push", "r/m:t", "--platforms", "linux/amd64,linux/amd64"}, "listed twice"},
	} {
		err := run(context.Background(), zerolog.Nop(), tc.args)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("run %q: error %v, want one saying %q", tc.args, err, tc.want)
		}
	}
}
