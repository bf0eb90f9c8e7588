package e2e

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/meshtun/meshtun/mesh/node"
	"github.com/meshtun/meshtun/test/cluster"
)

// meshtunBin is the binary under test, built once by TestMain.
var meshtunBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "meshtun-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		os.Exit(1)
	}
	meshtunBin = filepath.Join(dir, "meshtun")
	build := exec.Command("go", "build", "-o", meshtunBin, "github.com/meshtun/meshtun/cmd/meshtun")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "e2e: build meshtun:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// logLine is one JSON log record of a node process.
type logLine map[string]any

func (l logLine) str(k string) string { s, _ := l[k].(string); return s }

// nodeProc is a `meshtun node` process running in a node's namespace.
type nodeProc struct {
	t    testing.TB
	cmd  *exec.Cmd
	proc *cluster.Proc
	done chan struct{}
	err  error // valid after done

	mu      sync.Mutex
	lines   []logLine
	changed chan struct{} // closed and replaced on every new line
}

// nodeArgs returns the flags that capture every pod of n.
func nodeArgs(n *cluster.Node) []string {
	args := []string{"node", "--log-level", "debug", "--uplink", n.Uplink}
	for _, p := range n.Pods {
		args = append(args, "--capture-link", p.HostLink, "--pod", p.IPv4.String(), "--pod", p.IPv6.String())
	}
	return args
}

// startNode starts meshtun in n's namespace and waits until it reports
// ready. The process is stopped at the end of the test if still running.
func startNode(t testing.TB, n *cluster.Node, extra ...string) *nodeProc {
	t.Helper()
	cmd := n.Command(context.Background(), meshtunBin, append(nodeArgs(n), extra...)...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatalf("node %s: %v", n.Name(), err)
	}
	p := &nodeProc{t: t, cmd: cmd, done: make(chan struct{}), changed: make(chan struct{})}
	proc, err := n.Start(cmd)
	if err != nil {
		t.Fatalf("start meshtun in %s: %v", n.Name(), err)
	}
	p.proc = proc
	go p.readLogs(stderr)
	t.Cleanup(func() { p.stop(syscall.SIGTERM) })
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if _, err := p.waitLog(ctx, func(l logLine) bool { return l.str("message") == node.ReadyMessage }); err != nil {
		t.Fatalf("meshtun in %s did not become ready: %v\nlogs:\n%s", n.Name(), err, p.dump())
	}
	return p
}

func (p *nodeProc) readLogs(r io.Reader) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var l logLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			l = logLine{"message": sc.Text(), "unparsed": true}
		}
		p.mu.Lock()
		p.lines = append(p.lines, l)
		close(p.changed)
		p.changed = make(chan struct{})
		p.mu.Unlock()
	}
	p.err = p.proc.Wait()
	close(p.done)
}

// waitLog waits for a log line matching pred, looking at past lines too.
func (p *nodeProc) waitLog(ctx context.Context, pred func(logLine) bool) (logLine, error) {
	seen := 0
	for {
		p.mu.Lock()
		for ; seen < len(p.lines); seen++ {
			if pred(p.lines[seen]) {
				l := p.lines[seen]
				p.mu.Unlock()
				return l, nil
			}
		}
		ch := p.changed
		p.mu.Unlock()
		select {
		case <-ch:
		case <-p.done:
			// Drain lines that arrived with the exit.
			p.mu.Lock()
			n := len(p.lines)
			p.mu.Unlock()
			if seen == n {
				return nil, fmt.Errorf("process exited (%v) without the expected log line", p.err)
			}
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

func (p *nodeProc) dump() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var b strings.Builder
	for _, l := range p.lines {
		j, _ := json.Marshal(l)
		b.Write(j)
		b.WriteByte('\n')
	}
	return b.String()
}

// stop signals the process and waits for it to exit; it returns the exit
// error (nil for exit status 0).
func (p *nodeProc) stop(sig syscall.Signal) error {
	select {
	case <-p.done:
		return p.err
	default:
	}
	p.cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		p.cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("did not exit within 15s of %v", sig)
	}
	return p.err
}
