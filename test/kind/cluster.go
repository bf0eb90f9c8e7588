package kind

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"
)

// Service CIDRs of a dual-stack kind cluster (kind's defaults).
var ServiceCIDRs = []string{"10.96.0.0/16", "fd00:10:96::/112"}

// Cluster is a running kind cluster on podman.
type Cluster struct {
	Name       string // kind cluster name
	Network    string // podman network the nodes are on
	Bridge     string // its Linux bridge on this host
	Kubeconfig string
	Tools      Toolchain
	dir        string
	logf       Logf
}

// Options of Create.
type Options struct {
	Name   string // kind cluster name, unique per run
	Image  string // node image (AssembleNodeImage)
	Config string // the kind cluster config (deploy/kind/cluster.yaml)
	Dir    string // where the kubeconfig and generated files go
}

// containersConf is the podman configuration of the cluster (CONTAINERS_CONF):
// this host is cgroup v1 (hybrid) and lacks CAP_SYS_RESOURCE, so crun is
// refused and the default rlimits cannot be raised (docs/kind.md).
const containersConf = `[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]

[engine]
runtime = "runc"
`

// Env is the environment kind and podman run with.
func (c *Cluster) Env() []string {
	return append(os.Environ(),
		"KIND_EXPERIMENTAL_PROVIDER=podman",
		"KIND_EXPERIMENTAL_PODMAN_NETWORK="+c.Network,
		"CONTAINERS_CONF="+filepath.Join(c.dir, "containers.conf"),
		"PATH="+c.Tools.Kube+":"+os.Getenv("PATH"),
	)
}

func (c *Cluster) run(ctx context.Context, name string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, name, args...)
	cmd.Env = c.Env()
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.Bytes(), fmt.Errorf("%s %s: %w\n%s", filepath.Base(name), strings.Join(args, " "), err, tail(errb.Bytes(), 3000))
	}
	return out.Bytes(), nil
}

// Kubectl runs kubectl against the cluster.
func (c *Cluster) Kubectl(ctx context.Context, args ...string) ([]byte, error) {
	return c.run(ctx, c.Tools.Kubectl(), append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
}

// KubectlIn runs kubectl with stdin.
func (c *Cluster) KubectlIn(ctx context.Context, stdin string, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, c.Tools.Kubectl(), append([]string{"--kubeconfig", c.Kubeconfig}, args...)...)
	cmd.Env = c.Env()
	cmd.Stdin = strings.NewReader(stdin)
	out, err := cmd.CombinedOutput()
	if err != nil {
		return out, fmt.Errorf("kubectl %s: %w\n%s", strings.Join(args, " "), err, tail(out, 3000))
	}
	return out, nil
}

// Podman runs podman with the cluster's configuration.
func (c *Cluster) Podman(ctx context.Context, args ...string) ([]byte, error) {
	return c.run(ctx, "podman", args...)
}

// Kind runs the kind binary.
func (c *Cluster) Kind(ctx context.Context, args ...string) ([]byte, error) {
	return c.run(ctx, filepath.Join(c.Tools.Kind, "kind"), args...)
}

// Create makes the podman network and the kind cluster, gives the nodes
// their pod network and waits until every node is Ready. On error the
// returned Cluster (if not nil) holds what was made, for Delete.
func Create(ctx context.Context, logf Logf, t Toolchain, o Options) (*Cluster, error) {
	c := &Cluster{Name: o.Name, Network: o.Name, Tools: t, dir: o.Dir, logf: logf,
		Kubeconfig: filepath.Join(o.Dir, "kubeconfig")}
	if err := os.MkdirAll(o.Dir, 0o755); err != nil {
		return nil, err
	}
	// kind mounts /lib/modules into every node.
	if err := os.MkdirAll("/lib/modules", 0o755); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(o.Dir, "containers.conf"), []byte(containersConf), 0o644); err != nil {
		return nil, err
	}
	cfg, err := clusterConfig(o.Config)
	if err != nil {
		return nil, err
	}
	cfgPath := filepath.Join(o.Dir, "cluster.yaml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	// An internal network: no NAT, no default route, nothing leaves the
	// machine.
	if _, err := c.Podman(ctx, "network", "create", "--internal", "--ipv6", c.Network); err != nil {
		return nil, err
	}
	out, err := c.Podman(ctx, "network", "inspect", c.Network, "--format", "{{.NetworkInterface}}")
	if err != nil {
		return c, err
	}
	c.Bridge = strings.TrimSpace(string(out))
	start := time.Now()
	logf("kind create cluster %s (image %s, network %s on %s)", c.Name, o.Image, c.Network, c.Bridge)
	if _, err := c.Kind(ctx, "create", "cluster", "--name", c.Name, "--image", o.Image, "--config", cfgPath,
		"--kubeconfig", c.Kubeconfig, "--wait", "0s"); err != nil {
		return c, err
	}
	logf("kind create cluster %s: %s", c.Name, time.Since(start).Round(time.Second))
	// kind's kubeconfig names a port podman publishes on 127.0.0.1, which an
	// internal network does not forward: talk to the API server on the
	// control-plane node's own address instead (in its certificate).
	if err := c.useNodeAddress(ctx); err != nil {
		return c, err
	}
	nodes, err := c.allNodes(ctx)
	if err != nil {
		return c, err
	}
	if err := c.PlayKindnet(ctx, nodes); err != nil {
		return c, err
	}
	if _, err := c.Kubectl(ctx, "wait", "--for=condition=Ready", "nodes", "--all", "--timeout=10m"); err != nil {
		return c, err
	}
	if _, err := c.Kubectl(ctx, "-n", "kube-system", "rollout", "status", "deploy/coredns", "--timeout=10m"); err != nil {
		return c, err
	}
	logf("cluster %s ready after %s", c.Name, time.Since(start).Round(time.Second))
	return c, nil
}

// allNodes waits until every node kind made is registered with the API
// server with its pod CIDRs, and returns them: kind create can return
// before a joining kubelet has registered (seen on a loaded machine: the
// second worker registered minutes later, and got no pod network).
func (c *Cluster) allNodes(ctx context.Context) ([]Node, error) {
	out, err := c.Podman(ctx, "ps", "--filter", "label=io.x-k8s.kind.cluster="+c.Name, "--format", "{{.Names}}")
	if err != nil {
		return nil, err
	}
	want := len(strings.Fields(string(out)))
	deadline := time.Now().Add(10 * time.Minute)
	for {
		nodes, err := c.Nodes(ctx)
		ready := 0
		for _, n := range nodes {
			if len(n.PodCIDRs) > 0 {
				ready++
			}
		}
		if err == nil && ready == want {
			return nodes, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("cluster %s: %d of the %d nodes kind made are registered with pod CIDRs after 10 minutes (%v)", c.Name, ready, want, err)
		}
		select {
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-time.After(2 * time.Second): // the kubelets register on their own; the API has no signal to block on here
		}
	}
}

// useNodeAddress points the kubeconfig at the control-plane node's IPv4
// address on the podman network.
func (c *Cluster) useNodeAddress(ctx context.Context) error {
	out, err := c.Podman(ctx, "inspect", c.Name+"-control-plane", "--format", "{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}")
	if err != nil {
		return err
	}
	ip, err := netip.ParseAddr(strings.TrimSpace(string(out)))
	if err != nil {
		return fmt.Errorf("address of %s-control-plane %q: %w", c.Name, out, err)
	}
	kc, err := os.ReadFile(c.Kubeconfig)
	if err != nil {
		return err
	}
	var lines []string
	n := 0
	for _, l := range strings.Split(string(kc), "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), "server: https://") {
			l = l[:strings.Index(l, "server:")] + "server: https://" + netip.AddrPortFrom(ip, 6443).String()
			n++
		}
		lines = append(lines, l)
	}
	if n != 1 {
		return fmt.Errorf("%s: %d server lines, want 1", c.Kubeconfig, n)
	}
	return os.WriteFile(c.Kubeconfig, []byte(strings.Join(lines, "\n")), 0o600)
}

// clusterConfig is the user's kind config with what this machine needs
// added: the kubelet accepts cgroup v1. The name comes from --name.
func clusterConfig(path string) (string, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", err
	}
	var keep []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(l, "name:") {
			continue
		}
		if strings.HasPrefix(l, "kubeadmConfigPatches:") {
			return "", fmt.Errorf("%s: has kubeadmConfigPatches already; the harness adds its own", path)
		}
		keep = append(keep, l)
	}
	return strings.Join(keep, "\n") + `
# added by test/kind: this host is cgroup v1; and it is shared by many
# builds (load 60-120 on 2 cores was seen): kubeadm's default timeouts
# (4 min for the control plane, 1 min per API call) failed kind create
# three times in a row in "wait-control-plane".
kubeadmConfigPatches:
  - |
    kind: KubeletConfiguration
    failCgroupV1: false
  - |
    kind: InitConfiguration
    timeouts:
      controlPlaneComponentHealthCheck: 10m0s
      kubeletHealthCheck: 10m0s
      kubernetesAPICall: 5m0s
      etcdAPICall: 5m0s
  - |
    kind: JoinConfiguration
    timeouts:
      controlPlaneComponentHealthCheck: 10m0s
      kubeletHealthCheck: 10m0s
      kubernetesAPICall: 5m0s
      etcdAPICall: 5m0s
      tlsBootstrap: 10m0s
      discovery: 10m0s
`, nil
}

// Node is a kind node as the API server knows it.
type Node struct {
	Name     string
	IPs      []netip.Addr
	PodCIDRs []netip.Prefix
}

// Nodes lists the cluster's nodes with their addresses and pod CIDRs.
func (c *Cluster) Nodes(ctx context.Context) ([]Node, error) {
	out, err := c.Kubectl(ctx, "get", "nodes", "-o", "json")
	if err != nil {
		return nil, err
	}
	var list struct {
		Items []struct {
			Metadata struct{ Name string }
			Spec     struct{ PodCIDRs []string }
			Status   struct {
				Addresses []struct{ Type, Address string }
			}
		}
	}
	if err := json.Unmarshal(out, &list); err != nil {
		return nil, fmt.Errorf("kubectl get nodes: %w", err)
	}
	var nodes []Node
	for _, it := range list.Items {
		n := Node{Name: it.Metadata.Name}
		for _, a := range it.Status.Addresses {
			if a.Type == "InternalIP" {
				ip, err := netip.ParseAddr(a.Address)
				if err != nil {
					return nil, fmt.Errorf("node %s address %q: %w", n.Name, a.Address, err)
				}
				n.IPs = append(n.IPs, ip)
			}
		}
		for _, p := range it.Spec.PodCIDRs {
			pfx, err := netip.ParsePrefix(p)
			if err != nil {
				return nil, fmt.Errorf("node %s pod CIDR %q: %w", n.Name, p, err)
			}
			n.PodCIDRs = append(n.PodCIDRs, pfx)
		}
		nodes = append(nodes, n)
	}
	if len(nodes) == 0 {
		return nil, fmt.Errorf("cluster %s has no nodes", c.Name)
	}
	return nodes, nil
}

// PlayKindnet does on every node what kindnetd does when it starts (and
// again after a node restarts): the routes, and the pod network's CNI
// configuration written anew (WritePodNetwork).
func (c *Cluster) PlayKindnet(ctx context.Context, nodes []Node) error {
	for _, n := range nodes {
		// The node has no default route on an internal network: the API
		// server's Service VIP (and every other) must still route to eth0
		// for kube-proxy's DNAT of the node's own connections.
		for _, cidr := range ServiceCIDRs {
			if _, err := c.Podman(ctx, "exec", n.Name, "ip", "route", "replace", cidr, "dev", "eth0"); err != nil {
				return err
			}
		}
	}
	return c.WritePodNetwork(ctx, nodes)
}

// WritePodNetwork is the part of kindnetd a kind cluster needs, done from
// outside: each node gets a ptp + host-local CNI configuration for its
// spec.podCIDRs (both families) and a route to every other node's pod
// CIDRs through that node's address. Like kindnet, ptp gives each pod a
// veth whose host end carries a /32 (/128) route to the pod, which is what
// meshtun's capture looks for.
func (c *Cluster) WritePodNetwork(ctx context.Context, nodes []Node) error {
	for _, n := range nodes {
		if len(n.PodCIDRs) == 0 {
			return fmt.Errorf("node %s has no spec.podCIDRs", n.Name)
		}
		var ranges []string
		for _, p := range n.PodCIDRs {
			ranges = append(ranges, fmt.Sprintf(`[{"subnet": %q}]`, p.String()))
		}
		conf := fmt.Sprintf(`{
  "cniVersion": "0.4.0",
  "name": "kindnet",
  "plugins": [
    {
      "type": "ptp",
      "ipMasq": false,
      "ipam": {
        "type": "host-local",
        "dataDir": "/run/cni-ipam-state",
        "routes": [{"dst": "0.0.0.0/0"}, {"dst": "::/0"}],
        "ranges": [%s]
      },
      "mtu": 1500
    },
    {"type": "portmap", "capabilities": {"portMappings": true}}
  ]
}
`, strings.Join(ranges, ", "))
		cmd := exec.CommandContext(ctx, "podman", "exec", "-i", n.Name, "sh", "-c",
			"mkdir -p /etc/cni/net.d && cat > /etc/cni/net.d/10-kindnet.conflist.tmp && mv /etc/cni/net.d/10-kindnet.conflist.tmp /etc/cni/net.d/10-kindnet.conflist")
		cmd.Env = c.Env()
		cmd.Stdin = strings.NewReader(conf)
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("write CNI config on %s: %w: %s", n.Name, err, out)
		}
		for _, o := range nodes {
			if o.Name == n.Name {
				continue
			}
			for _, p := range o.PodCIDRs {
				via, ok := sameFamily(o.IPs, p.Addr())
				if !ok {
					return fmt.Errorf("node %s has no address of the family of its pod CIDR %s", o.Name, p)
				}
				if _, err := c.Podman(ctx, "exec", n.Name, "ip", "route", "replace", p.String(), "via", via.String()); err != nil {
					return err
				}
			}
		}
	}
	return nil
}

func sameFamily(ips []netip.Addr, a netip.Addr) (netip.Addr, bool) {
	for _, ip := range ips {
		if ip.Is4() == a.Is4() {
			return ip, true
		}
	}
	return netip.Addr{}, false
}

// Delete removes the cluster and its network: only what Create made.
func (c *Cluster) Delete(ctx context.Context) error {
	var errs []string
	if _, err := c.Kind(ctx, "delete", "cluster", "--name", c.Name, "--kubeconfig", c.Kubeconfig); err != nil {
		errs = append(errs, err.Error())
	}
	if _, err := c.Podman(ctx, "network", "rm", c.Network); err != nil {
		errs = append(errs, err.Error())
	}
	if len(errs) > 0 {
		return fmt.Errorf("delete cluster %s: %s", c.Name, strings.Join(errs, "; "))
	}
	return nil
}

// LoadImage loads a docker-archive into nodes, or every node if none are
// named (kind load image-archive).
func (c *Cluster) LoadImage(ctx context.Context, archive string, nodes ...string) error {
	args := []string{"load", "image-archive", archive, "--name", c.Name}
	if len(nodes) > 0 {
		args = append(args, "--nodes", strings.Join(nodes, ","))
	}
	_, err := c.Kind(ctx, args...)
	return err
}

// Workers are the names of the cluster's two worker nodes (kind's naming).
func (c *Cluster) Workers() []string {
	return []string{c.Name + "-worker", c.Name + "-worker2"}
}
