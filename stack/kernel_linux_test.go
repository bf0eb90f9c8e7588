package stack

import (
	"bytes"
	"context"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/stack/classify"
	"github.com/meshtun/meshtun/test/fixture"
	"github.com/meshtun/meshtun/tun"
)

// gsoCounter wraps the TUN device and counts the GSO super-packets that
// cross it in each direction.
type gsoCounter struct {
	*tun.Device
	in, out atomic.Int64
}

func (d *gsoCounter) Read(b []byte) (int, error) {
	n, err := d.Device.Read(b)
	if err == nil && d.VnetHdrLen() > 0 {
		var vh tun.VnetHdr
		if vh.Decode(b[:n]) == nil && vh.IsGSO() {
			d.in.Add(1)
		}
	}
	return n, err
}

func (d *gsoCounter) Writev(bufs [][]byte) (int, error) {
	if d.VnetHdrLen() > 0 && len(bufs) > 0 {
		var vh tun.VnetHdr
		if vh.Decode(bufs[0]) == nil && vh.IsGSO() {
			d.out.Add(1)
		}
	}
	return d.Device.Writev(bufs)
}

// TestKernelTCP runs the stack on a real TUN in a network namespace of its
// own, with and without offloads, and moves 16 MiB each way between a
// kernel TCP socket and the netstack, over IPv4 and IPv6: byte-exact, and
// with offloads as GSO super-packets in both directions (the kernel's TSO
// into the netstack, the netstack's GSO out).
func TestKernelTCP(t *testing.T) {
	fixture.RequireRoot(t, "CAP_SYS_ADMIN for a network namespace, CAP_NET_ADMIN and /dev/net/tun for the TUN")
	for _, offload := range []bool{true, false} {
		for _, v6 := range []bool{false, true} {
			name := fmt.Sprintf("offload=%v/ipv6=%v", offload, v6)
			t.Run(name, func(t *testing.T) { kernelTCP(t, offload, v6) })
		}
	}
}

func kernelTCP(t *testing.T, offload, v6 bool) {
	// This goroutine's thread moves into a new network namespace and,
	// still locked, ends with the goroutine: nothing else ever runs in
	// that namespace, and nothing leaves it.
	lo := fixture.PrivateNetns(t)
	raw, err := tun.Open(tun.Config{Name: "mttest0", NoOffload: !offload})
	if err != nil {
		t.Fatal(err)
	}
	if got := raw.VnetHdrLen() > 0; got != offload {
		t.Fatalf("offloads on: %v, want %v (%s)", got, offload, raw.Offloads())
	}
	dev := &gsoCounter{Device: raw}
	local, remote := netip.MustParseAddr("10.9.0.1"), netip.MustParseAddr("10.9.1.2")
	prefix := netip.MustParsePrefix("10.9.1.0/24")
	if v6 {
		local, remote = netip.MustParseAddr("fd00:9::1"), netip.MustParseAddr("fd00:9:1::2")
		prefix = netip.MustParsePrefix("fd00:9:1::/64")
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: local.AsSlice(), Mask: net.CIDRMask(local.BitLen(), local.BitLen())}, Flags: unix.IFA_F_NODAD}
	if err := netlink.AddrAdd(lo, addr); err != nil {
		t.Fatalf("address %s on lo: %v", local, err)
	}
	if err := netlink.RouteAdd(&netlink.Route{
		LinkIndex: raw.Index(), Dst: &net.IPNet{IP: prefix.Addr().AsSlice(), Mask: net.CIDRMask(prefix.Bits(), prefix.Addr().BitLen())},
		Src: local.AsSlice(),
	}); err != nil {
		t.Fatalf("route %s via the TUN: %v", prefix, err)
	}

	const size = 16 << 20
	pattern := func(i int) byte { return byte(i*31 + i>>9) }
	cls := classify.New(classify.Config{Policy: classify.PolicyFunc(func(_, dst netip.AddrPort) bool { return dst.Port() == 80 })})
	st, err := newStarted(startedConfig{
		Device: dev, Classifier: cls, Logger: zerolog.Nop(),
		HandleTCP: func(req *TCPRequest) {
			c, err := req.Accept()
			if err != nil {
				t.Error(err)
				return
			}
			defer c.Close()
			var cmd [1]byte
			if _, err := io.ReadFull(c, cmd[:]); err != nil {
				t.Error(err)
				return
			}
			switch cmd[0] {
			case 'U': // upload: sum what arrives, answer with the sum
				h := sha256.New()
				if _, err := io.Copy(h, c); err != nil {
					t.Errorf("netstack reading the upload: %v", err)
				}
				c.Write(h.Sum(nil))
			case 'D': // download: send the pattern
				b := make([]byte, size)
				for i := range b {
					b[i] = pattern(i)
				}
				if _, err := c.Write(b); err != nil {
					t.Errorf("netstack sending the download: %v", err)
				}
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { raw.Close(); st.Close() }()

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	dial := func() *net.TCPConn {
		var d net.Dialer
		c, err := d.DialContext(ctx, "tcp", netip.AddrPortFrom(remote, 80).String())
		if err != nil {
			t.Fatalf("kernel socket connecting through the TUN: %v", err)
		}
		c.SetDeadline(time.Now().Add(30 * time.Second))
		return c.(*net.TCPConn)
	}

	up := make([]byte, size)
	for i := range up {
		up[i] = pattern(i + 7)
	}
	c := dial()
	if _, err := c.Write(append([]byte{'U'}, up...)); err != nil {
		t.Fatalf("upload: %v", err)
	}
	c.CloseWrite()
	sum, err := io.ReadAll(c)
	c.Close()
	want := sha256.Sum256(up)
	if err != nil || !bytes.Equal(sum, want[:]) {
		t.Fatalf("upload: the netstack received other bytes than sent (sum %x, %v)", sum, err)
	}

	c = dial()
	c.Write([]byte{'D'})
	got, err := io.ReadAll(c)
	c.Close()
	if err != nil || len(got) != size {
		t.Fatalf("download: %d bytes, %v; want %d", len(got), err, size)
	}
	for i := range got {
		if got[i] != pattern(i) {
			t.Fatalf("download: byte %d differs", i)
		}
	}

	in, out := dev.in.Load(), dev.out.Load()
	t.Logf("GSO packets into the netstack %d, out of it %d; stats %+v", in, out, st.Stats())
	if offload && (in == 0 || out == 0) {
		t.Fatalf("with offloads, want GSO packets both ways; got %d in, %d out", in, out)
	}
	if !offload && in+out != 0 {
		t.Fatalf("without offloads, got GSO packets (%d in, %d out)", in, out)
	}
	if c := st.Stats(); c.BadChecksums != 0 || c.Drops != 0 {
		t.Fatalf("counters %+v", c)
	}
}

// gsoKinds wraps the TUN device and counts the GSO packets read by type.
type gsoKinds struct {
	*tun.Device
	tcp, udp atomic.Int64
}

func (d *gsoKinds) Read(b []byte) (int, error) {
	n, err := d.Device.Read(b)
	var vh tun.VnetHdr
	if err == nil && vh.Decode(b[:n]) == nil {
		switch vh.GSOType &^ tun.GSOECN {
		case tun.GSOTCPv4, tun.GSOTCPv6:
			d.tcp.Add(1)
		case tun.GSOUDPL4:
			d.udp.Add(1)
		}
	}
	return n, err
}

// TestKernelVerbatimGSO sends TCP and UDP GSO (UDP_SEGMENT) traffic
// between two local addresses of a private network namespace whose policy
// routing sends it through the TUN; the stack intercepts nothing, so every
// packet goes back verbatim, virtio-net header and all. The kernel must
// accept the super-packets as written and deliver the bytes intact.
func TestKernelVerbatimGSO(t *testing.T) {
	lo := fixture.PrivateNetns(t) // the thread, and its namespace, end with the test
	a, b := netip.MustParseAddr("10.9.0.1"), netip.MustParseAddr("10.9.1.2")
	for _, ip := range []netip.Addr{a, b} {
		if err := netlink.AddrAdd(lo, &netlink.Addr{IPNet: &net.IPNet{IP: ip.AsSlice(), Mask: net.CIDRMask(32, 32)}}); err != nil {
			t.Fatal(err)
		}
	}
	raw, err := tun.Open(tun.Config{Name: "mttest0"})
	if err != nil {
		t.Fatal(err)
	}
	if raw.VnetHdrLen() == 0 {
		t.Fatal("no offloads on the TUN")
	}
	dev := &gsoKinds{Device: raw}
	// Locally sent packets between a and b take table 100, through the
	// TUN; what comes back out of the TUN (iif mttest0) is delivered
	// locally by the local table, moved behind that rule. The TUN must
	// accept packets with a local source address.
	both := &net.IPNet{IP: net.IPv4(10, 9, 0, 0), Mask: net.CIDRMask(16, 32)}
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: raw.Index(), Dst: both, Table: 100}); err != nil {
		t.Fatal(err)
	}
	rule := netlink.NewRule()
	rule.Priority, rule.IifName, rule.Dst, rule.Table = 100, "lo", both, 100
	if err := netlink.RuleAdd(rule); err != nil {
		t.Fatal(err)
	}
	local := netlink.NewRule()
	local.Priority, local.Table = 200, unix.RT_TABLE_LOCAL
	if err := netlink.RuleAdd(local); err != nil {
		t.Fatal(err)
	}
	local.Priority = 0
	if err := netlink.RuleDel(local); err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"all/accept_local", "mttest0/accept_local", "all/rp_filter", "mttest0/rp_filter"} {
		v := "1"
		if strings.HasSuffix(k, "rp_filter") {
			v = "0"
		}
		if err := os.WriteFile("/proc/sys/net/ipv4/conf/"+k, []byte(v), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	cls := classify.New(classify.Config{}) // intercept nothing
	st, err := newStarted(startedConfig{Device: dev, Classifier: cls, Logger: zerolog.Nop(), HandleTCP: func(req *TCPRequest) { req.Reject() }})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { raw.Close(); st.Close() }()

	// TCP: 16 MiB from a to b, its SHA-256 back.
	ln, err := net.ListenTCP("tcp", net.TCPAddrFromAddrPort(netip.AddrPortFrom(b, 7000)))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		h := sha256.New()
		io.Copy(h, c)
		c.Write(h.Sum(nil))
	}()
	d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(netip.AddrPortFrom(a, 0)), Timeout: 10 * time.Second}
	c, err := d.Dial("tcp", netip.AddrPortFrom(b, 7000).String())
	if err != nil {
		t.Fatalf("TCP through the TUN: %v", err)
	}
	c.SetDeadline(time.Now().Add(30 * time.Second))
	data := make([]byte, 16<<20)
	for i := range data {
		data[i] = byte(i*7 + i>>11)
	}
	if _, err := c.Write(data); err != nil {
		t.Fatal(err)
	}
	c.(*net.TCPConn).CloseWrite()
	sum, err := io.ReadAll(c)
	c.Close()
	want := sha256.Sum256(data)
	if err != nil || !bytes.Equal(sum, want[:]) {
		t.Fatalf("TCP through the TUN: bytes differ (sum %x, %v)", sum, err)
	}

	// UDP: one sendmsg of 20 segments of 1000 bytes (UDP_SEGMENT).
	rc, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(b, 9999)))
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	sc, err := net.ListenUDP("udp", net.UDPAddrFromAddrPort(netip.AddrPortFrom(a, 0)))
	if err != nil {
		t.Fatal(err)
	}
	defer sc.Close()
	sraw, _ := sc.SyscallConn()
	var serr error
	sraw.Control(func(fd uintptr) { serr = unix.SetsockoptInt(int(fd), unix.IPPROTO_UDP, unix.UDP_SEGMENT, 1000) })
	if serr != nil {
		t.Fatalf("UDP_SEGMENT: %v", serr)
	}
	msg := make([]byte, 20*1000)
	for i := range msg {
		msg[i] = byte(i / 1000)
	}
	if _, err := sc.WriteToUDPAddrPort(msg, netip.AddrPortFrom(b, 9999)); err != nil {
		t.Fatal(err)
	}
	rc.SetReadDeadline(time.Now().Add(10 * time.Second))
	got := make([]byte, 2000)
	for i := 0; i < 20; i++ {
		n, err := rc.Read(got)
		if err != nil {
			t.Fatalf("UDP datagram %d of 20: %v", i+1, err)
		}
		if n != 1000 || !bytes.Equal(got[:n], msg[i*1000:(i+1)*1000]) {
			t.Fatalf("UDP datagram %d: %d bytes, first %d; want 1000 bytes of %d", i+1, n, got[0], i)
		}
	}

	t.Logf("GSO packets read: TCP %d, UDP %d (offloads %s); stats %+v", dev.tcp.Load(), dev.udp.Load(), raw.Offloads(), st.Stats())
	if dev.tcp.Load() == 0 {
		t.Fatal("no TCP GSO packet crossed the TUN")
	}
	if strings.Contains(raw.Offloads(), "uso") && dev.udp.Load() == 0 {
		t.Fatal("USO is on but no UDP GSO packet crossed the TUN")
	}
	if c := st.Stats(); c.VerbatimWriteErrors != 0 || c.Drops != 0 {
		t.Fatalf("counters %+v", c)
	}
}
