package tun

import (
	"errors"
	"fmt"
	"os"
	"syscall"

	"github.com/songgao/water"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// DefaultTxQueueLen is the transmit queue length given to the TUN device.
// The kernel default of 500 packets is smaller than what TCP receive-window
// auto-tuning puts in flight; the excess shows up as TX drops on the TUN
// and, on the sender, as retransmits.
const DefaultTxQueueLen = 5000

// in6AddrGenModeNone is IN6_ADDR_GEN_MODE_NONE from <linux/if_link.h>.
const in6AddrGenModeNone = 1

// Config describes the TUN device to create.
type Config struct {
	Name       string // interface name, e.g. "meshtun0"
	MTU        int    // link MTU; 0 means 1500
	TxQueueLen int    // 0 means DefaultTxQueueLen
}

// Device is an open TUN device in IFF_TUN|IFF_NO_PI mode: each read or write
// is exactly one IP packet with no header in front.
//
// Reads and writes go straight to the file descriptor through the Go
// runtime's poller (no io.Reader copying layer in between), and are safe for
// concurrent use: the kernel reads and writes whole packets atomically.
type Device struct {
	name  string
	index int
	mtu   int
	file  *os.File // keeps the descriptor alive; never read through water
	raw   syscall.RawConn
}

// Open creates the TUN device, sets its MTU and queue length and brings it
// up. An existing interface of the same name (left by a crashed run) is
// deleted first.
func Open(cfg Config) (*Device, error) {
	if cfg.Name == "" {
		return nil, errors.New("tun: device name is empty")
	}
	if len(cfg.Name) >= unix.IFNAMSIZ {
		return nil, fmt.Errorf("tun: device name %q is longer than %d bytes", cfg.Name, unix.IFNAMSIZ-1)
	}
	if cfg.MTU == 0 {
		cfg.MTU = 1500
	}
	if cfg.MTU < 1280 || cfg.MTU > 65535 {
		return nil, fmt.Errorf("tun: MTU %d out of range [1280, 65535] (IPv6 needs 1280)", cfg.MTU)
	}
	if cfg.TxQueueLen == 0 {
		cfg.TxQueueLen = DefaultTxQueueLen
	}
	if old, err := netlink.LinkByName(cfg.Name); err == nil {
		if old.Type() != "tuntap" {
			return nil, fmt.Errorf("tun: interface %q exists and is a %s, not a TUN device", cfg.Name, old.Type())
		}
		if err := netlink.LinkDel(old); err != nil {
			return nil, fmt.Errorf("tun: delete stale device %q: %w", cfg.Name, err)
		}
	}

	ifce, err := water.New(water.Config{
		DeviceType:             water.TUN,
		PlatformSpecificParams: water.PlatformSpecificParams{Name: cfg.Name},
	})
	if err != nil {
		return nil, fmt.Errorf("tun: create %q (is /dev/net/tun present, and are we CAP_NET_ADMIN?): %w", cfg.Name, err)
	}
	f, ok := ifce.ReadWriteCloser.(*os.File)
	if !ok {
		ifce.Close()
		return nil, fmt.Errorf("tun: water returned %T, want *os.File", ifce.ReadWriteCloser)
	}
	raw, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("tun: %q: %w", cfg.Name, err)
	}
	d := &Device{name: ifce.Name(), mtu: cfg.MTU, file: f, raw: raw}
	if err := d.configure(cfg); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

func (d *Device) configure(cfg Config) error {
	link, err := netlink.LinkByName(d.name)
	if err != nil {
		return fmt.Errorf("tun: look up %q: %w", d.name, err)
	}
	d.index = link.Attrs().Index
	if err := netlink.LinkSetMTU(link, cfg.MTU); err != nil {
		return fmt.Errorf("tun: set MTU %d on %q: %w", cfg.MTU, d.name, err)
	}
	if err := netlink.LinkSetTxQLen(link, cfg.TxQueueLen); err != nil {
		return fmt.Errorf("tun: set txqueuelen %d on %q: %w", cfg.TxQueueLen, d.name, err)
	}
	// The TUN carries other hosts' packets only; an IPv6 link-local address
	// would only make the kernel send its own router solicitations and MLD
	// reports through it.
	if err := netlink.LinkSetIP6AddrGenMode(link, in6AddrGenModeNone); err != nil && !errors.Is(err, unix.EOPNOTSUPP) {
		return fmt.Errorf("tun: disable IPv6 address generation on %q: %w", d.name, err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("tun: bring %q up: %w", d.name, err)
	}
	return nil
}

// Name returns the interface name.
func (d *Device) Name() string { return d.name }

// Index returns the interface index.
func (d *Device) Index() int { return d.index }

// MTU returns the link MTU.
func (d *Device) MTU() int { return d.mtu }

// Read reads one packet into b and returns its length. It blocks (parking
// the goroutine in the runtime poller, not an OS thread) until a packet is
// available or the device is closed.
func (d *Device) Read(b []byte) (int, error) {
	var n int
	var rerr error
	err := d.raw.Read(func(fd uintptr) bool {
		n, rerr = unix.Read(int(fd), b)
		return rerr != unix.EAGAIN && rerr != unix.EINTR
	})
	if err != nil {
		return 0, err
	}
	return n, rerr
}

// Write writes one packet. The kernel receives it as if it arrived on the
// TUN interface and routes it on.
func (d *Device) Write(pkt []byte) (int, error) {
	var n int
	var werr error
	err := d.raw.Write(func(fd uintptr) bool {
		n, werr = unix.Write(int(fd), pkt)
		return werr != unix.EAGAIN && werr != unix.EINTR
	})
	if err != nil {
		return 0, err
	}
	return n, werr
}

// Close closes the descriptor, which removes the (non-persistent) device and
// every route through it. Blocked reads return an error.
func (d *Device) Close() error {
	return d.file.Close()
}
