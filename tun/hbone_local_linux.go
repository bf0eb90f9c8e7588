package tun

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"syscall"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// LocalTable is the routing table of the local-delivery rules: two after
// DefaultTable (0x6d76; 0x6d75 is the spoof table). It holds one route per family, "local
// 0.0.0.0/0 dev lo" and "local ::/0 dev lo", so every packet a rule sends
// there is delivered to a socket of the node.
const LocalTable = DefaultTable + 2

// ErrNoPortRules means the kernel does not match rules on ipproto and
// dport (Linux < 4.17): a rule added with them would match every packet
// to the address, so none is installed.
var ErrNoPortRules = errors.New("tun: the kernel does not match policy rules on ipproto/dport (Linux 4.17 or later needed)")

// LocalDeliveryConfig says which TCP port of which pod addresses the node
// terminates itself.
type LocalDeliveryConfig struct {
	// Port is the TCP destination port delivered locally (HBONE's 15008).
	Port uint16
	// Table is the routing table of the local routes; 0 means LocalTable.
	Table int
	// Priority of the rules; 0 means DefaultPriority-1, the exemptions'
	// priority. The kernel places a rule after the existing rules of the
	// same priority, so when these are installed after InstallRouting they
	// sit after its exemptions (what the TUN writes back to a pod's port
	// 15008, a connection the netstack dials on behalf of a client, still
	// reaches the pod) and before the to-pod capture rules. The rules of
	// the captured links come earlier still (DefaultPriority-3 and -2): a
	// local pod's connection to another local pod's port is captured as
	// before (a spoofed one goes to the spoof table), not delivered here.
	Priority int
	// Pods are the addresses whose Port is delivered locally.
	Pods []netip.Addr
	// Replies, if set, are the local ports of the node's own connections
	// from a pod's address to a peer's Port (outbound HBONE dialled from
	// the client pod's address): a TCP segment from source port Port to a
	// pod's address and one of these ports is delivered locally too. Only
	// this range: a pod's own connection to some server's port Port from
	// another local port keeps its path.
	Replies PortRange
}

// PortRange is an inclusive range of ports; the zero value is none.
type PortRange struct{ Lo, Hi uint16 }

// IsZero reports whether r is no range.
func (r PortRange) IsZero() bool { return r.Lo == 0 && r.Hi == 0 }

// Contains reports whether port p is in r.
func (r PortRange) Contains(p uint16) bool { return !r.IsZero() && p >= r.Lo && p <= r.Hi }

func (r PortRange) String() string { return fmt.Sprintf("%d-%d", r.Lo, r.Hi) }

// LocalDelivery is the set of rules and routes that deliver one TCP port
// of the local pods' addresses to the node's own sockets, while every
// other port of the pods is routed as before:
//
//	ip rule add to <pod> ipproto tcp dport <port> lookup <table>
//	ip rule add to <pod> ipproto tcp sport <port> dport <replies> lookup <table>   (with Replies)
//	ip route add local 0.0.0.0/0 dev lo table <table>
//
// A socket listening on the port with IP_TRANSPARENT (ListenTransparent)
// accepts those connections; its local address is the pod's. No netfilter
// object is involved.
type LocalDelivery struct {
	mu     sync.Mutex
	cfg    LocalDeliveryConfig
	rules  map[netip.Addr][]*netlink.Rule
	routes []*netlink.Route
	fams   map[int]bool // families with a local route
	closed bool
}

// InstallLocalDelivery checks that the kernel honours ipproto/dport in
// policy rules (ErrNoPortRules if not), then installs the local routes and
// one rule per pod address. Install it after InstallRouting (see
// LocalDeliveryConfig.Priority). A family whose local route cannot be added
// (IPv6 disabled) is skipped with its pods; the error of the other family
// is returned. On error nothing stays installed.
func InstallLocalDelivery(cfg LocalDeliveryConfig) (*LocalDelivery, error) {
	if cfg.Port == 0 {
		return nil, errors.New("tun: local delivery needs a port")
	}
	// The kernel refuses a rule's port range that ends at 65535.
	if r := cfg.Replies; !r.IsZero() && (r.Lo == 0 || r.Hi == 65535 || r.Lo > r.Hi || r.Contains(cfg.Port)) {
		return nil, fmt.Errorf("tun: local delivery: reply ports %s: want a range within 1-65534 without %d", r, cfg.Port)
	}
	if cfg.Table == 0 {
		cfg.Table = LocalTable
	}
	if cfg.Priority == 0 {
		cfg.Priority = DefaultPriority - 1
	}
	if err := removeStaleLocal(cfg.Table); err != nil {
		return nil, err
	}
	if err := probePortRules(cfg); err != nil {
		return nil, err
	}
	ld := &LocalDelivery{cfg: cfg, rules: map[netip.Addr][]*netlink.Rule{}, fams: map[int]bool{}}
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return nil, fmt.Errorf("tun: local delivery: %w", err)
	}
	var errs []error
	for _, dst := range []*net.IPNet{
		{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)},
		{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)},
	} {
		rt := &netlink.Route{
			LinkIndex: lo.Attrs().Index, Dst: dst, Table: cfg.Table,
			Type: unix.RTN_LOCAL, Scope: netlink.SCOPE_HOST,
		}
		if err := netlink.RouteAdd(rt); err != nil {
			errs = append(errs, fmt.Errorf("tun: add route local %s dev lo table %d: %w", dst, cfg.Table, err))
			continue
		}
		ld.routes = append(ld.routes, rt)
		ld.fams[addrFamily(dst.IP.To4() == nil)] = true
	}
	if len(ld.routes) == 0 {
		return nil, errors.Join(errs...)
	}
	if err := ld.Update(cfg.Pods); err != nil {
		ld.Close()
		return nil, err
	}
	return ld, nil
}

// probePortRules adds a rule with ipproto and dport that points at the
// (still empty) table, so that it matches nothing, and reads it back: a
// kernel older than 4.17 ignores the attributes it does not know and would
// keep the rule without them.
func probePortRules(cfg LocalDeliveryConfig) error {
	rule := netlink.NewRule()
	rule.Family = unix.AF_INET
	rule.Table = cfg.Table
	rule.Priority = cfg.Priority
	rule.IPProto = unix.IPPROTO_TCP
	rule.Dport = netlink.NewRulePortRange(cfg.Port, cfg.Port)
	if err := netlink.RuleAdd(rule); err != nil {
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP) {
			return fmt.Errorf("%w: %w", ErrNoPortRules, err)
		}
		return fmt.Errorf("tun: add rule %s: %w", rule, err)
	}
	defer netlink.RuleDel(rule)
	got, err := netlink.RuleListFiltered(unix.AF_INET, &netlink.Rule{Table: cfg.Table}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return fmt.Errorf("tun: list rules: %w", err)
	}
	for _, r := range got {
		if r.Dst == nil && r.IPProto == unix.IPPROTO_TCP && r.Dport != nil && *r.Dport == *rule.Dport {
			return nil
		}
	}
	return ErrNoPortRules
}

func addrFamily(is6 bool) int {
	if is6 {
		return unix.AF_INET6
	}
	return unix.AF_INET
}

// Families reports whether IPv4 and IPv6 pods are delivered locally.
func (ld *LocalDelivery) Families() (v4, v6 bool) {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	return ld.fams[unix.AF_INET], ld.fams[unix.AF_INET6]
}

// Covers reports whether a's port is delivered locally.
func (ld *LocalDelivery) Covers(a netip.Addr) bool {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	_, ok := ld.rules[a.Unmap()]
	return ok
}

// Update sets the pod addresses whose port is delivered locally: new rules
// first, then the old ones go. Addresses of a family without a local
// route are left out (their port keeps the capture path).
func (ld *LocalDelivery) Update(pods []netip.Addr) error {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	if ld.closed {
		return errors.New("tun: local delivery already removed")
	}
	var errs []error
	want := make(map[netip.Addr]bool, len(pods))
	for _, a := range pods {
		a = a.Unmap()
		fam := addrFamily(a.Is6())
		if !ld.fams[fam] || want[a] {
			continue
		}
		want[a] = true
		if _, ok := ld.rules[a]; ok {
			continue
		}
		var added []*netlink.Rule
		var err error
		for _, rule := range ld.podRules(a) {
			if err = netlink.RuleAdd(rule); err != nil {
				err = fmt.Errorf("tun: add rule %s: %w", rule, err)
				break
			}
			added = append(added, rule)
		}
		if err != nil {
			for _, rule := range added {
				netlink.RuleDel(rule)
			}
			errs = append(errs, err)
			continue
		}
		ld.rules[a] = added
	}
	for a, rules := range ld.rules {
		if want[a] {
			continue
		}
		if err := delRules(rules); err != nil {
			errs = append(errs, err)
			continue
		}
		delete(ld.rules, a)
	}
	return errors.Join(errs...)
}

// podRules returns the rules of pod address a: its port, and the
// replies to the node's connections from it.
func (ld *LocalDelivery) podRules(a netip.Addr) []*netlink.Rule {
	rule := func() *netlink.Rule {
		rule := netlink.NewRule()
		rule.Family = addrFamily(a.Is6())
		rule.Table = ld.cfg.Table
		rule.Priority = ld.cfg.Priority
		rule.Dst = prefixToIPNet(netip.PrefixFrom(a, a.BitLen()))
		rule.IPProto = unix.IPPROTO_TCP
		return rule
	}
	port := rule()
	port.Dport = netlink.NewRulePortRange(ld.cfg.Port, ld.cfg.Port)
	out := []*netlink.Rule{port}
	if r := ld.cfg.Replies; !r.IsZero() {
		reply := rule()
		reply.Sport = netlink.NewRulePortRange(ld.cfg.Port, ld.cfg.Port)
		reply.Dport = netlink.NewRulePortRange(r.Lo, r.Hi)
		out = append(out, reply)
	}
	return out
}

// delRules deletes rules (one already gone is no error).
func delRules(rules []*netlink.Rule) error {
	var errs []error
	for _, rule := range rules {
		if err := netlink.RuleDel(rule); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("tun: delete rule %s: %w", rule, err))
		}
	}
	return errors.Join(errs...)
}

// Replies returns the local ports whose replies are delivered locally
// (LocalDeliveryConfig.Replies).
func (ld *LocalDelivery) Replies() PortRange { return ld.cfg.Replies }

// Close removes the rules, then the routes.
func (ld *LocalDelivery) Close() error {
	ld.mu.Lock()
	defer ld.mu.Unlock()
	ld.closed = true
	var errs []error
	for a, rules := range ld.rules {
		if err := delRules(rules); err != nil {
			errs = append(errs, err)
		}
		delete(ld.rules, a)
	}
	for _, rt := range ld.routes {
		if err := netlink.RouteDel(rt); err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("tun: delete route %s: %w", rt, err))
		}
	}
	ld.routes = nil
	return errors.Join(errs...)
}

// removeStaleLocal deletes the rules that point at the local table and
// the table's routes, for IPv4 and IPv6: what a run that did not exit
// cleanly left.
func removeStaleLocal(table int) error {
	var errs []error
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		rules, err := netlink.RuleListFiltered(family, &netlink.Rule{Table: table}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return fmt.Errorf("tun: list rules: %w", err)
		}
		for i := range rules {
			if err := netlink.RuleDel(&rules[i]); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("tun: delete stale rule %s: %w", rules[i], err))
			}
		}
		if err := flushTable(family, table); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// TransparentSocket sets IP_TRANSPARENT (IPv4) or IPV6_TRANSPARENT (IPv6,
// which covers the IPv4 side of a dual-stack socket too) on a socket: a
// listener with it answers connections to addresses the node does not own
// (the pods' addresses that LocalDelivery sends it), from those addresses.
// It has the signature of net.ListenConfig.Control; it needs CAP_NET_ADMIN.
func TransparentSocket(network, address string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) {
		if network == "tcp4" || network == "udp4" {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IP, unix.IP_TRANSPARENT, 1)
		} else {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_IPV6, unix.IPV6_TRANSPARENT, 1)
		}
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("tun: IP_TRANSPARENT on %s %s: %w", network, address, serr)
	}
	return nil
}
