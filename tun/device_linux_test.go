package tun

import (
	"net"
	"os"
	"runtime"
	"strings"
	"testing"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// inNewNetns moves the calling goroutine, locked to its thread for the rest
// of its life, into a new network namespace with lo up: nothing the test
// does there reaches the machine's own network.
func inNewNetns(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Fatal("this test needs root: CAP_SYS_ADMIN for a network namespace, CAP_NET_ADMIN and /dev/net/tun for a TUN")
	}
	runtime.LockOSThread() // never unlocked: the thread ends with the test
	if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
		t.Fatalf("unshare network namespace: %v", err)
	}
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		t.Fatal(err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		t.Fatal(err)
	}
}

// TestOpenModes opens the device with offloads (the default) and without,
// and checks the mode, the link settings and the stale-device cleanup.
func TestOpenModes(t *testing.T) {
	inNewNetns(t)
	d, err := Open(Config{Name: "mt0", MTU: 1400})
	if err != nil {
		t.Fatal(err)
	}
	if d.VnetHdrLen() != VnetHdrLen || !strings.Contains(d.Offloads(), "tso4") || !strings.Contains(d.Offloads(), "tso6") {
		t.Fatalf("default mode: VnetHdrLen %d, offloads %q; want %d and TSO", d.VnetHdrLen(), d.Offloads(), VnetHdrLen)
	}
	l, err := netlink.LinkByName("mt0")
	if err != nil {
		t.Fatal(err)
	}
	if a := l.Attrs(); a.MTU != 1400 || a.TxQLen != DefaultTxQueueLen || a.Index != d.Index() || a.Flags&net.FlagUp == 0 {
		t.Fatalf("link: mtu %d txqlen %d index %d (device says %d) flags %v", a.MTU, a.TxQLen, a.Index, d.Index(), a.Flags)
	}
	if got := tunFlags(t, d); got != unix.IFF_TUN|unix.IFF_NO_PI|unix.IFF_VNET_HDR {
		t.Fatalf("TUN flags %#x, want IFF_TUN|IFF_NO_PI|IFF_VNET_HDR", got)
	}
	// A second Open of the same name replaces the first device (as after
	// a crash), here without offloads.
	d2, err := Open(Config{Name: "mt0", NoOffload: true})
	if err != nil {
		t.Fatal(err)
	}
	defer d2.Close()
	if d2.VnetHdrLen() != 0 || d2.Offloads() != "none" {
		t.Fatalf("NoOffload: VnetHdrLen %d, offloads %q", d2.VnetHdrLen(), d2.Offloads())
	}
	if got := tunFlags(t, d2); got != unix.IFF_TUN|unix.IFF_NO_PI {
		t.Fatalf("TUN flags %#x without offloads, want IFF_TUN|IFF_NO_PI", got)
	}
	d.Close() // the replaced device's descriptor: closing it is harmless
	if _, err := d.Read(make([]byte, 100)); err == nil {
		t.Fatal("Read on a closed device succeeded")
	}
}

// tunFlags returns the device's TUNGETIFF flags.
func tunFlags(t *testing.T, d *Device) uint16 {
	t.Helper()
	ifr, err := unix.NewIfreq("")
	if err != nil {
		t.Fatal(err)
	}
	var ierr error
	if err := d.raw.Control(func(fd uintptr) { ierr = unix.IoctlIfreq(int(fd), unix.TUNGETIFF, ifr) }); err != nil || ierr != nil {
		t.Fatalf("TUNGETIFF: %v %v", err, ierr)
	}
	return ifr.Uint16()
}

// TestReadWriteNoAlloc: a packet the kernel routes into the TUN is read
// with its virtio-net header, written back, and neither Read, Write nor
// Writev allocates.
func TestReadWriteNoAlloc(t *testing.T) {
	if raceEnabled {
		t.Skip("the race detector allocates on its own")
	}
	inNewNetns(t)
	d, err := Open(Config{Name: "mt0"})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: d.Index(), Dst: &net.IPNet{IP: net.IPv4(10, 9, 1, 0), Mask: net.CIDRMask(24, 32)}}); err != nil {
		t.Fatal(err)
	}
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(s)
	if err := unix.Connect(s, &unix.SockaddrInet4{Addr: [4]byte{10, 9, 1, 2}, Port: 9}); err != nil {
		t.Fatal(err)
	}
	payload := make([]byte, 100)
	buf := make([]byte, VnetHdrLen+65536)
	var n int
	roundTrip := func() {
		if _, err := unix.Write(s, payload); err != nil {
			t.Fatal(err)
		}
		n, err = d.Read(buf)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := d.Write(buf[:n]); err != nil {
			t.Fatal(err)
		}
		if _, err := d.Writev([][]byte{buf[:VnetHdrLen], buf[VnetHdrLen:n]}); err != nil {
			t.Fatal(err)
		}
	}
	roundTrip()
	if n != VnetHdrLen+20+8+len(payload) {
		t.Fatalf("read %d bytes, want header + IPv4 + UDP + %d", n, len(payload))
	}
	var vh VnetHdr
	vh.Decode(buf)
	if vh.IsGSO() || buf[VnetHdrLen]>>4 != 4 || buf[VnetHdrLen+9] != unix.IPPROTO_UDP {
		t.Fatalf("read header %+v, packet % x", vh, buf[VnetHdrLen:VnetHdrLen+20])
	}
	if a := testing.AllocsPerRun(200, roundTrip); a != 0 {
		t.Fatalf("%.1f allocations per read + write + writev, want 0", a)
	}
}
