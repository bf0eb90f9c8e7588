// Package demo runs the meshtun demo: a two-node cluster in network
// namespaces with `meshtun node` on each node, a few pods with small
// services, real traffic between them and a report of how every flow
// travelled.
//
// The flows live in one table (Flows). How a flow travelled is read from
// the nodes' access log lines ("route" of the line whose source and
// destination match the flow); a flow without any line was forwarded
// verbatim. Whether its payload crossed the node-to-node link in plaintext
// is measured by capturing every frame in the fabric namespace while a
// unique marker string is sent.
package demo

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
)

// ExternalName is the name of the host outside the cluster in flows.
const ExternalName = "external"

// podSpec places one demo pod.
type podSpec struct {
	name    string
	node    int     // 1-based
	serve   service // what it runs; 0 for nothing
	outside bool    // not a mesh workload, not captured by the node
	strict  bool    // STRICT peer authentication: mTLS only
}

// pods returns the demo's pods, in order per node: the n-th pod of a node
// in this list is that node's pod n of the cluster.
func pods() []podSpec {
	return []podSpec{
		{name: "client", node: 1},
		{name: "web", node: 1, serve: svcEcho},
		{name: "legacy", node: 1, serve: svcEcho, outside: true},
		{name: "echo", node: 2, serve: svcEcho},
		{name: "banner", node: 2, serve: svcBanner},
		{name: "dns", node: 2, serve: svcDNS},
		{name: "secure", node: 2, serve: svcEcho, strict: true},
	}
}

// externalServes is what the external host runs.
const externalServes = svcEcho

// Every mesh workload of the demo is in this trust domain and Kubernetes
// namespace, with its pod name as service account.
const (
	trustDomain = "cluster.local"
	namespace   = "default"
)

// Options configure Start.
type Options struct {
	// Bin is the meshtun binary run as `meshtun node` on each node.
	Bin string
	// Dir is where the run's directory (config and logs), named after
	// the cluster, is created.
	Dir string
	// Log receives diagnostics.
	Log zerolog.Logger
}

// Endpoint is a pod or the external host of a running demo.
type Endpoint struct {
	Name string
	// NS is the endpoint's network namespace.
	NS *cluster.NS
	// Node is the 1-based node index, 0 for the external host.
	Node int
	// IPv4 and IPv6 are its addresses.
	IPv4, IPv6 netip.Addr
	// InMesh is false for the external host and pods outside the mesh.
	InMesh bool
	// Strict is true for a workload with STRICT peer authentication.
	Strict bool
	// Serves describes its service, "" if none.
	Serves string
}

// NodeInfo describes a node of a running demo.
type NodeInfo struct {
	Name  string `json:"name"`
	NetNS string `json:"netns"`
	PID   int    `json:"pid"`
	// IPv4 is the node's address on the node-to-node link.
	IPv4 string `json:"ipv4"`
	// Args are the arguments of its `meshtun node`.
	Args []string `json:"args"`
}

// Demo is a running demo cluster. Close tears it down.
type Demo struct {
	opts      Options
	log       zerolog.Logger
	cluster   *cluster.Cluster
	endpoints map[string]*Endpoint
	order     []*Endpoint
	nodes     []*noderun.Process
	nodeInfo  []NodeInfo
	// ca is `meshtun ca` on the cluster's control host; the nodes hold no
	// CA key, only their node credentials.
	ca *noderun.Process
	// configPath is the generated mesh config file of `meshtun ca`.
	configPath string
	dir        string
	wire       *wire
	closers    []io.Closer
	logsDone   sync.WaitGroup
	stopLogs   context.CancelFunc
	logCtx     context.Context

	closeOnce sync.Once
	closeErr  error
}

// Start builds the cluster, starts the services and `meshtun node` on
// every node, opens the capture on the fabric and writes config.json to
// opts.Dir. On error everything is torn down again.
func Start(ctx context.Context, opts Options) (d *Demo, err error) {
	d = &Demo{opts: opts, log: opts.Log, endpoints: map[string]*Endpoint{}}
	defer func() {
		if err != nil {
			err = errors.Join(err, d.Close())
			if d.dir != "" {
				os.RemoveAll(d.dir)
			}
			d = nil
		}
	}()
	perNode := map[int]int{}
	most := 0
	for _, p := range pods() {
		perNode[p.node]++
		most = max(most, perNode[p.node])
	}
	c, err := cluster.New(ctx, cluster.Spec{Name: "demo", Nodes: len(perNode), PodsPerNode: most, Control: true, Log: d.log})
	if err != nil {
		return d, fmt.Errorf("demo: build cluster: %w", err)
	}
	d.cluster = c
	d.dir = filepath.Join(opts.Dir, c.Name)
	if err := os.MkdirAll(d.dir, 0o755); err != nil {
		return d, fmt.Errorf("demo: create %s: %w", d.dir, err)
	}

	// Name the pods, then start the services.
	next := map[int]int{}
	serves := map[*Endpoint]service{}
	for _, ps := range pods() {
		cp := c.Nodes[ps.node-1].Pods[next[ps.node]]
		next[ps.node]++
		e := &Endpoint{Name: ps.name, NS: cp.NS, Node: ps.node, IPv4: cp.IPv4, IPv6: cp.IPv6,
			InMesh: !ps.outside, Strict: ps.strict, Serves: ps.serve.String()}
		d.add(e)
		serves[e] = ps.serve
	}
	ext := &Endpoint{Name: ExternalName, NS: c.External.NS, IPv4: c.External.IPv4, IPv6: c.External.IPv6,
		Serves: externalServes.String()}
	d.add(ext)
	serves[ext] = externalServes
	for _, e := range d.order {
		if err := d.serve(e, serves[e]); err != nil {
			return d, err
		}
	}

	if d.wire, err = openWire(c.Fabric); err != nil {
		return d, err
	}
	if err := d.startNodes(ctx); err != nil {
		return d, err
	}
	return d, d.writeConfig()
}

func (d *Demo) add(e *Endpoint) {
	d.endpoints[e.Name] = e
	d.order = append(d.order, e)
}

// startNodes writes the mesh config (every pod in the mesh is a workload
// in namespace "default" named after its role; the others are known but
// outside the mesh), creates the built-in CA's root, starts `meshtun node`
// on every node at once and streams each node's log into
// node-<name>.log.
func (d *Demo) startNodes(ctx context.Context) error {
	mesh := noderun.Mesh{Pods: map[string]noderun.Pod{}}
	for _, n := range d.cluster.Nodes {
		for _, p := range n.Pods {
			if e := d.endpointOf(p.NS); e != nil {
				mesh.Pods[p.ID] = noderun.Pod{Name: e.Name, Outside: !e.InMesh, Strict: e.Strict,
					Labels: map[string]string{"app": e.Name}}
			}
		}
	}
	mesh.Extra = meshPolicies
	cfgPath, err := noderun.WriteConfig(d.cluster, d.dir, mesh)
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	d.configPath = cfgPath
	// The certificate service first, in its own namespace (the cluster's
	// control host); it creates the root in <dir>/ca. Then one node
	// credential per node, as an operator would issue them.
	if d.ca, err = noderun.StartCA(ctx, d.opts.Bin, d.cluster, cfgPath, "--log-level", "info"); err != nil {
		return fmt.Errorf("demo: start meshtun ca: %w", err)
	}
	if err := d.streamLog(ctx, d.ca, "ca.log"); err != nil {
		return err
	}
	creds := map[*cluster.Node]string{}
	for _, n := range d.cluster.Nodes {
		if creds[n], err = noderun.IssueNodeCredential(ctx, d.opts.Bin, cfgPath, n); err != nil {
			return fmt.Errorf("demo: %w", err)
		}
	}
	// The nodes run with their own copy of the config, which does not
	// name the CA's directory: each trusts the root certificate stored
	// with its credential (roots.pem), and the root key stays with
	// `meshtun ca`, as in a deployment.
	nodeCfg, err := noderun.WriteNodeConfig(d.cluster, d.dir, mesh)
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	nodeFlags := []string{"--config", nodeCfg, "--log-level", "info"}
	procs := make([]*noderun.Process, len(d.cluster.Nodes))
	errs := make([]error, len(d.cluster.Nodes))
	var wg sync.WaitGroup
	for i, n := range d.cluster.Nodes {
		flags := append(append([]string{}, nodeFlags...), "--credentials", creds[n])
		d.nodeInfo = append(d.nodeInfo, NodeInfo{
			Name: noderun.NodeName(n), NetNS: n.Name(), IPv4: n.IPv4.String(),
			Args: append(append([]string{"node"}, noderun.Args(n)...), flags...),
		})
		wg.Go(func() {
			procs[i], errs[i] = noderun.Start(ctx, d.opts.Bin, n, flags...)
		})
	}
	wg.Wait()
	for i, p := range procs {
		if p == nil {
			continue
		}
		d.nodes = append(d.nodes, p)
		d.nodeInfo[i].PID = p.Pid()
		if err := d.streamLog(ctx, p, "node-"+d.nodeInfo[i].Name+".log"); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// streamLog writes p's log, past and future lines, to name in the demo's
// directory until the demo closes.
func (d *Demo) streamLog(ctx context.Context, p *noderun.Process, name string) error {
	if d.stopLogs == nil {
		logCtx, stop := context.WithCancel(context.WithoutCancel(ctx))
		d.logCtx, d.stopLogs = logCtx, stop
	}
	f, err := os.Create(filepath.Join(d.dir, name))
	if err != nil {
		return fmt.Errorf("demo: log: %w", err)
	}
	d.logsDone.Go(func() {
		defer f.Close()
		enc := json.NewEncoder(f)
		// WaitLog hands every line, past and future, to the
		// predicate; this one writes it out and never matches.
		p.WaitLog(d.logCtx, func(l noderun.Line) bool { enc.Encode(l); return false })
	})
	return nil
}

// meshPolicies are the demo's authorization policies: only the client's
// identity may reach the banner service.
const meshPolicies = `authorizationPolicies:
  - name: banner-from-client
    namespace: default
    selector: {app: banner}
    action: ALLOW
    rules:
      - from: [{principals: [cluster.local/ns/default/sa/client]}]
`

func (d *Demo) endpointOf(ns *cluster.NS) *Endpoint {
	for _, e := range d.order {
		if e.NS == ns {
			return e
		}
	}
	return nil
}

// writeConfig writes config.json: the topology, each endpoint's addresses
// and namespace, and each node's meshtun arguments.
func (d *Demo) writeConfig() error {
	type endpointJSON struct {
		Name   string `json:"name"`
		Node   string `json:"node"`
		NetNS  string `json:"netns"`
		IPv4   string `json:"ipv4"`
		IPv6   string `json:"ipv6"`
		InMesh bool   `json:"in_mesh"`
		Strict bool   `json:"strict,omitempty"`
		Serves string `json:"serves,omitempty"`
	}
	cfg := struct {
		Cluster     string         `json:"cluster"`
		TrustDomain string         `json:"trust_domain"`
		CADir       string         `json:"ca_dir"`
		CANetNS     string         `json:"ca_netns"`
		CAAddr      string         `json:"ca_addr"`
		Fabric      string         `json:"fabric_netns"`
		Nodes       []NodeInfo     `json:"nodes"`
		Endpoints   []endpointJSON `json:"endpoints"`
	}{Cluster: d.cluster.Name, TrustDomain: trustDomain, CADir: filepath.Join(d.dir, "ca"),
		CANetNS: d.cluster.Control.Name(), CAAddr: noderun.CAAddr(d.cluster),
		Fabric: d.cluster.Fabric.Name(), Nodes: d.nodeInfo}
	for _, e := range d.order {
		node := "-"
		if e.Node > 0 {
			node = fmt.Sprintf("n%d", e.Node)
		}
		cfg.Endpoints = append(cfg.Endpoints, endpointJSON{e.Name, node, e.NS.Name(),
			e.IPv4.String(), e.IPv6.String(), e.InMesh, e.Strict, e.Serves})
	}
	b, err := json.MarshalIndent(cfg, "", "  ")
	if err != nil {
		return err
	}
	p := filepath.Join(d.dir, "config.json")
	if err := os.WriteFile(p, append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("demo: write %s: %w", p, err)
	}
	return nil
}

// Cluster returns the cluster name: the prefix of every namespace name.
func (d *Demo) Cluster() string { return d.cluster.Name }

// Namespaces returns the names of the demo's namespaces.
func (d *Demo) Namespaces() []string { return d.cluster.Namespaces() }

// Nodes describes the nodes and their meshtun processes.
func (d *Demo) Nodes() []NodeInfo { return append([]NodeInfo(nil), d.nodeInfo...) }

// Endpoints returns the pods, node by node, then the external host.
func (d *Demo) Endpoints() []Endpoint {
	out := make([]Endpoint, len(d.order))
	for i, e := range d.order {
		out[i] = *e
	}
	return out
}

// Dir is the run's directory: config.json and node-<node>.log.
func (d *Demo) Dir() string { return d.dir }

// FabricNS is the name of the namespace holding the node-to-node bridge.
func (d *Demo) FabricNS() string { return d.cluster.Fabric.Name() }

// Close stops the services, the capture and the nodes and deletes every
// namespace. It is idempotent.
func (d *Demo) Close() error {
	d.closeOnce.Do(func() {
		var errs []error
		for _, c := range d.closers {
			c.Close()
		}
		if d.wire != nil {
			d.wire.Close()
		}
		// Nodes first, gently, so that they log their shutdown; a
		// stopped node keeps its pods' traffic blocked (fail closed), so
		// meshtun is then uninstalled from it, the explicit act an
		// operator would do; the cluster then deletes the namespaces.
		var wg sync.WaitGroup
		for _, p := range d.nodes {
			wg.Go(func() {
				if err := p.Stop(syscall.SIGTERM); err != nil {
					d.log.Warn().Err(err).Str("netns", p.Node.Name()).Msg("demo: meshtun node exit")
				}
				ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
				defer cancel()
				if err := noderun.Uninstall(ctx, d.opts.Bin, p.Node); err != nil {
					d.log.Warn().Err(err).Str("netns", p.Node.Name()).Msg("demo: meshtun node --uninstall")
				}
			})
		}
		wg.Wait()
		if d.ca != nil {
			if err := d.ca.Stop(syscall.SIGTERM); err != nil {
				d.log.Warn().Err(err).Msg("demo: meshtun ca exit")
			}
		}
		if d.stopLogs != nil {
			d.stopLogs()
		}
		d.logsDone.Wait()
		if d.cluster != nil {
			if err := d.cluster.Close(); err != nil {
				errs = append(errs, fmt.Errorf("demo: tear down cluster %s: %w", d.cluster.Name, err))
			}
		}
		d.closeErr = errors.Join(errs...)
	})
	return d.closeErr
}

// deadline bounds one flow's exchange.
const deadline = 3 * time.Second
