package tun

import (
	"errors"
	"net"
	"net/netip"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// addDummy creates an up link (one end of a veth pair, the other end
// "<name>x" up too; dummy links need a module CI may lack) with addr (a
// prefix) and returns it.
func addDummy(t *testing.T, name, addr string) netlink.Link {
	t.Helper()
	l := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: name}, PeerName: name + "x"}
	if err := netlink.LinkAdd(l); err != nil {
		t.Fatalf("add veth %s: %v", name, err)
	}
	if peer, err := netlink.LinkByName(name + "x"); err != nil {
		t.Fatal(err)
	} else if err := netlink.LinkSetUp(peer); err != nil {
		t.Fatal(err)
	}
	link, err := netlink.LinkByName(name)
	if err != nil {
		t.Fatal(err)
	}
	if addr != "" {
		a, err := netlink.ParseAddr(addr)
		if err != nil {
			t.Fatal(err)
		}
		if err := netlink.AddrAdd(link, a); err != nil {
			t.Fatalf("address %s on %s: %v", addr, name, err)
		}
	}
	if err := netlink.LinkSetUp(link); err != nil {
		t.Fatal(err)
	}
	return link
}

// forward asks the kernel how it would route a packet from src to dst
// arriving on iif: the output device's name, or the error (EACCES for a
// prohibit route, EINVAL for a blackhole).
func forward(t *testing.T, iif string, src, dst string) (string, error) {
	t.Helper()
	rts, err := netlink.RouteGetWithOptions(net.ParseIP(dst), &netlink.RouteGetOptions{Iif: iif, SrcAddr: net.ParseIP(src)})
	if err != nil {
		return "", err
	}
	l, err := netlink.LinkByIndex(rts[0].LinkIndex)
	if err != nil {
		return "", err
	}
	return l.Attrs().Name, nil
}

// testNode builds, in a new namespace, a node with a pod link "pod1"
// (pod 10.1.0.1, fd01::1; a neighbour 10.1.0.2, fd01::2 on "pod2") and an
// uplink "up0" towards 10.9.0.0/16 and fd09::/64, and opens the TUN "mt0"
// and the sink "mt0s".
func testNode(t *testing.T) (dev, sink *Device, cfg RoutingConfig) {
	inNewNetns(t)
	pod1 := addDummy(t, "pod1", "")
	pod2 := addDummy(t, "pod2", "")
	addDummy(t, "up0", "10.9.0.1/16")
	up6, _ := netlink.ParseAddr("fd09::1/64")
	up, _ := netlink.LinkByName("up0")
	if err := netlink.AddrAdd(up, up6); err != nil {
		t.Fatal(err)
	}
	for _, r := range []struct {
		link netlink.Link
		dst  string
	}{{pod1, "10.1.0.1/32"}, {pod1, "fd01::1/128"}, {pod2, "10.1.0.2/32"}, {pod2, "fd01::2/128"}} {
		_, dst, _ := net.ParseCIDR(r.dst)
		if err := netlink.RouteAdd(&netlink.Route{LinkIndex: r.link.Attrs().Index, Dst: dst, Scope: netlink.SCOPE_LINK}); err != nil {
			t.Fatal(err)
		}
	}
	var err error
	dev, err = Open(Config{Name: "mt0"})
	if err != nil {
		t.Fatal(err)
	}
	sink, err = Open(Config{Name: "mt0s", NoOffload: true})
	if err != nil {
		t.Fatal(err)
	}
	sys, err := SetSysctls(SysctlConfig{TUN: dev.Name(), IPv4: true, IPv6: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sys.Restore() })
	cfg = RoutingConfig{
		CaptureLinks: []CaptureLink{{Name: "pod1", Sources: []netip.Addr{netip.MustParseAddr("10.1.0.1"), netip.MustParseAddr("fd01::1")}}},
		PodPrefixes:  []netip.Prefix{netip.MustParsePrefix("10.1.0.1/32"), netip.MustParsePrefix("fd01::1/128")},
	}
	return dev, sink, cfg
}

// TestRoutingFailsClosed: a pod's own traffic goes to the TUN, a spoofed
// source to the sink; once the proxy is gone (Close, devices closed) the
// same traffic is prohibited (spoofed: blackholed), never routed through
// the main table, until Uninstall removes everything.
func TestRoutingFailsClosed(t *testing.T) {
	dev, sink, cfg := testNode(t)
	r, err := InstallRouting(dev, sink, cfg)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct{ iif, src, dst, want string }{
		{"pod1", "10.1.0.1", "10.9.0.7", "mt0"},
		{"pod1", "fd01::1", "fd09::7", "mt0"},
		{"pod1", "10.1.0.2", "10.9.0.7", "mt0s"}, // the neighbour's address
		{"pod1", "fd01::2", "fd09::7", "mt0s"},
		{"pod1", "10.9.0.99", "10.9.0.7", "mt0s"}, // any other address
		{"pod1", "10.1.0.2", "10.1.0.1", "mt0s"},  // even to a captured pod
		{"up0", "10.9.0.7", "10.1.0.1", "mt0"},    // to the pod from outside
		{"up0", "fd09::7", "fd01::1", "mt0"},
		{"pod2", "10.1.0.2", "10.9.0.7", "up0"}, // a pod not captured
		// A captured pod's address from anywhere but its own link:
		// another pod's link, the uplink; to anywhere, the pod itself
		// included.
		{"pod2", "10.1.0.1", "10.9.0.7", "mt0s"},
		{"pod2", "fd01::1", "fd09::7", "mt0s"},
		{"pod2", "10.1.0.1", "10.1.0.1", "mt0s"},
		{"up0", "10.1.0.1", "10.9.0.8", "mt0s"},
		{"up0", "fd01::1", "fd09::8", "mt0s"},
		{"up0", "fd01::1", "fd01::1", "mt0s"},
		// What the TUN writes back from the pod goes on.
		{"mt0", "10.1.0.1", "10.9.0.7", "up0"},
		{"mt0", "fd01::1", "fd09::7", "up0"},
	} {
		if got, err := forward(t, c.iif, c.src, c.dst); err != nil || got != c.want {
			t.Errorf("running: %s → %s on %s routed to %q (%v), want %s", c.src, c.dst, c.iif, got, err, c.want)
		}
	}
	if err := Uninstall(); !errors.Is(err, ErrRunning) {
		t.Errorf("Uninstall while the devices route: %v, want ErrRunning", err)
	}

	// The proxy stops (or dies: closing the devices alone has the same
	// effect on the routes through them).
	if err := r.Close(); err != nil {
		t.Fatal(err)
	}
	dev.Close()
	sink.Close()
	for _, c := range []struct {
		iif, src, dst string
		want          unix.Errno
	}{
		{"pod1", "10.1.0.1", "10.9.0.7", unix.EACCES},
		{"pod1", "fd01::1", "fd09::7", unix.EACCES},
		{"up0", "10.9.0.7", "10.1.0.1", unix.EACCES},
		{"up0", "fd09::7", "fd01::1", unix.EACCES},
		{"pod1", "10.1.0.2", "10.9.0.7", unix.EINVAL},
		{"up0", "10.1.0.1", "10.9.0.8", unix.EINVAL},
		{"pod2", "fd01::1", "fd09::7", unix.EINVAL},
	} {
		if got, err := forward(t, c.iif, c.src, c.dst); !errors.Is(err, c.want) {
			t.Errorf("stopped: %s → %s on %s routed to %q (%v), want %v", c.src, c.dst, c.iif, got, err, c.want)
		}
	}

	if err := Uninstall(); err != nil {
		t.Fatal(err)
	}
	if got, err := forward(t, "pod1", "10.1.0.1", "10.9.0.7"); err != nil || got != "up0" {
		t.Errorf("after Uninstall: routed to %q (%v), want up0 (the main table)", got, err)
	}
	if left := ourRules(t); len(left) > 0 {
		t.Errorf("after Uninstall, rules left: %v", left)
	}
	for _, family := range []int{unix.AF_INET, unix.AF_INET6} {
		for _, table := range []int{DefaultTable, DefaultTable + 1} {
			rts, _ := netlink.RouteListFiltered(family, &netlink.Route{Table: table}, netlink.RT_FILTER_TABLE)
			if len(rts) > 0 {
				t.Errorf("after Uninstall, routes left in table %#x: %v", table, rts)
			}
		}
	}
}

func ourRules(t *testing.T) []string {
	t.Helper()
	rules, err := ours(DefaultTable, DefaultPriority)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, r := range rules {
		out = append(out, ruleKey(r))
	}
	return out
}

// TestRoutingRestartAdopts: a new run adopts the rules a stopped one left
// (no moment without them) and drops those of a pod that left meanwhile;
// Update releases a pod that leaves while running.
func TestRoutingRestartAdopts(t *testing.T) {
	dev, sink, cfg := testNode(t)
	two := cfg
	two.CaptureLinks = append(two.CaptureLinks, CaptureLink{Name: "pod2", Sources: []netip.Addr{netip.MustParseAddr("10.1.0.2")}})
	two.PodPrefixes = append(two.PodPrefixes, netip.MustParsePrefix("10.1.0.2/32"))
	r, err := InstallRouting(dev, sink, two)
	if err != nil {
		t.Fatal(err)
	}
	r.Close()
	dev.Close()
	sink.Close()
	if got, err := forward(t, "pod2", "10.1.0.2", "10.9.0.7"); !errors.Is(err, unix.EACCES) {
		t.Fatalf("stopped: pod2 routed to %q (%v), want EACCES", got, err)
	}

	dev, err = Open(Config{Name: "mt0"})
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	r, err = InstallRouting(dev, nil, cfg) // pod2 left the mesh
	if err != nil {
		t.Fatal(err)
	}
	if got, err := forward(t, "pod2", "10.1.0.2", "10.9.0.7"); err != nil || got != "up0" {
		t.Errorf("restart without pod2: pod2 routed to %q (%v), want up0", got, err)
	}
	if got, err := forward(t, "pod1", "10.1.0.1", "10.9.0.7"); err != nil || got != "mt0" {
		t.Errorf("restart: pod1 routed to %q (%v), want mt0", got, err)
	}
	// Without a sink, spoofed packets are blackholed.
	if got, err := forward(t, "pod1", "10.1.0.2", "10.9.0.7"); !errors.Is(err, unix.EINVAL) {
		t.Errorf("spoofed without sink: routed to %q (%v), want EINVAL (blackhole)", got, err)
	}
	if err := r.Update(nil, nil); err != nil {
		t.Fatal(err)
	}
	if got, err := forward(t, "pod1", "10.1.0.1", "10.9.0.7"); err != nil || got != "up0" {
		t.Errorf("after Update without pods: pod1 routed to %q (%v), want up0", got, err)
	}
	for _, k := range ourRules(t) {
		if strings.Contains(k, "pod1") || strings.Contains(k, "10.1.0.1") {
			t.Errorf("after Update without pods, rule left: %s", k)
		}
	}
}

// TestSysctlsStrictAll: with net.ipv4.conf.all.rp_filter strict, no
// device but the TUN changes (its own rp_filter 2, accept_local 1, the
// address RPFAddr, over netlink); Restore puts forwarding back.
func TestSysctlsStrictAll(t *testing.T) {
	inNewNetns(t)
	addDummy(t, "d0", "")
	addDummy(t, "d2", "")
	addDummy(t, "pod1", "")
	for k, v := range map[string]string{"all": "1", "d0": "0", "d2": "2", "default": "0", "pod1": "0"} {
		if err := writeSysctl("net/ipv4/conf/"+k+"/rp_filter", v); err != nil {
			t.Fatal(err)
		}
	}
	// A new namespace copies ip_forward from the machine's (podman, for
	// one, turns it on there): start from off, whatever the machine has.
	if err := writeSysctl("net/ipv4/ip_forward", "0"); err != nil {
		t.Fatal(err)
	}
	dev, err := Open(Config{Name: "mt0"})
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	s, err := SetSysctls(SysctlConfig{TUN: "mt0", IPv4: true})
	if err != nil {
		t.Fatal(err)
	}
	check := func(when string, want map[string]string) {
		t.Helper()
		for k, v := range want {
			got, err := readSysctl("net/ipv4/" + k)
			if err != nil || got != v {
				t.Errorf("%s: %s = %q (%v), want %s", when, k, got, err, v)
			}
		}
	}
	unchanged := map[string]string{"conf/all/rp_filter": "1", "conf/d0/rp_filter": "0", "conf/d2/rp_filter": "2", "conf/default/rp_filter": "0", "conf/pod1/rp_filter": "0"}
	check("running", unchanged)
	check("running", map[string]string{"conf/mt0/rp_filter": "2", "conf/mt0/accept_local": "1", "ip_forward": "1"})
	l, err := netlink.LinkByIndex(dev.Index())
	if err != nil {
		t.Fatal(err)
	}
	addrs, err := netlink.AddrList(l, unix.AF_INET)
	if err != nil || len(addrs) != 1 || !addrs[0].IP.Equal(RPFAddr) || addrs[0].Scope != unix.RT_SCOPE_HOST {
		t.Errorf("addresses of the TUN: %v (%v), want %s scope host", addrs, err, RPFAddr)
	}
	if err := s.Restore(); err != nil {
		t.Fatal(err)
	}
	check("restored", unchanged)
	check("restored", map[string]string{"ip_forward": "0"})
}

// TestNodeTrafficCaptured: what the node itself sends to a captured pod
// is routed into the TUN, whatever its socket mark: no mark exempts a
// socket (any process with CAP_NET_RAW may set one). meshtun's own sockets
// are let through by the classifier (classify.Exempt).
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
	r, err := InstallRouting(d, nil, RoutingConfig{CaptureLinks: []CaptureLink{{Name: "pod0", Sources: []netip.Addr{podAddr}}}, PodPrefixes: []netip.Prefix{netip.PrefixFrom(podAddr, 32)}})
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
	if got := via(0x6d74); got != d.Index() { // the mark meshtun used to exempt
		t.Errorf("packets marked 0x6d74 to the pod leave through link %d, want the TUN (%d)", got, d.Index())
	}
}
