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
	"os"
	"path/filepath"
	"sort"
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

// Args returns the flags that select node n in the config file.
func Args(n *cluster.Node) []string { return []string{"--node", NodeName(n)} }

// Pod says how a cluster pod appears in the mesh config.
type Pod struct {
	// Name is the workload name (and service account); the pod ID
	// (n1p1, …) if empty.
	Name string
	// Outside: known to the mesh but not in it (not captured, reached in
	// plaintext).
	Outside bool
	// Strict: STRICT peer authentication.
	Strict bool
	// Labels of the workload.
	Labels map[string]string
	// ProbePorts are the ports the node's probes reach directly.
	ProbePorts []uint16
}

// Mesh describes the mesh of a cluster for WriteConfig.
type Mesh struct {
	// Pods by pod ID; a pod not listed is a mesh workload named after its
	// ID, in namespace "default".
	Pods map[string]Pod
	// Extra is YAML appended to the file: services, authorization
	// policies.
	Extra string
}

// WriteConfig writes the config file of cluster c and mesh m to
// dir/mesh.yaml, with the built-in CA in dir/ca, and returns its path.
// Every node has a TUN meshtun0, uplink eth0 and the admin server on
// 127.0.0.1:15000 of its own namespace.
func WriteConfig(c *cluster.Cluster, dir string, m Mesh) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "# Generated for cluster %s.\ntrustDomain: cluster.local\nca: {dir: %q}\nnodes:\n", c.Name, filepath.Join(dir, "ca"))
	for _, n := range c.Nodes {
		fmt.Fprintf(&b, "  - {name: %s, tun: {name: meshtun0, mtu: 1500}, uplinks: [%s], listen: {admin: \"127.0.0.1:15000\"}}\n", NodeName(n), n.Uplink)
	}
	b.WriteString("workloads:\n")
	for _, n := range c.Nodes {
		for _, p := range n.Pods {
			o := m.Pods[p.ID]
			name := o.Name
			if name == "" {
				name = p.ID
			}
			fmt.Fprintf(&b, "  - {name: %s, namespace: default, serviceAccount: %s, node: %s, addresses: [%s, %q]",
				name, name, NodeName(n), p.IPv4, p.IPv6.String())
			if o.Outside {
				b.WriteString(", mesh: false")
			} else {
				fmt.Fprintf(&b, ", captureLink: %s", p.HostLink)
			}
			if o.Strict {
				b.WriteString(", peerAuthentication: STRICT")
			}
			if len(o.ProbePorts) > 0 {
				b.WriteString(", probePorts: [")
				for i, port := range o.ProbePorts {
					if i > 0 {
						b.WriteString(", ")
					}
					fmt.Fprintf(&b, "%d", port)
				}
				b.WriteString("]")
			}
			if len(o.Labels) > 0 {
				keys := make([]string, 0, len(o.Labels))
				for k := range o.Labels {
					keys = append(keys, k)
				}
				sort.Strings(keys)
				b.WriteString(", labels: {")
				for i, k := range keys {
					if i > 0 {
						b.WriteString(", ")
					}
					fmt.Fprintf(&b, "%s: %q", k, o.Labels[k])
				}
				b.WriteString("}")
			}
			b.WriteString("}\n")
		}
	}
	b.WriteString(m.Extra)
	path := filepath.Join(dir, "mesh.yaml")
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		return "", fmt.Errorf("noderun: write config: %w", err)
	}
	return path, nil
}

// Start runs `bin node --node <name of n> <extra>` in n's namespace and waits until
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

// Signal sends sig to the process without waiting.
func (p *Process) Signal(sig syscall.Signal) error { return p.proc.Cmd.Process.Signal(sig) }

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

// Uninstall runs `bin node --uninstall` in n's namespace: the explicit act
// that removes the rules and blocking routes a stopped meshtun leaves (so
// that its pods' traffic stays blocked while no proxy runs). It fails
// while a meshtun still runs there.
func Uninstall(ctx context.Context, bin string, n *cluster.Node) error {
	cmd := n.Command(ctx, bin, "node", "--uninstall")
	var out strings.Builder
	cmd.Stdout, cmd.Stderr = &out, &out
	proc, err := n.Start(cmd)
	if err != nil {
		return fmt.Errorf("noderun: uninstall in %s: %w", n.Name(), err)
	}
	if err := proc.Wait(); err != nil {
		return fmt.Errorf("noderun: meshtun node --uninstall in %s: %w\n%s", n.Name(), err, out.String())
	}
	return nil
}
