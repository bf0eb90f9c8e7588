// Package config reads meshtun's YAML configuration file: the mesh
// (trust domain, workloads, services, authorization policies) and the
// nodes that run a meshtun proxy (TUN device, links, listen addresses).
// It is the embedded default source of the registry: Load parses and
// validates a file, Snapshot turns it into a registry.Snapshot, Node
// returns one node's settings, and Watch reloads the file when it changes.
//
// Decoding is strict: an unknown field, a value of the wrong kind, an
// invalid address or a reference to something that does not exist is an
// error naming the file, the line, the field path and the reason, e.g.
//
//	mesh.yaml:14:21: workloads[2].addresses[0]: "198.18.1.300" is not an IP address
//
// docs/config.md documents every field.
package config

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"strconv"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"gopkg.in/yaml.v3"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// Defaults for fields the file leaves out.
const (
	DefaultTrustDomain   = "cluster.local"
	DefaultRootNamespace = registry.DefaultRootNamespace
	DefaultClusterDomain = registry.DefaultDomainSuffix
	DefaultCADir         = "/var/lib/meshtun/ca"
	DefaultCAListen      = ":15012"
	// DefaultNodeCredentialTTL is the lifetime of a node credential: a
	// revoked one that is not on the deny list stops working after it.
	DefaultNodeCredentialTTL = 7 * 24 * time.Hour
	DefaultTUNName           = "meshtun0"
	DefaultMTU               = 1500
	DefaultAdmin             = "127.0.0.1:15000"
	// DefaultAdminSocket is the Unix socket of the node's writable and
	// profiling admin endpoints (root only: 0600 in a 0700 directory).
	DefaultAdminSocket = "/var/run/meshtun/admin.sock"
	DefaultMetrics     = ":15020"
	DefaultReadiness   = ":15021"
	DefaultNamespace   = "default"
	DefaultSA          = "default"
)

// Config is a parsed and validated config file. Load fills in defaults;
// do not modify a Config that Snapshot or Node will read.
type Config struct {
	// TrustDomain is the SPIFFE trust domain of every workload identity.
	TrustDomain string `yaml:"trustDomain"`
	// RootNamespace is where authorization policies apply mesh-wide.
	RootNamespace string `yaml:"rootNamespace"`
	// ClusterDomain completes service hostnames:
	// <name>.<namespace>.svc.<clusterDomain>.
	ClusterDomain string `yaml:"clusterDomain"`
	// PeerAuthentication is the mesh-wide default mode, STRICT or
	// PERMISSIVE, for workloads that do not set theirs.
	PeerAuthentication    string                `yaml:"peerAuthentication"`
	CA                    CAConfig              `yaml:"ca"`
	Nodes                 []NodeConfig          `yaml:"nodes"`
	Workloads             []Workload            `yaml:"workloads"`
	Services              []Service             `yaml:"services"`
	AuthorizationPolicies []AuthorizationPolicy `yaml:"authorizationPolicies"`
	PeerAuthentications   []PeerAuthentication  `yaml:"peerAuthentications"`

	// Path is the file the config was loaded from.
	Path string `yaml:"-"`
	// Warnings are problems that do not stop the config from working (a
	// selector that selects nothing, …), formatted like errors.
	Warnings []string `yaml:"-"`

	td       spiffeid.TrustDomain
	policies []*policy.Policy
	sum      [sha256.Size]byte
}

// Sum returns the SHA-256 of the content the config was parsed from: two
// configs with the same Sum describe the same mesh.
func (c *Config) Sum() [sha256.Size]byte { return c.sum }

// MaxFileSize is the largest config file Load and Watch read: a larger
// file is refused rather than read into memory and parsed.
const MaxFileSize = 8 << 20

// readFile reads path, refusing a file larger than MaxFileSize.
func readFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return nil, err
	}
	if len(data) > MaxFileSize {
		return nil, fmt.Errorf("%s: the file is larger than %d MiB; refusing to read it", path, MaxFileSize>>20)
	}
	return data, nil
}

// CAConfig is the certificate service (`meshtun ca`, see docs/identity.md)
// and how nodes reach it.
type CAConfig struct {
	// Dir holds the CA root key and certificate (created on first use). Only
	// `meshtun ca` reads it, and nodes with InsecureSharedDir.
	Dir string `yaml:"dir"`
	// SVIDTTL is the lifetime of issued workload certificates; zero means
	// the CA's default (identity.DefaultSVIDTTL).
	SVIDTTL time.Duration `yaml:"svidTTL"`
	// Address is host:port of `meshtun ca` for the nodes.
	Address string `yaml:"address"`
	// Listen is where `meshtun ca` listens; DefaultCAListen if empty.
	Listen string `yaml:"listen"`
	// NodeCredentialTTL is the lifetime of node credentials made by
	// `meshtun ca issue-node`; DefaultNodeCredentialTTL if zero.
	NodeCredentialTTL time.Duration `yaml:"nodeCredentialTTL"`
	// RevokedNodeCredentials are serial numbers (hexadecimal) of node
	// credentials `meshtun ca` refuses.
	RevokedNodeCredentials []string `yaml:"revokedNodeCredentials"`
	// InsecureSharedDir makes every node open Dir and issue its own
	// certificates with the root key (the old mode): development only.
	InsecureSharedDir bool `yaml:"insecureSharedDir"`
}

// NodeConfig is one node that runs a meshtun proxy.
type NodeConfig struct {
	Name string    `yaml:"name"`
	TUN  TUNConfig `yaml:"tun"`
	// Uplinks are the node's links towards other nodes. Optional: the
	// node routes traffic to its mesh pods through the TUN whichever link
	// it arrives on; uplinks are only checked against capture links.
	Uplinks []string `yaml:"uplinks"`
	// CaptureLinks are the node-side links of captured pods. After Load it
	// also holds the captureLink of every mesh workload on the node.
	CaptureLinks []string     `yaml:"captureLinks"`
	Listen       ListenConfig `yaml:"listen"`
}

// TUNConfig is the node's TUN device.
type TUNConfig struct {
	Name string `yaml:"name"`
	MTU  int    `yaml:"mtu"`
	// TxQueueLen is the device's transmit queue length; zero means the
	// tun package's default.
	TxQueueLen int `yaml:"txQueueLen"`
}

// ListenConfig holds the addresses of the node's HTTP endpoints, as
// host:port; an empty value (written as "") disables the endpoint.
type ListenConfig struct {
	Admin     string `yaml:"admin"`
	Metrics   string `yaml:"metrics"`
	Readiness string `yaml:"readiness"`
	// AdminFormat is the shape of the admin /config_dump without
	// ?format=: "meshtun" (default) or "ztunnel" (ztunnel's JSON, for
	// tools that read ztunnel's admin endpoint).
	AdminFormat string `yaml:"adminFormat"`
	// AdminSocket is the path of the Unix socket (mode 0600, in a
	// directory only its owner may write) that serves the admin endpoints
	// that change the node or profile it (POST /logging, /debug/pprof/)
	// as well as the read-only ones; the TCP admin address serves only
	// the read-only ones. Empty ("") disables it.
	AdminSocket string `yaml:"adminSocket"`
}

// Workload is a pod or any other addressable endpoint.
type Workload struct {
	Name           string            `yaml:"name"`
	Namespace      string            `yaml:"namespace"`
	ServiceAccount string            `yaml:"serviceAccount"`
	Node           string            `yaml:"node"`
	Addresses      []netip.Addr      `yaml:"addresses"`
	Labels         map[string]string `yaml:"labels"`
	// CaptureLink is the node-side link of the workload (its veth peer):
	// the node captures it when the workload is in the mesh.
	CaptureLink string `yaml:"captureLink"`
	// Mesh: the workload's traffic goes through the mesh (default true).
	Mesh *bool `yaml:"mesh"`
	// PeerAuthentication is STRICT or PERMISSIVE; if empty, the
	// peerAuthentications that select the workload decide, else the mesh
	// default. After Load it holds the workload's resolved mode.
	PeerAuthentication string `yaml:"peerAuthentication"`
	// ProbePorts are the ports the node's health probes reach the
	// workload on: served from the node directly, even under STRICT.
	ProbePorts []uint16 `yaml:"probePorts,port"`

	// portModes is the resolved port-level mode (STRICT or PERMISSIVE)
	// of some ports, from a peerAuthentications' portLevelMtls.
	portModes map[uint16]string
}

// InMesh reports whether the workload is in the mesh (Mesh, default true).
func (w *Workload) InMesh() bool { return w.Mesh == nil || *w.Mesh }

// Service is a set of workloads behind virtual IPs.
type Service struct {
	Name      string `yaml:"name"`
	Namespace string `yaml:"namespace"`
	// Hostname overrides <name>.<namespace>.svc.<clusterDomain>.
	Hostname string        `yaml:"hostname"`
	VIPs     []netip.Addr  `yaml:"vips"`
	Ports    []ServicePort `yaml:"ports"`
	// Selector selects the endpoints by label among the workloads of the
	// service's namespace; Workloads lists them instead ("name" for one of
	// the service's namespace, "namespace/name" for any).
	Selector  map[string]string `yaml:"selector"`
	Workloads []string          `yaml:"workloads"`
	// TrafficDistribution is empty (any endpoint) or PreferSameNode.
	TrafficDistribution string `yaml:"trafficDistribution"`
}

// ServicePort maps a service port to the endpoints' target port.
type ServicePort struct {
	Name       string `yaml:"name"`
	Port       uint16 `yaml:"port,port"`
	TargetPort uint16 `yaml:"targetPort,port"`
}

// Selector is a label selector: {app: echo}, or Istio's
// {matchLabels: {app: echo}}.
type Selector map[string]string

// AuthorizationPolicy is an Istio AuthorizationPolicy. HTTP fields and
// actions an L4 proxy cannot enforce load with a warning (docs/config.md).
type AuthorizationPolicy struct {
	Name      string   `yaml:"name"`
	Namespace string   `yaml:"namespace"`
	Selector  Selector `yaml:"selector"`
	// Action is ALLOW (the default), DENY or AUDIT; CUSTOM is accepted and
	// ignored with a warning.
	Action string `yaml:"action"`
	// Provider is CUSTOM's external authorizer.
	Provider *Provider `yaml:"provider"`
	// TargetRef and TargetRefs attach the policy to a waypoint or gateway;
	// such a policy is not for a node proxy and is ignored with a warning.
	TargetRef  *TargetRef  `yaml:"targetRef"`
	TargetRefs []TargetRef `yaml:"targetRefs"`
	Rules      []Rule      `yaml:"rules"`
}

// Provider names a CUSTOM policy's external authorizer.
type Provider struct {
	Name string `yaml:"name"`
}

// TargetRef is an Istio policy target (a Gateway API reference).
type TargetRef struct {
	Group     string `yaml:"group"`
	Kind      string `yaml:"kind"`
	Name      string `yaml:"name"`
	Namespace string `yaml:"namespace"`
}

// PeerAuthentication is an Istio PeerAuthentication: the mTLS mode of the
// workloads it selects. In the root namespace without a selector it is
// mesh-wide; in another namespace without a selector, namespace-wide;
// with a selector, it applies to the selected workloads of its namespace
// and may set modes per port.
type PeerAuthentication struct {
	Name      string   `yaml:"name"`
	Namespace string   `yaml:"namespace"`
	Selector  Selector `yaml:"selector"`
	MTLS      MTLS     `yaml:"mtls"`
	// PortLevelMTLS maps a workload port (as a string or a number) to its
	// mode; it needs a selector.
	PortLevelMTLS map[string]MTLS `yaml:"portLevelMtls"`
}

// MTLS is a peer-authentication mode: UNSET (or empty: inherit),
// STRICT, PERMISSIVE or DISABLE (which an L4 node proxy treats as
// PERMISSIVE, as ztunnel does).
type MTLS struct {
	Mode string `yaml:"mode"`
}

// Rule is one rule of a policy.
type Rule struct {
	From []From      `yaml:"from"`
	To   []To        `yaml:"to"`
	When []Condition `yaml:"when"`
}

// From is one source of a rule: {source: {…}} as in Istio, or the source
// fields directly.
type From struct {
	Source  Source
	wrapped bool
}

// To is one operation of a rule: {operation: {…}} as in Istio, or the
// operation fields directly.
type To struct {
	Operation Operation
	wrapped   bool
}

// l7Field is an HTTP field of a source or operation, by name.
type l7Field struct{ name string }

// Source matches the peer of a connection.
type Source struct {
	Principals         []string         `yaml:"principals"`
	NotPrincipals      []string         `yaml:"notPrincipals"`
	Namespaces         []string         `yaml:"namespaces"`
	NotNamespaces      []string         `yaml:"notNamespaces"`
	ServiceAccounts    []string         `yaml:"serviceAccounts"`
	NotServiceAccounts []string         `yaml:"notServiceAccounts"`
	IPBlocks           []policy.IPBlock `yaml:"ipBlocks"`
	NotIPBlocks        []policy.IPBlock `yaml:"notIpBlocks"`

	l7 []l7Field // requestPrincipals, remoteIpBlocks, …
}

// Operation matches the destination port of a connection.
type Operation struct {
	Ports    []uint16 `yaml:"ports,port"`
	NotPorts []uint16 `yaml:"notPorts,port"`

	l7 []l7Field // methods, paths, hosts, …
}

// Condition is one entry of a rule's when clause.
type Condition struct {
	Key       string   `yaml:"key"`
	Values    []string `yaml:"values"`
	NotValues []string `yaml:"notValues"`
}

// Load reads, parses and validates the config file at path. Its error is
// an Errors listing every problem, each with file, line and field, or a
// plain error when the file cannot be read.
func Load(path string) (*Config, error) {
	data, err := readFile(path)
	if err != nil {
		return nil, fmt.Errorf("config: %w", err)
	}
	return Parse(path, data)
}

var yamlLine = regexp.MustCompile(`^yaml: line (\d+): (.*)$`)

// Parse parses and validates config data; name is used in errors.
func Parse(name string, data []byte) (*Config, error) {
	file := filepath.Base(name)
	var doc yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); err != nil {
		if errors.Is(err, io.EOF) {
			return nil, Errors{{File: file, Reason: "the file is empty"}}
		}
		e := &Error{File: file, Reason: err.Error()}
		if m := yamlLine.FindStringSubmatch(err.Error()); m != nil {
			e.Line, _ = strconv.Atoi(m[1])
			e.Reason = m[2]
		}
		return nil, Errors{e}
	}
	var extra yaml.Node
	if err := dec.Decode(&extra); err == nil {
		return nil, Errors{{File: file, Line: extra.Line, Reason: "more than one YAML document; put everything in one"}}
	}
	root := &doc
	if root.Kind == yaml.DocumentNode && len(root.Content) == 1 {
		root = root.Content[0]
	}
	d := newDecoder(file)
	d.budget = 4*countNodes(root) + 1000
	c := &Config{Path: name, sum: sha256.Sum256(data)}
	d.decode(root, reflect.ValueOf(c).Elem(), "", "")
	if len(d.errs) == 0 {
		c.validate(d)
	}
	sortErrors(d.errs)
	if len(d.errs) > 0 {
		return nil, Errors(d.errs)
	}
	sortErrors(d.warns)
	for _, w := range d.warns {
		c.Warnings = append(c.Warnings, w.Error())
	}
	return c, nil
}

// Node returns the settings of the node called name.
func (c *Config) Node(name string) (*NodeConfig, error) {
	var names []string
	for i := range c.Nodes {
		if c.Nodes[i].Name == name {
			n := c.Nodes[i]
			return &n, nil
		}
		names = append(names, c.Nodes[i].Name)
	}
	return nil, fmt.Errorf("config %s: no node %q (nodes: %v)", c.Path, name, names)
}

// DefaultNodeName is the name of the node entry whose settings apply to
// every node the file does not list by name (NodeOrDefault), for nodes
// that come and go, as in a Kubernetes DaemonSet.
const DefaultNodeName = "default"

// NodeOrDefault returns the settings of the node called name, or else
// those of the entry named DefaultNodeName (with Name set to name).
func (c *Config) NodeOrDefault(name string) (*NodeConfig, error) {
	if n, err := c.Node(name); err == nil {
		return n, nil
	}
	n, err := c.Node(DefaultNodeName)
	if err != nil {
		return nil, fmt.Errorf("config %s: no node %q and no %q entry for unlisted nodes", c.Path, name, DefaultNodeName)
	}
	n.Name = name
	return n, nil
}

// TrustDomainID returns the parsed TrustDomain.
func (c *Config) TrustDomainID() spiffeid.TrustDomain { return c.td }

// Policies returns the file's authorization policies, built.
func (c *Config) Policies() []*policy.Policy { return c.policies }

// DefaultPeerAuth returns the mesh-wide peer-authentication mode.
func (c *Config) DefaultPeerAuth() registry.PeerAuth {
	if c.PeerAuthentication == "STRICT" {
		return registry.Strict
	}
	return registry.Permissive
}

// Snapshot builds the registry snapshot the config describes. Each call
// returns a new snapshot.
func (c *Config) Snapshot() (*registry.Snapshot, error) {
	m := registry.Model{
		TrustDomain:   c.td,
		RootNamespace: c.RootNamespace,
		DomainSuffix:  c.ClusterDomain,
		Policies:      c.policies,
		LinksKnown:    true,
	}
	links := c.captureLinks()
	for i := range c.Workloads {
		w := &c.Workloads[i]
		rw := &registry.Workload{
			Name: w.Name, Namespace: w.Namespace, ServiceAccount: w.ServiceAccount, Node: w.Node,
			Labels: w.Labels, InMesh: w.InMesh(), ProbePorts: w.ProbePorts, CaptureLinks: links[i],
		}
		rw.Addresses = append(rw.Addresses, w.Addresses...)
		if w.PeerAuthentication == "STRICT" {
			rw.PeerAuth = registry.Strict
		}
		for port, mode := range w.portModes {
			if rw.PortPeerAuth == nil {
				rw.PortPeerAuth = make(map[uint16]registry.PeerAuth, len(w.portModes))
			}
			rw.PortPeerAuth[port] = registry.Permissive
			if mode == "STRICT" {
				rw.PortPeerAuth[port] = registry.Strict
			}
		}
		m.Workloads = append(m.Workloads, rw)
	}
	for i := range c.Services {
		s := &c.Services[i]
		rs := &registry.Service{
			Name: s.Name, Namespace: s.Namespace, Hostname: s.Hostname, Selector: s.Selector,
			PreferSameNode: s.TrafficDistribution == "PreferSameNode",
		}
		rs.VIPs = append(rs.VIPs, s.VIPs...)
		for _, p := range s.Ports {
			rs.Ports = append(rs.Ports, registry.ServicePort{Name: p.Name, Port: p.Port, TargetPort: p.TargetPort})
		}
		for _, ref := range s.Workloads {
			rs.Workloads = append(rs.Workloads, workloadRef(s.Namespace, ref))
		}
		m.Services = append(m.Services, rs)
	}
	snap, err := registry.Build(m)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", c.Path, err)
	}
	return snap, nil
}

// captureLinks returns, by index of c.Workloads, the capture links of each
// mesh workload on its node: the one it names as its captureLink or, if it
// names none, those of its node's captureLinks that no mesh workload of
// the node names. The links of a workload may carry its addresses as
// sources; any other source that arrives on a capture link is spoofed and
// dropped.
func (c *Config) captureLinks() [][]string {
	named := map[[2]string]bool{} // node, link
	for i := range c.Workloads {
		if w := &c.Workloads[i]; w.InMesh() && w.CaptureLink != "" {
			named[[2]string{w.Node, w.CaptureLink}] = true
		}
	}
	unnamed := map[string][]string{} // node → links no workload names
	for i := range c.Nodes {
		n := &c.Nodes[i]
		for _, l := range n.CaptureLinks {
			if !named[[2]string{n.Name, l}] {
				unnamed[n.Name] = append(unnamed[n.Name], l)
			}
		}
	}
	out := make([][]string, len(c.Workloads))
	for i := range c.Workloads {
		w := &c.Workloads[i]
		switch {
		case !w.InMesh():
		case w.CaptureLink != "":
			out[i] = []string{w.CaptureLink}
		default:
			out[i] = unnamed[w.Node]
		}
	}
	return out
}
