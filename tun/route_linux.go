package tun

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"sync"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

const (
	// DefaultTable is the routing table meshtun installs its routes into:
	// 0x6d74, "mt" in ASCII. The table after it (0x6d75) holds the route
	// of spoofed packets (see [RoutingConfig]).
	DefaultTable = 0x6d74
	// DefaultPriority is the priority of meshtun's rules to pod
	// addresses. It sits before the main table's rule (32766) and after
	// the local table's (0), so locally addressed packets are never
	// captured. The other rules take the three priorities before it.
	DefaultPriority = 0x6d74

	// BlockMetric is the metric of the blocking routes, behind the
	// routes through the TUN devices (metric [tunMetric]) in the same
	// tables: they take over whenever no meshtun runs.
	BlockMetric = 0xffff
	tunMetric   = 1
)

// CaptureLink is the node-side link of captured pods and the addresses
// those pods may send from.
type CaptureLink struct {
	Name string
	// Sources are the addresses of the pods behind the link. A packet
	// that arrives on the link from any other source is spoofed: it is
	// routed to the spoof table, never to the TUN.
	Sources []netip.Addr
}

// RoutingConfig says which traffic is routed into the TUN device.
//
// With table T and priority P, the rules are, for IPv4 and IPv6:
//
//	P-3  iif <link> from <source> lookup T    a captured pod's own traffic
//	P-3  iif <tun> lookup main                what the TUN writes back
//	P-3  iif lo ipproto tcp sport <port>      the replies of meshtun's local-delivery
//	     uidrange <meshtun's uid> goto P      listener (SetLocalDelivery), from a pod's address
//	P-3  iif lo ipproto tcp sport <clients>   meshtun's own connections from a pod's address
//	     dport <port> uidrange <meshtun's     to a peer's port (outbound HBONE from the
//	     uid> goto P                          client pod's address; SetLocalDelivery)
//	P-2  iif <link> lookup T+1                any other source on that link: spoofed
//	P-2  from <source> lookup T+1             a captured pod's address from anywhere else: spoofed
//	P    to <pod> lookup T                    traffic to a captured pod, from anywhere else
//
// Everything else the node sends to a pod is captured: the node is not
// trusted more than any other host. A captured pod's address (a source
// of a capture link) is accepted only from the pod's own link, whatever
// the arrival interface (another pod's link, the uplink, a node socket
// bound to it): except for the TUN and meshtun's local-delivery listener,
// a packet from it that did not take the pod's own rule goes to the spoof
// sink.
type RoutingConfig struct {
	Table    int // routing table; 0 means DefaultTable
	Priority int // rule priority; 0 means DefaultPriority

	// CaptureLinks are the node-side links of the captured pods (the host
	// end of each pod's veth), each with the addresses its pods may use.
	CaptureLinks []CaptureLink
	// PodPrefixes are the addresses (or ranges) of the captured pods.
	// Every packet to one of them is routed into the TUN, from wherever it
	// arrives, except packets the TUN itself hands back and packets of
	// meshtun's own sockets (marked with Mark).
	PodPrefixes []netip.Prefix
}

func (cfg *RoutingConfig) defaults() {
	if cfg.Table == 0 {
		cfg.Table = DefaultTable
	}
	if cfg.Priority == 0 {
		cfg.Priority = DefaultPriority
	}
}

// Routing is the set of rules and routes installed for one TUN device.
type Routing struct {
	mu     sync.Mutex // Update, SetLocalDelivery and Close
	cfg    RoutingConfig
	dev    *Device
	sink   *Device
	closed bool
	// links and pods are what the rules were last reconciled to;
	// localPort is the port of the local-delivery listener whose replies
	// (from a pod's address) skip the spoof rules, 0 for none.
	links     []CaptureLink
	pods      []netip.Prefix
	localPort uint16
	clients   PortRange
}

// InstallRouting routes the captured traffic into dev, and spoofed packets
// into sink (nil: they are blackholed). It adopts what an earlier run left
// (rules and blocking routes stay across a stop): the routes through the
// devices and the blocking routes are put in first, then the rules of cfg
// are added and only then are the rules no longer wanted removed, so
// traffic that an earlier run captured is never routed in the clear while
// this one starts.
func InstallRouting(dev, sink *Device, cfg RoutingConfig) (*Routing, error) {
	cfg.defaults()
	r := &Routing{cfg: cfg, dev: dev, sink: sink}
	if err := r.installRoutes(); err != nil {
		return nil, err
	}
	if err := r.reconcile(cfg.CaptureLinks, cfg.PodPrefixes); err != nil {
		return nil, err
	}
	return r, nil
}

// routes returns the routes of tables T and T+1: through the devices (only
// those given) and the blocking ones.
func routes(cfg RoutingConfig, dev, sink *Device) []*netlink.Route {
	var out []*netlink.Route
	for _, dst := range []*net.IPNet{
		{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)},
		{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)},
	} {
		// The route through the TUN has scope global, not link: the
		// kernel picks the source of the node's own connections to a
		// captured pod (kubelet probes) from the TUN's addresses with
		// scope up to the route's, and where route_localnet is on
		// (kube-proxy sets net.ipv4.conf.all.route_localnet=1, so kind
		// has it) a scope-host address counts as scope link: on a link
		// route the node sent from RPFAddr (127.109.116.1), to which
		// the pod answers on its own loopback, and every probe timed
		// out. With scope global the TUN's scope-host address is never
		// picked and the node's global address is. The blocking route
		// gets scope link so that a lookup limited to link scope
		// (SO_DONTROUTE) still ends in it instead of falling through to
		// the main table's direct route to the pod.
		if dev != nil {
			out = append(out, &netlink.Route{LinkIndex: dev.Index(), Dst: dst, Table: cfg.Table, Scope: netlink.SCOPE_UNIVERSE, Priority: tunMetric})
		}
		out = append(out, &netlink.Route{Type: unix.RTN_PROHIBIT, Dst: dst, Table: cfg.Table, Scope: netlink.SCOPE_LINK, Priority: BlockMetric})
		if sink != nil {
			out = append(out, &netlink.Route{LinkIndex: sink.Index(), Dst: dst, Table: cfg.Table + 1, Scope: netlink.SCOPE_LINK, Priority: tunMetric})
		}
		out = append(out, &netlink.Route{Type: unix.RTN_BLACKHOLE, Dst: dst, Table: cfg.Table + 1, Priority: BlockMetric})
	}
	return out
}

func routeKey(rt *netlink.Route) string {
	typ := rt.Type
	if typ == 0 {
		typ = unix.RTN_UNICAST
	}
	link := rt.LinkIndex
	if typ != unix.RTN_UNICAST {
		link = 0 // the kernel puts reject routes on lo
	}
	bits := 0
	if rt.Dst != nil {
		bits, _ = rt.Dst.Mask.Size()
	}
	return fmt.Sprintf("%d|%d|%d|%d|%d", rt.Table, typ, link, rt.Priority, bits)
}

// installRoutes puts the routes in (replacing equal ones) and removes any
// other route of the two tables.
func (r *Routing) installRoutes() error {
	want := routes(r.cfg, r.dev, r.sink)
	keep := map[string]bool{}
	for _, rt := range want {
		if err := netlink.RouteReplace(rt); err != nil {
			return fmt.Errorf("tun: add route %s: %w", rt, err)
		}
		keep[familyOf(rt.Dst)+routeKey(rt)] = true
	}
	var errs []error
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		for _, table := range []int{r.cfg.Table, r.cfg.Table + 1} {
			have, err := netlink.RouteListFiltered(family, &netlink.Route{Table: table}, netlink.RT_FILTER_TABLE)
			if err != nil {
				return fmt.Errorf("tun: list routes of table %#x: %w", table, err)
			}
			for i := range have {
				rt := &have[i]
				if rt.Dst == nil { // a default route lists without Dst
					rt.Dst = defaultDst(family)
				}
				if keep[familyOf(rt.Dst)+routeKey(rt)] {
					continue
				}
				if err := netlink.RouteDel(rt); err != nil && !errors.Is(err, unix.ESRCH) {
					errs = append(errs, fmt.Errorf("tun: delete stale route %s: %w", rt, err))
				}
			}
		}
	}
	return errors.Join(errs...)
}

func defaultDst(family int) *net.IPNet {
	if family == unix.AF_INET6 {
		return &net.IPNet{IP: net.IPv6zero, Mask: net.CIDRMask(0, 128)}
	}
	return &net.IPNet{IP: net.IPv4zero, Mask: net.CIDRMask(0, 32)}
}

func familyOf(n *net.IPNet) string {
	if n != nil && n.IP.To4() == nil {
		return "6|"
	}
	return "4|"
}

// rules returns every rule cfg asks for, exemptions included.
func (r *Routing) rules(links []CaptureLink, pods []netip.Prefix) []*netlink.Rule {
	cfg := r.cfg
	var out []*netlink.Rule
	add := func(family, prio, table int, iif string, src, dst *netip.Prefix) *netlink.Rule {
		rule := netlink.NewRule()
		rule.Family = family
		rule.Priority = prio
		rule.Table = table
		rule.IifName = iif
		if src != nil {
			rule.Src = prefixToIPNet(*src)
		}
		if dst != nil {
			rule.Dst = prefixToIPNet(*dst)
		}
		out = append(out, rule)
		return rule
	}
	families := []int{unix.AF_INET, unix.AF_INET6}
	for _, family := range families {
		if iif := r.devName(); iif != "" { // no device: no rule that would match every interface
			add(family, cfg.Priority-3, unix.RT_TABLE_MAIN, iif, nil, nil)
		}
		if r.localPort != 0 {
			// The local-delivery listener answers from the pod's
			// address: its packets skip the spoof rules (and still
			// meet the rules to the pods). Only meshtun's uid, only its
			// port, and only while it holds that port.
			rule := add(family, cfg.Priority-3, 0, "lo", nil, nil)
			rule.IPProto = unix.IPPROTO_TCP
			rule.Sport = netlink.NewRulePortRange(r.localPort, r.localPort)
			uid := uint32(os.Geteuid())
			rule.UIDRange = netlink.NewRuleUIDRange(uid, uid)
			rule.Goto = cfg.Priority
			if c := r.clients; !c.IsZero() {
				// meshtun's connections from a pod's address to a
				// peer's port (their replies: LocalDelivery's
				// Replies), same terms, only from those local ports.
				rule := add(family, cfg.Priority-3, 0, "lo", nil, nil)
				rule.IPProto = unix.IPPROTO_TCP
				rule.Sport = netlink.NewRulePortRange(c.Lo, c.Hi)
				rule.Dport = netlink.NewRulePortRange(r.localPort, r.localPort)
				rule.UIDRange = netlink.NewRuleUIDRange(uid, uid)
				rule.Goto = cfg.Priority
			}
		}
	}
	for _, l := range links {
		for _, a := range l.Sources {
			a = a.Unmap()
			p := netip.PrefixFrom(a, a.BitLen())
			add(familyOfAddr(a), cfg.Priority-3, cfg.Table, l.Name, &p, nil)
		}
		for _, family := range families {
			add(family, cfg.Priority-2, cfg.Table+1, l.Name, nil, nil)
		}
	}
	// A captured pod's address from anywhere but its link. Only the
	// addresses of known links: a pod whose link is not known (a bridge
	// CNI) is not captured outbound either, and would lose its traffic.
	for _, l := range links {
		for _, a := range l.Sources {
			a = a.Unmap()
			p := netip.PrefixFrom(a, a.BitLen())
			add(familyOfAddr(a), cfg.Priority-2, cfg.Table+1, "", &p, nil)
		}
	}
	for _, p := range pods {
		p = netip.PrefixFrom(p.Addr().Unmap(), min(p.Bits(), p.Addr().Unmap().BitLen())).Masked()
		add(familyOfAddr(p.Addr()), cfg.Priority, cfg.Table, "", nil, &p)
	}
	return out
}

func (r *Routing) devName() string {
	if r.dev == nil {
		return ""
	}
	return r.dev.Name()
}

func familyOfAddr(a netip.Addr) int {
	if a.Is4() {
		return unix.AF_INET
	}
	return unix.AF_INET6
}

func ruleKey(r *netlink.Rule) string {
	mark := r.Mark
	if mark == 0xffffffff { // NewRule's "no mark"; a listed rule without one has 0
		mark = 0
	}
	var sport string
	if r.Sport != nil {
		sport = fmt.Sprintf("%d-%d", r.Sport.Start, r.Sport.End)
	}
	if r.Dport != nil {
		sport += fmt.Sprintf(">%d-%d", r.Dport.Start, r.Dport.End)
	}
	var uids string
	if r.UIDRange != nil {
		uids = fmt.Sprintf("%d-%d", r.UIDRange.Start, r.UIDRange.End)
	}
	return fmt.Sprintf("%d|%d|%d|%s|%v|%v|%#x|%d|%s|%s|%d", r.Family, r.Priority, r.Table, r.IifName, r.Src, r.Dst, mark,
		r.IPProto, sport, uids, max(r.Goto, 0))
}

// ours lists the rules meshtun installs in tables table and table+1, its
// exemptions (priorities priority-3 to priority-1, main table) and its
// jumps to priority.
func ours(table, priority int) ([]*netlink.Rule, error) {
	var out []*netlink.Rule
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		all, err := netlink.RuleList(family)
		if err != nil {
			return nil, fmt.Errorf("tun: list rules: %w", err)
		}
		for i := range all {
			rule := &all[i]
			ourPrio := rule.Priority >= priority-3 && rule.Priority <= priority-1
			if rule.Table == table || rule.Table == table+1 ||
				ourPrio && (rule.Table == unix.RT_TABLE_MAIN || rule.Goto == priority) {
				rule.Family = family
				out = append(out, rule)
			}
		}
	}
	return out, nil
}

// reconcile makes the kernel's rules those of links and pods: it adds the
// missing ones first, then deletes those no longer wanted.
func (r *Routing) reconcile(links []CaptureLink, pods []netip.Prefix) error {
	for _, l := range links {
		if err := looseLink(l.Name); err != nil {
			return err
		}
	}
	r.links, r.pods = links, pods
	want := r.rules(links, pods)
	have, err := ours(r.cfg.Table, r.cfg.Priority)
	if err != nil {
		return err
	}
	haveKeys := map[string]bool{}
	for _, rule := range have {
		haveKeys[ruleKey(rule)] = true
	}
	wantKeys := map[string]bool{}
	for _, rule := range want {
		k := ruleKey(rule)
		if wantKeys[k] {
			continue
		}
		wantKeys[k] = true
		if haveKeys[k] {
			continue
		}
		if err := netlink.RuleAdd(rule); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("tun: add rule %s: %w", rule, err)
		}
	}
	var errs []error
	for _, rule := range have {
		if wantKeys[ruleKey(rule)] {
			continue
		}
		if err := netlink.RuleDel(rule); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("tun: delete rule %s: %w", rule, err))
		}
	}
	return errors.Join(errs...)
}

// Update changes the captured links and pod addresses, for a node whose
// pods come and go. New rules are added before old ones are removed, so
// capture never lapses for a pod that stays; a pod that leaves is released
// (its rules removed).
func (r *Routing) Update(links []CaptureLink, pods []netip.Prefix) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return errors.New("tun: routing already closed")
	}
	return r.reconcile(links, pods)
}

// SetLocalDelivery tells the routing that meshtun's local-delivery
// listener (LocalDelivery, a transparent socket whose packets carry a
// pod's address as source) holds TCP port port, so that its packets skip
// the spoof rules; 0 when it no longer does (its rule is removed: a node
// process that binds the port afterwards is caught again). clients, if
// not zero, are the local ports of meshtun's own transparent connections
// from a pod's address to a peer's port port (LocalDeliveryConfig.Replies):
// their packets skip the spoof rules too.
func (r *Routing) SetLocalDelivery(port uint16, clients PortRange) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return errors.New("tun: routing already closed")
	}
	if port == 0 {
		clients = PortRange{}
	}
	r.localPort, r.clients = port, clients
	return r.reconcile(r.links, r.pods)
}

// Close removes the routes through the TUN devices and leaves everything
// else: the rules and the blocking routes then refuse the captured traffic
// until a new meshtun installs its routes, or [Uninstall] removes them.
func (r *Routing) Close() error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.closed {
		return nil
	}
	r.closed = true
	var errs []error
	for _, rt := range routes(r.cfg, r.dev, r.sink) {
		if rt.Priority != tunMetric {
			continue
		}
		if err := netlink.RouteDel(rt); err != nil && !errors.Is(err, unix.ESRCH) && !errors.Is(err, unix.ENODEV) {
			errs = append(errs, fmt.Errorf("tun: delete route %s: %w", rt, err))
		}
	}
	return errors.Join(errs...)
}

// ErrRunning is returned by Uninstall while a meshtun proxy routes
// traffic in the namespace.
var ErrRunning = errors.New("a meshtun proxy is running in this network namespace")

// Uninstall removes every rule and route meshtun installs (table and
// priority 0x6d74 and the three priorities before it) from the current
// network namespace, so that the pods' traffic is routed directly again.
// It refuses with ErrRunning while a table still routes through a device,
// i.e. while a proxy runs: stop it first.
func Uninstall() error {
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		for _, table := range []int{DefaultTable, DefaultTable + 1} {
			rts, err := netlink.RouteListFiltered(family, &netlink.Route{Table: table}, netlink.RT_FILTER_TABLE)
			if err != nil {
				return fmt.Errorf("tun: list routes of table %#x: %w", table, err)
			}
			for _, rt := range rts {
				if (rt.Type == 0 || rt.Type == unix.RTN_UNICAST) && rt.LinkIndex > 0 {
					name := fmt.Sprint(rt.LinkIndex)
					if l, err := netlink.LinkByIndex(rt.LinkIndex); err == nil {
						name = l.Attrs().Name
					}
					return fmt.Errorf("%w (table %#x routes through %s); stop it first", ErrRunning, table, name)
				}
			}
		}
	}
	return RemoveStale(DefaultTable)
}

// RemoveStale deletes every policy rule that points at table or table+1,
// or has meshtun's exemption priority (DefaultPriority-1) and points at the
// main table, and every route in the two tables, for IPv4 and IPv6; and
// the local-delivery rules and routes (table+2, LocalDelivery). Unlike
// Uninstall it does not check whether a proxy runs.
func RemoveStale(table int) error {
	rules, err := ours(table, DefaultPriority)
	if err != nil {
		return err
	}
	errs := []error{removeStaleLocal(table + 2)}
	for _, rule := range rules {
		if err := netlink.RuleDel(rule); err != nil && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("tun: delete rule %s: %w", rule, err))
		}
	}
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		for _, t := range []int{table, table + 1} {
			if err := flushTable(family, t); err != nil {
				errs = append(errs, err)
			}
		}
	}
	return errors.Join(errs...)
}

// flushTable deletes every route of family in table; a route already gone
// is not an error.
func flushTable(family, table int) error {
	rts, err := netlink.RouteListFiltered(family, &netlink.Route{Table: table}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return fmt.Errorf("tun: list routes of table %#x: %w", table, err)
	}
	var errs []error
	for i := range rts {
		if err := netlink.RouteDel(&rts[i]); err != nil && !errors.Is(err, unix.ESRCH) {
			errs = append(errs, fmt.Errorf("tun: delete route %s: %w", rts[i], err))
		}
	}
	return errors.Join(errs...)
}

func prefixToIPNet(p netip.Prefix) *net.IPNet {
	p = p.Masked()
	return &net.IPNet{IP: net.IP(p.Addr().AsSlice()), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}
