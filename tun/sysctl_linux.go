package tun

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
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
//     otherwise drop as a martian;
//   - net.ipv4.conf.all.rp_filter lowered from strict (1) to loose (2) if it
//     was strict, because the kernel applies the larger of "all" and the
//     device's value.
//
// Call Restore to put the previous values back.
func SetSysctls(tunName string) (*Sysctls, error) {
	s := &Sysctls{}
	set := func(key, val string, only func(old string) bool) error {
		old, err := readSysctl(key)
		if err != nil {
			return err
		}
		if old == val || (only != nil && !only(old)) {
			return nil
		}
		if err := writeSysctl(key, val); err != nil {
			return err
		}
		s.saved = append(s.saved, sysctl{key, old})
		return nil
	}
	steps := []struct {
		key, val string
		only     func(string) bool
	}{
		{"net/ipv4/ip_forward", "1", nil},
		{"net/ipv6/conf/all/forwarding", "1", nil},
		{"net/ipv4/conf/" + tunName + "/rp_filter", "0", nil},
		{"net/ipv4/conf/" + tunName + "/accept_local", "1", nil},
		{"net/ipv4/conf/all/rp_filter", "2", func(old string) bool { return old == "1" }},
	}
	for _, st := range steps {
		if err := set(st.key, st.val, st.only); err != nil {
			s.Restore()
			return nil, err
		}
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
