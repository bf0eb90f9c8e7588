package cluster

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
)

// netnsDir is where named network namespaces are bind-mounted, the same
// directory `ip netns` uses.
const netnsDir = "/run/netns"

// NS is one named network namespace of a cluster. The zero value is not
// usable; namespaces come from New.
type NS struct {
	name  string
	procs *procTable
}

// Name returns the namespace's name, usable with `ip netns exec <name> …`.
func (n *NS) Name() string { return n.name }

// Path returns the bind mount that pins the namespace, /run/netns/<name>.
func (n *NS) Path() string { return filepath.Join(netnsDir, n.name) }

// String returns the namespace's name.
func (n *NS) String() string { return n.name }

// Do runs fn on an OS thread that has been switched into the namespace and
// returns fn's error. Sockets created by fn stay in this namespace for their
// whole life, so Do is the way to open listeners and connections here.
//
// fn runs on a fresh goroutine locked to its thread: it must not call
// t.Fatal or start goroutines that expect to inherit the namespace (new
// goroutines run on other threads, in other namespaces). A panic in fn is
// re-raised in the caller after the thread has been switched back. If the
// thread cannot be switched back, it is never unlocked, so the Go runtime
// retires it instead of reusing it in the wrong namespace.
func (n *NS) Do(fn func() error) error {
	type result struct {
		err      error
		panicked bool
		pv       any
	}
	ch := make(chan result, 1)
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: fmt.Errorf("netns %s: get current namespace: %w", n.name, err)}
			return
		}
		defer orig.Close()
		target, err := netns.GetFromName(n.name)
		if err != nil {
			runtime.UnlockOSThread()
			ch <- result{err: fmt.Errorf("netns %s: open: %w", n.name, err)}
			return
		}
		err = netns.Set(target)
		target.Close()
		if err != nil {
			// Set failed, so the thread is still where it was.
			runtime.UnlockOSThread()
			ch <- result{err: fmt.Errorf("netns %s: enter: %w", n.name, err)}
			return
		}
		var res result
		func() {
			defer func() {
				if pv := recover(); pv != nil {
					res = result{panicked: true, pv: pv}
				}
			}()
			res.err = fn()
		}()
		if err := netns.Set(orig); err != nil {
			// Leave the thread locked: it dies with this goroutine.
			res.err = errors.Join(res.err, fmt.Errorf("netns %s: switch back to original namespace: %w", n.name, err))
			ch <- res
			return
		}
		runtime.UnlockOSThread()
		ch <- res
	}()
	res := <-ch
	if res.panicked {
		panic(res.pv)
	}
	return res.err
}

// checkLiteral rejects IP network addresses whose host is a name: resolving
// a name may make the net package dial from helper goroutines, which would
// run outside the namespace. An empty host is fine.
func checkLiteral(network, address string, allowEmpty bool) error {
	switch network {
	case "tcp", "tcp4", "tcp6", "udp", "udp4", "udp6":
	default:
		if strings.HasPrefix(network, "ip") {
			host := address
			if host == "" && allowEmpty {
				return nil
			}
			if _, err := netip.ParseAddr(host); err != nil {
				return fmt.Errorf("address %q: want an IP literal: %w", address, err)
			}
		}
		return nil
	}
	host, _, err := net.SplitHostPort(address)
	if err != nil {
		return fmt.Errorf("address %q: %w", address, err)
	}
	if host == "" && allowEmpty {
		return nil
	}
	if _, err := netip.ParseAddr(host); err != nil {
		return fmt.Errorf("address %q: want an IP literal host, names are not resolved inside a namespace: %w", address, err)
	}
	return nil
}

// Dial connects to address from inside the namespace. For IP networks the
// host must be an IP literal.
func (n *NS) Dial(ctx context.Context, network, address string) (net.Conn, error) {
	if err := checkLiteral(network, address, false); err != nil {
		return nil, fmt.Errorf("netns %s: dial %s: %w", n.name, network, err)
	}
	var c net.Conn
	err := n.Do(func() error {
		var d net.Dialer
		var err error
		c, err = d.DialContext(ctx, network, address)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("netns %s: %w", n.name, err)
	}
	return c, nil
}

// Listen opens a stream listener inside the namespace. For IP networks the
// host must be empty or an IP literal.
func (n *NS) Listen(network, address string) (net.Listener, error) {
	if err := checkLiteral(network, address, true); err != nil {
		return nil, fmt.Errorf("netns %s: listen %s: %w", n.name, network, err)
	}
	var l net.Listener
	err := n.Do(func() error {
		var err error
		l, err = net.Listen(network, address)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("netns %s: %w", n.name, err)
	}
	return l, nil
}

// ListenPacket opens a packet socket inside the namespace. For IP networks
// the host must be empty or an IP literal.
func (n *NS) ListenPacket(network, address string) (net.PacketConn, error) {
	if err := checkLiteral(network, address, true); err != nil {
		return nil, fmt.Errorf("netns %s: listen %s: %w", n.name, network, err)
	}
	var pc net.PacketConn
	err := n.Do(func() error {
		var err error
		pc, err = net.ListenPacket(network, address)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("netns %s: %w", n.name, err)
	}
	return pc, nil
}

// sysctlPath maps "net.ipv4.ip_forward" (or "net/ipv4/ip_forward") to its
// file under /proc/sys. Dotted keys cannot name interfaces whose names
// contain dots; use the slash form for those.
func sysctlPath(key string) (string, error) {
	k := key
	if !strings.Contains(k, "/") {
		k = strings.ReplaceAll(k, ".", "/")
	}
	k = strings.TrimPrefix(k, "/proc/sys/")
	clean := filepath.Clean("/" + k)
	if clean == "/" || strings.Contains(k, "..") {
		return "", fmt.Errorf("sysctl key %q: not a sysctl name", key)
	}
	return filepath.Join("/proc/sys", clean), nil
}

// Sysctl reads a sysctl inside the namespace, e.g.
// "net.ipv4.conf.all.rp_filter", and returns its value without the trailing
// newline. /proc/sys/net resolves against the network namespace of the
// thread that opens the file, so the read happens inside Do.
func (n *NS) Sysctl(key string) (string, error) {
	p, err := sysctlPath(key)
	if err != nil {
		return "", fmt.Errorf("netns %s: %w", n.name, err)
	}
	var b []byte
	err = n.Do(func() error {
		var err error
		b, err = os.ReadFile(p)
		return err
	})
	if err != nil {
		return "", fmt.Errorf("netns %s: read sysctl %s: %w", n.name, key, err)
	}
	return strings.TrimRight(string(b), "\n"), nil
}

// SetSysctl writes a sysctl inside the namespace.
func (n *NS) SetSysctl(key, value string) error {
	p, err := sysctlPath(key)
	if err != nil {
		return fmt.Errorf("netns %s: %w", n.name, err)
	}
	err = n.Do(func() error {
		f, err := os.OpenFile(p, os.O_WRONLY, 0)
		if err != nil {
			return err
		}
		_, werr := f.WriteString(value)
		return errors.Join(werr, f.Close())
	})
	if err != nil {
		return fmt.Errorf("netns %s: set sysctl %s=%s: %w", n.name, key, value, err)
	}
	return nil
}

// setSysctls writes key/value pairs, in order, inside one Do.
func (n *NS) setSysctls(kv ...string) error {
	return n.Do(func() error {
		for i := 0; i+1 < len(kv); i += 2 {
			p, err := sysctlPath(kv[i])
			if err != nil {
				return err
			}
			if err := os.WriteFile(p, []byte(kv[i+1]), 0); err != nil {
				return fmt.Errorf("netns %s: set sysctl %s=%s: %w", n.name, kv[i], kv[i+1], err)
			}
		}
		return nil
	})
}

// handle opens a netlink handle bound to the namespace. The caller closes it.
func (n *NS) handle() (*netlink.Handle, error) {
	h, err := netns.GetFromName(n.name)
	if err != nil {
		return nil, fmt.Errorf("netns %s: open: %w", n.name, err)
	}
	defer h.Close()
	nl, err := netlink.NewHandleAt(h)
	if err != nil {
		return nil, fmt.Errorf("netns %s: netlink handle: %w", n.name, err)
	}
	return nl, nil
}
