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

// HostLinks finds, for each address, the link the node's main routing
// table sends it to directly (no gateway), by the most specific route that
// contains it: on a routed CNI (kindnet, Calico, Cilium in routing mode)
// the /32 or /128 route to the pod through its veth's host end. Addresses
// without such a route are missing from the result.
func HostLinks(addrs []netip.Addr) (map[netip.Addr]HostLink, error) {
	out := make(map[netip.Addr]HostLink, len(addrs))
	if len(addrs) == 0 {
		return out, nil
	}
	names := map[int]netlink.Link{}
	var routes [2][]netlink.Route
	for i, family := range []int{unix.AF_INET, unix.AF_INET6} {
		rs, err := netlink.RouteListFiltered(family, &netlink.Route{Table: unix.RT_TABLE_MAIN}, netlink.RT_FILTER_TABLE)
		if err != nil {
			return nil, fmt.Errorf("tun: list routes: %w", err)
		}
		routes[i] = rs
	}
	for _, a := range addrs {
		a = a.Unmap()
		rs := routes[0]
		if a.Is6() {
			rs = routes[1]
		}
		best := -1
		var bestRoute netlink.Route
		for _, r := range rs {
			if r.Dst == nil || r.LinkIndex <= 0 || r.Gw != nil || len(r.MultiPath) > 0 {
				continue
			}
			p, ok := ipNetPrefix(r.Dst)
			if !ok || !p.Contains(a) || p.Bits() <= best {
				continue
			}
			best, bestRoute = p.Bits(), r
		}
		if best < 0 {
			continue
		}
		l, ok := names[bestRoute.LinkIndex]
		if !ok {
			var err error
			l, err = netlink.LinkByIndex(bestRoute.LinkIndex)
			if err != nil {
				continue // the link went away meanwhile
			}
			names[bestRoute.LinkIndex] = l
		}
		p, _ := ipNetPrefix(bestRoute.Dst)
		out[a] = HostLink{Name: l.Attrs().Name, Bridge: l.Type() == "bridge", Route: p}
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
