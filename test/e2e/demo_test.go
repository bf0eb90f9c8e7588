package e2e

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/mesh/config"
	"github.com/meshtun/meshtun/mesh/identity"
)

// nobody is the unprivileged user the rootless demo runs as.
const nobody = 65534

// demoStateDir is the demo's state directory for this test run
// (MESHTUN_DEMO_STATE_DIR), set by TestDemo.
var demoStateDir string

// demoSummary is the part of `meshtun demo --json` the test reads.
type demoSummary struct {
	Mode       string   `json:"mode"`
	Cluster    string   `json:"cluster"`
	Namespaces []string `json:"namespaces"`
	Nodes      []struct {
		Name string   `json:"name"`
		PID  int      `json:"pid"`
		Args []string `json:"args"`
	} `json:"nodes"`
	Dir     string  `json:"dir"`
	OK      bool    `json:"ok"`
	Seconds float64 `json:"seconds"`
	Flows   []struct {
		Name            string `json:"name"`
		Protocol        string `json:"protocol"`
		Route           string `json:"route"`
		WantRoute       string `json:"want_route"`
		Outcome         string `json:"outcome"`
		WantOutcome     string `json:"want_outcome"`
		Error           string `json:"error"`
		CrossesWire     bool   `json:"crosses_wire"`
		PlaintextOnWire string `json:"plaintext_on_wire"`
	} `json:"flows"`
}

// TestDemo runs `meshtun demo` the ways a user does: as an unprivileged
// user (rootless, in namespaces the demo makes itself), as root, with
// --keep and --down, and interrupted; each time it checks the summary and
// that nothing of the demo is left behind.
func TestDemo(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Fatalf("TestDemo needs root: it runs the demo as uid %d and as root, and inspects /run/netns", nobody)
	}
	bin := publicCopy(t, meshtunBin)
	// A state directory of the test's own: a demo the user keeps up
	// (meshtun demo --keep) is neither seen nor torn down by this test.
	demoStateDir = filepath.Join(t.TempDir(), "state")

	t.Run("rootless", func(t *testing.T) {
		requireUserNamespaces(t)
		s := runDemoJSON(t, bin, true)
		checkSummary(t, s, "rootless")
		checkNothingLeft(t, bin, s)
	})
	t.Run("root", func(t *testing.T) {
		s := runDemoJSON(t, bin, false)
		checkSummary(t, s, "root")
		checkNothingLeft(t, bin, s)
	})
	t.Run("keep and down", func(t *testing.T) {
		out, err := demoCommand(t, bin, false, "--keep", "--json").Output()
		if err != nil {
			t.Fatalf("meshtun demo --keep: %v", err)
		}
		var s demoSummary
		if err := json.Unmarshal(out, &s); err != nil {
			t.Fatalf("meshtun demo --keep --json: %v\n%s", err, out)
		}
		t.Cleanup(func() {
			down := exec.Command(bin, "demo", "--down") // t.Context() is done by now
			down.Env = demoEnv()
			down.Run()
		})
		checkSummary(t, s, "root")
		for _, ns := range s.Namespaces {
			if _, err := os.Stat(filepath.Join("/run/netns", ns)); err != nil {
				t.Errorf("kept cluster: namespace %s: %v", ns, err)
			}
		}
		for _, n := range s.Nodes {
			if syscall.Kill(n.PID, 0) != nil {
				t.Errorf("kept cluster: meshtun node %s (pid %d) is not running", n.Name, n.PID)
			}
		}
		if _, err := os.Stat(filepath.Join(s.Dir, "config.json")); err != nil {
			t.Errorf("kept cluster: generated config: %v", err)
		}
		checkNodesTrust(t, s)
		if out, err := demoCommand(t, bin, false, "--down").CombinedOutput(); err != nil {
			t.Fatalf("meshtun demo --down: %v\n%s", err, out)
		}
		checkNothingLeft(t, bin, s)
	})
	t.Run("interrupted rootless", func(t *testing.T) {
		requireUserNamespaces(t)
		interrupt(t, bin, true)
	})
	t.Run("interrupted root", func(t *testing.T) { interrupt(t, bin, false) })
}

// publicCopy copies the binary into a directory that uid nobody can
// traverse (the test's build directory is private to root).
func publicCopy(t *testing.T, src string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "meshtun-demo-e2e-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	dst := filepath.Join(dir, "meshtun")
	if err := os.WriteFile(dst, b, 0o755); err != nil {
		t.Fatal(err)
	}
	return dst
}

// requireUserNamespaces fails the test, saying why, unless uid nobody can
// create a user namespace with a network namespace in it.
func requireUserNamespaces(t *testing.T) {
	t.Helper()
	cmd := exec.Command("unshare", "--user", "--map-root-user", "--net", "true")
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: nobody, Gid: nobody}}
	out, err := cmd.CombinedOutput()
	if err == nil {
		return
	}
	var settings []string
	for _, k := range []string{"user/max_user_namespaces", "kernel/unprivileged_userns_clone", "kernel/apparmor_restrict_unprivileged_userns"} {
		if b, err := os.ReadFile("/proc/sys/" + k); err == nil {
			settings = append(settings, strings.ReplaceAll(k, "/", ".")+" = "+strings.TrimSpace(string(b)))
		}
	}
	t.Fatalf("unprivileged user namespaces do not work on this machine, so the rootless demo cannot run: "+
		"`unshare --user --map-root-user --net true` as uid %d: %v %s\nkernel settings: %s\n"+
		"(want user.max_user_namespaces > 0, kernel.unprivileged_userns_clone = 1 and "+
		"kernel.apparmor_restrict_unprivileged_userns = 0 where they exist)",
		nobody, err, bytes.TrimSpace(out), strings.Join(settings, ", "))
}

// demoCommand returns `bin demo <args>`, as uid nobody if asNobody, with a
// minimal environment like a fresh login's.
func demoCommand(t *testing.T, bin string, asNobody bool, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(t.Context(), bin, append([]string{"demo"}, args...)...)
	cmd.Dir = "/"
	cmd.Env = demoEnv()
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if asNobody {
		cmd.SysProcAttr.Credential = &syscall.Credential{Uid: nobody, Gid: nobody}
	}
	cmd.WaitDelay = 10 * time.Second
	return cmd
}

// demoEnv is the environment the demo runs in: minimal, with the test's
// own state directory.
func demoEnv() []string {
	return []string{"PATH=/usr/local/bin:/usr/bin:/bin", "HOME=/", "TMPDIR=/tmp",
		"MESHTUN_DEMO_STATE_DIR=" + demoStateDir}
}

// runDemoJSON runs `meshtun demo --json` and returns its summary.
func runDemoJSON(t *testing.T, bin string, asNobody bool) demoSummary {
	t.Helper()
	cmd := demoCommand(t, bin, asNobody, "--json")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	start := time.Now()
	err := startAndWait(t, cmd, asNobody)
	took := time.Since(start)
	who := "root"
	if asNobody {
		who = fmt.Sprintf("uid %d", nobody)
	}
	t.Logf("meshtun demo --json as %s took %v", who, took.Round(time.Millisecond))
	if err != nil {
		t.Fatalf("meshtun demo --json: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.Bytes(), stderr.Bytes())
	}
	if took > time.Minute {
		t.Errorf("meshtun demo took %v, want under a minute", took)
	}
	var s demoSummary
	if err := json.Unmarshal(stdout.Bytes(), &s); err != nil {
		t.Fatalf("meshtun demo --json: parse summary: %v\n%s", err, stdout.Bytes())
	}
	return s
}

// startAndWait runs cmd. For uid nobody on a machine whose /dev/net/tun
// is not open to everyone (mode 0600 instead of the 0666 udev gives it on
// most distributions), it runs cmd in a mount namespace of its own where
// /dev/net/tun is the same device with mode 0666: the demo itself stays
// unprivileged.
func startAndWait(t *testing.T, cmd *exec.Cmd, asNobody bool) error {
	fi, err := os.Stat("/dev/net/tun")
	if err != nil {
		t.Fatalf("this test needs /dev/net/tun: %v", err)
	}
	if !asNobody || fi.Mode().Perm()&0o006 == 0o006 {
		return cmd.Run()
	}
	t.Logf("/dev/net/tun has mode %v here; the unprivileged demo gets a 0666 node of it in a private mount namespace", fi.Mode().Perm())
	rdev := fi.Sys().(*syscall.Stat_t).Rdev
	done := make(chan error, 1)
	go func() {
		// Never unlocked: the thread ends with the goroutine, and its
		// private mount namespace with it. It lives until cmd has exited,
		// as cmd's parent-death signal is tied to it.
		runtime.LockOSThread()
		if err := privateTun(rdev); err != nil {
			done <- err
			return
		}
		if err := cmd.Start(); err != nil {
			done <- err
			return
		}
		done <- cmd.Wait()
	}()
	return <-done
}

// privateTun gives the calling thread a mount namespace in which
// /dev/net/tun is a fresh node for device rdev with mode 0666.
func privateTun(rdev uint64) error {
	if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("unshare mount namespace: %w", err)
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SLAVE, ""); err != nil {
		return fmt.Errorf("make mounts slave: %w", err)
	}
	if err := unix.Mount("tmpfs", "/dev/net", "tmpfs", unix.MS_NOSUID|unix.MS_NOEXEC, "mode=0755"); err != nil {
		return fmt.Errorf("mount tmpfs on /dev/net: %w", err)
	}
	if err := unix.Mknod("/dev/net/tun", unix.S_IFCHR|0o666, int(rdev)); err != nil {
		return fmt.Errorf("mknod /dev/net/tun: %w", err)
	}
	return unix.Chmod("/dev/net/tun", 0o666) // past the umask
}

// checkSummary checks that every flow had its expected outcome and route,
// that the wire capture agrees with the route (a flow that crossed the
// node-to-node link showed its payload there exactly when it was not in
// an mTLS tunnel), that some flow crossed it encrypted and some flow was
// denied, and that the flows cover TCP, UDP and ICMP.
func checkSummary(t *testing.T, s demoSummary, mode string) {
	t.Helper()
	if s.Mode != mode {
		t.Errorf("summary mode %q, want %q", s.Mode, mode)
	}
	if !s.OK {
		t.Errorf("summary: not ok")
	}
	if len(s.Nodes) != 2 || len(s.Namespaces) == 0 {
		t.Errorf("summary: %d nodes, %d namespaces; want 2 nodes", len(s.Nodes), len(s.Namespaces))
	}
	protocols := map[string]bool{}
	encrypted, denied := 0, 0
	for _, f := range s.Flows {
		protocols[f.Protocol] = true
		if f.Route == "hbone" && f.CrossesWire && f.PlaintextOnWire == "no" && f.Outcome == "ok" {
			encrypted++
		}
		if f.Outcome == "denied" && f.WantOutcome == "denied" {
			denied++
		}
		if f.Outcome != f.WantOutcome || f.Route != f.WantRoute {
			t.Errorf("flow %q: outcome %s (%s) route %s, want outcome %s route %s", f.Name, f.Outcome, f.Error, f.Route, f.WantOutcome, f.WantRoute)
		}
		switch {
		case !f.CrossesWire:
			if f.PlaintextOnWire != "n/a" {
				t.Errorf("flow %q does not cross the link, yet plaintext on wire is %q", f.Name, f.PlaintextOnWire)
			}
		case f.Outcome == "ok":
			want := "yes"
			if f.Route == "hbone" {
				want = "no"
			}
			if f.PlaintextOnWire != want {
				t.Errorf("flow %q (route %s): plaintext on wire %q, want %q", f.Name, f.Route, f.PlaintextOnWire, want)
			}
		}
	}
	if encrypted == 0 {
		t.Errorf("no flow crossed the node-to-node link encrypted in an HBONE tunnel")
	}
	if denied == 0 {
		t.Errorf("no flow was denied as expected")
	}
	for _, p := range []string{"tcp", "udp", "icmp"} {
		if !protocols[p] {
			t.Errorf("no %s flow in the summary", p)
		}
	}
}

// checkNothingLeft checks that the demo left no namespace, process or
// file behind.
func checkNothingLeft(t *testing.T, bin string, s demoSummary) {
	t.Helper()
	if s.Cluster == "" {
		t.Fatal("summary names no cluster")
	}
	entries, err := os.ReadDir("/run/netns")
	if err != nil && !errors.Is(err, fs.ErrNotExist) {
		t.Fatal(err)
	}
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), s.Cluster) {
			t.Errorf("namespace /run/netns/%s is left", e.Name())
		}
	}
	if procs := procsOf(bin); len(procs) > 0 {
		t.Errorf("processes of %s are left: %s", bin, strings.Join(procs, "; "))
	}
	if _, err := os.Stat(s.Dir); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("run directory %s is left (stat: %v)", s.Dir, err)
	}
	switch s.Mode {
	case "rootless":
		if _, err := os.Stat(filepath.Dir(s.Dir)); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("temporary directory %s is left (stat: %v)", filepath.Dir(s.Dir), err)
		}
	case "root":
		if _, err := os.Stat(filepath.Join(demoStateDir, "kept.json")); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s/kept.json is left (stat: %v)", demoStateDir, err)
		}
	}
}

// procsOf lists the running processes whose executable is bin.
func procsOf(bin string) []string {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	var out []string
	for _, d := range dirs {
		exe, err := os.Readlink(filepath.Join(d, "exe"))
		if err != nil || strings.TrimSuffix(exe, " (deleted)") != bin {
			continue
		}
		cmdline, _ := os.ReadFile(filepath.Join(d, "cmdline"))
		out = append(out, filepath.Base(d)+" "+strings.Join(strings.Split(strings.TrimRight(string(cmdline), "\x00"), "\x00"), " "))
	}
	return out
}

// interrupt starts the demo, sends SIGINT to it as soon as it has started
// driving flows (meshtun node running on both nodes), and checks that it
// exits and leaves nothing behind.
func interrupt(t *testing.T, bin string, asNobody bool) {
	cmd := demoCommand(t, bin, asNobody)
	out := &watchWriter{want: "\nFlows", seen: make(chan struct{})}
	var stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = out, &stderr
	exited := make(chan error, 1)
	go func() { exited <- startAndWait(t, cmd, asNobody) }()
	select {
	case <-out.seen:
	case err := <-exited:
		t.Fatalf("the demo exited (%v) before it drove flows:\n%s\nstderr:\n%s", err, out.String(), stderr.Bytes())
	}
	if err := cmd.Process.Signal(os.Interrupt); err != nil {
		t.Fatal(err)
	}
	err := <-exited
	t.Logf("output:\n%s\nstderr: %s", out.String(), stderr.Bytes())
	if err != nil && !strings.Contains(stderr.String(), "interrupted; everything was torn down") {
		t.Errorf("the demo failed (%v) other than by the interrupt", err)
	}
	if !strings.Contains(out.String(), "Tearing down ... done") {
		t.Errorf("no completed teardown in the output")
	}
	// "Cluster <name>: namespaces <name>-*, generated config <dir>/config.json"
	s := demoSummary{Mode: "root"}
	if asNobody {
		s.Mode = "rootless"
	}
	for _, line := range strings.Split(out.String(), "\n") {
		if rest, ok := strings.CutPrefix(line, "Cluster "); ok {
			s.Cluster, _, _ = strings.Cut(rest, ":")
			_, cfg, _ := strings.Cut(rest, "generated config ")
			s.Dir = filepath.Dir(cfg)
		}
	}
	checkNothingLeft(t, bin, s)
}

// watchWriter collects output and closes seen once it contains want.
type watchWriter struct {
	want string
	seen chan struct{}

	mu   sync.Mutex
	buf  bytes.Buffer
	once sync.Once
}

func (w *watchWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.buf.Write(p)
	if bytes.Contains(w.buf.Bytes(), []byte(w.want)) {
		w.once.Do(func() { close(w.seen) })
	}
	return len(p), nil
}

func (w *watchWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.String()
}

// checkNodesTrust checks the trust model of the kept demo's nodes: no path
// a node is given (its flags, its config file and every absolute path in
// it, ca.dir included) is or is in a directory holding the CA's root key,
// and each node trusts its own copy of the CA's root certificate (the
// roots.pem of its credential).
func checkNodesTrust(t *testing.T, s demoSummary) {
	t.Helper()
	rootCert, err := os.ReadFile(filepath.Join(s.Dir, "ca", identity.RootCertFile))
	if err != nil {
		t.Fatalf("kept cluster: the CA's root certificate: %v", err)
	}
	if len(s.Nodes) == 0 {
		t.Fatal("kept cluster: the summary lists no node")
	}
	for _, n := range s.Nodes {
		var paths []string
		flag := func(name string) string {
			for i, a := range n.Args {
				if (a == "--"+name || a == "-"+name) && i+1 < len(n.Args) {
					return n.Args[i+1]
				}
			}
			t.Fatalf("node %s: no --%s in its arguments %q", n.Name, name, n.Args)
			return ""
		}
		cfgPath, credDir := flag("config"), flag("credentials")
		paths = append(paths, cfgPath, credDir)
		for _, a := range n.Args {
			if filepath.IsAbs(a) {
				paths = append(paths, a)
			}
		}
		data, err := os.ReadFile(cfgPath)
		if err != nil {
			t.Fatalf("node %s: config: %v", n.Name, err)
		}
		for _, f := range strings.FieldsFunc(string(data), func(r rune) bool {
			return r == '"' || r == ' ' || r == ',' || r == '{' || r == '}' || r == '[' || r == ']' || r == '\n'
		}) {
			if filepath.IsAbs(f) {
				paths = append(paths, f)
			}
		}
		c, err := config.Load(cfgPath)
		if err != nil {
			t.Fatalf("node %s: config: %v", n.Name, err)
		}
		paths = append(paths, c.CA.Dir)
		seen := map[string]bool{}
		for _, p := range paths {
			if seen[p] {
				continue
			}
			seen[p] = true
			dir := p
			if fi, err := os.Stat(p); err == nil && !fi.IsDir() {
				dir = filepath.Dir(p)
			}
			if _, err := os.Stat(filepath.Join(dir, identity.RootKeyFile)); err == nil {
				t.Errorf("node %s is given %s, which is in %s, the directory of the CA's root key", n.Name, p, dir)
			}
		}
		roots, err := os.ReadFile(filepath.Join(credDir, identity.NodeRootsFile))
		if err != nil {
			t.Errorf("node %s: its copy of the CA's roots: %v", n.Name, err)
		} else if !bytes.Equal(bytes.TrimSpace(roots), bytes.TrimSpace(rootCert)) {
			t.Errorf("node %s: its roots %s differ from the CA's root certificate", n.Name, filepath.Join(credDir, identity.NodeRootsFile))
		}
	}
}
