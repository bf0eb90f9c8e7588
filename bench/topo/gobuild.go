package topo

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"

	"github.com/rs/zerolog"
)

// buildGoPeer returns the path of the binary name built from the main
// package at the root of module at version, under
// cacheDir/<name>-<version>, building it there the first time: in a
// scratch module, `go get -tool module@version` then `go build`, with the
// module's own go.sum checked against the checksum database as usual. A
// half-finished build never takes the binary's place (it is renamed in
// when complete), so concurrent runs at worst build twice.
func buildGoPeer(ctx context.Context, cacheDir, name, module, version string, log zerolog.Logger) (string, error) {
	dir := filepath.Join(cacheDir, name+"-"+version)
	bin := filepath.Join(dir, name)
	if fi, err := os.Stat(bin); err == nil && fi.Mode().IsRegular() && fi.Mode()&0o111 != 0 {
		return bin, nil
	}
	goTool, err := findGo(name)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return "", fmt.Errorf("topo: %s cache: %w", name, err)
	}
	scratch, err := os.MkdirTemp(dir, "build-")
	if err != nil {
		return "", fmt.Errorf("topo: %s cache: %w", name, err)
	}
	defer os.RemoveAll(scratch)
	log.Info().Str("module", module+"@"+version).Str("cache", dir).Msgf("building the %s peer (once)", name)
	tmp := filepath.Join(scratch, name)
	steps := [][]string{
		{"mod", "init", "meshtun.bench/peer"},
		{"get", "-tool", module + "@" + version},
		{"build", "-o", tmp, module},
	}
	for _, args := range steps {
		cmd := exec.CommandContext(ctx, goTool, args...)
		cmd.Dir = scratch
		cmd.Env = append(os.Environ(), "GOFLAGS=-mod=mod", "GOWORK=off")
		out, err := cmd.CombinedOutput()
		if err != nil {
			return "", fmt.Errorf("topo: build %s: go %s: %w\n%s", name, strings.Join(args, " "), err, out)
		}
	}
	if err := os.Rename(tmp, bin); err != nil {
		return "", fmt.Errorf("topo: %s cache: %w", name, err)
	}
	return bin, nil
}

// findGo returns the go command: from PATH, else the toolchain in
// /usr/local/go. what names the peer that needs it, for the error.
func findGo(what string) (string, error) {
	if p, err := exec.LookPath("go"); err == nil {
		return p, nil
	}
	const fallback = "/usr/local/go/bin/go"
	if _, err := os.Stat(fallback); err == nil {
		return fallback, nil
	}
	return "", errors.New("topo: building " + what + " needs the go command (not in PATH, nor " + fallback + ")")
}
