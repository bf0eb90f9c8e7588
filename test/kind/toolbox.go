package kind

import (
	"compress/gzip"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"time"

	"github.com/google/go-containerregistry/pkg/v1/tarball"
)

// ToolboxImage holds the real clients and servers the tests run in pods
// (issue 21 §1): Debian's own curl, socat, nc, dig, iperf3, nginx and
// redis, with sh.
const ToolboxImage = "meshtun-toolbox:dev"

// ToolboxPackages are debootstrapped (minbase) into the toolbox image.
var ToolboxPackages = []string{
	"curl", "socat", "netcat-openbsd", "dnsutils", "iperf3", "nginx-light", "redis-server", "redis-tools",
}

// toolboxRecipe changes whenever ToolboxArchive's steps change.
const toolboxRecipe = "1"

// toolboxTrim are the rootfs paths left out of the image: documentation,
// translations and apt's state (nothing is installed into a running pod).
var toolboxTrim = []string{
	"usr/share/doc", "usr/share/man", "usr/share/info", "usr/share/locale", "usr/share/zoneinfo",
	"var/lib/apt/lists", "var/cache/apt", "var/cache/debconf", "var/log",
}

// ToolboxArchive returns the docker-archive of ToolboxImage, built once
// into CacheDir()/toolbox-<suite>-<hash>/image.tar: a debootstrap
// --variant=minbase of Debian with ToolboxPackages, trimmed, as one layer
// written with go-containerregistry. The rootfs is not kept; the
// archive is what `kind load image-archive` takes.
func ToolboxArchive(ctx context.Context, logf Logf) (string, error) {
	name := "toolbox-" + BaseSuite + "-" + shortHash(append([]string{toolboxRecipe, BaseSuite}, ToolboxPackages...)...)
	dir, err := debootstrapOnce(ctx, logf, name, "toolbox.lock", "image.tar", ToolboxPackages, func(tmp string) error {
		rootfs := filepath.Join(tmp, "rootfs")
		for _, p := range toolboxTrim {
			if err := os.RemoveAll(filepath.Join(rootfs, p)); err != nil {
				return err
			}
		}
		for _, p := range []string{"var/log", "usr/share/zoneinfo"} {
			if err := os.MkdirAll(filepath.Join(rootfs, p), 0o755); err != nil {
				return err
			}
		}
		layerTar := filepath.Join(tmp, "layer.tar")
		if out, err := exec.CommandContext(ctx, "tar", "-C", rootfs, "--numeric-owner", "-cf", layerTar, ".").CombinedOutput(); err != nil {
			return fmt.Errorf("tar %s: %w: %s", rootfs, err, out)
		}
		start := time.Now()
		if err := writeToolboxImage(layerTar, filepath.Join(tmp, "image.tar")); err != nil {
			return err
		}
		logf("toolbox image archive written in %s", time.Since(start).Round(time.Second))
		os.Remove(layerTar)
		return os.RemoveAll(rootfs)
	})
	if err != nil {
		return "", err
	}
	return filepath.Join(dir, "image.tar"), nil
}

// writeToolboxImage writes ToolboxImage, one layer from layerTar, as a
// docker-archive at out.
func writeToolboxImage(layerTar, out string) error {
	l, err := tarball.LayerFromFile(layerTar, tarball.WithCompressionLevel(gzip.BestSpeed))
	if err != nil {
		return err
	}
	return writeImage(out, ToolboxImage, imageConfig{Cmd: []string{"sleep", "infinity"}, Env: systemPath}, l)
}

// ToolboxPrograms are what a toolbox image must run (checked by the test
// of the image).
var ToolboxPrograms = []string{"sh", "curl", "socat", "nc", "dig", "iperf3", "nginx", "redis-server", "redis-cli", "redis-benchmark"}
