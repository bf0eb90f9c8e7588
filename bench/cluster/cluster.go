// Package cluster builds a small, sealed Kubernetes-like network out of
// Linux network namespaces, for end-to-end tests, benchmarks and the demo.
//
// Topology for a Spec with N nodes, P pods per node and the external host:
//
//	fabric netns: bridge br0, one port per node/external (n<i>, ext)
//	node i netns:  eth0 198.18.0.(10+i)/24  fd00:6d74::(10+i)/64, forwarding on
//	               vp<i>p<j> 198.18.i.1/32  fd00:6d74:i::1/128 (one per pod)
//	               198.18.i.(10+j)/32, fd00:6d74:i::(10+j)/128 dev vp<i>p<j>
//	               198.18.k.0/24 via 198.18.0.(10+k), fd00:6d74:k::/64 via fd00:6d74::(10+k)
//	pod j netns:   eth0 198.18.i.(10+j)/32  fd00:6d74:i::(10+j)/128
//	               default via 198.18.i.1 / fd00:6d74:i::1 dev eth0 onlink
//	external:      eth0 198.18.0.100/24 fd00:6d74::100/64, pod ranges via nodes
//	control:       eth0 198.18.0.101/24 fd00:6d74::101/64 (Spec.Control; no
//	               route to pods: it serves the nodes, e.g. `meshtun ca`)
//
// IPv6 groups are written with the same decimal digits as the IPv4 octets
// (node 1's pod 2 is 198.18.1.12 and fd00:6d74:1::12). Nothing connects the
// cluster to the root namespace. Every namespace is named
// mt-<pid>-<run>[-<name>]-<role> under /run/netns, so `ip netns exec` works
// on it and CleanupStale can recognise leftovers of dead processes.
package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"time"

	"github.com/rs/zerolog"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// Limits of the addressing plan: node uplinks are .11–.99 (.100 is the
// external host) and pods .11–.254 of their node's /24.
const (
	MaxNodes       = 89
	MaxPodsPerNode = 244
)

// linkName is the name of the uplink of nodes and the external host and of
// the pod end of a pod's veth pair.
const linkName = "eth0"

// Spec describes the cluster to build.
type Spec struct {
	// Name is an optional short tag (up to 8 lowercase letters or digits)
	// that appears in namespace names.
	Name string
	// Nodes is the number of nodes, 1 to MaxNodes.
	Nodes int
	// PodsPerNode is the number of pods on each node, 0 to MaxPodsPerNode.
	PodsPerNode int
	// NoExternal leaves out the external host.
	NoExternal bool
	// Control adds the control-plane host, a namespace on the fabric that
	// reaches the nodes' uplinks only (for `meshtun ca`).
	Control bool
	// Log receives progress messages; the zero value discards them.
	Log zerolog.Logger
}

// Cluster is a built topology. Close tears it down.
type Cluster struct {
	// Name is the prefix shared by all of the cluster's namespace names.
	Name string
	// Fabric holds the bridge that joins the nodes and the external host.
	Fabric *NS
	// Nodes are in index order: Nodes[0] is node 1.
	Nodes []*Node
	// External is the host outside the cluster, nil with Spec.NoExternal.
	External *Host
	// Control is the control-plane host, nil without Spec.Control.
	Control *Host

	log     zerolog.Logger
	procs   *procTable
	created []string // namespace names, in creation order
	pods    map[string]*Pod

	closeOnce sync.Once
	closeErr  error
}

// Node is a cluster node: a namespace with an uplink to the fabric and one
// veth pair per pod.
type Node struct {
	*NS
	// Index is the 1-based node number.
	Index int
	// Uplink is the name of the node's interface on the fabric.
	Uplink string
	// IPv4 and IPv6 are the node's uplink addresses.
	IPv4, IPv6 netip.Addr
	// Gateway4 and Gateway6 are the addresses every pod link of the node
	// carries and that the pods use as default gateway.
	Gateway4, Gateway6 netip.Addr
	// PodPrefix4 and PodPrefix6 hold the node's pod addresses; other nodes
	// and the external host route them to this node.
	PodPrefix4, PodPrefix6 netip.Prefix
	// Pods are in index order: Pods[0] is pod 1.
	Pods []*Pod
}

// Pod is a pod: a namespace with eth0 on a veth pair whose other end,
// HostLink, is in its node.
type Pod struct {
	*NS
	// ID is "n<node>p<pod>", e.g. "n1p2"; it ends the namespace name.
	ID string
	// Index is the 1-based pod number within its node.
	Index int
	// Node is the node the pod runs on.
	Node *Node
	// IPv4 and IPv6 are the pod's addresses.
	IPv4, IPv6 netip.Addr
	// Link is the pod's interface name.
	Link string
	// HostLink is the name of the node end of the pod's veth pair.
	HostLink string
}

// Host is the external host: a namespace on the fabric outside the cluster.
type Host struct {
	*NS
	// Uplink is the name of the host's interface on the fabric.
	Uplink string
	// IPv4 and IPv6 are the host's addresses.
	IPv4, IPv6 netip.Addr
}

// addr4 and addr6 build addresses of the plan: IPv4 198.18.<sub>.<host>
// and IPv6 fd00:6d74:<sub>::<host>, the IPv6 groups spelled with the same
// decimal digits as the IPv4 octets.
func addr4(sub, host int) netip.Addr {
	return netip.AddrFrom4([4]byte{198, 18, byte(sub), byte(host)})
}

func addr6(sub, host int) netip.Addr {
	s := fmt.Sprintf("fd00:6d74:%d::%d", sub, host)
	if sub == 0 {
		s = fmt.Sprintf("fd00:6d74::%d", host)
	}
	return netip.MustParseAddr(s)
}

func (s Spec) validate() error {
	if len(s.Name) > 8 {
		return fmt.Errorf("spec name %q: longer than 8 characters", s.Name)
	}
	for _, r := range s.Name {
		if (r < 'a' || r > 'z') && (r < '0' || r > '9') {
			return fmt.Errorf("spec name %q: only lowercase letters and digits are allowed", s.Name)
		}
	}
	if s.Nodes < 1 || s.Nodes > MaxNodes {
		return fmt.Errorf("spec nodes %d: want 1 to %d", s.Nodes, MaxNodes)
	}
	if s.PodsPerNode < 0 || s.PodsPerNode > MaxPodsPerNode {
		return fmt.Errorf("spec pods per node %d: want 0 to %d", s.PodsPerNode, MaxPodsPerNode)
	}
	return nil
}

// New builds the cluster described by spec. It first removes stale
// namespaces of dead processes (CleanupStale). On error everything it
// created is removed again. It needs root (CAP_SYS_ADMIN and
// CAP_NET_ADMIN); see Preflight.
func New(ctx context.Context, spec Spec) (*Cluster, error) {
	if err := spec.validate(); err != nil {
		return nil, fmt.Errorf("cluster: %w", err)
	}
	log := spec.Log
	removed, err := CleanupStale()
	for _, name := range removed {
		log.Info().Str("netns", name).Msg("cluster: removed stale namespace of a dead process")
	}
	if err != nil {
		log.Warn().Err(err).Msg("cluster: could not remove all stale namespaces")
	}
	if err := prepareNetnsDir(); err != nil {
		return nil, fmt.Errorf("cluster: %w", err)
	}
	c := &Cluster{
		Name:  runPrefix(spec.Name),
		log:   log,
		procs: &procTable{},
		pods:  map[string]*Pod{},
	}
	if err := c.build(ctx, spec); err != nil {
		return nil, errors.Join(fmt.Errorf("cluster %s: %w", c.Name, err), c.Close())
	}
	log.Info().Str("cluster", c.Name).Int("nodes", spec.Nodes).Int("pods_per_node", spec.PodsPerNode).
		Bool("external", !spec.NoExternal).Msg("cluster: up")
	return c, nil
}

// newNS creates a named namespace "<cluster>-<role>" and records it for
// Close.
func (c *Cluster) newNS(role string) (*NS, error) {
	name := c.Name + "-" + role
	if err := createNamed(name); err != nil {
		return nil, err
	}
	c.created = append(c.created, name)
	c.log.Debug().Str("netns", name).Msg("cluster: created namespace")
	return &NS{name: name, procs: c.procs}, nil
}

func (c *Cluster) build(ctx context.Context, spec Spec) error {
	// Namespaces first, so that every later step can fail cleanly.
	var err error
	if c.Fabric, err = c.newNS("fab"); err != nil {
		return err
	}
	for i := 1; i <= spec.Nodes; i++ {
		ns, err := c.newNS(fmt.Sprintf("n%d", i))
		if err != nil {
			return err
		}
		n := &Node{
			NS:         ns,
			Index:      i,
			Uplink:     linkName,
			IPv4:       addr4(0, 10+i),
			IPv6:       addr6(0, 10+i),
			Gateway4:   addr4(i, 1),
			Gateway6:   addr6(i, 1),
			PodPrefix4: netip.PrefixFrom(addr4(i, 0), 24),
			PodPrefix6: netip.PrefixFrom(addr6(i, 0), 64),
		}
		c.Nodes = append(c.Nodes, n)
		for j := 1; j <= spec.PodsPerNode; j++ {
			name := fmt.Sprintf("n%dp%d", i, j)
			ns, err := c.newNS(name)
			if err != nil {
				return err
			}
			p := &Pod{
				NS:       ns,
				ID:       name,
				Index:    j,
				Node:     n,
				IPv4:     addr4(i, 10+j),
				IPv6:     addr6(i, 10+j),
				Link:     linkName,
				HostLink: fmt.Sprintf("vp%dp%d", i, j),
			}
			n.Pods = append(n.Pods, p)
			c.pods[name] = p
		}
	}
	if !spec.NoExternal {
		ns, err := c.newNS("ext")
		if err != nil {
			return err
		}
		c.External = &Host{NS: ns, Uplink: linkName, IPv4: addr4(0, 100), IPv6: addr6(0, 100)}
	}
	if spec.Control {
		ns, err := c.newNS("ctl")
		if err != nil {
			return err
		}
		c.Control = &Host{NS: ns, Uplink: linkName, IPv4: addr4(0, 101), IPv6: addr6(0, 101)}
	}
	if err := ctx.Err(); err != nil {
		return err
	}

	// Sysctls before any interface exists, so that new interfaces inherit
	// the "default" settings.
	if err := c.Fabric.setSysctls(
		"net.ipv6.conf.all.disable_ipv6", "1",
		"net.ipv6.conf.default.disable_ipv6", "1",
	); err != nil {
		return err
	}
	quiet := []string{ // no router advertisements, autoconf or DAD
		"net.ipv6.conf.all.accept_ra", "0",
		"net.ipv6.conf.default.accept_ra", "0",
		"net.ipv6.conf.all.autoconf", "0",
		"net.ipv6.conf.default.autoconf", "0",
		"net.ipv6.conf.all.accept_dad", "0",
		"net.ipv6.conf.default.accept_dad", "0",
	}
	for _, n := range c.Nodes {
		kv := append(append([]string{}, quiet...),
			"net.ipv4.ip_forward", "1",
			"net.ipv6.conf.all.forwarding", "1",
		)
		if err := n.setSysctls(kv...); err != nil {
			return err
		}
		for _, p := range n.Pods {
			if err := p.setSysctls(quiet...); err != nil {
				return err
			}
		}
	}
	for _, h := range []*Host{c.External, c.Control} {
		if h == nil {
			continue
		}
		if err := h.setSysctls(quiet...); err != nil {
			return err
		}
	}
	if err := ctx.Err(); err != nil {
		return err
	}

	b := &builder{handles: map[*NS]*netlink.Handle{}}
	defer b.close()
	if err := c.wire(ctx, b); err != nil {
		return err
	}
	return c.settle(ctx, b)
}

// settleTimeout bounds the wait for the kernel to finish IPv6 address
// setup.
const settleTimeout = 10 * time.Second

// settle waits until the kernel has finished setting up the IPv6 addresses
// of every namespace. The kernel completes an address (even a nodad one)
// on a workqueue: its local route, and on a router its subnet anycast
// route, appear shortly after the address itself; link-local addresses
// appear once the link has carrier. Waiting here makes routing snapshots
// taken right after New stable and every address usable at once.
func (c *Cluster) settle(ctx context.Context, b *builder) error {
	ctx, cancel := context.WithTimeout(ctx, settleTimeout)
	defer cancel()
	var todo []*NS
	routers := map[*NS]bool{}
	for _, n := range c.Nodes {
		todo = append(todo, n.NS)
		routers[n.NS] = true
		for _, p := range n.Pods {
			todo = append(todo, p.NS)
		}
	}
	if c.Control != nil {
		todo = append(todo, c.Control.NS)
	}
	if c.External != nil {
		todo = append(todo, c.External.NS)
	}
	for _, ns := range todo {
		for wait := time.Millisecond; ; wait = min(2*wait, 50*time.Millisecond) {
			pending, err := b.pending6(ns, routers[ns])
			if err != nil {
				return err
			}
			if pending == "" {
				break
			}
			t := time.NewTimer(wait)
			select {
			case <-ctx.Done():
				t.Stop()
				return fmt.Errorf("netns %s: IPv6 setup did not finish: %s: %w", ns.name, pending, ctx.Err())
			case <-t.C:
			}
		}
	}
	return nil
}

// wire creates the interfaces, addresses and routes.
func (c *Cluster) wire(ctx context.Context, b *builder) error {
	all := []*NS{c.Fabric}
	for _, n := range c.Nodes {
		all = append(all, n.NS)
		for _, p := range n.Pods {
			all = append(all, p.NS)
		}
	}
	if c.External != nil {
		all = append(all, c.External.NS)
	}
	if c.Control != nil {
		all = append(all, c.Control.NS)
	}
	for _, ns := range all {
		if err := b.up(ns, "lo"); err != nil {
			return err
		}
	}

	// Fabric bridge. Multicast snooping off: IPv6 neighbour discovery must
	// not depend on MLD reports having been seen.
	snoop := false
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "br0"}, MulticastSnooping: &snoop}
	fab, err := b.handle(c.Fabric)
	if err != nil {
		return err
	}
	if err := fab.LinkAdd(br); err != nil {
		return fmt.Errorf("netns %s: add bridge br0: %w", c.Fabric.name, err)
	}
	if err := b.up(c.Fabric, "br0"); err != nil {
		return err
	}
	brLink, err := fab.LinkByName("br0")
	if err != nil {
		return fmt.Errorf("netns %s: find bridge br0: %w", c.Fabric.name, err)
	}
	uplink := func(ns *NS, port string, v4, v6 netip.Addr) error {
		if err := b.veth(c.Fabric, port, brLink.Attrs().Index, ns, linkName); err != nil {
			return err
		}
		return b.addrs(ns, linkName, 0, netip.PrefixFrom(v4, 24), netip.PrefixFrom(v6, 64))
	}

	for _, n := range c.Nodes {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := uplink(n.NS, fmt.Sprintf("n%d", n.Index), n.IPv4, n.IPv6); err != nil {
			return err
		}
		for _, p := range n.Pods {
			if err := b.veth(n.NS, p.HostLink, 0, p.NS, p.Link); err != nil {
				return err
			}
			if err := b.addrs(n.NS, p.HostLink, unix.IFA_F_NOPREFIXROUTE,
				netip.PrefixFrom(n.Gateway4, 32), netip.PrefixFrom(n.Gateway6, 128)); err != nil {
				return err
			}
			if err := b.addrs(p.NS, p.Link, unix.IFA_F_NOPREFIXROUTE,
				netip.PrefixFrom(p.IPv4, 32), netip.PrefixFrom(p.IPv6, 128)); err != nil {
				return err
			}
			for _, a := range []netip.Addr{p.IPv4, p.IPv6} {
				if err := b.route(n.NS, p.HostLink, netip.PrefixFrom(a, a.BitLen()), netip.Addr{}, false); err != nil {
					return err
				}
			}
			for _, gw := range []netip.Addr{n.Gateway4, n.Gateway6} {
				if err := b.route(p.NS, p.Link, netip.Prefix{}, gw, true); err != nil {
					return err
				}
			}
		}
	}
	if c.External != nil {
		h := c.External
		if err := uplink(h.NS, "ext", h.IPv4, h.IPv6); err != nil {
			return err
		}
	}
	if c.Control != nil {
		h := c.Control
		if err := uplink(h.NS, "ctl", h.IPv4, h.IPv6); err != nil {
			return err
		}
	}

	// Pod ranges of each node, routed via that node's uplink address.
	for _, n := range c.Nodes {
		var peers []*NS
		for _, m := range c.Nodes {
			if m != n {
				peers = append(peers, m.NS)
			}
		}
		if c.External != nil {
			peers = append(peers, c.External.NS)
		}
		for _, ns := range peers {
			if err := b.route(ns, linkName, n.PodPrefix4, n.IPv4, false); err != nil {
				return err
			}
			if err := b.route(ns, linkName, n.PodPrefix6, n.IPv6, false); err != nil {
				return err
			}
		}
	}
	return nil
}

// Pod returns the pod with this ID ("n<node>p<pod>"), or nil.
func (c *Cluster) Pod(id string) *Pod { return c.pods[id] }

// Pods returns all pods, node by node.
func (c *Cluster) Pods() []*Pod {
	var out []*Pod
	for _, n := range c.Nodes {
		out = append(out, n.Pods...)
	}
	return out
}

// Namespaces returns the names of all of the cluster's namespaces, in
// creation order.
func (c *Cluster) Namespaces() []string {
	return append([]string(nil), c.created...)
}

// Close stops the processes started in the cluster (SIGTERM, SIGKILL after
// two seconds) and deletes its namespaces, which removes their interfaces,
// addresses and routes. Sockets opened in a namespace keep that namespace
// alive, unnamed, until they are closed. Close is idempotent and safe on a
// partly built cluster; later calls return the first call's result.
func (c *Cluster) Close() error {
	c.closeOnce.Do(func() {
		errs := []error{c.procs.stopAll(stopGrace)}
		for i := len(c.created) - 1; i >= 0; i-- {
			if err := deleteNamed(c.created[i]); err != nil {
				errs = append(errs, err)
			}
		}
		c.closeErr = errors.Join(errs...)
		if c.closeErr != nil {
			c.log.Warn().Err(c.closeErr).Str("cluster", c.Name).Msg("cluster: close")
		} else {
			c.log.Debug().Str("cluster", c.Name).Msg("cluster: closed")
		}
	})
	return c.closeErr
}

// builder holds netlink handles per namespace while a cluster is wired.
type builder struct {
	handles map[*NS]*netlink.Handle
}

func (b *builder) close() {
	for _, h := range b.handles {
		h.Close()
	}
}

func (b *builder) handle(ns *NS) (*netlink.Handle, error) {
	if h, ok := b.handles[ns]; ok {
		return h, nil
	}
	h, err := ns.handle()
	if err != nil {
		return nil, err
	}
	b.handles[ns] = h
	return h, nil
}

func (b *builder) link(ns *NS, name string) (*netlink.Handle, netlink.Link, error) {
	h, err := b.handle(ns)
	if err != nil {
		return nil, nil, err
	}
	l, err := h.LinkByName(name)
	if err != nil {
		return nil, nil, fmt.Errorf("netns %s: find link %s: %w", ns.name, name, err)
	}
	return h, l, nil
}

func (b *builder) up(ns *NS, name string) error {
	h, l, err := b.link(ns, name)
	if err != nil {
		return err
	}
	if err := h.LinkSetUp(l); err != nil {
		return fmt.Errorf("netns %s: set %s up: %w", ns.name, name, err)
	}
	return nil
}

// veth creates a veth pair with end aName in a (enslaved to master if that
// is not 0) and end bName in b, and sets both up. The pair is created in a
// with its peer placed directly in b, so it never exists anywhere else.
func (b *builder) veth(a *NS, aName string, master int, bNS *NS, bName string) error {
	h, err := b.handle(a)
	if err != nil {
		return err
	}
	fd, err := netns.GetFromName(bNS.name)
	if err != nil {
		return fmt.Errorf("netns %s: open: %w", bNS.name, err)
	}
	defer fd.Close()
	v := &netlink.Veth{
		LinkAttrs:     netlink.LinkAttrs{Name: aName, MasterIndex: master},
		PeerName:      bName,
		PeerNamespace: netlink.NsFd(fd),
	}
	if err := h.LinkAdd(v); err != nil {
		return fmt.Errorf("netns %s: add veth %s with peer %s in %s: %w", a.name, aName, bName, bNS.name, err)
	}
	if err := b.up(a, aName); err != nil {
		return err
	}
	return b.up(bNS, bName)
}

// pending6 describes the first unfinished piece of IPv6 setup in ns, or
// returns "" if there is none: every up link other than lo has a link-local
// address, every IPv6 address has its local route and, on a router, every
// address shorter than /128 has its subnet-router anycast route.
func (b *builder) pending6(ns *NS, router bool) (string, error) {
	h, err := b.handle(ns)
	if err != nil {
		return "", err
	}
	routes, err := h.RouteListFiltered(unix.AF_INET6, &netlink.Route{Table: unix.RT_TABLE_LOCAL}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return "", fmt.Errorf("netns %s: list local IPv6 routes: %w", ns.name, err)
	}
	type key struct {
		typ   int
		dst   netip.Addr
		index int
	}
	have := map[key]bool{}
	for _, r := range routes {
		if r.Dst == nil {
			continue
		}
		if a, ok := netip.AddrFromSlice(r.Dst.IP); ok {
			have[key{r.Type, a, r.LinkIndex}] = true
		}
	}
	links, err := h.LinkList()
	if err != nil {
		return "", fmt.Errorf("netns %s: list links: %w", ns.name, err)
	}
	for _, l := range links {
		at := l.Attrs()
		if at.Name == "lo" || at.Flags&net.FlagUp == 0 {
			continue
		}
		addrs, err := h.AddrList(l, netlink.FAMILY_V6)
		if err != nil {
			return "", fmt.Errorf("netns %s: list addresses of %s: %w", ns.name, at.Name, err)
		}
		linkLocal := false
		for _, a := range addrs {
			p, ok := netipPrefix(a.IPNet)
			if !ok {
				continue
			}
			if p.Addr().IsLinkLocalUnicast() {
				linkLocal = true
			}
			if a.Flags&unix.IFA_F_TENTATIVE != 0 {
				return fmt.Sprintf("%s on %s is tentative", p, at.Name), nil
			}
			if !have[key{unix.RTN_LOCAL, p.Addr(), at.Index}] {
				return fmt.Sprintf("no local route for %s on %s", p, at.Name), nil
			}
			if router && p.Bits() < 128 && !have[key{unix.RTN_ANYCAST, p.Masked().Addr(), at.Index}] {
				return fmt.Sprintf("no anycast route for %s on %s", p.Masked(), at.Name), nil
			}
		}
		if !linkLocal {
			return fmt.Sprintf("no link-local address on %s", at.Name), nil
		}
	}
	return "", nil
}

func netipPrefix(n *net.IPNet) (netip.Prefix, bool) {
	if n == nil {
		return netip.Prefix{}, false
	}
	a, ok := netip.AddrFromSlice(n.IP)
	if !ok {
		return netip.Prefix{}, false
	}
	ones, _ := n.Mask.Size()
	return netip.PrefixFrom(a.Unmap(), ones), true
}

// addrs adds addresses to a link, without duplicate address detection.
func (b *builder) addrs(ns *NS, name string, flags int, prefixes ...netip.Prefix) error {
	h, l, err := b.link(ns, name)
	if err != nil {
		return err
	}
	for _, p := range prefixes {
		a := &netlink.Addr{IPNet: ipNet(p), Flags: flags}
		if p.Addr().Is6() {
			a.Flags |= unix.IFA_F_NODAD
		}
		if err := h.AddrAdd(l, a); err != nil {
			return fmt.Errorf("netns %s: add address %s to %s: %w", ns.name, p, name, err)
		}
	}
	return nil
}

// route adds a route out of link name: to dst (the default route if dst is
// the zero Prefix, then gw's family), via gw if it is valid.
func (b *builder) route(ns *NS, name string, dst netip.Prefix, gw netip.Addr, onlink bool) error {
	h, l, err := b.link(ns, name)
	if err != nil {
		return err
	}
	r := &netlink.Route{LinkIndex: l.Attrs().Index}
	switch {
	case dst.IsValid():
		r.Dst = ipNet(dst)
	case gw.Is4():
		r.Dst = ipNet(netip.PrefixFrom(netip.IPv4Unspecified(), 0))
	default:
		r.Dst = ipNet(netip.PrefixFrom(netip.IPv6Unspecified(), 0))
	}
	if gw.IsValid() {
		r.Gw = gw.AsSlice()
	} else {
		r.Scope = netlink.SCOPE_LINK
	}
	if onlink {
		r.Flags = int(netlink.FLAG_ONLINK)
	}
	if err := h.RouteAdd(r); err != nil {
		return fmt.Errorf("netns %s: add route %s via %s dev %s: %w", ns.name, r.Dst, gw, name, err)
	}
	return nil
}

func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}
