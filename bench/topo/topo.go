// Package topo builds the benchmark's sealed topology: a network-namespace
// cluster (bench/cluster) with one pair of nodes per data path, one pod on
// each node, and the proxies of each path started on its nodes. The paths
// exist side by side, so a benchmark can interleave them without
// restarting anything.
package topo

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
)

// Path names.
const (
	Direct      = "direct"
	Verbatim    = "verbatim"
	Passthrough = "passthrough"
	Mesh        = "mesh"
	Tun2socks   = "tun2socks"
	WireGuardGo = "wireguard-go"
	Pasta       = "pasta"
)

// Peers are the paths of other projects, in display order.
var Peers = []string{Tun2socks, WireGuardGo, Pasta}

// Proxy is a proxy process a path's traffic runs through.
type Proxy struct {
	// Name says what runs where, e.g. "meshtun n7".
	Name string
	// Pid is the process ID, for /proc; Restart changes it.
	Pid int
	// Node is the node the proxy runs on.
	Node *cluster.Node
	// Pprof is the Unix socket where the proxy serves net/http/pprof
	// (under /debug/pprof/; meshtun's admin socket); empty if it does not.
	Pprof string

	proc  *cluster.Proc
	start func(context.Context) (*cluster.Proc, error)
}

// Path is one way from a source pod to a destination pod.
type Path struct {
	// Name is one of Direct, Verbatim, Passthrough, Mesh or a peer (see
	// Peers).
	Name string
	// Description says what the packets go through.
	Description string
	// Peer marks a path of another project, one that ratios are taken to.
	Peer bool
	// Src is the client pod, Dst the server pod, on another node.
	Src, Dst *cluster.Pod
	// Proxies are the proxy processes on the way; none on Direct.
	Proxies []Proxy
	// Kind is the kind of path, one of the path names: a variant path's
	// Name carries the variant's label, its Kind does not.
	Kind string
	// VariantOf is, on a variant path (the B of an A/B comparison), the
	// name of the path it is compared with; empty otherwise.
	VariantOf string
}

// Spec says what to build.
type Spec struct {
	// Meshtun is the meshtun binary to run `meshtun node` from.
	Meshtun string
	// Tun2socks is the tun2socks binary (see BuildTun2socks), WireGuardGo
	// the wireguard-go binary (see BuildWireGuardGo), Pasta the pasta
	// binary (see EnsurePasta); an empty one leaves its peer path out.
	Tun2socks, WireGuardGo, Pasta string
	// LogLevel is meshtun's --log-level ("info", its default, if empty).
	LogLevel string
	// Paths, if not empty, limits the meshtun paths to these kinds
	// (Verbatim, Passthrough, Mesh). Direct is always built: it is the
	// baseline.
	Paths []string
	// Variant, if not nil, builds every meshtun path a second time, run as
	// it says, beside the first: an A/B comparison in one run.
	Variant *Variant
	// Log receives progress messages.
	Log zerolog.Logger
}

// Variant is the B side of an A/B comparison: a meshtun build or setting
// measured against the A side (Spec.Meshtun as is) on paths of its own,
// interleaved with them.
type Variant struct {
	// Label is appended to the path names ("mesh·B"); "B" if empty.
	Label string
	// Meshtun is the binary; Spec.Meshtun if empty.
	Meshtun string
	// Env holds KEY=VALUE pairs added to the environment of its nodes.
	Env []string
	// Args are extra flags of its `meshtun node` commands.
	Args []string
}

// name returns the variant path's name for a path kind.
func (v *Variant) name(kind string) string {
	l := v.Label
	if l == "" {
		l = "B"
	}
	return kind + "·" + l
}

// String says what the variant runs, for reports.
func (v *Variant) String() string {
	var parts []string
	if v.Meshtun != "" {
		parts = append(parts, "binary "+v.Meshtun)
	}
	if len(v.Env) > 0 {
		parts = append(parts, "environment "+strings.Join(v.Env, " "))
	}
	if len(v.Args) > 0 {
		parts = append(parts, "node flags "+strings.Join(v.Args, " "))
	}
	if len(parts) == 0 {
		return "the same binary and settings as A"
	}
	return strings.Join(parts, ", ")
}

// Topology is a built topology. Close tears it down.
type Topology struct {
	// Cluster is the namespace cluster.
	Cluster *cluster.Cluster
	// Paths are in the order Direct, Verbatim, Passthrough, Mesh and, if
	// asked for, the peers in the order of Peers.
	Paths []*Path
	// ConfigPath is the mesh config the meshtun nodes run with.
	ConfigPath string

	dir string
	log zerolog.Logger
}

// pathPlan describes a path before it is built.
type pathPlan struct {
	name, desc string
	peer       bool
	kind       string   // name of the plan it copies; name if empty
	variant    *Variant // set on the B copy of a meshtun path
	variantOf  string
}

var plans = []pathPlan{
	{name: Direct, desc: "the kernel alone: pod → node → node → pod over veth and a bridge, no proxy", peer: false},
	{name: Verbatim, desc: "meshtun on both nodes with --no-intercept: every packet through each node's TUN and written back", peer: false},
	{name: Passthrough, desc: "meshtun on the client's node, server pod outside the mesh: TCP terminated in the netstack, sent on by a kernel socket", peer: false},
	{name: Mesh, desc: "meshtun on both nodes, both pods in the mesh: HBONE (HTTP/2 CONNECT over mTLS) from node to node", peer: false},
	{name: Tun2socks, desc: "tun2socks v2.6.0 on the client's node with -proxy direct:// on the same TUN path (same rules, MTU, queue length)", peer: true},
	{name: WireGuardGo, desc: "wireguard-go " + WireGuardVersion + " on both nodes, configured through its UAPI socket: pod → node → encrypted tunnel (UDP over the fabric, its Linux offloads on) → node → pod", peer: true},
	{name: Pasta, desc: "pasta (Debian's " + PastaPackage + ") on the client's node gives the client pod its network in place of the veth: the pod's TCP and UDP become pasta's sockets in the node, routed on by the node's kernel", peer: true},
}

// Sysctls set in every pod and node namespace: connect-heavy scenarios
// leave many TIME_WAIT sockets behind, and 10,000 idle connections need
// ports.
var portSysctls = [][2]string{
	{"net.ipv4.tcp_tw_reuse", "1"},
	{"net.ipv4.ip_local_port_range", "10000 65000"},
}

// Build builds the cluster, writes the mesh config, starts the proxies and
// returns once every path carries traffic. On error it tears down what it
// built.
func Build(ctx context.Context, spec Spec) (*Topology, error) {
	if spec.Meshtun == "" {
		return nil, errors.New("topo: no meshtun binary")
	}
	if spec.LogLevel == "" {
		spec.LogLevel = "info"
	}
	ps, err := choosePlans(spec)
	if err != nil {
		return nil, err
	}
	c, err := cluster.New(ctx, cluster.Spec{Name: "bench", Nodes: 2 * len(ps), PodsPerNode: 1, NoExternal: true, Log: spec.Log})
	if err != nil {
		return nil, fmt.Errorf("topo: %w", err)
	}
	t := &Topology{Cluster: c, log: spec.Log}
	if err := t.build(ctx, spec, ps); err != nil {
		return nil, errors.Join(err, t.Close())
	}
	return t, nil
}

// choosePlans returns the paths spec asks for, in display order: each
// variant path right after the path it is compared with.
func choosePlans(spec Spec) ([]pathPlan, error) {
	for _, k := range spec.Paths {
		if k != Verbatim && k != Passthrough && k != Mesh {
			return nil, fmt.Errorf("topo: no meshtun path %q (want %s, %s or %s)", k, Verbatim, Passthrough, Mesh)
		}
	}
	var ps []pathPlan
	for _, p := range plans {
		p.kind = p.name
		switch {
		case p.peer && spec.peerBinary(p.name) == "":
			continue
		case p.name == Direct || p.peer:
			ps = append(ps, p)
			continue
		case len(spec.Paths) > 0 && !slices.Contains(spec.Paths, p.name):
			continue
		}
		ps = append(ps, p)
		if v := spec.Variant; v != nil {
			b := p
			b.name, b.variant, b.variantOf = v.name(p.name), v, p.name
			b.desc = p.desc + "; run with " + v.String()
			ps = append(ps, b)
		}
	}
	return ps, nil
}

// peerBinary returns the binary spec gives for peer path name, "" if
// none.
func (s Spec) peerBinary(name string) string {
	switch name {
	case Tun2socks:
		return s.Tun2socks
	case WireGuardGo:
		return s.WireGuardGo
	case Pasta:
		return s.Pasta
	}
	return ""
}

func (t *Topology) build(ctx context.Context, spec Spec, ps []pathPlan) error {
	c := t.Cluster
	for _, n := range c.Nodes {
		for _, ns := range []*cluster.NS{n.NS, n.Pods[0].NS} {
			for _, kv := range portSysctls {
				if err := ns.SetSysctl(kv[0], kv[1]); err != nil {
					return fmt.Errorf("topo: %w", err)
				}
			}
		}
	}
	for i, p := range ps {
		t.Paths = append(t.Paths, &Path{
			Name: p.name, Description: p.desc, Peer: p.peer, Kind: p.kind, VariantOf: p.variantOf,
			Src: c.Nodes[2*i].Pods[0], Dst: c.Nodes[2*i+1].Pods[0],
		})
	}
	dir, err := os.MkdirTemp("", "meshtun-bench-")
	if err != nil {
		return fmt.Errorf("topo: %w", err)
	}
	t.dir = dir
	// The benchmark measures the data path: its nodes issue their own
	// certificates from a shared CA directory (development mode) instead
	// of running `meshtun ca` on a control host.
	m := noderun.Mesh{Pods: map[string]noderun.Pod{}, InsecureSharedCA: true}
	for _, p := range t.Paths {
		if p.Kind == Passthrough {
			m.Pods[p.Dst.ID] = noderun.Pod{Outside: true}
		}
	}
	if t.ConfigPath, err = noderun.WriteConfig(c, dir, m); err != nil {
		return fmt.Errorf("topo: %w", err)
	}
	for i, p := range t.Paths {
		var nodes []*cluster.Node
		var extra []string
		bin, env := spec.Meshtun, []string(nil)
		if v := ps[i].variant; v != nil {
			bin = cmp.Or(v.Meshtun, bin)
			env = v.Env
			extra = append(extra, v.Args...)
		}
		switch p.Kind {
		case Verbatim:
			nodes, extra = []*cluster.Node{p.Src.Node, p.Dst.Node}, append(extra, "--no-intercept")
		case Passthrough:
			nodes = []*cluster.Node{p.Src.Node}
		case Mesh:
			nodes = []*cluster.Node{p.Src.Node, p.Dst.Node}
		case Tun2socks:
			src := p.Src
			p.Proxies = append(p.Proxies, Proxy{
				Name: "tun2socks " + noderun.NodeName(src.Node),
				Node: src.Node,
				start: func(ctx context.Context) (*cluster.Proc, error) {
					return startTun2socks(ctx, spec.Tun2socks, src, t.log)
				},
			})
		case WireGuardGo:
			ends, err := newWGPair(p.Src, p.Dst)
			if err != nil {
				return err
			}
			for _, e := range ends {
				p.Proxies = append(p.Proxies, Proxy{
					Name: "wireguard-go " + noderun.NodeName(e.node),
					Node: e.node,
					start: func(ctx context.Context) (*cluster.Proc, error) {
						return startWireGuard(ctx, spec.WireGuardGo, e, t.log)
					},
				})
			}
		case Pasta:
			src := p.Src
			if v := PastaVersion(); v != "" {
				p.Description += " (" + PastaPackage + " " + v + ")"
			}
			if err := detachPod(src); err != nil {
				return err
			}
			logFile := filepath.Join(t.dir, "pasta-"+src.ID+".log")
			p.Proxies = append(p.Proxies, Proxy{
				Name: "pasta " + noderun.NodeName(src.Node),
				Node: src.Node,
				start: func(ctx context.Context) (*cluster.Proc, error) {
					return startPasta(ctx, spec.Pasta, src, logFile, t.log)
				},
			})
		}
		for _, n := range nodes {
			args := append([]string{"--config", t.ConfigPath, "--log-level", spec.LogLevel}, extra...)
			p.Proxies = append(p.Proxies, Proxy{
				Name:  "meshtun " + noderun.NodeName(n),
				Node:  n,
				Pprof: noderun.AdminSocket(filepath.Dir(t.ConfigPath), n),
				start: func(ctx context.Context) (*cluster.Proc, error) {
					return startMeshtun(ctx, bin, env, n, args...)
				},
			})
		}
		for i := range p.Proxies {
			if err := p.Proxies[i].run(ctx); err != nil {
				return err
			}
		}
		t.log.Debug().Str("path", p.Name).Str("src", p.Src.ID).Str("dst", p.Dst.ID).Msg("topo: path ready")
	}
	return nil
}

func (x *Proxy) run(ctx context.Context) error {
	proc, err := x.start(ctx)
	if err != nil {
		return err
	}
	x.proc, x.Pid = proc, proc.Cmd.Process.Pid
	return nil
}

// stopGrace is how long a proxy gets to exit after SIGTERM.
const stopGrace = 5 * time.Second

// Restart stops the proxies of path p and starts them again, fresh: for
// measurements that must not see what earlier traffic left in a process
// (its peak memory, its heap). Connections through p break.
func (t *Topology) Restart(ctx context.Context, p *Path) error {
	for i := range p.Proxies {
		x := &p.Proxies[i]
		if err := x.proc.Stop(stopGrace); err != nil {
			return fmt.Errorf("topo: stop %s: %w", x.Name, err)
		}
	}
	for i := range p.Proxies {
		if err := p.Proxies[i].run(ctx); err != nil {
			return err
		}
	}
	return nil
}

// Path returns the path with this name, or nil.
func (t *Topology) Path(name string) *Path {
	for _, p := range t.Paths {
		if p.Name == name {
			return p
		}
	}
	return nil
}

// Close stops the proxies, tears down the cluster and removes the config
// directory.
func (t *Topology) Close() error {
	err := t.Cluster.Close()
	if t.dir != "" {
		err = errors.Join(err, os.RemoveAll(t.dir))
	}
	return err
}

// ParsePeers reads the value of `meshtun bench --peers`: "true" (the flag
// alone) selects every peer, "false" none, otherwise a comma-separated
// list of peer names ("wireguard" and "wg" stand for wireguard-go). It
// returns the selected peers in the order of Peers.
func ParsePeers(s string) ([]string, error) {
	switch s {
	case "true":
		return slices.Clone(Peers), nil
	case "false", "":
		return nil, nil
	}
	want := map[string]bool{}
	for _, f := range strings.Split(s, ",") {
		name := strings.TrimSpace(f)
		switch name {
		case "wireguard", "wg":
			name = WireGuardGo
		}
		if !slices.Contains(Peers, name) {
			return nil, fmt.Errorf("no peer %q (want a comma-separated list of %s)", f, strings.Join(Peers, ", "))
		}
		want[name] = true
	}
	var out []string
	for _, p := range Peers {
		if want[p] {
			out = append(out, p)
		}
	}
	return out, nil
}
