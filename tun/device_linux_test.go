package tun

import (
	"errors"
	"net"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/meshtun/meshtun/test/fixture"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// inNewNetns moves the calling goroutine, locked to its thread for the rest
// of its life, into a new network namespace with lo up: nothing the test
// does there reaches the machine's own network.
func inNewNetns(t *testing.T) { fixture.PrivateNetns(t) }

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
	inNewNetns(t)
	d, err := Open(Config{Name: "mt0"})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	s := udpIntoTUN(t, d)
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
	if fixture.Race {
		t.Log("allocations not counted: the race detector allocates on its own")
		return
	}
	if a := testing.AllocsPerRun(200, roundTrip); a != 0 {
		t.Fatalf("%.1f allocations per read + write + writev, want 0", a)
	}
}

// TestTryRead: TryRead returns 0 at once when nothing is queued, takes the
// packets the kernel queued in order, does not allocate, and fails on a
// closed device. The device reports USO on this kernel (6.2+).
func TestTryRead(t *testing.T) {
	inNewNetns(t)
	d, err := Open(Config{Name: "mt0"})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if !d.USO() || !strings.Contains(d.Offloads(), "uso4") {
		t.Fatalf("USO %v, offloads %q: want USO on a 6.2+ kernel", d.USO(), d.Offloads())
	}
	buf := make([]byte, VnetHdrLen+65536)
	done := make(chan struct{})
	go func() {
		defer close(done)
		if n, err := d.TryRead(buf); n != 0 || err != nil {
			t.Errorf("TryRead on an empty queue: %d, %v; want 0, nil", n, err)
		}
	}()
	select {
	case <-done:
	case <-time.After(5 * time.Second):
		t.Fatal("TryRead on an empty queue did not return")
	}
	s := udpIntoTUN(t, d)
	for i := range 3 {
		if _, err := unix.Write(s, make([]byte, 100+i)); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 3 {
		n, err := d.TryRead(buf)
		if err != nil || n != VnetHdrLen+28+100+i {
			t.Fatalf("TryRead %d: %d bytes, %v; want the queued %d-byte datagram", i, n, err, 100+i)
		}
	}
	if n, err := d.TryRead(buf); n != 0 || err != nil {
		t.Fatalf("TryRead after the queue emptied: %d, %v", n, err)
	}
	try := func() {
		if _, err := unix.Write(s, make([]byte, 100)); err != nil {
			t.Fatal(err)
		}
		if n, err := d.TryRead(buf); n == 0 || err != nil {
			t.Fatalf("TryRead: %d, %v", n, err)
		}
		d.TryRead(buf) // empty
	}
	if fixture.Race {
		t.Log("allocations not counted: the race detector allocates on its own")
	} else if a := testing.AllocsPerRun(200, try); a != 0 {
		t.Fatalf("%.1f allocations per TryRead pair, want 0", a)
	}
	d.Close()
	if _, err := d.TryRead(buf); !errors.Is(err, os.ErrClosed) {
		t.Fatalf("TryRead on a closed device: %v, want os.ErrClosed", err)
	}
}

// udpIntoTUN routes 10.9.1.0/24 to d and returns a UDP socket connected to
// 10.9.1.2:9: what it sends, d reads. The socket is closed with the test.
func udpIntoTUN(t *testing.T, d *Device) int {
	t.Helper()
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: d.Index(), Dst: &net.IPNet{IP: net.IPv4(10, 9, 1, 0), Mask: net.CIDRMask(24, 32)}}); err != nil {
		t.Fatal(err)
	}
	s, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(s) })
	if err := unix.Connect(s, &unix.SockaddrInet4{Addr: [4]byte{10, 9, 1, 2}, Port: 9}); err != nil {
		t.Fatal(err)
	}
	return s
}
