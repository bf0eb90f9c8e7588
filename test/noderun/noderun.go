// Package noderun starts `meshtun node` processes in cluster namespaces and
// follows their JSON logs, for the end-to-end tests, the benchmarks and the
// demo.
package noderun

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/meshtun/meshtun/mesh/node"
	"github.com/meshtun/meshtun/test/cluster"
)

// Line is one JSON log record of a node process.
type Line map[string]any

// Str returns field k as a string ("" if absent or not a string).
func (l Line) Str(k string) string { s, _ := l[k].(string); return s }

// Num returns field k as a number (0 if absent or not a number).
func (l Line) Num(k string) float64 { f, _ := l[k].(float64); return f }

// Process is a running `meshtun node`.
type Process struct {
	Node *cluster.Node
	proc *cluster.Proc
	done chan struct{}
	err  error // valid after done

	mu      sync.Mutex
	lines   []Line
	changed chan struct{} // closed and replaced on every new line
}

// NodeName is the mesh name of cluster node n: "n<index>".
func NodeName(n *cluster.Node) string { return fmt.Sprintf("n%d", n.Index) }

// Args returns the flags that name node n and capture every pod of it.
func Args(n *cluster.Node) []string {
	args := []string{"--node", NodeName(n), "--uplink", n.Uplink}
	for _, p := range n.Pods {
		args = append(args, "--capture-link", p.HostLink)
	}
	return args
}

// MeshArgs returns the flags that describe the mesh of cluster c to a node:
// every pod is a mesh workload in namespace "default" named, and with a
// service account named, after its ID (n1p1, …), except the pods in
// outside; pods in strict have STRICT peer authentication. caDir is the
// built-in CA's directory, shared by all nodes.
func MeshArgs(c *cluster.Cluster, caDir string, outside, strict map[string]bool) []string {
	args := []string{"--ca-dir", caDir}
	for _, n := range c.Nodes {
		for _, p := range n.Pods {
			if outside[p.ID] {
				continue
			}
			w := fmt.Sprintf("%s/default/%s=%s+%s", NodeName(n), p.ID, p.IPv4, p.IPv6)
			if strict[p.ID] {
				w += ";strict"
			}
			args = append(args, "--workload", w)
		}
	}
	return args
}

// Start runs `bin node <Args(n)> <extra>` in n's namespace and waits until
// it logs node.ReadyMessage (or ctx ends, or the process exits). The
// cluster stops the process on Close if it is still running.
func Start(ctx context.Context, bin string, n *cluster.Node, extra ...string) (*Process, error) {
	args := append(append([]string{"node"}, Args(n)...), extra...)
	cmd := n.Command(context.WithoutCancel(ctx), bin, args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, fmt.Errorf("noderun: %s: %w", n.Name(), err)
	}
	p := &Process{Node: n, done: make(chan struct{}), changed: make(chan struct{})}
	proc, err := n.Start(cmd)
	if err != nil {
		return nil, fmt.Errorf("noderun: start meshtun in %s: %w", n.Name(), err)
	}
	p.proc = proc
	go p.readLogs(stderr)
	if _, err := p.WaitLog(ctx, func(l Line) bool { return l.Str("message") == node.ReadyMessage }); err != nil {
		p.Stop(syscall.SIGKILL)
		return nil, fmt.Errorf("noderun: meshtun in %s did not become ready: %w\nlogs:\n%s", n.Name(), err, p.Logs())
	}
	return p, nil
}

func (p *Process) readLogs(r io.Reader) {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		var l Line
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			l = Line{"message": sc.Text(), "unparsed": true}
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

// ErrExited is returned by WaitLog when the process exits first.
var ErrExited = errors.New("meshtun exited")

// WaitLog waits for a log line matching pred, past lines included.
func (p *Process) WaitLog(ctx context.Context, pred func(Line) bool) (Line, error) {
	return p.WaitLogSince(ctx, 0, pred)
}

// Len returns the number of log lines so far, a mark for WaitLogSince.
func (p *Process) Len() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.lines)
}

// WaitLogSince waits for a log line matching pred among the lines from
// index since (a Len taken earlier) on.
func (p *Process) WaitLogSince(ctx context.Context, since int, pred func(Line) bool) (Line, error) {
	seen := since
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
			p.mu.Lock()
			n := len(p.lines)
			p.mu.Unlock()
			if seen == n {
				return nil, fmt.Errorf("%w (%v) without the expected log line", ErrExited, p.err)
			}
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
}

// Lines returns the log lines so far.
func (p *Process) Lines() []Line {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]Line(nil), p.lines...)
}

// Logs returns the log so far, one JSON record per line.
func (p *Process) Logs() string {
	var b strings.Builder
	for _, l := range p.Lines() {
		j, _ := json.Marshal(l)
		b.Write(j)
		b.WriteByte('\n')
	}
	return b.String()
}

// Pid returns the process ID.
func (p *Process) Pid() int { return p.proc.Cmd.Process.Pid }

// Done is closed when the process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// Stop sends sig and waits up to 15 s for the process to exit (then kills
// it). It returns the exit error: nil for exit status 0.
func (p *Process) Stop(sig syscall.Signal) error {
	select {
	case <-p.done:
		return p.err
	default:
	}
	p.proc.Cmd.Process.Signal(sig)
	select {
	case <-p.done:
	case <-time.After(15 * time.Second):
		p.proc.Cmd.Process.Kill()
		<-p.done
		return fmt.Errorf("noderun: meshtun in %s did not exit within 15s of %v", p.Node.Name(), sig)
	}
	return p.err
}
