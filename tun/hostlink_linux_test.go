package tun

import (
	"net"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
)

// TestHostLinks finds a routed pod's veth by its /32 and /128 routes, a
// bridged pod's bridge by the subnet route, and nothing for an address
// reached through a gateway.
func TestHostLinks(t *testing.T) {
	inNewNetns(t)
	add := func(l netlink.Link) {
		t.Helper()
		if err := netlink.LinkAdd(l); err != nil {
			t.Fatal(err)
		}
		if err := netlink.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
	}
	route := func(dst string, link netlink.Link, gw string) {
		t.Helper()
		_, n, _ := net.ParseCIDR(dst)
		r := &netlink.Route{Dst: n, LinkIndex: link.Attrs().Index}
		if gw != "" {
			r.Gw = net.ParseIP(gw)
		} else {
			r.Scope = netlink.SCOPE_LINK
		}
		if err := netlink.RouteAdd(r); err != nil {
			t.Fatalf("route %s: %v", dst, err)
		}
	}
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "vethpod1"}, PeerName: "vethpod1p"}
	add(veth)
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "cni0"}}
	add(br)
	if err := netlink.AddrAdd(br, &netlink.Addr{IPNet: &net.IPNet{IP: net.ParseIP("198.18.9.1"), Mask: net.CIDRMask(24, 32)}}); err != nil {
		t.Fatal(err)
	}
	route("198.18.1.11/32", veth, "")
	route("fd00:6d74:1::11/128", veth, "")
	// A wider route through the veth must lose to the pod's /32.
	route("198.18.1.0/24", br, "")
	route("198.18.2.0/24", br, "198.18.9.254")

	pod4, pod6 := netip.MustParseAddr("198.18.1.11"), netip.MustParseAddr("fd00:6d74:1::11")
	bridged, remote := netip.MustParseAddr("198.18.9.12"), netip.MustParseAddr("198.18.2.11")
	got, err := HostLinks([]netip.Addr{pod4, pod6, bridged, remote})
	if err != nil {
		t.Fatal(err)
	}
	for a, want := range map[netip.Addr]HostLink{
		pod4:    {Name: "vethpod1", Route: netip.MustParsePrefix("198.18.1.11/32")},
		pod6:    {Name: "vethpod1", Route: netip.MustParsePrefix("fd00:6d74:1::11/128")},
		bridged: {Name: "cni0", Bridge: true, Route: netip.MustParsePrefix("198.18.9.0/24")},
	} {
		if got[a] != want {
			t.Errorf("%s: %+v, want %+v", a, got[a], want)
		}
	}
	if hl, ok := got[remote]; ok {
		t.Errorf("%s is reached through a gateway, yet has host link %+v", remote, hl)
	}
}

// TestRoutedLink accepts a pod's veth and refuses a bridge, a bridge's
// port and a missing link: a link the CNI gate names is captured by iif
// only if the node routes the pod's traffic from it.
func TestRoutedLink(t *testing.T) {
	inNewNetns(t)
	veth := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "vethpod1"}, PeerName: "vethpod1p"}
	port := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "vethport"}, PeerName: "vethportp"}
	br := &netlink.Bridge{LinkAttrs: netlink.LinkAttrs{Name: "cni0"}}
	for _, l := range []netlink.Link{veth, port, br} {
		if err := netlink.LinkAdd(l); err != nil {
			t.Fatal(err)
		}
	}
	if err := netlink.LinkSetMaster(port, br); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]bool{"vethpod1": true, "cni0": false, "vethport": false, "nosuch0": false} {
		if got := RoutedLink(name); got != want {
			t.Errorf("RoutedLink(%q) = %v, want %v", name, got, want)
		}
	}
}

// TestHostLinksOnlyPodLinks: only a host route (/32, /128) without a
// gateway makes a pod's link, and never to a shared link. A pod whose host
// route is missing is not found, rather than taken for the uplink (a
// direct subnet route, or the link of the default route), whose capture
// would black-hole everything the node forwards from it; a point-to-point
// veth that holds the node's gateway address (CNI ptp, kindnet) is a pod
// link.
func TestHostLinksOnlyPodLinks(t *testing.T) {
	inNewNetns(t)
	veth := func(name string) netlink.Link {
		t.Helper()
		l := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "p"}
		if err := netlink.LinkAdd(l); err != nil {
			t.Fatal(err)
		}
		if err := netlink.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
		return l
	}
	addr := func(l netlink.Link, cidr string) {
		t.Helper()
		a, err := netlink.ParseAddr(cidr)
		if err != nil {
			t.Fatal(err)
		}
		if err := netlink.AddrAdd(l, a); err != nil {
			t.Fatalf("address %s: %v", cidr, err)
		}
	}
	route := func(dst string, l netlink.Link, gw string) {
		t.Helper()
		r := &netlink.Route{LinkIndex: l.Attrs().Index}
		if dst != "" {
			_, n, _ := net.ParseCIDR(dst)
			r.Dst = n
		}
		if gw != "" {
			r.Gw = net.ParseIP(gw)
		} else {
			r.Scope = netlink.SCOPE_LINK
		}
		if err := netlink.RouteAdd(r); err != nil {
			t.Fatalf("route %s: %v", dst, err)
		}
	}
	// The uplink: the node's address, its LAN, the default route, and a
	// /32 to a neighbour on it (as cloud images add for their gateway).
	up := veth("uplink0")
	addr(up, "198.18.0.11/24")
	addr(up, "fd00:6d74::11/64")
	route("", up, "198.18.0.1")
	route("198.18.7.7/32", up, "")
	// A pod link as CNI ptp makes it: the gateway address, /32 routes.
	pod := veth("vethpod1")
	addr(pod, "198.18.1.1/32")
	route("198.18.1.11/32", pod, "")
	route("fd00:6d74:1::11/128", pod, "")
	// A wide direct route to a link that is no bridge.
	wide := veth("vethwide")
	route("198.18.3.0/24", wide, "")
	// A /32 to a link whose own prefix contains it: a shared segment.
	lan := veth("lan1")
	addr(lan, "198.18.4.1/24")
	route("198.18.4.9/32", lan, "")

	pod4, pod6 := netip.MustParseAddr("198.18.1.11"), netip.MustParseAddr("fd00:6d74:1::11")
	missing := map[netip.Addr]string{
		netip.MustParseAddr("198.18.0.50"):   "on the uplink's LAN, no /32",
		netip.MustParseAddr("fd00:6d74::50"): "on the uplink's IPv6 LAN, no /128",
		netip.MustParseAddr("198.18.7.7"):    "a /32 to the link of the default route",
		netip.MustParseAddr("198.18.3.7"):    "a /24 without gateway to a veth",
		netip.MustParseAddr("198.18.4.9"):    "a /32 to a link holding its prefix",
		netip.MustParseAddr("198.18.1.12"):   "a pod whose /32 is missing",
	}
	addrs := []netip.Addr{pod4, pod6}
	for a := range missing {
		addrs = append(addrs, a)
	}
	got, err := HostLinks(addrs)
	if err != nil {
		t.Fatal(err)
	}
	for a, want := range map[netip.Addr]HostLink{
		pod4: {Name: "vethpod1", Route: netip.MustParsePrefix("198.18.1.11/32")},
		pod6: {Name: "vethpod1", Route: netip.MustParsePrefix("fd00:6d74:1::11/128")},
	} {
		if got[a] != want {
			t.Errorf("%s: %+v, want %+v", a, got[a], want)
		}
	}
	for a, why := range missing {
		if hl, ok := got[a]; ok {
			t.Errorf("%s (%s): host link %+v, want none", a, why, hl)
		}
	}
}
