package cluster

import (
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// Links returns the namespace's network interfaces, one "<name> <type>"
// line each, sorted by name. Two snapshots compare equal when the same
// interfaces exist.
func (n *NS) Links() ([]string, error) {
	h, err := n.handle()
	if err != nil {
		return nil, err
	}
	defer h.Close()
	links, err := h.LinkList()
	if err != nil {
		return nil, fmt.Errorf("netns %s: list links: %w", n.name, err)
	}
	out := make([]string, 0, len(links))
	for _, l := range links {
		out = append(out, l.Attrs().Name+" "+l.Type())
	}
	slices.Sort(out)
	return out, nil
}

// Routes returns the routes of one family (unix.AF_INET or unix.AF_INET6)
// in one table (0 for all tables, including local), formatted roughly like
// `ip route show table all` and sorted. Cached (cloned) routes are left out,
// so two snapshots compare equal when the configured routes are the same.
func (n *NS) Routes(family, table int) ([]string, error) {
	if family != unix.AF_INET && family != unix.AF_INET6 {
		return nil, fmt.Errorf("netns %s: routes: family %d is neither AF_INET nor AF_INET6", n.name, family)
	}
	h, err := n.handle()
	if err != nil {
		return nil, err
	}
	defer h.Close()
	names, err := linkNames(h)
	if err != nil {
		return nil, fmt.Errorf("netns %s: %w", n.name, err)
	}
	routes, err := h.RouteListFiltered(family, &netlink.Route{Table: table}, netlink.RT_FILTER_TABLE)
	if err != nil {
		return nil, fmt.Errorf("netns %s: list routes (family %d, table %d): %w", n.name, family, table, err)
	}
	out := make([]string, 0, len(routes))
	for _, r := range routes {
		out = append(out, formatRoute(r, names))
	}
	slices.Sort(out)
	return out, nil
}

// IPRules returns the policy routing rules of one family (unix.AF_INET or
// unix.AF_INET6), formatted roughly like `ip rule show`, in priority order.
// Rule actions other than lookup and goto (blackhole, unreachable, …) are
// not decoded by netlink; such rules show as "lookup 0".
func (n *NS) IPRules(family int) ([]string, error) {
	if family != unix.AF_INET && family != unix.AF_INET6 {
		return nil, fmt.Errorf("netns %s: rules: family %d is neither AF_INET nor AF_INET6", n.name, family)
	}
	h, err := n.handle()
	if err != nil {
		return nil, err
	}
	defer h.Close()
	rules, err := h.RuleList(family)
	if err != nil {
		return nil, fmt.Errorf("netns %s: list rules (family %d): %w", n.name, family, err)
	}
	out := make([]string, 0, len(rules))
	for _, r := range rules {
		out = append(out, formatRule(r))
	}
	slices.SortStableFunc(out, func(a, b string) int {
		return prioOf(a) - prioOf(b)
	})
	return out, nil
}

func prioOf(s string) int {
	p, _, _ := strings.Cut(s, ":")
	v, _ := strconv.Atoi(p)
	return v
}

func linkNames(h *netlink.Handle) (map[int]string, error) {
	links, err := h.LinkList()
	if err != nil {
		return nil, fmt.Errorf("list links: %w", err)
	}
	m := make(map[int]string, len(links))
	for _, l := range links {
		m[l.Attrs().Index] = l.Attrs().Name
	}
	return m, nil
}

func routeType(t int) string {
	switch t {
	case unix.RTN_UNICAST:
		return "unicast"
	case unix.RTN_LOCAL:
		return "local"
	case unix.RTN_BROADCAST:
		return "broadcast"
	case unix.RTN_ANYCAST:
		return "anycast"
	case unix.RTN_MULTICAST:
		return "multicast"
	case unix.RTN_BLACKHOLE:
		return "blackhole"
	case unix.RTN_UNREACHABLE:
		return "unreachable"
	case unix.RTN_PROHIBIT:
		return "prohibit"
	case unix.RTN_THROW:
		return "throw"
	default:
		return "type" + strconv.Itoa(t)
	}
}

func ifName(names map[int]string, idx int) string {
	if s, ok := names[idx]; ok {
		return s
	}
	return "if" + strconv.Itoa(idx)
}

func ipString(ip net.IP) string {
	if a, ok := netip.AddrFromSlice(ip); ok {
		return a.Unmap().String()
	}
	return ip.String()
}

func formatRoute(r netlink.Route, names map[int]string) string {
	var b strings.Builder
	fmt.Fprintf(&b, "table %d", r.Table)
	b.WriteString(" " + routeType(r.Type))
	if r.Dst == nil {
		b.WriteString(" default")
	} else {
		ones, _ := r.Dst.Mask.Size()
		fmt.Fprintf(&b, " %s/%d", ipString(r.Dst.IP), ones)
	}
	if r.Gw != nil {
		b.WriteString(" via " + ipString(r.Gw))
	}
	if r.LinkIndex != 0 {
		b.WriteString(" dev " + ifName(names, r.LinkIndex))
	}
	for _, nh := range r.MultiPath {
		b.WriteString(" nexthop")
		if nh.Gw != nil {
			b.WriteString(" via " + ipString(nh.Gw))
		}
		fmt.Fprintf(&b, " dev %s weight %d", ifName(names, nh.LinkIndex), nh.Hops+1)
	}
	if r.Src != nil {
		b.WriteString(" src " + ipString(r.Src))
	}
	fmt.Fprintf(&b, " proto %s scope %s", r.Protocol, scopeName(r.Scope))
	if r.Priority != 0 {
		fmt.Fprintf(&b, " metric %d", r.Priority)
	}
	if r.Flags&int(netlink.FLAG_ONLINK) != 0 {
		b.WriteString(" onlink")
	}
	if r.MTU != 0 {
		fmt.Fprintf(&b, " mtu %d", r.MTU)
	}
	return b.String()
}

func formatRule(r netlink.Rule) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%d:", r.Priority)
	if r.Invert {
		b.WriteString(" not")
	}
	b.WriteString(" from " + prefixOrAll(r.Src))
	if r.Dst != nil {
		b.WriteString(" to " + prefixOrAll(r.Dst))
	}
	if r.Tos != 0 {
		fmt.Fprintf(&b, " tos %#x", r.Tos)
	}
	if r.Mark != 0 || r.Mask != nil {
		fmt.Fprintf(&b, " fwmark %#x", r.Mark)
		if r.Mask != nil {
			fmt.Fprintf(&b, "/%#x", *r.Mask)
		}
	}
	if r.IifName != "" {
		b.WriteString(" iif " + r.IifName)
	}
	if r.OifName != "" {
		b.WriteString(" oif " + r.OifName)
	}
	if r.IPProto != 0 {
		fmt.Fprintf(&b, " ipproto %d", r.IPProto)
	}
	if r.Sport != nil {
		fmt.Fprintf(&b, " sport %d-%d", r.Sport.Start, r.Sport.End)
	}
	if r.Dport != nil {
		fmt.Fprintf(&b, " dport %d-%d", r.Dport.Start, r.Dport.End)
	}
	if r.UIDRange != nil {
		fmt.Fprintf(&b, " uidrange %d-%d", r.UIDRange.Start, r.UIDRange.End)
	}
	if r.TunID != 0 {
		fmt.Fprintf(&b, " tun_id %d", r.TunID)
	}
	if r.Goto >= 0 {
		fmt.Fprintf(&b, " goto %d", r.Goto)
	} else {
		fmt.Fprintf(&b, " lookup %d", r.Table)
	}
	if r.SuppressPrefixlen >= 0 {
		fmt.Fprintf(&b, " suppress_prefixlength %d", r.SuppressPrefixlen)
	}
	if r.SuppressIfgroup >= 0 {
		fmt.Fprintf(&b, " suppress_ifgroup %d", r.SuppressIfgroup)
	}
	if r.Flow >= 0 {
		fmt.Fprintf(&b, " realms %d", r.Flow)
	}
	fmt.Fprintf(&b, " proto %s", netlink.RouteProtocol(r.Protocol))
	return b.String()
}

func prefixOrAll(p *net.IPNet) string {
	if p == nil {
		return "all"
	}
	ones, _ := p.Mask.Size()
	return fmt.Sprintf("%s/%d", ipString(p.IP), ones)
}

func scopeName(s netlink.Scope) string {
	if n := s.String(); n != "unknown" {
		return n
	}
	return strconv.Itoa(int(s))
}
