package tun

import (
	"errors"
	"fmt"
	"os"
	"sync"
	"sync/atomic"
	"syscall"
	"unsafe"

	"github.com/rs/zerolog"
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
	// NoOffload opens the device without the virtio-net header and
	// offloads: one MTU-sized packet per read and write, checksums
	// complete. Without it, Open asks for offloads (TSO, checksum, USO)
	// and falls back to the plain mode, with a warning in Logger, if the
	// kernel refuses them.
	NoOffload bool
	// Logger receives the fallback warning; the zero value discards it.
	Logger zerolog.Logger
}

// offloadFlags are the offloads asked of the kernel with TUNSETOFFLOAD:
// packets may be read with a partial checksum and as TCP (and UDP) GSO
// super-packets, and may be written the same way. USO (UDP segmentation,
// Linux 6.2) is optional: older kernels refuse the whole set with EINVAL,
// and Open then retries without it.
const (
	offloadFlags = unix.TUN_F_CSUM | unix.TUN_F_TSO4 | unix.TUN_F_TSO6 | unix.TUN_F_TSO_ECN
	offloadUSO   = unix.TUN_F_USO4 | unix.TUN_F_USO6
)

// Device is an open TUN device in IFF_TUN|IFF_NO_PI mode. Each read or
// write is exactly one IP packet; with offloads (VnetHdrLen() > 0) the
// packet is preceded by a virtio-net header ([VnetHdr]) and may be a GSO
// super-packet of up to 64 KiB.
//
// Reads and writes go straight to the file descriptor through the Go
// runtime's poller (no io.Reader copying layer in between), and are safe for
// concurrent use: the kernel reads and writes whole packets atomically.
type Device struct {
	name     string
	index    int
	mtu      int
	vnet     bool
	uso      bool     // USO4/6 negotiated: UDP GSO packets may be read and written
	offloads string   // for logs: "csum,tso4,…" or "none"
	file     *os.File // keeps the descriptor alive; never read through water
	raw      syscall.RawConn
	closed   atomic.Bool
	ops      sync.Pool // of *op
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

	d := &Device{mtu: cfg.MTU, offloads: "none"}
	if !cfg.NoOffload {
		f, name, offloads, uso, err := openVnet(cfg.Name)
		if err == nil {
			d.file, d.name, d.vnet, d.uso, d.offloads = f, name, true, uso, offloads
		} else {
			cfg.Logger.Warn().Err(err).Str("tun", cfg.Name).
				Msg("TUN offloads unavailable: one packet per read and write, no TSO/GSO")
		}
	}
	if d.file == nil {
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
		d.file, d.name = f, ifce.Name()
	}
	raw, err := d.file.SyscallConn()
	if err != nil {
		d.file.Close()
		return nil, fmt.Errorf("tun: %q: %w", cfg.Name, err)
	}
	d.raw = raw
	if err := d.configure(cfg); err != nil {
		d.Close()
		return nil, err
	}
	return d, nil
}

// openVnet creates the TUN with IFF_VNET_HDR and switches its offloads on.
// water cannot set IFF_VNET_HDR, so this path opens /dev/net/tun itself.
func openVnet(name string) (f *os.File, ifname, offloads string, uso bool, err error) {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return nil, "", "", false, fmt.Errorf("tun: open /dev/net/tun: %w", err)
	}
	defer func() {
		if err != nil {
			unix.Close(fd)
		}
	}()
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return nil, "", "", false, fmt.Errorf("tun: interface name %q: %w", name, err)
	}
	ifr.SetUint16(unix.IFF_TUN | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		return nil, "", "", false, fmt.Errorf("tun: TUNSETIFF %q with IFF_VNET_HDR: %w", name, err)
	}
	if err := unix.IoctlSetPointerInt(fd, unix.TUNSETVNETHDRSZ, VnetHdrLen); err != nil {
		return nil, "", "", false, fmt.Errorf("tun: TUNSETVNETHDRSZ %d on %q: %w", VnetHdrLen, name, err)
	}
	flags := offloadFlags | offloadUSO
	if err := unix.IoctlSetInt(fd, unix.TUNSETOFFLOAD, flags); err != nil {
		flags = offloadFlags
		if err2 := unix.IoctlSetInt(fd, unix.TUNSETOFFLOAD, flags); err2 != nil {
			return nil, "", "", false, fmt.Errorf("tun: TUNSETOFFLOAD %#x on %q: %w (with USO: %v)", flags, name, err2, err)
		}
	}
	offloads = "csum,tso4,tso6,tso-ecn"
	uso = flags&offloadUSO != 0
	if uso {
		offloads += ",uso4,uso6"
	}
	// O_NONBLOCK makes os.NewFile register the descriptor with the
	// runtime poller.
	return os.NewFile(uintptr(fd), "/dev/net/tun"), ifr.Name(), offloads, uso, nil
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

// VnetHdrLen returns the length of the virtio-net header in front of every
// packet read or written: [VnetHdrLen] with offloads, 0 without.
func (d *Device) VnetHdrLen() int {
	if d.vnet {
		return VnetHdrLen
	}
	return 0
}

// Offloads names the offloads in use, "none" without: for logs.
func (d *Device) Offloads() string { return d.offloads }

// USO reports whether the kernel took the UDP segmentation offloads
// (TUN_F_USO4|TUN_F_USO6, Linux 6.2): packets read may then be UDP GSO
// super-packets (GSOUDPL4), and such packets may be written.
func (d *Device) USO() bool { return d.uso }

// Read reads one packet (with its virtio-net header when VnetHdrLen() > 0)
// into b and returns its length. It blocks, parking the goroutine in the
// runtime poller, not an OS thread, until a packet is available or the
// device is closed; then it returns an error matching os.ErrClosed.
// It does not allocate.
func (d *Device) Read(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	o := d.op(opRead)
	o.b = b
	return d.run(o, d.raw.Read)
}

// TryRead reads one packet into b, like Read, if one is queued, and
// returns 0 and no error at once if none is: it never parks the goroutine.
// A reader uses it to take the packets that arrived meanwhile after a Read
// before it writes anything (see stack's UDP coalescing). It does not
// allocate.
func (d *Device) TryRead(b []byte) (int, error) {
	if len(b) == 0 {
		return 0, nil
	}
	o := d.op(opTryRead)
	o.b = b
	// Control, not Read: one attempt, without the poller.
	return d.finish(o, d.raw.Control(o.ctl))
}

// Write writes one packet (with its virtio-net header when VnetHdrLen() >
// 0). The kernel receives it as if it arrived on the TUN interface and
// routes it on. It does not allocate.
func (d *Device) Write(pkt []byte) (int, error) {
	if len(pkt) == 0 {
		return 0, nil
	}
	o := d.op(opWrite)
	o.b = pkt
	return d.run(o, d.raw.Write)
}

// Writev writes one packet gathered from bufs (the virtio-net header, if
// any, in front), with one writev(2). It does not allocate.
func (d *Device) Writev(bufs [][]byte) (int, error) {
	o := d.op(opWritev)
	for _, b := range bufs {
		if len(b) == 0 {
			continue
		}
		var v unix.Iovec
		v.Base = &b[0]
		v.SetLen(len(b))
		o.iov = append(o.iov, v)
	}
	if len(o.iov) == 0 {
		d.ops.Put(o)
		return 0, nil
	}
	return d.run(o, d.raw.Write)
}

// op is the state of one read or write on the descriptor: the callback
// handed to the runtime poller is bound once per op, and ops are pooled,
// so that no packet allocates.
type op struct {
	kind  int
	b     []byte
	iov   []unix.Iovec
	n     int
	errno unix.Errno
	fn    func(fd uintptr) bool // o.do, bound once
	ctl   func(fd uintptr)      // o.do for RawConn.Control, bound once
}

const (
	opRead = iota
	opWrite
	opWritev
	opTryRead // a read that reports "nothing queued" (n = 0) instead of waiting
)

func (d *Device) op(kind int) *op {
	o, _ := d.ops.Get().(*op)
	if o == nil {
		o = &op{}
		o.fn = o.do
		o.ctl = func(fd uintptr) { o.do(fd) }
	}
	o.kind = kind
	return o
}

// run performs o through the poller method rw (raw.Read or raw.Write) and
// returns o to the pool.
func (d *Device) run(o *op, rw func(func(uintptr) bool) error) (int, error) {
	return d.finish(o, rw(o.fn))
}

// finish returns o's outcome, given the poller's error err, and returns o
// to the pool.
func (d *Device) finish(o *op, err error) (int, error) {
	n := o.n
	if err == nil && o.errno != 0 {
		err = o.errno
	}
	o.b = nil
	clear(o.iov) // drop the references to the caller's buffers
	o.iov = o.iov[:0]
	o.n, o.errno = 0, 0
	d.ops.Put(o)
	if err != nil {
		if d.closed.Load() {
			return 0, os.ErrClosed
		}
		return 0, err
	}
	return n, nil
}

// do makes the system call. The descriptor is non-blocking, so the call
// never sleeps: it is a raw system call, without the runtime's syscall
// bookkeeping (which would also wake the runtime's monitor thread after
// every idle spell: a futex wake per packet on a quiet link). EAGAIN goes
// back to the poller, which waits for the descriptor.
func (o *op) do(fd uintptr) bool {
	var r uintptr
	var e unix.Errno
	switch o.kind {
	case opRead, opTryRead:
		r, _, e = unix.RawSyscall(unix.SYS_READ, fd, uintptr(unsafe.Pointer(&o.b[0])), uintptr(len(o.b)))
	case opWrite:
		r, _, e = unix.RawSyscall(unix.SYS_WRITE, fd, uintptr(unsafe.Pointer(&o.b[0])), uintptr(len(o.b)))
	case opWritev:
		r, _, e = unix.RawSyscall(unix.SYS_WRITEV, fd, uintptr(unsafe.Pointer(&o.iov[0])), uintptr(len(o.iov)))
	}
	switch e {
	case unix.EAGAIN:
		if o.kind == opTryRead {
			o.n, o.errno = 0, 0
			return true
		}
		return false
	case unix.EINTR:
		return o.do(fd)
	}
	o.n, o.errno = int(r), e
	return true
}

// Close closes the descriptor, which removes the (non-persistent) device and
// every route through it. Blocked reads return os.ErrClosed.
func (d *Device) Close() error {
	d.closed.Store(true)
	return d.file.Close()
}
