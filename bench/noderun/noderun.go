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
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/mesh/node"
)

// Line is one JSON log record of a node process.
type Line map[string]any

// Str returns field k as a string ("" if absent or not a string).
func (l Line) Str(k string) string { s, _ := l[k].(string); return s }

// Num returns field k as a number (0 if absent or not a number).
func (l Line) Num(k string) float64 { f, _ := l[k].(float64); return f }

// Process is a running `meshtun node` (or `meshtun ca serve`).
type Process struct {
	// Node is the node the process runs on; nil for the certificate
	// service, which runs on the cluster's control host.
	Node *cluster.Node
	ns   *cluster.NS
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
	// InsecureSharedCA has every node hold the CA root key
	// (ca.insecureSharedDir), for runs that measure the data path only.
	// Otherwise the nodes get their certificates from `meshtun ca` on the
	// cluster's control host (StartCA), which the cluster must have.
	InsecureSharedCA bool
	// SVIDTTL is ca.svidTTL; the default if zero.
	SVIDTTL time.Duration
	// CAExtra is YAML appended inside the ca mapping (as ", key: value").
	CAExtra string
}

// AdminSocket is the admin socket (POST /logging, /debug/pprof/) of node n
// in the config WriteConfig writes to dir; empty (none) if its path would
// be longer than a Unix socket's 107 bytes.
func AdminSocket(dir string, n *cluster.Node) string {
	p := filepath.Join(dir, "admin", NodeName(n)+".sock")
	if len(p) > 107 {
		return ""
	}
	return p
}

// WriteConfig writes the config file of cluster c and mesh m to
// dir/mesh.yaml, with the CA directory dir/ca, and returns its path.
// Every node has a TUN meshtun0, uplink eth0, the admin server on
// 127.0.0.1:15000 of its own namespace and its admin socket at
// AdminSocket(dir, node).
func WriteConfig(c *cluster.Cluster, dir string, m Mesh) (string, error) {
	return writeConfig(c, dir, m, filepath.Join(dir, "mesh.yaml"), filepath.Join(dir, "ca"))
}

// WriteNodeConfig writes the nodes' copy of the config file WriteConfig
// writes (the same mesh, from the same dir and m) to dir/node.yaml and
// returns its path. It leaves ca.dir out: a node with a node credential
// (IssueNodeCredential) trusts the roots stored in that credential and has
// no business with the directory that holds the CA's root key, as on a
// deployed node, which has its credential and no access to the CA's
// directory. The certificate service and `meshtun ca issue-node` keep the
// file of WriteConfig. Refused with m.InsecureSharedCA, whose nodes hold the
// root key.
func WriteNodeConfig(c *cluster.Cluster, dir string, m Mesh) (string, error) {
	if m.InsecureSharedCA {
		return "", errors.New("noderun: WriteNodeConfig: with InsecureSharedCA the nodes read the CA directory; use WriteConfig")
	}
	return writeConfig(c, dir, m, filepath.Join(dir, "node.yaml"), "")
}

// writeConfig writes the config to path; caDir is ca.dir, left out if
// empty.
func writeConfig(c *cluster.Cluster, dir string, m Mesh, path, caDir string) (string, error) {
	var b strings.Builder
	fmt.Fprintf(&b, "# Generated for cluster %s.\ntrustDomain: cluster.local\nca: {", c.Name)
	var ca []string
	if caDir != "" {
		ca = append(ca, fmt.Sprintf("dir: %q", caDir))
	}
	switch {
	case m.InsecureSharedCA:
		ca = append(ca, "insecureSharedDir: true")
	case c.Control == nil:
		return "", errors.New("noderun: the cluster has no control host for meshtun ca (cluster.Spec.Control), and the mesh does not ask for InsecureSharedCA")
	default:
		ca = append(ca, fmt.Sprintf("address: %q, listen: %q", CAAddr(c), CAAddr(c)))
	}
	if m.SVIDTTL > 0 {
		ca = append(ca, fmt.Sprintf("svidTTL: %s", m.SVIDTTL))
	}
	b.WriteString(strings.Join(ca, ", "))
	b.WriteString(m.CAExtra)
	b.WriteString("}\nnodes:\n")
	for _, n := range c.Nodes {
		fmt.Fprintf(&b, "  - {name: %s, tun: {name: meshtun0, mtu: 1500}, uplinks: [%s], listen: {admin: \"127.0.0.1:15000\", adminSocket: %q}}\n", NodeName(n), n.Uplink, AdminSocket(dir, n))
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
	p, err := start(ctx, n.NS, bin, args, node.ReadyMessage)
	if p != nil {
		p.Node = n
	}
	return p, err
}

// CAReadyMessage is the log line of `meshtun ca serve` once it serves
// (caserver.ReadyMessage).
const CAReadyMessage = "certificate service ready"

// StartCA runs `bin ca serve --config cfgPath <extra>` on c's control host
// and waits until it serves.
func StartCA(ctx context.Context, bin string, c *cluster.Cluster, cfgPath string, extra ...string) (*Process, error) {
	if c.Control == nil {
		return nil, errors.New("noderun: the cluster has no control host (cluster.Spec.Control) for meshtun ca")
	}
	args := append([]string{"ca", "serve", "--config", cfgPath}, extra...)
	return start(ctx, c.Control.NS, bin, args, CAReadyMessage)
}

func start(ctx context.Context, ns *cluster.NS, bin string, args []string, ready string) (*Process, error) {
	cmd := ns.Command(context.WithoutCancel(ctx), bin, args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		return nil, fmt.Errorf("noderun: %s: %w", ns.Name(), err)
	}
	p := &Process{ns: ns, done: make(chan struct{}), changed: make(chan struct{})}
	proc, err := ns.Start(cmd)
	if err != nil {
		return nil, fmt.Errorf("noderun: start meshtun in %s: %w", ns.Name(), err)
	}
	p.proc = proc
	go p.readLogs(stderr)
	if _, err := p.WaitLog(ctx, func(l Line) bool { return l.Str("message") == ready }); err != nil {
		p.Stop(syscall.SIGKILL)
		return nil, fmt.Errorf("noderun: meshtun in %s did not become ready: %w\nlogs:\n%s", ns.Name(), err, p.Logs())
	}
	return p, nil
}

// CAAddr is where `meshtun ca` listens on the control host of c.
func CAAddr(c *cluster.Cluster) string {
	return netip.AddrPortFrom(c.Control.IPv4, 15012).String()
}

// CredentialDir is where IssueNodeCredential puts node n's credential for
// the config file at cfgPath.
func CredentialDir(cfgPath string, n *cluster.Node) string {
	return filepath.Join(filepath.Dir(cfgPath), "nodes", NodeName(n))
}

// IssueNodeCredential runs `bin ca issue-node` for node n (an operator's
// command: no network, it reads the CA directory) and returns the
// credential directory.
func IssueNodeCredential(ctx context.Context, bin, cfgPath string, n *cluster.Node, extra ...string) (string, error) {
	dir := CredentialDir(cfgPath, n)
	args := append([]string{"ca", "issue-node", "--config", cfgPath, "--node", NodeName(n), "--out", dir}, extra...)
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("noderun: meshtun ca issue-node for %s: %w\n%s", NodeName(n), err, out)
	}
	return dir, nil
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
		return fmt.Errorf("noderun: meshtun in %s did not exit within 15s of %v", p.ns.Name(), sig)
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

// BuildTags are the build tags every build of meshtun passes (the
// Makefile's GOTAGS): grpcnotrace keeps golang.org/x/net/trace, and with it
// text/template's dynamic method lookup that turns off the linker's
// dead-code elimination of methods, out of the binary.
const BuildTags = "grpcnotrace"

// Build builds the meshtun binary of the module rooted at moduleDir (with
// that module's go.mod and go.sum, so a test module need not carry the
// product's requirements) into a new temporary directory. remove deletes
// the directory. The go command's output goes to stderr.
func Build(moduleDir string) (bin string, remove func(), err error) {
	dir, err := os.MkdirTemp("", "meshtun-bin-")
	if err != nil {
		return "", nil, err
	}
	bin = filepath.Join(dir, "meshtun")
	build := exec.Command("go", "build", "-tags", BuildTags, "-o", bin, "github.com/meshtun/meshtun/cmd/meshtun")
	build.Dir = moduleDir
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		os.RemoveAll(dir)
		return "", nil, fmt.Errorf("build meshtun in %s: %w", moduleDir, err)
	}
	return bin, func() { os.RemoveAll(dir) }, nil
}
