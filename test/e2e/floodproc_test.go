package e2e

import (
	"bufio"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshtun/meshtun/bench/cluster"
)

// flooderEnv, set in the environment of this test binary, makes it a
// flooder process instead (TestMain): "<dst addr:port> <max>".
const flooderEnv = "MESHTUN_E2E_FLOODER"

// runFlooder is the flooder process: it waits for a first line on stdin
// (sent once it is in its CPU cgroup), floods dst as handshakeFlood does
// from the namespace it was started in, writes its attempt count to stdout
// every 100 ms, and stops when stdin closes.
func runFlooder(spec string) int {
	var dstS string
	var max int
	if _, err := fmt.Sscan(spec, &dstS, &max); err != nil {
		fmt.Fprintf(os.Stderr, "%s=%q: %v\n", flooderEnv, spec, err)
		return 2
	}
	dst, err := netip.ParseAddrPort(dstS)
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s=%q: %v\n", flooderEnv, spec, err)
		return 2
	}
	limit, err := fileLimit()
	if err != nil {
		fmt.Fprintln(os.Stderr, "flooder:", err)
		return 1
	}
	in := bufio.NewReader(os.Stdin)
	if _, err := in.ReadString('\n'); err != nil {
		return 0
	}
	f, _ := newHandshakeFlood(func(fn func() error) error { return fn() }, dst, max, limit)
	closed := make(chan struct{})
	go func() { io.Copy(io.Discard, in); close(closed) }()
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-closed:
			f.stop()
			fmt.Printf("attempts %d\n", f.attempts.Load())
			return 0
		case <-tick.C:
			fmt.Printf("attempts %d\n", f.attempts.Load())
		}
	}
}

// floodProc is a handshake flood run by a process of its own in a
// namespace, held to a CPU quota: an attacker on another machine does not
// take the CPU the node and its workloads run on, which a flood in the
// test process (handshakeFlood) does on this 2-core machine.
type floodProc struct {
	cmd      *exec.Cmd
	stdin    io.WriteCloser
	cgroup   string
	attempts atomic.Int64
	done     chan struct{}
}

// startFloodProcess starts this test binary as a flooder in ns against dst
// with up to max connections, in a CPU cgroup of its own limited to cores
// (0: no limit). It is stopped at the end of the test.
func startFloodProcess(t testing.TB, ns *cluster.NS, dst netip.AddrPort, max int, cores float64) *floodProc {
	t.Helper()
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	p := &floodProc{done: make(chan struct{})}
	if cores > 0 {
		if p.cgroup, err = cpuCgroup(fmt.Sprintf("meshtun-e2e-flood-%d", os.Getpid()), cores); err != nil {
			t.Fatal(err)
		}
	}
	p.cmd = exec.Command("ip", "netns", "exec", ns.Name(), self)
	p.cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%s %d", flooderEnv, dst, max))
	p.cmd.Stderr = os.Stderr
	if p.stdin, err = p.cmd.StdinPipe(); err != nil {
		t.Fatal(err)
	}
	out, err := p.cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("flooder: %v", err)
	}
	t.Cleanup(p.stop)
	if p.cgroup != "" {
		// `ip netns exec` execs the flooder in place: this is its PID.
		if err := os.WriteFile(filepath.Join(p.cgroup, "cgroup.procs"), []byte(strconv.Itoa(p.cmd.Process.Pid)), 0o644); err != nil {
			t.Fatalf("flooder into %s: %v", p.cgroup, err)
		}
	}
	go func() {
		defer close(p.done)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if v, ok := strings.CutPrefix(sc.Text(), "attempts "); ok {
				n, _ := strconv.ParseInt(v, 10, 64)
				p.attempts.Store(n)
			}
		}
	}()
	if _, err := io.WriteString(p.stdin, "go\n"); err != nil {
		t.Fatalf("flooder: %v", err)
	}
	return p
}

// stop ends the flood and removes its cgroup.
func (p *floodProc) stop() {
	if p.stdin == nil {
		return
	}
	p.stdin.Close()
	p.stdin = nil
	select {
	case <-p.done:
	case <-time.After(30 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
	}
	p.cmd.Wait()
	if p.cgroup != "" {
		os.Remove(p.cgroup)
	}
}

// cpuCgroup makes a CPU cgroup named name limited to cores, on cgroup v1's
// cpu controller or on cgroup v2, and returns its directory.
func cpuCgroup(name string, cores float64) (string, error) {
	const period = 100000 // µs
	quota := strconv.Itoa(int(cores * period))
	if _, err := os.Stat("/sys/fs/cgroup/cgroup.controllers"); err == nil { // v2
		dir := filepath.Join("/sys/fs/cgroup", name)
		if err := os.Mkdir(dir, 0o755); err != nil && !os.IsExist(err) {
			return "", err
		}
		if err := os.WriteFile(filepath.Join(dir, "cpu.max"), []byte(quota+" "+strconv.Itoa(period)), 0o644); err != nil {
			os.Remove(dir)
			return "", fmt.Errorf("cgroup v2 cpu.max of %s (is the cpu controller enabled in /sys/fs/cgroup/cgroup.subtree_control?): %w", dir, err)
		}
		return dir, nil
	}
	dir := filepath.Join("/sys/fs/cgroup/cpu", name)
	if err := os.Mkdir(dir, 0o755); err != nil && !os.IsExist(err) {
		return "", fmt.Errorf("cgroup v1 cpu controller: %w", err)
	}
	for _, fv := range [][2]string{{"cpu.cfs_period_us", strconv.Itoa(period)}, {"cpu.cfs_quota_us", quota}} {
		f, v := fv[0], fv[1]
		if err := os.WriteFile(filepath.Join(dir, f), []byte(v), 0o644); err != nil {
			os.Remove(dir)
			return "", fmt.Errorf("%s of %s: %w", f, dir, err)
		}
	}
	return dir, nil
}
