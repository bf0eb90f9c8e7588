package node

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/metrics"
	"github.com/meshtun/meshtun/stack/classify"
	"github.com/meshtun/meshtun/test/fixture"
)

// The child side of TestAdminPrivilegedEndpointsOnlyForRoot: run as an
// unprivileged user, it tries the admin endpoints and prints what it got.
func TestAdminChild(t *testing.T) {
	if os.Getenv("MESHTUN_ADMIN_CHILD") != "1" {
		t.Skip("run by TestAdminPrivilegedEndpointsOnlyForRoot")
	}
	fmt.Printf("uid %d\n", os.Getuid())
	tcp := &http.Client{Timeout: 5 * time.Second}
	sock := unixClient(os.Getenv("ADMIN_SOCK"))
	for _, c := range []struct {
		name   string
		client *http.Client
		method string
		url    string
	}{
		{"tcp-post-logging", tcp, http.MethodPost, "http://" + os.Getenv("ADMIN_TCP") + "/logging?level=error"},
		{"tcp-post-logging-ztunnel", tcp, http.MethodPost, "http://" + os.Getenv("ADMIN_TCP") + "/logging?level=access:off"},
		{"tcp-post-logging-read", tcp, http.MethodPost, "http://" + os.Getenv("ADMIN_TCP") + "/logging?level="},
		{"tcp-pprof-index", tcp, http.MethodGet, "http://" + os.Getenv("ADMIN_TCP") + "/debug/pprof/"},
		{"tcp-pprof-cmdline", tcp, http.MethodGet, "http://" + os.Getenv("ADMIN_TCP") + "/debug/pprof/cmdline"},
		{"sock-post-logging", sock, http.MethodPost, "http://admin/logging?level=error"},
		{"sock-pprof-cmdline", sock, http.MethodGet, "http://admin/debug/pprof/cmdline"},
	} {
		fmt.Printf("%s %s\n", c.name, try(c.client, c.method, c.url))
	}
}

func unixClient(path string) *http.Client {
	return &http.Client{Timeout: 5 * time.Second, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		}}}
}

// try returns "status <code>" or "error <what>".
func try(c *http.Client, method, url string) string {
	req, _ := http.NewRequest(method, url, nil)
	resp, err := c.Do(req)
	if err != nil {
		return "error " + err.Error()
	}
	defer resp.Body.Close()
	io.Copy(io.Discard, resp.Body)
	return fmt.Sprintf("status %d", resp.StatusCode)
}

// runUnprivileged runs TestAdminChild as uid/gid 65534 and returns its
// results by name.
func runUnprivileged(t *testing.T, bin, tcpAddr, sock string) map[string]string {
	t.Helper()
	cmd := exec.Command(bin, "-test.run=^TestAdminChild$", "-test.v")
	cmd.Env = append(os.Environ(), "MESHTUN_ADMIN_CHILD=1", "ADMIN_TCP="+tcpAddr, "ADMIN_SOCK="+sock)
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child as uid 65534: %v\n%s", err, out)
	}
	res := map[string]string{}
	sc := bufio.NewScanner(strings.NewReader(string(out)))
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), " "); ok {
			res[k] = v
		}
	}
	if res["uid"] != "65534" {
		t.Fatalf("child did not run as uid 65534:\n%s", out)
	}
	return res
}

// An unprivileged local process can neither change the log levels nor
// read pprof: not on the TCP admin address (read-only there), not through
// the admin socket (0600, and the peer's uid checked); root can, through
// the socket, and the change is logged before it applies, even when it
// raises the level above warn.
func TestAdminPrivilegedEndpointsOnlyForRoot(t *testing.T) {
	fixture.RequireRoot(t, "it runs a child as uid 65534")
	prev := zerolog.GlobalLevel()
	zerolog.SetGlobalLevel(zerolog.InfoLevel)
	t.Cleanup(func() { zerolog.SetGlobalLevel(prev) })

	// A base directory the child can traverse (t.TempDir is 0700), with
	// a copy of this test binary it can run.
	base, err := os.MkdirTemp("", "meshtun-admin-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(base) })
	if err := os.Chmod(base, 0o755); err != nil {
		t.Fatal(err)
	}
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	bin := filepath.Join(base, "node.test")
	data, err := os.ReadFile(self)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(bin, data, 0o755); err != nil {
		t.Fatal(err)
	}

	sock := filepath.Join(base, "run", "admin.sock")
	logs := &syncBuf{}
	n := &node{cfg: Config{AdminAddr: "127.0.0.1:0", AdminSocket: sock}, log: zerolog.New(logs), metrics: metrics.New(),
		exempt: classify.NewExempt(func(netip.Addr) bool { return false })}
	stop, err := n.serveHTTP(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(stop)
	tcpAddr := n.httpAddrs["admin"]
	if fi, err := os.Stat(sock); err != nil || fi.Mode().Perm() != 0o600 || fi.Mode()&os.ModeSocket == 0 {
		t.Fatalf("admin socket: %v, mode %v; want a socket, 0600", err, fi.Mode())
	}
	if fi, _ := os.Stat(filepath.Dir(sock)); fi.Mode().Perm() != 0o700 {
		t.Fatalf("admin socket directory mode %v, want 0700", fi.Mode().Perm())
	}

	unchanged := func(when string) {
		t.Helper()
		if l := zerolog.GlobalLevel(); l != zerolog.InfoLevel {
			t.Fatalf("%s: the log level is %s; an unprivileged process changed it", when, l)
		}
	}
	refusedOnTCP := func(res map[string]string) {
		t.Helper()
		if res["tcp-post-logging"] != "status 403" {
			t.Errorf("POST /logging on TCP as uid 65534: %s, want 403", res["tcp-post-logging"])
		}
		if res["tcp-post-logging-ztunnel"] != "status 403" {
			t.Errorf("POST /logging?level=access:off on TCP as uid 65534: %s, want 403", res["tcp-post-logging-ztunnel"])
		}
		// istioctl ztunnel-config log reads the levels with a POST that
		// sets nothing.
		if res["tcp-post-logging-read"] != "status 200" {
			t.Errorf("POST /logging?level= on TCP as uid 65534: %s, want 200 (a read)", res["tcp-post-logging-read"])
		}
		for _, k := range []string{"tcp-pprof-index", "tcp-pprof-cmdline"} {
			if res[k] != "status 404" {
				t.Errorf("%s as uid 65534: %s, want 404", k, res[k])
			}
		}
	}

	// As set up: the directory (0700) stops the child.
	res := runUnprivileged(t, bin, tcpAddr, sock)
	refusedOnTCP(res)
	for _, k := range []string{"sock-post-logging", "sock-pprof-cmdline"} {
		if !strings.Contains(res[k], "permission denied") {
			t.Errorf("%s as uid 65534: %s, want permission denied", k, res[k])
		}
	}
	unchanged("directory 0700")

	// A directory others may enter: the socket's mode (0600) stops it.
	if err := os.Chmod(filepath.Dir(sock), 0o755); err != nil {
		t.Fatal(err)
	}
	res = runUnprivileged(t, bin, tcpAddr, sock)
	if !strings.Contains(res["sock-post-logging"], "permission denied") {
		t.Errorf("socket 0600 in a 0755 directory, uid 65534: %s, want permission denied", res["sock-post-logging"])
	}
	unchanged("socket 0600")

	// A socket anyone may connect to: the peer check stops it.
	if err := os.Chmod(sock, 0o666); err != nil {
		t.Fatal(err)
	}
	res = runUnprivileged(t, bin, tcpAddr, sock)
	for _, k := range []string{"sock-post-logging", "sock-pprof-cmdline"} {
		if !strings.HasPrefix(res[k], "error ") {
			t.Errorf("%s through a 0666 socket as uid 65534: %s, want the connection closed", k, res[k])
		}
	}
	if !strings.Contains(logs.String(), `"uid":65534`) || !strings.Contains(logs.String(), "connection from another user refused") {
		t.Errorf("no log line of the refused peer:\n%s", logs)
	}
	unchanged("socket 0666")

	// Root, through the socket: allowed, logged before it applies (the
	// new level error would suppress a warning logged after).
	root := unixClient(sock)
	if got := try(root, http.MethodGet, "http://admin/debug/pprof/cmdline"); got != "status 200" {
		t.Fatalf("root, pprof through the socket: %s", got)
	}
	if got := try(root, http.MethodPost, "http://admin/logging?level=error"); got != "status 200" {
		t.Fatalf("root, POST /logging through the socket: %s", got)
	}
	if l := zerolog.GlobalLevel(); l != zerolog.ErrorLevel {
		t.Fatalf("after root's POST: level %s, want error", l)
	}
	var line string
	for _, l := range strings.Split(logs.String(), "\n") {
		if strings.Contains(l, LogLevelChangedMessage) {
			line = l
		}
	}
	for _, want := range []string{`"level":"warn"`, `"new_level":"error"`, `"was_level":"info"`, `"by_uid":0`} {
		if !strings.Contains(line, want) {
			t.Errorf("level change log line %q lacks %s\n%s", line, want, logs)
		}
	}
	// At level error, a change (and turning the access log off) is still
	// logged: not suppressible by the level it changes.
	if got := try(root, http.MethodPost, "http://admin/logging?level=info"); got != "status 200" {
		t.Fatalf("root, POST /logging?level=info: %s", got)
	}
	if !strings.Contains(logs.String(), `"was_level":"error","new_level":"info"`) {
		t.Errorf("a change made at level error is not logged:\n%s", logs)
	}
}

// The socket's directory: created 0700; tightened to 0700 when it is ours
// and others may write to it (an emptyDir volume is 0777); refused when
// another user owns it.
func TestAdminSocketDirectory(t *testing.T) {
	fixture.RequireRoot(t, "it chowns a directory")
	dir := t.TempDir()
	loose := filepath.Join(dir, "loose")
	if err := os.Mkdir(loose, 0o777); err != nil {
		t.Fatal(err)
	}
	os.Chmod(loose, 0o777)
	ln, err := listenAdminSocket(filepath.Join(loose, "admin.sock"), zerolog.Nop())
	if err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(loose); fi.Mode().Perm() != 0o700 {
		t.Errorf("a 0777 directory of ours is %v after, want 0700", fi.Mode().Perm())
	}
	ln.Close()
	if _, err := os.Stat(filepath.Join(loose, "admin.sock")); !os.IsNotExist(err) {
		t.Errorf("socket left behind after Close: %v", err)
	}
	theirs := filepath.Join(dir, "theirs")
	if err := os.Mkdir(theirs, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chown(theirs, 65534, 65534); err != nil {
		t.Fatal(err)
	}
	if _, err := listenAdminSocket(filepath.Join(theirs, "admin.sock"), zerolog.Nop()); err == nil || !strings.Contains(err.Error(), "is not owned by uid 0") {
		t.Errorf("directory of uid 65534: %v, want refused", err)
	}
}

// syncBuf collects log output written from the servers' goroutines.
type syncBuf struct {
	mu sync.Mutex
	b  strings.Builder
}

func (s *syncBuf) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuf) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}
