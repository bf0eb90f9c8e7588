package tun

import (
	"net"
	"net/netip"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// TestNodeTrafficCaptured: what the node itself sends to a captured pod
// is routed into the TUN, except what a socket marked by MarkSocket sends,
// which takes the main table (the pod's link).
func TestNodeTrafficCaptured(t *testing.T) {
	inNewNetns(t)
	pod := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "pod0"}, PeerName: "pod0peer"}
	if err := netlink.LinkAdd(pod); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(pod); err != nil {
		t.Fatal(err)
	}
	podAddr := netip.MustParseAddr("198.18.1.11")
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: pod.Attrs().Index, Dst: prefixToIPNet(netip.PrefixFrom(podAddr, 32)), Scope: netlink.SCOPE_LINK}); err != nil {
		t.Fatal(err)
	}
	d, err := Open(Config{Name: "mt0"})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	r, err := InstallRouting(d, RoutingConfig{CaptureLinks: []string{"pod0"}, PodPrefixes: []netip.Prefix{netip.PrefixFrom(podAddr, 32)}})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()

	via := func(mark uint32) int {
		t.Helper()
		routes, err := netlink.RouteGetWithOptions(net.IP(podAddr.AsSlice()), &netlink.RouteGetOptions{Mark: mark})
		if err != nil || len(routes) == 0 {
			t.Fatalf("route get %s mark %#x: %v", podAddr, mark, err)
		}
		return routes[0].LinkIndex
	}
	if got := via(0); got != d.Index() {
		t.Errorf("the node's own packets to the pod leave through link %d, want the TUN (%d)", got, d.Index())
	}
	if got := via(Mark); got != pod.Attrs().Index {
		t.Errorf("marked packets to the pod leave through link %d, want the pod's link (%d)", got, pod.Attrs().Index)
	}

	lc := net.ListenConfig{Control: MarkSocket}
	ln, err := lc.Listen(t.Context(), "tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	rc, err := ln.(*net.TCPListener).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var mark int
	var gerr error
	rc.Control(func(fd uintptr) { mark, gerr = unix.GetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_MARK) })
	if gerr != nil || mark != Mark {
		t.Errorf("SO_MARK of a socket MarkSocket set up: %#x, %v; want %#x", mark, gerr, Mark)
	}
}
