package demo

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// The demo re-runs itself for two purposes; StageEnv tells the re-run
// process which one it is.
const (
	// StageEnv names the environment variable that carries the stage.
	StageEnv = "MESHTUN_DEMO_STAGE"
	// StageRootless: running as root of namespaces of its own, made by
	// RunRootless; DirEnv names the directory for config and logs.
	StageRootless = "rootless"
	// StageDaemon: the background process holding a kept cluster.
	StageDaemon = "daemon"
	// DirEnv names the environment variable with the rootless run's
	// directory.
	DirEnv = "MESHTUN_DEMO_DIR"
)

// RootlessProblems returns what stops this (unprivileged) user from
// running the demo inside namespaces of its own, each with what to do
// about it; nil when nothing known stands in the way.
func RootlessProblems() []string {
	var p []string
	if sysctlIs("kernel/unprivileged_userns_clone", "0") {
		p = append(p, "unprivileged user namespaces are disabled (kernel.unprivileged_userns_clone = 0); enable them: sudo sysctl -w kernel.unprivileged_userns_clone=1")
	}
	if sysctlIs("user/max_user_namespaces", "0") {
		p = append(p, "user namespaces are disabled (user.max_user_namespaces = 0); enable them: sudo sysctl -w user.max_user_namespaces=15000")
	}
	if sysctlIs("kernel/apparmor_restrict_unprivileged_userns", "1") {
		p = append(p, "AppArmor restricts unprivileged user namespaces (kernel.apparmor_restrict_unprivileged_userns = 1); lift it: sudo sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or give the meshtun binary an AppArmor profile that allows userns")
	}
	switch err := unix.Access("/dev/net/tun", unix.R_OK|unix.W_OK); {
	case errors.Is(err, fs.ErrNotExist):
		p = append(p, "there is no /dev/net/tun; load the TUN driver: sudo modprobe tun")
	case err != nil:
		mode := "unknown mode"
		if fi, serr := os.Stat("/dev/net/tun"); serr == nil {
			mode = "mode " + fi.Mode().Perm().String()
		}
		p = append(p, fmt.Sprintf("/dev/net/tun (%s) cannot be opened by uid %d (%v). Most distributions make it 0666 (udev); "+
			"opening it grants nothing by itself, a TUN device still needs CAP_NET_ADMIN over a network namespace. Do the same: sudo chmod 0666 /dev/net/tun",
			mode, os.Getuid(), err))
	}
	if _, err := lookIP(); err != nil {
		p = append(p, "the ip command (iproute2) is not installed: install the iproute2 package")
	}
	return p
}

func sysctlIs(key, value string) bool {
	b, err := os.ReadFile("/proc/sys/" + key)
	return err == nil && strings.TrimSpace(string(b)) == value
}

// lookIP finds the ip command, also in the sbin directories that an
// unprivileged user's PATH often lacks.
func lookIP() (string, error) {
	if p, err := exec.LookPath("ip"); err == nil {
		return p, nil
	}
	for _, p := range []string{"/usr/sbin/ip", "/sbin/ip", "/usr/bin/ip", "/bin/ip"} {
		if fi, err := os.Stat(p); err == nil && fi.Mode()&0o111 != 0 {
			return p, nil
		}
	}
	return "", errors.New("ip (iproute2) not found in PATH, /usr/sbin or /sbin")
}

// RunRootless runs this binary with args as root of new user, network and
// mount namespaces (the caller's uid and gid mapped to root, no other ids),
// with StageEnv=StageRootless and DirEnv=dir, stdio inherited, and waits
// for it. The caller gains no privilege over anything outside those
// namespaces. When ctx ends, the child gets SIGTERM; if this process dies,
// the child gets SIGKILL, and its node processes die with it (the cluster
// starts them with a parent-death signal).
//
// There is no PID namespace: the netlink and netns libraries find a
// thread's namespaces under /proc/<pid>/task/<tid>, which a PID namespace
// would need a /proc of its own for, and mounting one is refused in many
// containers.
func RunRootless(ctx context.Context, args []string, dir string) error {
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("demo: find own binary: %w", err)
	}
	ipPath, err := lookIP()
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	cmd := exec.Command(self, args...)
	cmd.Env = append(os.Environ(), StageEnv+"="+StageRootless, DirEnv+"="+dir,
		"PATH="+filepath.Dir(ipPath)+string(os.PathListSeparator)+os.Getenv("PATH"))
	cmd.Stdin, cmd.Stdout, cmd.Stderr = os.Stdin, os.Stdout, os.Stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{
		Cloneflags:                 unix.CLONE_NEWUSER | unix.CLONE_NEWNET | unix.CLONE_NEWNS,
		UidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getuid(), Size: 1}},
		GidMappings:                []syscall.SysProcIDMap{{ContainerID: 0, HostID: os.Getgid(), Size: 1}},
		GidMappingsEnableSetgroups: false,
		Pdeathsig:                  syscall.SIGKILL,
	}
	// Pdeathsig fires when the thread that started the child exits: keep
	// this goroutine on its thread until the child is gone.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := cmd.Start(); err != nil {
		msg := fmt.Sprintf("demo: create user, network and mount namespaces for uid %d: %v", os.Getuid(), err)
		if p := RootlessProblems(); len(p) > 0 {
			msg += "\n  - " + strings.Join(p, "\n  - ")
		} else if errors.Is(err, unix.EPERM) || errors.Is(err, unix.ENOSPC) {
			msg += "\n  - the kernel or a security policy (seccomp in a container, an LSM) refuses unprivileged user namespaces here; run the demo as root instead"
		}
		return errors.New(msg)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-ctx.Done():
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case err = <-done:
		case <-time.After(30 * time.Second):
			cmd.Process.Kill()
			err = <-done
		}
	}
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		return &ExitError{Code: ee.ExitCode()}
	}
	return err
}

// ExitError is returned by RunRootless when the demo inside the
// namespaces failed; it has already said why on its own output.
type ExitError struct{ Code int }

func (e *ExitError) Error() string { return "exit status " + strconv.Itoa(e.Code) }

// SetupRootless prepares the mount namespace of a StageRootless process:
// no mount propagation towards the machine, and a private tmpfs on
// /run/netns (on /run if that does not exist) for the named network
// namespaces, which the user could not create in the machine's /run/netns.
func SetupRootless() error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("demo: make mounts private: %w", err)
	}
	target := "/run/netns"
	if _, err := os.Stat(target); err != nil {
		target = "/run"
	}
	if err := unix.Mount("tmpfs", target, "tmpfs", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0755"); err != nil {
		return fmt.Errorf("demo: mount a private tmpfs on %s: %w", target, err)
	}
	return nil
}
