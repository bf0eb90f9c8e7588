package tun

import (
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"

	"github.com/rs/zerolog"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// RPFAddr is the address SetSysctls puts on the TUN (scope host): with
// one, the kernel's loose reverse-path check accepts what the TUN writes
// back with one of the node's own addresses as source (without any IPv4
// address on the incoming device it refuses such a packet). It lies in
// 127.0.0.0/8, which lo already makes local, so the node gains no new
// local address, and a scope-host address is never picked as the source
// of a packet that leaves.
var RPFAddr = net.IPv4(127, 109, 116, 1) // "mt"

// SysctlConfig says what SetSysctls prepares.
type SysctlConfig struct {
	// TUN is the device the proxy writes packets back into.
	TUN string
	// IPv4 and IPv6 say which families the node's captured pods use. A
	// family in use whose forwarding is off and cannot be turned on is
	// an error; a family not in use only gets a warning.
	IPv4, IPv6 bool
	Logger     zerolog.Logger
}

// Sysctls records the kernel settings meshtun changed, to put them back.
type Sysctls struct {
	saved []sysctl
}

// sysctl is one saved value: a /proc/sys key, or (dev set) the IPv4
// devconf index idx of device dev, set over netlink.
type sysctl struct {
	key, old string
	dev      string
	idx      uint16
}

// SetSysctls prepares the current network namespace for the TUN data path
// without writing any host-wide setting that a node's defaults already
// make work, so that it runs in an unprivileged container (CAP_NET_ADMIN
// only, /proc/sys mounted read-only) on kind's defaults
// (net.ipv4.conf.{all,default}.rp_filter=1):
//
//   - The TUN's own settings, over netlink (RTM_SETLINK,
//     IFLA_AF_SPEC/AF_INET/IFLA_INET_CONF), never /proc/sys:
//     rp_filter=2 and accept_local=1, and the scope-host address RPFAddr.
//     The kernel filters with max(all, device), so 2 makes the TUN loose
//     whatever "all" is (0 cannot be had under a strict "all"). What the
//     TUN writes back to a captured pod passes even the strict check:
//     the kernel's reverse-path lookup of a forwarded packet is made as
//     arriving on the output device (the pod's link), and the capture
//     rule "iif <link> from <pod> lookup <table>" answers the TUN. What
//     it writes back with one of the node's own addresses as source (the
//     node's verbatim traffic to a pod) finds that address in the local
//     table (priority 0, before any rule meshtun can add), on the node's
//     uplink: that needs accept_local, the loose check and an IPv4
//     address on the TUN (RPFAddr). The reverse-path lookups of packets
//     arriving on pod links and uplinks towards the TUN are made as from
//     the TUN, and "iif <tun> lookup main" answers with the link they
//     came from, so uplinks keep their value; only a capture link that
//     is strict is made loose, over netlink, as its rules go in
//     (looseLink: the pod's own ARP for its gateway needs it).
//   - Forwarding, IPv4 and IPv6, which every Kubernetes node has on. If
//     off, it is written to /proc/sys; where that is read-only, IPv4
//     forwarding is set per device over netlink (IPV4_DEVCONF_FORWARDING,
//     on every device present), while IPv6 forwarding has no such way
//     (the kernel's IFLA_INET6_CONF is read-only): an error if the node's
//     pods use IPv6, a warning otherwise.
//
// Call Restore to put the previous values back.
func SetSysctls(cfg SysctlConfig) (*Sysctls, error) {
	s := &Sysctls{}
	fail := func(err error) (*Sysctls, error) {
		s.Restore()
		return nil, err
	}
	if err := setDevconf(cfg.TUN, map[uint16]uint32{devconfRPFilter: 2, devconfAcceptLocal: 1}); err != nil {
		return nil, err
	}
	l, err := netlink.LinkByName(cfg.TUN)
	if err != nil {
		return nil, fmt.Errorf("tun: %s: %w", cfg.TUN, err)
	}
	addr := &netlink.Addr{IPNet: &net.IPNet{IP: RPFAddr, Mask: net.CIDRMask(32, 32)}, Scope: unix.RT_SCOPE_HOST}
	if err := netlink.AddrAdd(l, addr); err != nil && !errors.Is(err, unix.EEXIST) {
		return nil, fmt.Errorf("tun: address %s on %s: %w", RPFAddr, cfg.TUN, err)
	}
	if err := s.forwarding("net/ipv4/ip_forward", "IPv4", cfg.IPv4, cfg.Logger); err != nil {
		return fail(err)
	}
	if err := s.forwarding("net/ipv6/conf/all/forwarding", "IPv6", cfg.IPv6, cfg.Logger); err != nil {
		return fail(err)
	}
	return s, nil
}

// looseLink makes a capture link's reverse-path filter loose (2) over
// netlink if it is strict (max(all, device) = 1), before its capture rules
// go in. Strict filtering cannot work on a capture link: what the kernel
// delivers locally from the pod (the pod's ARP request for its gateway,
// an address of the link itself) is checked with a lookup made as from
// iif lo, which meets the capture rule "to <pod>" and finds the TUN, not
// the pod's link, so the pod could no longer resolve its gateway. The
// capture rules' own source check (iif <link> from <pod>) is exact
// instead. The value stays when meshtun stops (the rules stay too); the
// link goes with its pod.
func looseLink(name string) error {
	all, err := readSysctl("net/ipv4/conf/all/rp_filter")
	if err != nil {
		return err
	}
	dev, err := readSysctl("net/ipv4/conf/" + name + "/rp_filter")
	if errors.Is(err, os.ErrNotExist) {
		return nil // not there (yet): nothing to filter
	} else if err != nil {
		return err
	}
	if max(all, dev) != "1" {
		return nil
	}
	return setDevconf(name, map[uint16]uint32{devconfRPFilter: 2})
}

// forwarding turns forwarding of one family on (key is its /proc/sys
// switch) if it is off; see SetSysctls.
func (s *Sysctls) forwarding(key, family string, used bool, log zerolog.Logger) error {
	old, err := readSysctl(key)
	if err != nil {
		if !used { // e.g. IPv6 disabled on the node
			log.Info().Err(err).Str("family", family).Msg("no forwarding switch for a family the node's pods do not use")
			return nil
		}
		return err
	}
	if old == "1" {
		return nil
	}
	werr := writeSysctl(key, "1")
	if werr == nil {
		s.saved = append(s.saved, sysctl{key: key, old: old})
		return nil
	}
	if !readOnly(werr) {
		return werr
	}
	if family == "IPv4" && used {
		if err := s.forwardingPerDevice(); err != nil {
			return fmt.Errorf("%w; and over netlink: %w", werr, err)
		}
		log.Warn().Str("sysctl", strings.ReplaceAll(key, "/", ".")).Msg("IPv4 forwarding is off and /proc/sys read-only: set on every present device over netlink instead; devices added later (new pod links) do not forward until it is on (every Kubernetes node has it on)")
		return nil
	}
	if used {
		return fmt.Errorf("%w: %s forwarding is off and this node's pods use %s; turn it on for the node (sysctl %s=1; kind does so for clusters of that family)", werr, family, family, strings.ReplaceAll(key, "/", "."))
	}
	log.Warn().Str("sysctl", strings.ReplaceAll(key, "/", ".")).Str("family", family).
		Msg("forwarding of a family no captured pod uses is off and cannot be written (read-only /proc/sys): that family is not forwarded through the TUN")
	return nil
}

// forwardingPerDevice sets IPV4_DEVCONF_FORWARDING on every device but lo
// whose own value is 0, over netlink, and records the old values.
func (s *Sysctls) forwardingPerDevice() error {
	links, err := netlink.LinkList()
	if err != nil {
		return fmt.Errorf("tun: list links: %w", err)
	}
	for _, l := range links {
		name := l.Attrs().Name
		if l.Attrs().Flags&net.FlagLoopback != 0 {
			continue
		}
		if v, err := readSysctl("net/ipv4/conf/" + name + "/forwarding"); err == nil && v != "0" {
			continue
		}
		if err := setDevconf(name, map[uint16]uint32{devconfForwarding: 1}); err != nil {
			if errors.Is(err, unix.ENODEV) || errors.Is(err, os.ErrNotExist) {
				continue // went meanwhile
			}
			return err
		}
		s.saved = append(s.saved, sysctl{dev: name, idx: devconfForwarding, old: "0"})
	}
	return nil
}

// readOnly says whether a /proc/sys write failed for want of permission
// (a read-only mount, as container runtimes give unprivileged
// containers, or a missing capability), not for a bad key or value.
func readOnly(err error) bool {
	return errors.Is(err, unix.EROFS) || errors.Is(err, unix.EACCES) || errors.Is(err, unix.EPERM)
}

// Restore writes back the values SetSysctls replaced, newest first. Keys of
// a device that no longer exists are skipped.
func (s *Sysctls) Restore() error {
	var errs []error
	for i := len(s.saved) - 1; i >= 0; i-- {
		sc := s.saved[i]
		var err error
		if sc.dev != "" {
			if err = setDevconf(sc.dev, map[uint16]uint32{sc.idx: 0}); err != nil {
				var nf netlink.LinkNotFoundError
				if errors.As(err, &nf) {
					err = nil
				}
			}
		} else if err = writeSysctl(sc.key, sc.old); errors.Is(err, os.ErrNotExist) {
			err = nil
		}
		if err != nil {
			errs = append(errs, err)
		}
	}
	s.saved = nil
	return errors.Join(errs...)
}

func readSysctl(key string) (string, error) {
	b, err := os.ReadFile(filepath.Join("/proc/sys", key))
	if err != nil {
		return "", fmt.Errorf("tun: read sysctl %s: %w", key, err)
	}
	return strings.TrimSpace(string(b)), nil
}

func writeSysctl(key, val string) error {
	if err := os.WriteFile(filepath.Join("/proc/sys", key), []byte(val), 0o644); err != nil {
		return fmt.Errorf("tun: set sysctl %s=%s: %w", key, val, err)
	}
	return nil
}
