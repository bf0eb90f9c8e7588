package tun

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Sysctls records the kernel settings meshtun changed, to put them back.
type Sysctls struct {
	saved []sysctl
}

type sysctl struct{ key, old string }

// SetSysctls sets what the bump-in-the-wire data path needs in the current
// network namespace:
//
//   - IPv4 and IPv6 forwarding on, so packets move between pod links, the
//     uplink and the TUN;
//   - reverse-path filtering off on the TUN: packets written back into it
//     carry other hosts' source addresses, whose routes point elsewhere;
//   - accept_local on the TUN: what the node itself sends to a captured pod
//     enters the TUN and, when it is not proxied, is written back with one
//     of the node's own addresses as its source, which the kernel would
//     otherwise drop as a martian.
//
// The kernel filters with the larger of net.ipv4.conf.all.rp_filter and the
// device's own value, so a strict (1) "all" would still apply to the TUN.
// In that case, and only then, the strictness moves from "all" to the
// devices: every other device is raised to at least 1, except the links in
// loose (the capture links and the spoof sink) and "default" (which new
// devices, such as new pod links, copy), which are raised to at least 2
// (loose); only then is "all" lowered to 0. Strict filtering cannot work on
// a capture link: the reverse-path lookup of a pod's packet finds the
// capture rule to the pod, i.e. the TUN, not the pod's link; the capture
// rules' own source check (iif <link> from <pod>) is exact instead. A loose
// (2) "all" is left alone: loose filtering passes what the TUN writes back.
//
// Call Restore to put the previous values back.
func SetSysctls(tunName string, loose ...string) (*Sysctls, error) {
	s := &Sysctls{}
	// set writes val to key if only (nil: always) accepts the old value;
	// with pin it writes a device's value even when it stays the same:
	// a device value never written explicitly follows every later write
	// to "default" (the kernel copies it), and must not.
	set := func(key, val string, only func(old string) bool, pin bool) error {
		old, err := readSysctl(key)
		if err != nil {
			return err
		}
		if only != nil && !only(old) {
			val = old
		}
		if old == val && !pin {
			return nil
		}
		if err := writeSysctl(key, val); err != nil {
			// /proc/sys read-only (an unprivileged container): the TUN's
			// own settings can still be set over netlink. They need no
			// restoring: the device goes when meshtun closes it.
			dev, ok := strings.CutPrefix(key, "net/ipv4/conf/"+tunName+"/")
			idx, known := devconfKeys[dev]
			if !ok || !known || !(errors.Is(err, unix.EROFS) || errors.Is(err, unix.EACCES)) {
				return err
			}
			n, _ := strconv.ParseUint(val, 10, 32)
			return setDevconf(tunName, map[uint16]uint32{idx: uint32(n)})
		}
		if old != val {
			s.saved = append(s.saved, sysctl{key, old})
		}
		return nil
	}
	fail := func(err error) (*Sysctls, error) {
		s.Restore()
		return nil, err
	}
	for _, st := range []struct {
		key, val string
		pin      bool
	}{
		{"net/ipv4/ip_forward", "1", false},
		{"net/ipv6/conf/all/forwarding", "1", false},
		{"net/ipv4/conf/" + tunName + "/rp_filter", "0", true},
		{"net/ipv4/conf/" + tunName + "/accept_local", "1", true},
	} {
		if err := set(st.key, st.val, nil, st.pin); err != nil {
			return fail(err)
		}
	}
	all, err := readSysctl("net/ipv4/conf/all/rp_filter")
	if err != nil {
		return fail(err)
	}
	if all != "1" {
		return s, nil
	}
	entries, err := os.ReadDir("/proc/sys/net/ipv4/conf")
	if err != nil {
		return fail(fmt.Errorf("tun: list devices' sysctls: %w", err))
	}
	notStrict := func(old string) bool { return old == "0" }
	for _, e := range entries {
		if e.Name() == "all" || e.Name() == "default" || e.Name() == tunName {
			continue
		}
		val := "1"
		if slices.Contains(loose, e.Name()) {
			val = "2"
		}
		err := set("net/ipv4/conf/"+e.Name()+"/rp_filter", val, notStrict, true)
		if err != nil && !errors.Is(err, os.ErrNotExist) { // a device that just went
			return fail(err)
		}
	}
	// "default" last: the devices are pinned by now.
	if err := set("net/ipv4/conf/default/rp_filter", "2", notStrict, false); err != nil {
		return fail(err)
	}
	if err := set("net/ipv4/conf/all/rp_filter", "0", nil, false); err != nil {
		return fail(err)
	}
	return s, nil
}

// Restore writes back the values SetSysctls replaced, newest first. Keys of
// a device that no longer exists are skipped.
func (s *Sysctls) Restore() error {
	var errs []error
	for i := len(s.saved) - 1; i >= 0; i-- {
		sc := s.saved[i]
		if err := writeSysctl(sc.key, sc.old); err != nil && !errors.Is(err, os.ErrNotExist) {
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
