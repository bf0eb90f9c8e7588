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

const (
	// DefaultTable is the routing table meshtun installs its routes into:
	// 0x6d74, "mt" in ASCII.
	DefaultTable = 0x6d74
	// DefaultPriority is the priority of meshtun's policy-routing rules. It
	// sits before the main table's rule (32766) and after the local table's
	// (0), so locally addressed packets are never captured.
	DefaultPriority = 0x6d74
	// Mark is the socket mark (SO_MARK) of meshtun's own kernel sockets.
	// A rule one priority before the capture rules sends packets with
	// this mark to the main table, so that what meshtun itself sends to a
	// captured pod (or anywhere) never loops back into the TUN.
	Mark = 0x6d74
)

// RoutingConfig says which traffic is routed into the TUN device.
type RoutingConfig struct {
	Table    int // routing table; 0 means DefaultTable
	Priority int // rule priority; 0 means DefaultPriority

	// CaptureLinks are the node-side links of the captured pods (the host
	// end of each pod's veth). Every packet arriving on one of them is
	// routed into the TUN: "ip rule add iif <link> lookup <table>".
	CaptureLinks []string
	// PodPrefixes are the addresses (or ranges) of the captured pods.
	// Every packet to one of them is routed into the TUN, from wherever it
	// arrives ("ip rule add to <prefix> lookup <table>"), except packets
	// the TUN itself hands back and packets of meshtun's own sockets
	// (marked with Mark): two rules before it send those to the main table
	// ("ip rule add iif <tun> lookup main", "fwmark <Mark> lookup main").
	// Everything else the node sends to a pod is captured: the node is
	// not trusted more than any other host.
	PodPrefixes []netip.Prefix
}

// Routing is the set of rules and routes installed for one TUN device.
type Routing struct {
	mu      sync.Mutex // Update and Close
	cfg     RoutingConfig
	exempt  []*netlink.Rule // iif <tun>, fwmark Mark → main
	capture []*netlink.Rule // iif <pod link>, to <pod> → table
	routes  []*netlink.Route
	closed  bool
}

// InstallRouting removes whatever an earlier run left in the table and then
// installs: a default route for IPv4 and IPv6 through dev in the table, and
// the capture rules of cfg. On error it removes what it had installed.
func InstallRouting(dev *Device, cfg RoutingConfig) (*Routing, error) {
	if cfg.Table == 0 {
		cfg.Table = DefaultTable
	}
	if cfg.Priority == 0 {
		cfg.Priority = DefaultPriority
	}
	if err := removeStale(cfg.Table, cfg.Priority); err != nil {
		return nil, err
	}
	r := &Routing{}
	for _, dst := range []*net.IPNet{
		{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)},
		{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)},
	} {
		rt := &netlink.Route{LinkIndex: dev.Index(), Dst: dst, Table: cfg.Table, Scope: netlink.SCOPE_LINK}
		if err := netlink.RouteAdd(rt); err != nil {
			r.Close()
			return nil, fmt.Errorf("tun: add route %s dev %s table %d: %w", dst, dev.Name(), cfg.Table, err)
		}
		r.routes = append(r.routes, rt)
	}
	// Exemptions first (one priority earlier): what the TUN writes back,
	// and what meshtun's own sockets send.
	for _, byMark := range []bool{false, true} {
		for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
			rule := newRule(cfg, family)
			rule.Priority = cfg.Priority - 1
			rule.Table = unix.RT_TABLE_MAIN
			if byMark {
				rule.Mark = Mark
			} else {
				rule.IifName = dev.Name()
			}
			if err := netlink.RuleAdd(rule); err != nil {
				r.Close()
				return nil, fmt.Errorf("tun: add rule %s: %w", rule, err)
			}
			r.exempt = append(r.exempt, rule)
		}
	}
	r.cfg = cfg
	if err := r.Update(cfg.CaptureLinks, cfg.PodPrefixes); err != nil {
		r.Close()
		return nil, err
	}
	return r, nil
}

// captureRules returns the rules that route the traffic of links and pods
// into the table.
func (r *Routing) captureRules(links []string, pods []netip.Prefix) []*netlink.Rule {
	var rules []*netlink.Rule
	for _, link := range links {
		for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
			rule := newRule(r.cfg, family)
			rule.IifName = link
			rules = append(rules, rule)
		}
	}
	for _, p := range pods {
		family := unix.AF_INET
		if p.Addr().Is6() {
			family = unix.AF_INET6
		}
		rule := newRule(r.cfg, family)
		rule.Dst = prefixToIPNet(p)
		rules = append(rules, rule)
	}
	return rules
}

func ruleKey(r *netlink.Rule) string {
	return fmt.Sprintf("%d|%s|%v", r.Family, r.IifName, r.Dst)
}

// Update changes the captured links and pod addresses, for a node whose
// pods come and go. New rules are added before old ones are removed, so
// capture never lapses for a pod that stays.
func (r *Routing) Update(links []string, pods []netip.Prefix) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return errors.New("tun: routing already removed")
	}
	want := r.captureRules(links, pods)
	have := make(map[string]*netlink.Rule, len(r.capture))
	for _, rule := range r.capture {
		have[ruleKey(rule)] = rule
	}
	keep := make(map[string]bool, len(want))
	var next []*netlink.Rule
	for _, rule := range want {
		k := ruleKey(rule)
		if keep[k] {
			continue
		}
		keep[k] = true
		if old, ok := have[k]; ok {
			next = append(next, old)
			continue
		}
		if err := netlink.RuleAdd(rule); err != nil {
			r.capture = append(next, r.unkept(keep)...)
			return fmt.Errorf("tun: add rule %s: %w", rule, err)
		}
		next = append(next, rule)
	}
	var errs []error
	for _, rule := range r.unkept(keep) {
		if err := netlink.RuleDel(rule); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("tun: delete rule %s: %w", rule, err))
			next = append(next, rule)
		}
	}
	r.capture = next
	return errors.Join(errs...)
}

// unkept returns the installed capture rules whose keys are not in keep.
func (r *Routing) unkept(keep map[string]bool) []*netlink.Rule {
	var out []*netlink.Rule
	for _, rule := range r.capture {
		if !keep[ruleKey(rule)] {
			out = append(out, rule)
		}
	}
	return out
}

func newRule(cfg RoutingConfig, family int) *netlink.Rule {
	rule := netlink.NewRule()
	rule.Family = family
	rule.Table = cfg.Table
	rule.Priority = cfg.Priority
	return rule
}

// Close removes the rules and routes. Routes through the TUN also vanish
// when the device is closed; removing them here keeps the order explicit.
func (r *Routing) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.closed = true
	var errs []error
	for _, rule := range append(r.capture, r.exempt...) {
		if err := netlink.RuleDel(rule); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("tun: delete rule %s: %w", rule, err))
		}
	}
	for _, rt := range r.routes {
		if err := netlink.RouteDel(rt); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENODEV) {
			errs = append(errs, fmt.Errorf("tun: delete route %s: %w", rt, err))
		}
	}
	r.capture, r.exempt, r.routes = nil, nil, nil
	return errors.Join(errs...)
}

// RemoveStale deletes every policy rule that points at table, or has
// meshtun's exemption priority (priority-1) and points at the main table,
// and every route in table, for IPv4 and IPv6: the leftovers of a run that
// did not exit cleanly.
func RemoveStale(table int) error {
	return removeStale(table, DefaultPriority)
}

func removeStale(table, priority int) error {
	var errs []error
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		rules, err := netlink.RuleListFiltered(family, &netlink.Rule{Table: table}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return fmt.Errorf("tun: list rules: %w", err)
		}
		exempt, err := netlink.RuleListFiltered(family, &netlink.Rule{Table: unix.RT_TABLE_MAIN, Priority: priority - 1}, netlink.RT_FILTER_TABLE|netlink.RT_FILTER_PRIORITY)
		if err != nil {
			return fmt.Errorf("tun: list rules: %w", err)
		}
		rules = append(rules, exempt...)
		for i := range rules {
			if err := netlink.RuleDel(&rules[i]); err != nil && !errors.Is(err, unix.ENOENT) {
				errs = append(errs, fmt.Errorf("tun: delete stale rule %s: %w", rules[i], err))
			}
		}
		routes, err := netlink.RouteListFiltered(family, &netlink.Route{Table: table}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return fmt.Errorf("tun: list routes of table %d: %w", table, err)
		}
		for i := range routes {
			if err := netlink.RouteDel(&routes[i]); err != nil && !errors.Is(err, unix.ESRCH) {
				errs = append(errs, fmt.Errorf("tun: delete stale route %s: %w", routes[i], err))
			}
		}
	}
	return errors.Join(errs...)
}

func prefixToIPNet(p netip.Prefix) *net.IPNet {
	p = p.Masked()
	return &net.IPNet{IP: net.IP(p.Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}

// MarkSocket sets SO_MARK to Mark on a socket, so that the exemption rule
// keeps its packets out of the TUN. It has the signature of
// net.Dialer.Control and net.ListenConfig.Control; it needs CAP_NET_ADMIN.
func MarkSocket(network, address string, c syscall.RawConn) error {
	var serr error
	if err := c.Control(func(fd uintptr) {
		serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK, Mark)
	}); err != nil {
		return err
	}
	if serr != nil {
		return fmt.Errorf("tun: mark socket for %s %s: %w", network, address, serr)
	}
	return nil
}
