package cluster

import (
	"crypto/rand"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"

	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// NamePrefix starts the name of every namespace this package creates. The
// full form is mt-<pid>-<run>-…, where pid is the creating process and run
// a random tag; CleanupStale relies on it.
const NamePrefix = "mt-"

// runPrefix returns "mt-<pid>-<4 random letters>" plus "-<name>" if name is
// set.
func runPrefix(name string) string {
	tag := strings.ToLower(rand.Text()[:4]) // base32: a-z, 2-7
	p := fmt.Sprintf("%s%d-%s", NamePrefix, os.Getpid(), tag)
	if name != "" {
		p += "-" + name
	}
	return p
}

// pidOf returns the PID encoded in a namespace name made by this package.
func pidOf(nsName string) (int, bool) {
	rest, ok := strings.CutPrefix(nsName, NamePrefix)
	if !ok {
		return 0, false
	}
	digits, _, ok := strings.Cut(rest, "-")
	if !ok {
		return 0, false
	}
	pid, err := strconv.Atoi(digits)
	// 1<<22 is the kernel's PID_MAX_LIMIT; larger numbers are not PIDs
	// (and would be truncated by kill).
	if err != nil || pid <= 0 || pid > 1<<22 || strconv.Itoa(pid) != digits {
		return 0, false
	}
	return pid, true
}

// pidAlive reports whether a process with this PID exists (a zombie counts).
func pidAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// prepareNetnsDir creates /run/netns and makes it a shared mount point,
// as `ip netns add` does, so that namespace unmounts propagate into the
// mount namespaces `ip netns exec` creates (otherwise a command started in
// one namespace would pin every other namespace that existed when it
// started).
func prepareNetnsDir() error {
	if err := os.MkdirAll(netnsDir, 0o755); err != nil {
		return fmt.Errorf("create %s: %w", netnsDir, err)
	}
	err := unix.Mount("", netnsDir, "none", unix.MS_SHARED|unix.MS_REC, "")
	if errors.Is(err, unix.EINVAL) {
		// Not a mount point yet: bind it onto itself first.
		if err := unix.Mount(netnsDir, netnsDir, "none", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind-mount %s onto itself: %w", netnsDir, err)
		}
		err = unix.Mount("", netnsDir, "none", unix.MS_SHARED|unix.MS_REC, "")
	}
	if err != nil {
		return fmt.Errorf("make %s a shared mount: %w", netnsDir, err)
	}
	return nil
}

// createNamed creates a network namespace pinned at /run/netns/<name>. The
// namespace is created on a locked thread that is switched back afterwards
// (and retired if that fails), so no other code ever runs in it by accident.
func createNamed(name string) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			errc <- fmt.Errorf("create netns %s: get current namespace: %w", name, err)
			return
		}
		defer orig.Close()
		h, err := netns.NewNamed(name)
		if err == nil {
			h.Close()
		} else {
			err = fmt.Errorf("create netns %s: %w", name, err)
			if !errors.Is(err, fs.ErrExist) {
				// NewNamed may have left an unmounted placeholder file.
				_ = deleteNamed(name)
			}
		}
		if rerr := netns.Set(orig); rerr != nil {
			// Keep the thread locked: it exits with this goroutine.
			errc <- errors.Join(err, fmt.Errorf("create netns %s: switch back: %w", name, rerr))
			return
		}
		runtime.UnlockOSThread()
		errc <- err
	}()
	return <-errc
}

// deleteNamed unmounts and removes /run/netns/<name>. The namespace itself
// (with its interfaces) goes away once nothing else holds it. A missing
// entry is not an error.
func deleteNamed(name string) error {
	p := filepath.Join(netnsDir, name)
	err := unix.Unmount(p, unix.MNT_DETACH)
	if err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
		return fmt.Errorf("unmount %s: %w", p, err)
	}
	if err := os.Remove(p); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("remove %s: %w", p, err)
	}
	return nil
}

// CleanupStale deletes namespaces left behind by runs of this package whose
// process is gone (named mt-<pid>-… with no live process <pid>). Namespaces
// of live processes are never touched. Processes still running inside a
// stale namespace are not killed; they keep it alive, unnamed, until they
// exit. PIDs are compared within this PID namespace only, and a reused PID
// makes a leftover look alive, which errs on the safe side. It returns the
// names it removed.
func CleanupStale() ([]string, error) {
	entries, err := os.ReadDir(netnsDir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("cleanup stale namespaces: %w", err)
	}
	var removed []string
	var errs []error
	for _, e := range entries {
		pid, ok := pidOf(e.Name())
		if !ok || pidAlive(pid) {
			continue
		}
		if err := deleteNamed(e.Name()); err != nil {
			errs = append(errs, fmt.Errorf("cleanup stale namespace %s: %w", e.Name(), err))
			continue
		}
		removed = append(removed, e.Name())
	}
	return removed, errors.Join(errs...)
}
