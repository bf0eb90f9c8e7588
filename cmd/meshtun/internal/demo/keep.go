package demo

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/bench/cluster"
)

// DefaultStateDir is where a demo run as root writes its files unless
// StateDirEnv names another directory.
const DefaultStateDir = "/run/meshtun-demo"

// StateDirEnv, when set, names the state directory instead of
// DefaultStateDir, so that a second demo (a test's, say) neither sees nor
// tears down the one a user keeps.
const StateDirEnv = "MESHTUN_DEMO_STATE_DIR"

// StateDir is where a demo run as root writes its files: one directory
// per run (config and logs), the kept demo's state and the daemon's log.
func StateDir() string {
	if d := os.Getenv(StateDirEnv); d != "" {
		return d
	}
	return DefaultStateDir
}

// keptFile records the demo left up by `meshtun demo --keep`.
func keptFile() string { return filepath.Join(StateDir(), "kept.json") }

// DaemonLog is the log of the process holding a kept demo.
func DaemonLog() string { return filepath.Join(StateDir(), "daemon.log") }

// Kept describes a demo left up by `meshtun demo --keep`.
type Kept struct {
	// PID is the process that holds the cluster; SIGTERM tears it down.
	PID        int        `json:"pid"`
	Cluster    string     `json:"cluster"`
	Dir        string     `json:"dir"`
	Namespaces []string   `json:"namespaces"`
	Nodes      []NodeInfo `json:"nodes"`
}

// WriteKept records k for Down.
func WriteKept(k Kept) error {
	b, err := json.MarshalIndent(k, "", "  ")
	if err != nil {
		return err
	}
	if err := os.WriteFile(keptFile(), append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("demo: record kept demo: %w", err)
	}
	return nil
}

// ReadKept returns the kept demo's record; ok is false if there is none.
func ReadKept() (k Kept, ok bool, err error) {
	b, err := os.ReadFile(keptFile())
	if errors.Is(err, fs.ErrNotExist) {
		return k, false, nil
	}
	if err != nil {
		return k, false, fmt.Errorf("demo: read %s: %w", keptFile(), err)
	}
	if err := json.Unmarshal(b, &k); err != nil {
		return k, false, fmt.Errorf("demo: parse %s: %w", keptFile(), err)
	}
	return k, true, nil
}

// ForgetKept removes the kept demo's record and the daemon's log, and
// StateDir if that leaves it empty.
func ForgetKept() {
	os.Remove(keptFile())
	os.Remove(DaemonLog())
	os.Remove(StateDir())
}

// Running reports whether the kept demo's process is still alive.
func (k Kept) Running() bool { return isProc(k.PID, "demo") }

// isProc reports whether pid is alive and is `<binary> <sub> …`.
func isProc(pid int, sub string) bool {
	if pid <= 0 {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", pid))
	if err != nil {
		return false
	}
	args := bytes.Split(b, []byte{0})
	return len(args) > 1 && string(args[1]) == sub ||
		// `ip netns exec <ns> <binary> node …` before ip has exec'd.
		len(args) > 5 && string(args[1]) == "netns" && string(args[5]) == sub
}

// Down tears down the kept demo: SIGTERM to the process holding it, which
// removes everything it made; if that process is gone, or still there
// after 20 s, it kills the recorded node processes, deletes the cluster's
// namespaces of dead processes (cluster.CleanupStale) and the run's
// directory itself. It returns what it did, one line each.
func Down() ([]string, error) {
	k, ok, err := ReadKept()
	if err != nil {
		return nil, err
	}
	var did []string
	if ok && k.Running() {
		if err := syscall.Kill(k.PID, syscall.SIGTERM); err == nil {
			did = append(did, fmt.Sprintf("stopped the demo process (pid %d), which tore down cluster %s", k.PID, k.Cluster))
		}
		if !waitExit(k.PID, 20*time.Second) {
			syscall.Kill(k.PID, syscall.SIGKILL)
			waitExit(k.PID, 5*time.Second)
			did = append(did, fmt.Sprintf("killed the demo process (pid %d): it did not finish within 20s", k.PID))
		}
	}
	for _, n := range k.Nodes {
		if isProc(n.PID, "node") {
			syscall.Kill(n.PID, syscall.SIGKILL)
			waitExit(n.PID, 5*time.Second)
			did = append(did, fmt.Sprintf("killed meshtun node %s (pid %d)", n.Name, n.PID))
		}
	}
	removed, err := cluster.CleanupStale()
	for _, ns := range removed {
		did = append(did, "deleted network namespace "+ns)
	}
	if ok {
		if k.Dir != "" {
			if _, serr := os.Stat(k.Dir); serr == nil {
				did = append(did, "removed "+k.Dir)
			}
			os.RemoveAll(k.Dir)
		}
		ForgetKept()
	}
	return did, err
}

// waitExit waits until pid, not a child of ours, has exited, or timeout.
func waitExit(pid int, timeout time.Duration) bool {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return errors.Is(err, unix.ESRCH)
	}
	defer unix.Close(fd)
	// A pidfd becomes readable when its process exits.
	fds := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
	for deadline := time.Now().Add(timeout); time.Now().Before(deadline); {
		n, err := unix.Poll(fds, int(time.Until(deadline).Milliseconds())+1)
		if err == nil && n > 0 {
			return true
		}
		if err != nil && !errors.Is(err, unix.EINTR) {
			return false
		}
	}
	return false
}
