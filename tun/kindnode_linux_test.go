package tun

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// The addresses of TestKindNodeSettings: a pod behind link "pod1" (kindnet
// style: a /32 and /128 route per pod veth, the gateway address on the
// node side), the node's own address on its uplink "up0", and a remote
// peer whose route goes out of the uplink.
var (
	kindPod4, kindPod6       = netip.MustParseAddr("10.244.0.5"), netip.MustParseAddr("fd00:10:244::5")
	kindNode4, kindNode6     = netip.MustParseAddr("172.18.0.2"), netip.MustParseAddr("fc00:f853:ccd:e793::2")
	kindRemote4, kindRemote6 = netip.MustParseAddr("10.244.1.7"), netip.MustParseAddr("fd00:10:244:1::7")
)

const kindNodeEnv = "MESHTUN_TEST_CONFINED_NODE"

// TestKindNodeSettings: the node's TUN setup works on kind's default node
// settings, in a confined process as the DaemonSet runs (CAP_NET_ADMIN
// only, /proc/sys mounted read-only, net.ipv4.conf.{all,default}.rp_filter=1),
// on IPv4-only, IPv6-only and dual-stack nodes (kind turns IPv6
// forwarding on only for the latter two), and what the TUN writes back to
// the pod is delivered: with a remote source (mesh traffic inbound) and
// with the node's own address as source (the node's verbatim traffic,
// e.g. kubelet probes). The confined child reports its setup on stdout;
// the pod's sockets (in the parent) check the packets.
func TestKindNodeSettings(t *testing.T) {
	if c := os.Getenv(kindNodeEnv); c != "" {
		confinedNode(t, c)
		return
	}
	for _, c := range []struct {
		name   string
		v4, v6 bool
	}{{"ipv4", true, false}, {"ipv6", false, true}, {"dual", true, true},
		// Not kind: IPv4 forwarding off too, set per device over netlink.
		{"ipv4-noforward", true, false},
		// IPv6 pods, IPv6 forwarding off: no netlink way, so the node
		// refuses to start, naming the sysctl.
		{"ipv6-noforward", false, true}} {
		t.Run(c.name, func(t *testing.T) { kindNode(t, c.name, c.v4, c.v6) })
	}
}

// kindNode builds a kind-like node namespace with one pod, starts the
// confined child in it and checks that the pod receives what the child's
// TUN writes.
func kindNode(t *testing.T, name string, v4, v6 bool) {
	inNewNetns(t)
	for key, val := range map[string]string{
		"net/ipv4/conf/all/rp_filter": "1", "net/ipv4/conf/default/rp_filter": "1",
		// kube-proxy's (iptables mode, for NodePorts on 127.0.0.1): with
		// it a scope-host address counts as scope link in the kernel's
		// choice of a source address.
		"net/ipv4/conf/all/route_localnet": "1",
		"net/ipv4/ip_forward":              b01(v4 && name != "ipv4-noforward"), "net/ipv6/conf/all/forwarding": b01(v6 && name != "ipv6-noforward"),
	} {
		if err := writeSysctl(key, val); err != nil {
			t.Fatal(err)
		}
	}
	nodeNS, err := netns.Get()
	if err != nil {
		t.Fatal(err)
	}
	defer nodeNS.Close()
	podNS, err := netns.New() // and the thread is in it
	if err != nil {
		t.Fatal(err)
	}
	defer podNS.Close()
	if err := netns.Set(nodeNS); err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkAdd(&netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "pod1"}, PeerName: "eth0", PeerNamespace: netlink.NsFd(int(podNS))}); err != nil {
		t.Fatal(err)
	}
	up := addDummy(t, "up0", "")
	pod1, err := netlink.LinkByName("pod1")
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(pod1); err != nil {
		t.Fatal(err)
	}
	ph, err := netlink.NewHandleAt(podNS)
	if err != nil {
		t.Fatal(err)
	}
	defer ph.Close()
	lo, _ := ph.LinkByName("lo")
	eth0, err := ph.LinkByName("eth0")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range []netlink.Link{lo, eth0} {
		if err := ph.LinkSetUp(l); err != nil {
			t.Fatal(err)
		}
	}
	addr := func(h *netlink.Handle, l netlink.Link, a netip.Addr, bits int) {
		t.Helper()
		na := &netlink.Addr{IPNet: &net.IPNet{IP: a.AsSlice(), Mask: net.CIDRMask(bits, a.BitLen())}, Flags: unix.IFA_F_NODAD}
		if err := h.AddrAdd(l, na); err != nil {
			t.Fatalf("address %s: %v", a, err)
		}
	}
	route := func(h *netlink.Handle, l netlink.Link, dst netip.Prefix) {
		t.Helper()
		if err := h.RouteAdd(&netlink.Route{LinkIndex: l.Attrs().Index, Dst: prefixToIPNet(dst), Scope: netlink.SCOPE_LINK}); err != nil {
			t.Fatalf("route %s: %v", dst, err)
		}
	}
	nh := &netlink.Handle{}
	var pods []netip.Addr
	if v4 {
		pods = append(pods, kindPod4)
		addr(nh, pod1, netip.MustParseAddr("10.244.0.1"), 32) // ptp's gateway address
		addr(nh, up, kindNode4, 16)
		route(nh, pod1, netip.PrefixFrom(kindPod4, 32))
		route(nh, up, netip.MustParsePrefix("10.244.1.0/24"))
		addr(ph, eth0, kindPod4, 32)
		gateway(t, ph, eth0, netip.MustParseAddr("10.244.0.1"))
	}
	if v6 {
		pods = append(pods, kindPod6)
		addr(nh, up, kindNode6, 64)
		addr(nh, pod1, netip.MustParseAddr("fd00:10:244::1"), 128)
		route(nh, pod1, netip.PrefixFrom(kindPod6, 128))
		route(nh, up, netip.MustParsePrefix("fd00:10:244:1::/64"))
		addr(ph, eth0, kindPod6, 128)
		gateway(t, ph, eth0, netip.MustParseAddr("fd00:10:244::1"))
	}
	// The pod's receivers, opened in its namespace.
	if err := netns.Set(podNS); err != nil {
		t.Fatal(err)
	}
	conns := map[netip.Addr]*net.UDPConn{}
	for _, a := range pods {
		c, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(a, 9000)))
		if err != nil {
			netns.Set(nodeNS)
			t.Fatal(err)
		}
		defer c.Close()
		conns[a] = c
	}
	if err := netns.Set(nodeNS); err != nil {
		t.Fatal(err)
	}

	// The node proxy's part, confined as the DaemonSet confines it: a
	// mount namespace of its own with /proc/sys bound read-only, and
	// every capability but CAP_NET_ADMIN dropped from the bounding set
	// before the exec (so root gets only that one). The fork happens on
	// this locked thread, so the child starts in the node's namespace.
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "sh", "-c",
		`mount --bind -o ro /proc/sys /proc/sys && exec setpriv --inh-caps=-all --bounding-set=-all,+net_admin -- "$0" "$@"`,
		os.Args[0], "-test.run=^TestKindNodeSettings$", "-test.v")
	cmd.Env = append(os.Environ(), kindNodeEnv+"="+name)
	cmd.Stderr = os.Stderr
	stdin, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	out := make(chan string, 100)
	go func() {
		sc := bufio.NewScanner(stdout)
		for sc.Scan() {
			out <- sc.Text()
		}
		close(out)
	}()
	var lines []string
	ready := false
	for l := range out {
		lines = append(lines, l)
		if name == "ipv6-noforward" && strings.HasPrefix(l, "confined node: refused: ") {
			t.Log(l)
			if !strings.Contains(l, "net.ipv6.conf.all.forwarding") {
				t.Errorf("the refusal does not name the sysctl: %s", l)
			}
			stdin.Close()
			if err := cmd.Wait(); err != nil {
				t.Errorf("confined node: %v", err)
			}
			return
		}
		if l == "confined node: ready" {
			ready = true
			break
		}
	}
	if !ready {
		stdin.Close()
		cmd.Wait()
		t.Fatalf("the confined node did not set up:\n%s", strings.Join(lines, "\n"))
	}
	t.Logf("confined node:\n%s", strings.Join(lines, "\n"))
	// The node's own connections to the pod (kubelet probes) are routed
	// into the TUN: their source, chosen by the kernel, must be one of
	// the node's addresses the pod can answer, never the TUN's scope-host
	// RPFAddr (the pod would answer 127.109.116.1 on its own loopback:
	// on kind every probe timed out).
	for _, a := range pods {
		rts, err := netlink.RouteGet(a.AsSlice())
		if err != nil || len(rts) != 1 {
			t.Fatalf("%s: route to pod %s: %v %v", name, a, rts, err)
		}
		src, _ := netip.AddrFromSlice(rts[0].Src)
		src = src.Unmap()
		t.Logf("%s: the node reaches pod %s through link %d from %s", name, a, rts[0].LinkIndex, src)
		if rts[0].LinkIndex != dev0Index(t) {
			t.Errorf("%s: the node's route to pod %s is not through the TUN: %v", name, a, rts[0])
		}
		if a.Is4() && src != kindNode4 && src != netip.MustParseAddr("10.244.0.1") {
			t.Errorf("%s: the node sends to pod %s from %s (want its address %s or the pod's gateway; RPFAddr is %s)", name, a, src, kindNode4, RPFAddr)
		}
	}
	// A lookup limited to link scope (SO_DONTROUTE) skips the TUN's route
	// of scope global: it must end in the blocking route (scope link), not
	// in the main table's direct route to the pod.
	for _, a := range pods {
		if !a.Is4() {
			continue // IPv6 routes have no scope
		}
		fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
		if err != nil {
			t.Fatal(err)
		}
		if err := unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_DONTROUTE, 1); err != nil {
			unix.Close(fd)
			t.Fatal(err)
		}
		err = unix.Connect(fd, &unix.SockaddrInet4{Port: 9000, Addr: a.As4()})
		unix.Close(fd)
		if !errors.Is(err, unix.EACCES) {
			t.Errorf("%s: a SO_DONTROUTE socket of the node connects to pod %s with %v, want EACCES (the blocking route), not a route around the TUN", name, a, err)
		}
	}
	// And the other way: what the pod sends (after resolving its gateway,
	// which a strict capture link would refuse) reaches the TUN.
	for _, a := range pods {
		remote := kindRemote4
		if a.Is6() {
			remote = kindRemote6
		}
		want := fmt.Sprintf("tun read %s -> %s", a, remote)
		deadline := time.After(5 * time.Second)
		tick := time.NewTicker(20 * time.Millisecond)
	wait:
		for {
			if _, err := conns[a].WriteToUDPAddrPort([]byte("out"), netip.AddrPortFrom(remote, 9001)); err != nil {
				t.Fatal(err)
			}
			select {
			case l, ok := <-out:
				if !ok {
					t.Errorf("%s: the confined node ended before the TUN read %q", name, want)
					break wait
				}
				lines = append(lines, l)
				if l == want {
					break wait
				}
			case <-deadline:
				t.Errorf("%s: the TUN never read the pod's packet (%q)", name, want)
				break wait
			case <-tick.C:
			}
		}
		tick.Stop()
	}
	// Now the TUN writes back to the pod.
	if _, err := stdin.Write([]byte("write\n")); err != nil {
		t.Fatal(err)
	}
	for _, a := range pods {
		got := map[string]bool{}
		c := conns[a]
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		buf := make([]byte, 100)
		for len(got) < 2 {
			n, from, err := c.ReadFromUDPAddrPort(buf)
			if err != nil {
				t.Errorf("%s: pod %s received %v of what the TUN wrote back (from a remote peer, from the node): %v", name, a, got, err)
				break
			}
			got[fmt.Sprintf("%s from %s", buf[:n], from.Addr())] = true
		}
		t.Logf("%s: pod %s received %v", name, a, got)
	}
	stdin.Close()
	for l := range out {
		lines = append(lines, l)
	}
	if err := cmd.Wait(); err != nil {
		t.Errorf("confined node: %v\n%s", err, strings.Join(lines, "\n"))
	}
}

func b01(b bool) string {
	if b {
		return "1"
	}
	return "0"
}

// confinedNode runs in the confined child: it checks the confinement,
// opens the TUN, prepares it and the routing as the node does, and then
// writes UDP packets to the pod (from a remote peer, from the node's own
// address) until its stdin closes.
func confinedNode(t *testing.T, name string) {
	v4, v6 := strings.HasPrefix(name, "ipv4") || name == "dual", strings.HasPrefix(name, "ipv6") || name == "dual"
	if _, err := netlink.LinkByName("pod1"); err != nil {
		t.Fatalf("not in the node's namespace: %v", err)
	}
	if err := writeSysctl("net/ipv4/conf/all/rp_filter", "1"); !errors.Is(err, unix.EROFS) {
		t.Fatalf("/proc/sys is not read-only here: %v", err)
	}
	var hdr = unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		t.Fatal(err)
	}
	if data[0].Effective != 1<<unix.CAP_NET_ADMIN || data[1].Effective != 0 {
		t.Fatalf("effective capabilities %#x %#x, want CAP_NET_ADMIN only", data[0].Effective, data[1].Effective)
	}
	if v, _ := readSysctl("net/ipv4/conf/all/rp_filter"); v != "1" {
		t.Fatalf("all.rp_filter = %s, want kind's 1", v)
	}

	dev, err := Open(Config{Name: "mt0", NoOffload: true})
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	log := zerolog.New(zerolog.NewTestWriter(t))
	sys, err := SetSysctls(SysctlConfig{TUN: dev.Name(), IPv4: v4, IPv6: v6, Logger: log})
	if name == "ipv6-noforward" {
		if err == nil {
			t.Fatal("SetSysctls accepted IPv6 pods with IPv6 forwarding off")
		}
		fmt.Println("confined node: refused:", err)
		return
	}
	if err != nil {
		t.Fatalf("SetSysctls on a kind node (%s): %v", name, err)
	}
	defer sys.Restore()
	var pods []netip.Addr
	var prefixes []netip.Prefix
	if v4 {
		pods = append(pods, kindPod4)
	}
	if v6 {
		pods = append(pods, kindPod6)
	}
	for _, a := range pods {
		prefixes = append(prefixes, netip.PrefixFrom(a, a.BitLen()))
	}
	r, err := InstallRouting(dev, nil, RoutingConfig{CaptureLinks: []CaptureLink{{Name: "pod1", Sources: pods}}, PodPrefixes: prefixes})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()

	var pkts [][]byte
	for _, p := range pods {
		remote, node := kindRemote4, kindNode4
		if p.Is6() {
			remote, node = kindRemote6, kindNode6
		}
		pkts = append(pkts, udpPacket(remote, p, 4000, 9000, "remote"), udpPacket(node, p, 4001, 9000, "node"))
	}
	for _, k := range []string{"all/rp_filter", "mt0/rp_filter", "mt0/accept_local", "pod1/rp_filter", "up0/rp_filter"} {
		v, _ := readSysctl("net/ipv4/conf/" + k)
		fmt.Println(k, v)
	}
	go func() {
		buf := make([]byte, 2048)
		for {
			n, err := dev.Read(buf)
			if err != nil {
				return
			}
			if src, dst, dport, ok := udpOf(buf[:n]); ok && dport == 9001 {
				fmt.Printf("tun read %s -> %s\n", src, dst)
			}
		}
	}()
	fmt.Println("confined node: ready")
	// It writes only when told to, so that the pod first resolves its
	// gateway itself (the node's ARP request for the pod, on the first
	// write, would teach the pod the gateway's address).
	in := bufio.NewReader(os.Stdin)
	if l, err := in.ReadString('\n'); err != nil || l != "write\n" {
		t.Fatalf("stdin: %q, %v", l, err)
	}
	done := make(chan struct{})
	go func() { in.ReadString(0); close(done) }()
	tick := time.NewTicker(20 * time.Millisecond) // UDP: resent until the parent has them
	defer tick.Stop()
	for {
		for _, p := range pkts {
			if _, err := dev.Write(p); err != nil {
				t.Fatal(err)
			}
		}
		select {
		case <-done:
			return
		case <-time.After(10 * time.Second):
			t.Fatal("the parent never closed stdin")
		case <-tick.C:
		}
	}
}

// udpPacket builds an IPv4 or IPv6 UDP packet with valid checksums.
func udpPacket(src, dst netip.Addr, sport, dport uint16, payload string) []byte {
	udp := make([]byte, 8+len(payload))
	binary.BigEndian.PutUint16(udp[0:], sport)
	binary.BigEndian.PutUint16(udp[2:], dport)
	binary.BigEndian.PutUint16(udp[4:], uint16(len(udp)))
	copy(udp[8:], payload)
	s, d := src.AsSlice(), dst.AsSlice()
	pseudo := append(append(append([]byte{}, s...), d...), 0, unix.IPPROTO_UDP, byte(len(udp)>>8), byte(len(udp)))
	sum := ^checksum(append(pseudo, udp...))
	if sum == 0 {
		sum = 0xffff
	}
	binary.BigEndian.PutUint16(udp[6:], sum)
	if src.Is4() {
		ip := make([]byte, 20)
		ip[0], ip[8], ip[9] = 0x45, 64, unix.IPPROTO_UDP
		binary.BigEndian.PutUint16(ip[2:], uint16(20+len(udp)))
		copy(ip[12:], s)
		copy(ip[16:], d)
		binary.BigEndian.PutUint16(ip[10:], ^checksum(ip))
		return append(ip, udp...)
	}
	ip := make([]byte, 40)
	ip[0], ip[6], ip[7] = 0x60, unix.IPPROTO_UDP, 64
	binary.BigEndian.PutUint16(ip[4:], uint16(len(udp)))
	copy(ip[8:], s)
	copy(ip[24:], d)
	return append(ip, udp...)
}

func checksum(b []byte) uint16 {
	var s uint32
	for i := 0; i+1 < len(b); i += 2 {
		s += uint32(binary.BigEndian.Uint16(b[i:]))
	}
	if len(b)%2 == 1 {
		s += uint32(b[len(b)-1]) << 8
	}
	for s > 0xffff {
		s = s>>16 + s&0xffff
	}
	return uint16(s)
}

// gateway gives the pod a default route via gw on link l, on-link (as
// kindnet's ptp does).
func gateway(t *testing.T, h *netlink.Handle, l netlink.Link, gw netip.Addr) {
	t.Helper()
	dst := netip.PrefixFrom(netip.IPv4Unspecified(), 0)
	if gw.Is6() {
		dst = netip.PrefixFrom(netip.IPv6Unspecified(), 0)
	}
	r := &netlink.Route{LinkIndex: l.Attrs().Index, Dst: prefixToIPNet(dst), Gw: gw.AsSlice(), Flags: int(netlink.FLAG_ONLINK)}
	if err := h.RouteAdd(r); err != nil {
		t.Fatalf("default route via %s: %v", gw, err)
	}
}

// udpOf returns the addresses and destination port of an IPv4 or IPv6
// UDP packet.
func udpOf(p []byte) (src, dst netip.Addr, dport uint16, ok bool) {
	switch {
	case len(p) >= 28 && p[0]>>4 == 4 && p[9] == unix.IPPROTO_UDP:
		ihl := int(p[0]&0xf) * 4
		if len(p) < ihl+8 {
			return
		}
		src, _ = netip.AddrFromSlice(p[12:16])
		dst, _ = netip.AddrFromSlice(p[16:20])
		return src, dst, binary.BigEndian.Uint16(p[ihl+2:]), true
	case len(p) >= 48 && p[0]>>4 == 6 && p[6] == unix.IPPROTO_UDP:
		src, _ = netip.AddrFromSlice(p[8:24])
		dst, _ = netip.AddrFromSlice(p[24:40])
		return src, dst, binary.BigEndian.Uint16(p[42:]), true
	}
	return
}

// dev0Index is the index of the confined node's TUN, mt0, in the current
// namespace.
func dev0Index(t *testing.T) int {
	t.Helper()
	l, err := netlink.LinkByName("mt0")
	if err != nil {
		t.Fatalf("the confined node's TUN: %v", err)
	}
	return l.Attrs().Index
}
