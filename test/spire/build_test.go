package spire

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// SpireVersion is the SPIRE release the test runs.
const SpireVersion = "v1.13.3"

// spireBinaries returns spire-server and spire-agent of SpireVersion,
// building them on first use (about ten minutes cold; later runs reuse
// them) in a scratch module under ~/.cache/meshtun-test.
func spireBinaries() (server, agent string, err error) {
	home, err := os.UserHomeDir()
	if err != nil {
		return "", "", err
	}
	cache := filepath.Join(home, ".cache", "meshtun-test")
	bin := filepath.Join(cache, "bin")
	server = filepath.Join(bin, "spire-server-"+SpireVersion)
	agent = filepath.Join(bin, "spire-agent-"+SpireVersion)
	if exists(server) && exists(agent) {
		return server, agent, nil
	}
	src := filepath.Join(cache, "src", "spire-"+SpireVersion)
	if err := os.MkdirAll(src, 0o755); err != nil {
		return "", "", err
	}
	if err := os.MkdirAll(bin, 0o755); err != nil {
		return "", "", err
	}
	// One build at a time across concurrent test runs.
	lock, err := os.OpenFile(filepath.Join(src, ".lock"), os.O_RDWR|os.O_CREATE, 0o644)
	if err != nil {
		return "", "", err
	}
	defer lock.Close()
	if err := unix.Flock(int(lock.Fd()), unix.LOCK_EX); err != nil {
		return "", "", err
	}
	if exists(server) && exists(agent) {
		return server, agent, nil
	}
	if !exists(filepath.Join(src, "go.mod")) {
		if err := os.WriteFile(filepath.Join(src, "go.mod"), []byte("module spirebuild\n\ngo 1.26.8\n"), 0o644); err != nil {
			return "", "", err
		}
	}
	steps := [][]string{
		{"get", "-tool", "github.com/spiffe/spire/cmd/spire-server@" + SpireVersion},
		{"get", "-tool", "github.com/spiffe/spire/cmd/spire-agent@" + SpireVersion},
		{"build", "-o", server + ".tmp", "github.com/spiffe/spire/cmd/spire-server"},
		{"build", "-o", agent + ".tmp", "github.com/spiffe/spire/cmd/spire-agent"},
	}
	for _, s := range steps {
		cmd := exec.Command("go", s...)
		cmd.Dir = src
		if out, err := cmd.CombinedOutput(); err != nil {
			return "", "", fmt.Errorf("build SPIRE %s: go %v: %w\n%s", SpireVersion, s, err, out)
		}
	}
	for _, b := range []string{server, agent} {
		if err := os.Rename(b+".tmp", b); err != nil {
			return "", "", err
		}
	}
	return server, agent, nil
}

func exists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}
