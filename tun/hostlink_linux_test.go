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
