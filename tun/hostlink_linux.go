package tun

import (
	"fmt"
	"net"
	"net/netip"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// HostLink is the node-side link a pod's address is routed to.
type HostLink struct {
	// Name is the link's name ("veth1a2b3c", "cali…", "cni0").
	Name string
	// Bridge: the link is a Linux bridge (a bridge CNI): pods on it reach
	// each other through the bridge without being routed by the node.
	Bridge bool
	// Route is the main-table route that leads to the link.
	Route netip.Prefix
}

// HostLinks finds, for each address, the node-side link of a pod that
// has it: the link the node's main routing table sends the address to by a
// host route (/32, /128) without a gateway, as a routed CNI (kindnet,
// Calico, Cilium in routing mode) installs through the pod's veth. Only
// such a route counts, and only to a link that is not shared: one that
// carries a default route, or holds an address whose prefix contains the
// pod's (the uplink's LAN, a bridge), is never a pod's link. So a pod whose
// host route is missing is missing from the result (its capture waits for
// the route), and is never taken for the uplink, whose capture would
// black-hole everything the node forwards from it.
//
// An address reached only by a wider direct route to a Linux bridge is
// reported with Bridge set (a bridge CNI), for the caller to say why it
// is not captured; it is never a capture link.
func HostLinks(addrs []netip.Addr) (map[netip.Addr]HostLink, error) {
	out := make(map[netip.Addr]HostLink, len(addrs))
	if len(addrs) == 0 {
		return out, nil
	}
	var routes [2][]netlink.Route
	defaults := map[int]bool{} // links that carry a default route
	for i, family := range []int{unix.AF_INET, unix.AF_INET6} {
		rs, err := netlink.RouteListFiltered(family, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return nil, fmt.Errorf("tun: list routes: %w", err)
		}
		routes[i] = rs
		for _, r := range rs {
			if r.Dst != nil {
				if p, ok := ipNetPrefix(r.Dst); !ok || p.Bits() != 0 {
					continue
				}
			}
			defaults[r.LinkIndex] = true
			for _, nh := range r.MultiPath {
				defaults[nh.LinkIndex] = true
			}
		}
	}
	addrList, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("tun: list addresses: %w", err)
	}
	// holds reports whether link index holds an address whose prefix
	// contains a.
	holds := func(index int, a netip.Addr) bool {
		for _, la := range addrList {
			if la.LinkIndex != index || la.IPNet == nil {
				continue
			}
			if p, ok := ipNetPrefix(la.IPNet); ok && p.Contains(a) {
				return true
			}
		}
		return false
	}
	names := map[int]netlink.Link{}
	linkOf := func(index int) (netlink.Link, bool) {
		l, ok := names[index]
		if !ok {
			var err error
			if l, err = netlink.LinkByIndex(index); err != nil {
				return nil, false // the link went away meanwhile
			}
			names[index] = l
		}
		return l, true
	}
	for _, a := range addrs {
		a = a.Unmap()
		rs := routes[0]
		if a.Is6() {
			rs = routes[1]
		}
		// The host route, if any, and the most specific direct route
		// (for the bridge diagnosis).
		var host, widest *netlink.Route
		best := -1
		for i := range rs {
			r := &rs[i]
			if r.Dst == nil || r.LinkIndex <= 0 || r.Gw != nil || len(r.MultiPath) > 0 {
				continue
			}
			p, ok := ipNetPrefix(r.Dst)
			if !ok || !p.Contains(a) {
				continue
			}
			if p.Bits() == a.BitLen() {
				host = r
			}
			if p.Bits() > best {
				best, widest = p.Bits(), r
			}
		}
		if host != nil && !defaults[host.LinkIndex] && !holds(host.LinkIndex, a) {
			if l, ok := linkOf(host.LinkIndex); ok && l.Type() != "bridge" {
				out[a] = HostLink{Name: l.Attrs().Name, Route: netip.PrefixFrom(a, a.BitLen())}
				continue
			}
		}
		if widest != nil {
			if l, ok := linkOf(widest.LinkIndex); ok && l.Type() == "bridge" {
				p, _ := ipNetPrefix(widest.Dst)
				out[a] = HostLink{Name: l.Attrs().Name, Bridge: true, Route: p}
			}
		}
	}
	return out, nil
}

func ipNetPrefix(n *net.IPNet) (netip.Prefix, bool) {
	a, ok := netip.AddrFromSlice(n.IP)
	if !ok {
		return netip.Prefix{}, false
	}
	ones, _ := n.Mask.Size()
	return netip.PrefixFrom(a.Unmap(), ones).Masked(), true
}

// RoutedLink says whether the node has a link of that name that it
// routes a pod's traffic from: not a bridge, nor a bridge's port (a
// bridge CNI's pods reach each other through the bridge, unrouted).
func RoutedLink(name string) bool {
	l, err := netlink.LinkByName(name)
	return err == nil && l.Type() != "bridge" && l.Attrs().MasterIndex == 0
}
