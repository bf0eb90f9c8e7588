package tun

import (
	"io"
	"net"
	"net/netip"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// TestLocalDelivery: in a private namespace with a TUN, routing and a pod
// link, a client behind an uplink connects to the pod's port 15008 and a
// transparent listener of the node accepts it, with the pod's address as
// its local address (IPv4 and IPv6); any other port of the pod still
// routes into the TUN, and port 15008 coming back from the TUN (a dial
// the netstack makes for a client) still reaches the pod's link, and
// from another local pod's link it is captured as before. With Replies,
// the node dials the client's port 15008 from the pod's address and a
// port of the range (a transparent socket): the client sees the pod's
// address, the replies come back to the node's socket, and a segment from
// port 15008 to another port of the pod still goes into the TUN. Close
// and the stale-state cleanup remove everything.
func TestLocalDelivery(t *testing.T) {
	inNewNetns(t)
	nodeNS, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer nodeNS.Close()
	clientNS, err := netns.New() // the thread is now in it
	if err != nil {
		t.Fatal(err)
	}
	defer clientNS.Close()
	inClient := func(f func()) {
		t.Helper()
		if err := netns.Set(clientNS); err != nil {
			t.Fatal(err)
		}
		defer func() {
			if err := netns.Set(nodeNS); err != nil {
				panic(err)
			}
		}()
		f()
	}
	if err := netns.Set(nodeNS); err != nil {
		t.Fatal(err)
	}
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	addr := func(link netlink.Link, p string) {
		t.Helper()
		a, err := netlink.ParseAddr(p)
		must(err)
		a.Flags = unix.IFA_F_NODAD
		must(netlink.AddrAdd(link, a))
	}
	for _, k := range []string{"net/ipv4/ip_forward", "net/ipv6/conf/all/forwarding"} {
		must(writeSysctl(k, "1"))
	}

	pod4 := netip.MustParseAddr("198.18.201.11")
	pod6 := netip.MustParseAddr("fd00:6d74:201::11")
	client4 := netip.MustParseAddr("198.18.200.2")
	client6 := netip.MustParseAddr("fd00:6d74:200::2")

	up := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "up0"}, PeerName: "up0c"}
	must(netlink.LinkAdd(up))
	upc, err := netlink.LinkByName("up0c")
	must(err)
	must(netlink.LinkSetNsFd(upc, int(clientNS)))
	must(netlink.LinkSetUp(up))
	addr(up, "198.18.200.1/24")
	addr(up, "fd00:6d74:200::1/64")
	inClient(func() {
		lo, err := netlink.LinkByName("lo")
		must(err)
		must(netlink.LinkSetUp(lo))
		upc, err := netlink.LinkByName("up0c")
		must(err)
		must(netlink.LinkSetUp(upc))
		addr(upc, client4.String()+"/24")
		addr(upc, client6.String()+"/64")
		must(netlink.RouteAdd(&netlink.Route{Dst: prefixToIPNet(netip.MustParsePrefix("198.18.201.0/24")), Gw: net.ParseIP("198.18.200.1")}))
		must(netlink.RouteAdd(&netlink.Route{Dst: prefixToIPNet(netip.MustParsePrefix("fd00:6d74:201::/64")), Gw: net.ParseIP("fd00:6d74:200::1")}))
	})

	pod := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "pod0"}, PeerName: "pod0peer"}
	must(netlink.LinkAdd(pod))
	must(netlink.LinkSetUp(pod))
	for _, a := range []netip.Addr{pod4, pod6} {
		must(netlink.RouteAdd(&netlink.Route{LinkIndex: pod.Attrs().Index, Dst: prefixToIPNet(netip.PrefixFrom(a, a.BitLen())), Scope: netlink.SCOPE_LINK}))
	}
	d, err := Open(Config{Name: "mt0"})
	must(err)
	defer d.Close()
	r, err := InstallRouting(d, nil, RoutingConfig{CaptureLinks: []CaptureLink{{Name: "pod0", Sources: []netip.Addr{
		pod4, pod6, netip.MustParseAddr("198.18.201.12"), netip.MustParseAddr("fd00:6d74:201::12")}}},
		PodPrefixes: []netip.Prefix{netip.PrefixFrom(pod4, 32), netip.PrefixFrom(pod6, 128)}})
	must(err)
	defer r.Close()
	replies := PortRange{Lo: 64512, Hi: 65534}
	ld, err := InstallLocalDelivery(LocalDeliveryConfig{Port: 15008, Pods: []netip.Addr{pod4, pod6}, Replies: replies})
	must(err)
	defer ld.Close()
	// The listener answers from the pods' addresses, and the node's
	// connections leave from them: without this their packets meet the
	// spoof rules.
	must(r.SetLocalDelivery(15008, replies))
	if v4, v6 := ld.Families(); !v4 || !v6 {
		t.Fatalf("families delivered locally: IPv4 %v, IPv6 %v; want both", v4, v6)
	}

	lc := net.ListenConfig{Control: TransparentSocket}
	ln, err := lc.Listen(t.Context(), "tcp", ":15008")
	must(err)
	defer ln.Close()

	for _, tc := range []struct{ pod, client netip.Addr }{{pod4, client4}, {pod6, client6}} {
		dst := netip.AddrPortFrom(tc.pod, 15008)
		var c net.Conn
		inClient(func() {
			c, err = net.DialTimeout("tcp", dst.String(), 5*time.Second)
		})
		if err != nil {
			t.Fatalf("client dials %s: %v", dst, err)
		}
		defer c.Close()
		ln.(*net.TCPListener).SetDeadline(time.Now().Add(5 * time.Second))
		s, err := ln.Accept()
		if err != nil {
			t.Fatalf("accept of %s: %v", dst, err)
		}
		local := s.LocalAddr().(*net.TCPAddr).AddrPort()
		remote := s.RemoteAddr().(*net.TCPAddr).AddrPort()
		s.Close()
		if local.Addr().Unmap() != tc.pod || local.Port() != 15008 || remote.Addr().Unmap() != tc.client {
			t.Errorf("accepted %s → %s; want %s → %s", remote, local, tc.client, dst)
		}
	}

	// The node's connection from a pod's address to the client's port
	// 15008 (outbound HBONE from the client pod's address), under strict
	// reverse-path filtering on the uplink (kind sets all.rp_filter=1):
	// the check of a reply looks the swapped flow up as sent from lo,
	// which the exemption answers with the uplink.
	for _, k := range []string{"net/ipv4/conf/all/rp_filter", "net/ipv4/conf/up0/rp_filter"} {
		must(writeSysctl(k, "1"))
	}
	var peerLn net.Listener
	inClient(func() {
		peerLn, err = net.Listen("tcp", ":15008")
	})
	must(err)
	defer peerLn.Close()
	for _, tc := range []struct{ pod, client netip.Addr }{{pod4, client4}, {pod6, client6}} {
		local := netip.AddrPortFrom(tc.pod, 64600)
		d := net.Dialer{Timeout: 5 * time.Second, Control: func(network, address string, c syscall.RawConn) error {
			if err := TransparentSocket(network, address, c); err != nil {
				return err
			}
			var berr error
			c.Control(func(fd uintptr) {
				var sa unix.Sockaddr = &unix.SockaddrInet6{Addr: tc.pod.As16(), Port: int(local.Port())}
				if tc.pod.Is4() {
					sa = &unix.SockaddrInet4{Addr: tc.pod.As4(), Port: int(local.Port())}
				}
				berr = unix.Bind(int(fd), sa)
			})
			return berr
		}}
		network := "tcp4"
		if tc.pod.Is6() {
			network = "tcp6"
		}
		c, err := d.Dial(network, netip.AddrPortFrom(tc.client, 15008).String())
		if err != nil {
			t.Fatalf("node dials %s:15008 from %s: %v", tc.client, local, err)
		}
		peerLn.(*net.TCPListener).SetDeadline(time.Now().Add(5 * time.Second))
		s, err := peerLn.Accept()
		if err != nil {
			t.Fatalf("client accepts the node's connection from %s: %v", local, err)
		}
		if got := s.RemoteAddr().(*net.TCPAddr).AddrPort(); got.Addr().Unmap() != tc.pod || got.Port() != local.Port() {
			t.Errorf("client sees the node's connection from %s, want %s", got, local)
		}
		// Data both ways: the replies reach the node's socket.
		s.SetDeadline(time.Now().Add(5 * time.Second))
		c.SetDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 4)
		if _, err := c.Write([]byte("ping")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(s, buf); err != nil || string(buf) != "ping" {
			t.Fatalf("client read %q, %v", buf, err)
		}
		if _, err := s.Write([]byte("pong")); err != nil {
			t.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "pong" {
			t.Fatalf("node read %q, %v (the reply from port 15008 was not delivered to its socket)", buf, err)
		}
		s.Close()
		c.Close()
	}
	// The route lookups below simulate arrivals (from the TUN, from a
	// pod's link) that strict filtering would judge by routes this
	// namespace does not have: back to the default.
	for _, k := range []string{"net/ipv4/conf/all/rp_filter", "net/ipv4/conf/up0/rp_filter"} {
		must(writeSysctl(k, "0"))
	}
	for _, tc := range []struct {
		from, pod netip.Addr
		sport     string
		dport     string
		want      string
	}{
		{client4, pod4, "15008", "64600", "local " + pod4.String()},
		{client6, pod6, "15008", "64600", "local " + pod6.String()},
		// A pod's own connection to a server's port 15008, from a port
		// outside the range: its replies still go to the pod (the TUN).
		{client4, pod4, "15008", "40000", "dev mt0"},
		{client6, pod6, "15008", "40000", "dev mt0"},
		{client4, pod4, "15009", "64600", "dev mt0"},
	} {
		out, err := exec.Command("ip", "route", "get", tc.pod.String(), "from", tc.from.String(), "iif", "up0",
			"ipproto", "tcp", "sport", tc.sport, "dport", tc.dport).CombinedOutput()
		if err != nil {
			t.Fatalf("ip route get: %v: %s", err, out)
		}
		if !strings.Contains(string(out), tc.want) {
			t.Errorf("tcp %s:%s → %s:%s arriving on up0: %q; want %q", tc.from, tc.sport, tc.pod, tc.dport, strings.TrimSpace(string(out)), tc.want)
		}
	}

	// Other ports from the uplink go into the TUN; port 15008 from the
	// TUN goes to the pod's link; port 15008 from the uplink is local, from
	// a captured pod's link (another local pod) it is captured as before.
	for _, tc := range []struct {
		from, pod netip.Addr
		iif       string
		port      string
		want      string
	}{
		{client4, pod4, "up0", "8080", "dev mt0"},
		{client6, pod6, "up0", "8080", "dev mt0"},
		{client4, pod4, "up0", "15008", "local " + pod4.String()},
		{client6, pod6, "up0", "15008", "local " + pod6.String()},
		{client4, pod4, "mt0", "15008", "dev pod0"},
		{client6, pod6, "mt0", "15008", "dev pod0"},
		{netip.MustParseAddr("198.18.201.12"), pod4, "pod0", "15008", "dev mt0"},
		{netip.MustParseAddr("fd00:6d74:201::12"), pod6, "pod0", "15008", "dev mt0"},
	} {
		out, err := exec.Command("ip", "route", "get", tc.pod.String(), "from", tc.from.String(), "iif", tc.iif,
			"ipproto", "tcp", "dport", tc.port).CombinedOutput()
		if err != nil {
			t.Fatalf("ip route get: %v: %s", err, out)
		}
		if !strings.Contains(string(out), tc.want) {
			t.Errorf("tcp %s → %s:%s arriving on %s: %q; want %q", tc.from, tc.pod, tc.port, tc.iif, strings.TrimSpace(string(out)), tc.want)
		}
	}

	// A pod that leaves loses its rule.
	must(ld.Update([]netip.Addr{pod6}))
	if ld.Covers(pod4) || !ld.Covers(pod6) {
		t.Errorf("after Update(%s): covers %s %v, %s %v", pod6, pod4, ld.Covers(pod4), pod6, ld.Covers(pod6))
	}

	// The exemptions go with SetLocalDelivery(0).
	must(r.SetLocalDelivery(0, PortRange{}))
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		rules, err := netlink.RuleList(fam)
		must(err)
		for _, rule := range rules {
			if rule.IifName == "lo" && rule.IPProto == unix.IPPROTO_TCP {
				t.Errorf("family %d: exemption %s left after SetLocalDelivery(0)", fam, rule)
			}
		}
	}

	// What a crashed run leaves is removed by the stale-state cleanup.
	must(RemoveStale(DefaultTable))
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		rules, err := netlink.RuleListFiltered(fam, &netlink.Rule{Table: LocalTable}, netlink.RT_FILTER_TABLE)
		must(err)
		routes, err := netlink.RouteListFiltered(fam, &netlink.Route{Table: LocalTable}, netlink.RT_FILTER_TABLE)
		must(err)
		if len(rules)+len(routes) > 0 {
			t.Errorf("family %d after RemoveStale: rules %v, routes %v", fam, rules, routes)
		}
	}
}
