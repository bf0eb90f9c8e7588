package cluster

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/meshtun/meshtun/test/fixture"
	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// rootSnapshot lists the links and the routes of the test process's own
// namespace (the one its main thread is in).
func rootSnapshot(t *testing.T) (links, routes []string) {
	t.Helper()
	ns, err := netns.GetFromPath("/proc/self/ns/net")
	if err != nil {
		t.Fatalf("open root netns: %v", err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		t.Fatalf("root netlink handle: %v", err)
	}
	defer h.Close()
	ls, err := h.LinkList()
	if err != nil {
		t.Fatalf("root links: %v", err)
	}
	for _, l := range ls {
		links = append(links, fmt.Sprintf("%d %s %s", l.Attrs().Index, l.Attrs().Name, l.Type()))
	}
	names, err := linkNames(h)
	if err != nil {
		t.Fatal(err)
	}
	for _, fam := range []int{unix.AF_INET, unix.AF_INET6} {
		rs, err := h.RouteListFiltered(fam, &netlink.Route{}, netlink.RT_FILTER_TABLE)
		if err != nil {
			t.Fatalf("root routes: %v", err)
		}
		for _, r := range rs {
			routes = append(routes, formatRoute(r, names))
		}
	}
	slices.Sort(links)
	slices.Sort(routes)
	return links, routes
}

// diff returns the lines only in a and the lines only in b.
func diff(a, b []string) (onlyA, onlyB []string) {
	for _, s := range a {
		if !slices.Contains(b, s) {
			onlyA = append(onlyA, s)
		}
	}
	for _, s := range b {
		if !slices.Contains(a, s) {
			onlyB = append(onlyB, s)
		}
	}
	return onlyA, onlyB
}

func netnsEntries(t *testing.T) []string {
	t.Helper()
	es, err := os.ReadDir(netnsDir)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatal(err)
	}
	var out []string
	for _, e := range es {
		out = append(out, e.Name())
	}
	return out
}

// echoServer accepts connections on a listener in ns and echoes them back;
// each accepted connection's remote address is sent on the returned channel.
func echoServer(t *testing.T, ns *NS, a netip.Addr) (netip.AddrPort, <-chan netip.AddrPort) {
	t.Helper()
	l, err := ns.Listen("tcp", netip.AddrPortFrom(a, 0).String())
	if err != nil {
		t.Fatalf("listen in %s on %s: %v", ns.Name(), a, err)
	}
	t.Cleanup(func() { l.Close() })
	peers := make(chan netip.AddrPort, 4)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			peers <- c.RemoteAddr().(*net.TCPAddr).AddrPort()
			go func() {
				defer c.Close()
				io.Copy(c, c)
			}()
		}
	}()
	return l.Addr().(*net.TCPAddr).AddrPort(), peers
}

// echo dials dst from src, checks the payload comes back and returns the
// source address the server saw.
func echo(t *testing.T, src, dst *NS, dstAddr netip.Addr) netip.Addr {
	t.Helper()
	ap, peers := echoServer(t, dst, dstAddr)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	c, err := src.Dial(ctx, "tcp", ap.String())
	if err != nil {
		t.Fatalf("dial %s from %s: %v", ap, src.Name(), err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	msg := "hello from " + src.Name() + " to " + ap.String()
	if _, err := io.WriteString(c, msg); err != nil {
		t.Fatalf("write to %s from %s: %v", ap, src.Name(), err)
	}
	c.(*net.TCPConn).CloseWrite()
	got, err := io.ReadAll(c)
	if err != nil {
		t.Fatalf("read echo from %s in %s: %v", ap, src.Name(), err)
	}
	if string(got) != msg {
		t.Fatalf("echo from %s in %s: got %q, want %q", ap, src.Name(), got, msg)
	}
	select {
	case p := <-peers:
		return p.Addr()
	case <-ctx.Done():
		t.Fatalf("server %s saw no connection", ap)
		return netip.Addr{}
	}
}

func TestCluster(t *testing.T) {
	fixture.RequireRoot(t, "network namespaces")
	linksBefore, routesBefore := rootSnapshot(t)

	c := NewT(t, Spec{Name: "t", Nodes: 2, PodsPerNode: 2})

	t.Run("Layout", func(t *testing.T) {
		if len(c.Nodes) != 2 || c.External == nil || len(c.Pods()) != 4 {
			t.Fatalf("got %d nodes, %d pods, external %v; want 2, 4, present", len(c.Nodes), len(c.Pods()), c.External)
		}
		prefix := fmt.Sprintf("mt-%d-", os.Getpid())
		entries := netnsEntries(t)
		for _, name := range c.Namespaces() {
			if !strings.HasPrefix(name, prefix) {
				t.Errorf("namespace %s does not start with %s", name, prefix)
			}
			if !slices.Contains(entries, name) {
				t.Errorf("namespace %s not in %s", name, netnsDir)
			}
		}
		if got := len(c.Namespaces()); got != 1+2+4+1 {
			t.Errorf("got %d namespaces, want 8", got)
		}
		p := c.Pod("n2p1")
		if p == nil || p.Node != c.Nodes[1] || p.HostLink != "vp2p1" {
			t.Fatalf("Pod(n2p1) = %+v", p)
		}
		want := map[string]string{
			p.IPv4.String():                "198.18.2.11",
			p.IPv6.String():                "fd00:6d74:2::11",
			c.Nodes[1].IPv4.String():       "198.18.0.12",
			c.Nodes[1].IPv6.String():       "fd00:6d74::12",
			c.Nodes[1].PodPrefix6.String(): "fd00:6d74:2::/64",
			c.External.IPv6.String():       "fd00:6d74::100",
		}
		for got, w := range want {
			if got != w {
				t.Errorf("address %s, want %s", got, w)
			}
		}
		if c.Pod("n3p1") != nil {
			t.Errorf("Pod(n3p1) is not nil")
		}
	})

	t.Run("Sealed", func(t *testing.T) {
		linksAfter, routesAfter := rootSnapshot(t)
		if added, removed := diff(linksAfter, linksBefore); len(added)+len(removed) > 0 {
			t.Errorf("root namespace links changed: added %q, removed %q", added, removed)
		}
		for _, r := range routesAfter {
			if strings.Contains(r, " 198.18.") || strings.Contains(r, "fd00:6d74") {
				t.Errorf("root namespace has a cluster route: %s", r)
			}
		}
		if added, _ := diff(routesAfter, routesBefore); len(added) > 0 {
			t.Errorf("root namespace routes added: %q", added)
		}
		// The fabric's veths all have their peers in cluster namespaces:
		// the fabric holds exactly the bridge, its ports and lo.
		links, err := c.Fabric.Links()
		if err != nil {
			t.Fatal(err)
		}
		want := []string{"br0 bridge", "ext veth", "lo device", "n1 veth", "n2 veth"}
		if !slices.Equal(links, want) {
			t.Errorf("fabric links %q, want %q", links, want)
		}
	})

	t.Run("Reachability", func(t *testing.T) {
		n1, n2, ext := c.Nodes[0], c.Nodes[1], c.External
		p11, p12, p21, p22 := c.Pod("n1p1"), c.Pod("n1p2"), c.Pod("n2p1"), c.Pod("n2p2")
		type hop struct {
			name string
			src  *NS
			dst  *NS
			dst4 netip.Addr
			dst6 netip.Addr
			src4 netip.Addr
			src6 netip.Addr
		}
		hops := []hop{
			{"pod to pod, same node", p11.NS, p12.NS, p12.IPv4, p12.IPv6, p11.IPv4, p11.IPv6},
			{"pod to pod, across nodes", p11.NS, p21.NS, p21.IPv4, p21.IPv6, p11.IPv4, p11.IPv6},
			{"pod to pod, back", p22.NS, p12.NS, p12.IPv4, p12.IPv6, p22.IPv4, p22.IPv6},
			{"pod to external", p22.NS, ext.NS, ext.IPv4, ext.IPv6, p22.IPv4, p22.IPv6},
			{"external to pod", ext.NS, p11.NS, p11.IPv4, p11.IPv6, ext.IPv4, ext.IPv6},
			{"node to local pod", n1.NS, p12.NS, p12.IPv4, p12.IPv6, n1.Gateway4, n1.Gateway6},
			{"node to remote pod", n1.NS, p21.NS, p21.IPv4, p21.IPv6, n1.IPv4, n1.IPv6},
			{"pod to remote node", p21.NS, n1.NS, n1.IPv4, n1.IPv6, p21.IPv4, p21.IPv6},
			{"node to node", n2.NS, n1.NS, n1.IPv4, n1.IPv6, n2.IPv4, n2.IPv6},
		}
		for _, h := range hops {
			for _, fam := range []struct {
				name     string
				dst, src netip.Addr
			}{{"v4", h.dst4, h.src4}, {"v6", h.dst6, h.src6}} {
				t.Run(strings.ReplaceAll(h.name, " ", "_")+"/"+fam.name, func(t *testing.T) {
					got := echo(t, h.src, h.dst, fam.dst)
					if got != fam.src {
						t.Errorf("server saw source %s, want %s (no NAT on the direct path)", got, fam.src)
					}
				})
			}
		}
	})

	t.Run("UDP", func(t *testing.T) {
		src, dst := c.Pod("n2p2"), c.Pod("n1p1")
		for _, pair := range [][2]netip.Addr{{src.IPv4, dst.IPv4}, {src.IPv6, dst.IPv6}} {
			pc, err := dst.ListenPacket("udp", netip.AddrPortFrom(pair[1], 0).String())
			if err != nil {
				t.Fatal(err)
			}
			defer pc.Close()
			conn, err := src.Dial(t.Context(), "udp", pc.LocalAddr().String())
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			if _, err := conn.Write([]byte("ping")); err != nil {
				t.Fatal(err)
			}
			pc.SetDeadline(time.Now().Add(5 * time.Second))
			buf := make([]byte, 16)
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				t.Fatalf("UDP %s -> %s: %v", pair[0], pc.LocalAddr(), err)
			}
			if string(buf[:n]) != "ping" || from.(*net.UDPAddr).AddrPort().Addr() != pair[0] {
				t.Errorf("UDP got %q from %s, want ping from %s", buf[:n], from, pair[0])
			}
		}
	})

	t.Run("Sysctl", func(t *testing.T) {
		n1 := c.Nodes[0]
		for key, want := range map[string]string{
			"net.ipv4.ip_forward":                    "1",
			"net.ipv6.conf.all.forwarding":           "1",
			"net.ipv6.conf.eth0.forwarding":          "1",
			"net/ipv4/conf/vp1p1/forwarding":         "1",
			"net.ipv6.conf.vp1p2.accept_ra":          "0",
			"net.ipv6.conf.default.accept_dad":       "0",
			"net.ipv6.conf.eth0.autoconf":            "0",
			"/proc/sys/net/ipv6/conf/eth0/accept_ra": "0",
		} {
			got, err := n1.Sysctl(key)
			if err != nil {
				t.Errorf("node1 sysctl %s: %v", key, err)
			} else if got != want {
				t.Errorf("node1 sysctl %s = %q, want %q", key, got, want)
			}
		}
		// vp1p1 exists only in node1: reading it proves the read happened
		// inside the namespace, and the root namespace must not have it.
		if _, err := os.Stat("/proc/sys/net/ipv4/conf/vp1p1"); err == nil {
			t.Errorf("root namespace has /proc/sys/net/ipv4/conf/vp1p1")
		}
		if got, err := c.Fabric.Sysctl("net.ipv6.conf.br0.disable_ipv6"); err != nil || got != "1" {
			t.Errorf("fabric br0 disable_ipv6 = %q, %v; want 1", got, err)
		}
		p := c.Pod("n1p1")
		if err := p.SetSysctl("net.ipv4.conf.eth0.rp_filter", "2"); err != nil {
			t.Fatal(err)
		}
		if got, err := p.Sysctl("net.ipv4.conf.eth0.rp_filter"); err != nil || got != "2" {
			t.Errorf("pod rp_filter after set = %q, %v; want 2", got, err)
		}
		if got, err := c.Pod("n1p2").Sysctl("net.ipv4.conf.eth0.rp_filter"); err != nil || got == "2" {
			t.Errorf("other pod rp_filter = %q, %v; want untouched", got, err)
		}
		if _, err := p.Sysctl("../etc/passwd"); err == nil {
			t.Errorf("Sysctl accepted a path outside /proc/sys")
		}
	})

	t.Run("Snapshots", func(t *testing.T) {
		n1 := c.Nodes[0]
		routes, err := n1.Routes(unix.AF_INET, unix.RT_TABLE_MAIN)
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range []string{
			"table 254 unicast 198.18.2.0/24 via 198.18.0.12 dev eth0 proto boot scope universe",
			"table 254 unicast 198.18.1.11/32 dev vp1p1 proto boot scope link",
			"table 254 unicast 198.18.1.12/32 dev vp1p2 proto boot scope link",
			"table 254 unicast 198.18.0.0/24 dev eth0 src 198.18.0.11 proto kernel scope link",
		} {
			if !slices.Contains(routes, want) {
				t.Errorf("node1 IPv4 main table lacks %q; has %q", want, routes)
			}
		}
		if len(routes) != 4 {
			t.Errorf("node1 IPv4 main table has %d routes, want 4: %q", len(routes), routes)
		}
		pod6, err := c.Pod("n2p2").Routes(unix.AF_INET6, unix.RT_TABLE_MAIN)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.ContainsFunc(pod6, func(s string) bool {
			return strings.Contains(s, " via fd00:6d74:2::1 dev eth0 ") && strings.HasSuffix(s, " onlink")
		}) {
			t.Errorf("pod n2p2 IPv6 routes lack the onlink default route: %q", pod6)
		}
		all, err := n1.Routes(unix.AF_INET6, 0)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.ContainsFunc(all, func(s string) bool { return strings.HasPrefix(s, "table 255 local fd00:6d74:1::1/128 dev vp1p1") }) {
			t.Errorf("node1 IPv6 all tables lack the local gateway route: %q", all)
		}

		before, err := n1.IPRules(unix.AF_INET)
		if err != nil {
			t.Fatal(err)
		}
		wantRules := []string{
			"0: from all lookup 255 proto kernel",
			"32766: from all lookup 254 proto kernel",
			"32767: from all lookup 253 proto kernel",
		}
		if !slices.Equal(before, wantRules) {
			t.Errorf("node1 rules %q, want %q", before, wantRules)
		}
		// A rule added and removed again must show up, then vanish.
		err = n1.Do(func() error {
			r := netlink.NewRule()
			r.Priority = 100
			r.IifName = "vp1p1"
			r.Table = 7
			r.Family = unix.AF_INET
			if err := netlink.RuleAdd(r); err != nil {
				return err
			}
			return nil
		})
		if err != nil {
			t.Fatalf("add rule in node1: %v", err)
		}
		during, err := n1.IPRules(unix.AF_INET)
		if err != nil {
			t.Fatal(err)
		}
		if want := "100: from all iif vp1p1 lookup 7 proto unspec"; !slices.Contains(during, want) || len(during) != 4 {
			t.Errorf("rules after adding %q: %q", want, during)
		}
		root, _ := netlink.RuleList(unix.AF_INET)
		for _, r := range root {
			if r.IifName == "vp1p1" {
				t.Errorf("rule added in node1 appeared in the root namespace: %v", r)
			}
		}
		err = n1.Do(func() error {
			r := netlink.NewRule()
			r.Priority = 100
			r.IifName = "vp1p1"
			r.Table = 7
			r.Family = unix.AF_INET
			return netlink.RuleDel(r)
		})
		if err != nil {
			t.Fatalf("delete rule in node1: %v", err)
		}
		after, err := n1.IPRules(unix.AF_INET)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(before, after) {
			t.Errorf("rules after add+delete %q, want %q", after, before)
		}
	})

	t.Run("Settled", func(t *testing.T) {
		b := &builder{handles: map[*NS]*netlink.Handle{}}
		defer b.close()
		for _, n := range c.Nodes {
			if got, err := b.pending6(n.NS, true); err != nil || got != "" {
				t.Errorf("node %s after New: pending %q, %v", n.Name(), got, err)
			}
		}
		ext := c.External.NS
		for _, p := range append(c.Pods(), &Pod{NS: ext}) {
			if got, err := b.pending6(p.NS, false); err != nil || got != "" {
				t.Errorf("%s after New: pending %q, %v", p.Name(), got, err)
			}
		}
		// A link without a link-local address must count as unfinished.
		if err := ext.SetSysctl("net.ipv6.conf.default.addr_gen_mode", "1"); err != nil {
			t.Fatal(err)
		}
		h, err := b.handle(ext)
		if err != nil {
			t.Fatal(err)
		}
		d := &netlink.Veth{LinkAttrs: netlink.LinkAttrs{Name: "d0"}, PeerName: "d1"}
		if err := h.LinkAdd(d); err != nil {
			t.Fatal(err)
		}
		defer h.LinkDel(d)
		if err := b.up(ext, "d0"); err != nil {
			t.Fatal(err)
		}
		if got, err := b.pending6(ext, false); err != nil || !strings.HasPrefix(got, "no link-local address on d") {
			t.Errorf("pending with a bare link: %q, %v", got, err)
		}
		if err := h.LinkDel(d); err != nil {
			t.Fatal(err)
		}
		if err := ext.SetSysctl("net.ipv6.conf.default.addr_gen_mode", "0"); err != nil {
			t.Fatal(err)
		}
	})

	t.Run("Do", func(t *testing.T) {
		var self, inside uint64
		st := func(p string) uint64 {
			var s unix.Stat_t
			if err := unix.Stat(p, &s); err != nil {
				t.Fatalf("stat %s: %v", p, err)
			}
			return s.Ino
		}
		self = st("/proc/thread-self/ns/net")
		p := c.Pod("n1p1")
		err := p.Do(func() error {
			inside = st("/proc/thread-self/ns/net")
			return errors.New("marker")
		})
		if err == nil || err.Error() != "marker" {
			t.Errorf("Do returned %v, want fn's error", err)
		}
		if inside != st(p.Path()) {
			t.Errorf("fn ran in netns inode %d, want %s's %d", inside, p.Name(), st(p.Path()))
		}
		if inside == self || st("/proc/thread-self/ns/net") != self {
			t.Errorf("caller's thread namespace changed or equals the pod's")
		}
		func() {
			defer func() {
				if r := recover(); r != "boom" {
					t.Errorf("panic in fn: recovered %v, want boom", r)
				}
			}()
			p.Do(func() error { panic("boom") })
		}()
		if _, err := p.Dial(t.Context(), "tcp", "localhost:80"); err == nil {
			t.Errorf("Dial accepted a host name")
		}
	})

	t.Run("Command", func(t *testing.T) {
		p := c.Pod("n2p2")
		out, err := p.Command(t.Context(), "ip", "-o", "addr", "show", "dev", "eth0").CombinedOutput()
		if err != nil {
			t.Fatalf("ip addr in %s: %v: %s", p.Name(), err, out)
		}
		if !strings.Contains(string(out), p.IPv4.String()+"/32") || !strings.Contains(string(out), p.IPv6.String()+"/128") {
			t.Errorf("ip addr in %s lacks the pod addresses: %s", p.Name(), out)
		}
		if _, err := p.Start(exec.Command("sleep", "1")); err == nil {
			t.Errorf("Start accepted a command not made by Command")
		}
		if _, err := p.Start(c.Pod("n1p1").Command(t.Context(), "sleep", "1")); err == nil {
			t.Errorf("Start accepted another namespace's command")
		}
	})

	t.Run("Close", func(t *testing.T) {
		p := c.Pod("n1p1")
		// The shell reports readiness once ip has entered the namespace,
		// then becomes sleep (same PID).
		cmd := p.Command(context.Background(), "sh", "-c", "echo ready; exec sleep 60")
		stdout, err := cmd.StdoutPipe()
		if err != nil {
			t.Fatal(err)
		}
		proc, err := p.Start(cmd)
		if err != nil {
			t.Fatal(err)
		}
		line := make([]byte, 6)
		if _, err := io.ReadFull(stdout, line); err != nil || string(line) != "ready\n" {
			t.Fatalf("read readiness of sh in %s: %q, %v", p.Name(), line, err)
		}
		nsLink, err := os.Readlink("/proc/" + strconv.Itoa(proc.Cmd.Process.Pid) + "/ns/net")
		if err != nil {
			t.Fatal(err)
		}
		var s unix.Stat_t
		if err := unix.Stat(p.Path(), &s); err != nil {
			t.Fatal(err)
		}
		if want := fmt.Sprintf("net:[%d]", s.Ino); nsLink != want {
			t.Errorf("started process is in %s, want %s", nsLink, want)
		}
		start := time.Now()
		if err := c.Close(); err != nil {
			t.Fatalf("Close: %v", err)
		}
		select {
		case <-proc.Done():
		default:
			t.Fatalf("process still running after Close")
		}
		var ee *exec.ExitError
		if err := proc.Wait(); !errors.As(err, &ee) || ee.Sys().(syscall.WaitStatus).Signal() != syscall.SIGTERM {
			t.Errorf("sleep ended with %v, want SIGTERM", err)
		}
		if d := time.Since(start); d > stopGrace {
			t.Errorf("Close took %v; SIGTERM should have sufficed", d)
		}
		entries := netnsEntries(t)
		for _, name := range c.Namespaces() {
			if slices.Contains(entries, name) {
				t.Errorf("namespace %s still exists after Close", name)
			}
		}
		if err := c.Close(); err != nil {
			t.Errorf("second Close: %v", err)
		}
		if _, err := p.Start(p.Command(context.Background(), "true")); err == nil {
			t.Errorf("Start after Close succeeded")
		}
		if err := p.Do(func() error { return nil }); err == nil {
			t.Errorf("Do after Close succeeded")
		}
		linksAfter, _ := rootSnapshot(t)
		if added, removed := diff(linksAfter, linksBefore); len(added)+len(removed) > 0 {
			t.Errorf("root namespace links changed: added %q, removed %q", added, removed)
		}
	})
}

func TestNewCleansUpOnError(t *testing.T) {
	fixture.RequireRoot(t, "network namespaces")
	if err := Preflight(); err != nil {
		t.Fatalf("needs root and netns: %v", err)
	}
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	prefix := fmt.Sprintf("mt-%d-", os.Getpid())
	before := netnsEntries(t)
	_, err := New(ctx, Spec{Nodes: 2, PodsPerNode: 1})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("New with a cancelled context: %v, want context.Canceled", err)
	}
	for _, name := range netnsEntries(t) {
		if strings.HasPrefix(name, prefix) && !slices.Contains(before, name) {
			t.Errorf("New left namespace %s behind after failing", name)
		}
	}
	if _, err := New(t.Context(), Spec{Nodes: 0}); err == nil {
		t.Errorf("New accepted 0 nodes")
	}
	if _, err := New(t.Context(), Spec{Nodes: 1, Name: "Bad-Name"}); err == nil {
		t.Errorf("New accepted an invalid name")
	}
}

func TestCleanupStale(t *testing.T) {
	fixture.RequireRoot(t, "network namespaces")
	if err := Preflight(); err != nil {
		t.Fatalf("needs root and netns: %v", err)
	}
	if err := prepareNetnsDir(); err != nil {
		t.Fatal(err)
	}
	// A PID that was ours and is now dead: a reaped child.
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	dead := cmd.Process.Pid
	if pidAlive(dead) {
		t.Fatalf("pid %d of a reaped child is still alive", dead)
	}
	stale := fmt.Sprintf("mt-%d-zzzz-stale", dead)
	live := fmt.Sprintf("mt-%d-zzzz-live", os.Getpid())
	for _, name := range []string{stale, live} {
		if err := createNamed(name); err != nil {
			t.Fatalf("create %s: %v", name, err)
		}
		t.Cleanup(func() { deleteNamed(name) })
	}
	// A leftover placeholder without a mount (interrupted creation).
	orphan := fmt.Sprintf("mt-%d-zzzz-orphan", dead)
	if err := os.WriteFile(filepath.Join(netnsDir, orphan), nil, 0o444); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Remove(filepath.Join(netnsDir, orphan)) })

	removed, err := CleanupStale()
	if err != nil {
		t.Fatalf("CleanupStale: %v", err)
	}
	entries := netnsEntries(t)
	for _, name := range []string{stale, orphan} {
		if slices.Contains(entries, name) {
			t.Errorf("stale namespace %s survived", name)
		}
		if !slices.Contains(removed, name) {
			t.Errorf("CleanupStale did not report %s; reported %q", name, removed)
		}
	}
	if !slices.Contains(entries, live) || slices.Contains(removed, live) {
		t.Errorf("CleanupStale touched %s of the live process", live)
	}
}

func TestPidOf(t *testing.T) {
	for name, want := range map[string]int{
		"mt-123-abcd-n1":  123,
		"mt-1-x":          1,
		"mt-0-x":          0,
		"mt-0123-x":       0,
		"mt-12a-x":        0,
		"mt-123":          0,
		"cni-123-x":       0,
		"mt--5-x":         0,
		"mt-99999999999-": 0,
	} {
		got, ok := pidOf(name)
		if ok != (want != 0) || got != want {
			t.Errorf("pidOf(%q) = %d, %v; want %d", name, got, ok, want)
		}
	}
}

// TestControlHost: Spec.Control adds a host on the fabric that reaches the
// nodes' uplinks (for `meshtun ca`) and, having no route to them, not the
// pods.
func TestControlHost(t *testing.T) {
	fixture.RequireRoot(t, "network namespaces")
	c := NewT(t, Spec{Name: "ctl", Nodes: 1, PodsPerNode: 1, NoExternal: true, Control: true})
	if c.Control == nil || c.Control.IPv4.String() != "198.18.0.101" || c.Control.IPv6.String() != "fd00:6d74::101" {
		t.Fatalf("control host %+v, want 198.18.0.101 and fd00:6d74::101", c.Control)
	}
	if got := len(c.Namespaces()); got != 1+1+1+1 {
		t.Errorf("got %d namespaces, want 4 (fabric, node, pod, control)", got)
	}
	n := c.Nodes[0]
	if got := echo(t, n.NS, c.Control.NS, c.Control.IPv4); got != n.IPv4 {
		t.Errorf("control host saw the node as %s, want %s", got, n.IPv4)
	}
	echo(t, n.NS, c.Control.NS, c.Control.IPv6)
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	if conn, err := c.Control.Dial(ctx, "tcp", netip.AddrPortFrom(n.Pods[0].IPv4, 80).String()); err == nil {
		conn.Close()
		t.Errorf("the control host reached a pod")
	}
	if c2 := NewT(t, Spec{Name: "noctl", Nodes: 1, NoExternal: true}); c2.Control != nil {
		t.Errorf("a cluster without Spec.Control has a control host")
	}
}
