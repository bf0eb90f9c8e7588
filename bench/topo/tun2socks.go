package topo

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"time"

	"github.com/rs/zerolog"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/tun"
)

// Tun2socksModule and Tun2socksVersion name the peer the suite compares
// against.
const (
	Tun2socksModule  = "github.com/xjasonlyu/tun2socks/v2"
	Tun2socksVersion = "v2.6.0"
)

// tun2socksDev is the TUN device tun2socks creates on its node.
const tun2socksDev = "t2s0"

// BuildTun2socks returns the path of a tun2socks binary of
// Tun2socksVersion under cacheDir, building it there from the Go module
// proxy the first time (about a minute on this kind of machine). It is
// built in a scratch module with `go get -tool` and `go build`, as plain
// `go install module@version` refuses the module (its go.mod has replace
// directives). The binary is a peer the benchmark runs, never code of
// meshtun's.
func BuildTun2socks(ctx context.Context, cacheDir string, log zerolog.Logger) (string, error) {
	return buildGoPeer(ctx, cacheDir, "tun2socks", Tun2socksModule, Tun2socksVersion, log)
}

// startTun2socks runs tun2socks on the node of pod src with a TUN of its
// own and the direct:// proxy (each flow sent on by a kernel socket of the
// node), at its default log level, then puts the TUN on the path meshtun
// uses: the same queue length, no IPv6 address generation, reverse-path
// filtering off on it, and the same policy rules and table (see
// tun.InstallRouting): packets from src's link and to src's addresses go
// to the TUN, what the TUN or the node itself sends does not.
func startTun2socks(ctx context.Context, bin string, src *cluster.Pod, log zerolog.Logger) (*cluster.Proc, error) {
	n := src.Node
	proc, err := startLogged(ctx, n, nil, func(line []byte) bool {
		return bytes.Contains(line, []byte("[STACK]"))
	}, bin, "-device", "tun://"+tun2socksDev, "-proxy", "direct://", "-loglevel", "info")
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*cluster.Proc, error) {
		proc.Stop(time.Second)
		return nil, fmt.Errorf("topo: tun2socks on %s: %w", n.Name(), err)
	}
	if err := n.SetSysctl("net/ipv4/conf/"+tun2socksDev+"/rp_filter", "0"); err != nil {
		return fail(err)
	}
	if v, err := n.Sysctl("net.ipv4.conf.all.rp_filter"); err != nil {
		return fail(err)
	} else if v == "1" {
		if err := n.SetSysctl("net.ipv4.conf.all.rp_filter", "2"); err != nil {
			return fail(err)
		}
	}
	err = n.Do(func() error {
		link, err := netlink.LinkByName(tun2socksDev)
		if err != nil {
			return fmt.Errorf("find %s: %w", tun2socksDev, err)
		}
		if err := netlink.LinkSetTxQLen(link, tun.DefaultTxQueueLen); err != nil {
			return fmt.Errorf("txqueuelen of %s: %w", tun2socksDev, err)
		}
		const addrGenModeNone = 1
		if err := netlink.LinkSetIP6AddrGenMode(link, addrGenModeNone); err != nil && !errors.Is(err, unix.EOPNOTSUPP) {
			return fmt.Errorf("addrgenmode of %s: %w", tun2socksDev, err)
		}
		if err := netlink.LinkSetUp(link); err != nil {
			return fmt.Errorf("bring %s up: %w", tun2socksDev, err)
		}
		// A restart finds the rules of the previous run (the routes went
		// with its device).
		if err := tun.RemoveStale(tun.DefaultTable); err != nil {
			return err
		}
		return captureRules(link.Attrs().Index, src)
	})
	if err != nil {
		return fail(err)
	}
	log.Debug().Int("pid", proc.Cmd.Process.Pid).Str("node", n.Name()).Msg("topo: tun2socks ready")
	return proc, nil
}

// captureRules installs, in the current namespace, the routes and rules
// tun.InstallRouting installs for meshtun, for the TUN with index dev and
// the one captured pod src.
func captureRules(dev int, src *cluster.Pod) error {
	table, prio := tun.DefaultTable, tun.DefaultPriority
	for _, dst := range []netip.Prefix{netip.MustParsePrefix("0.0.0.0/0"), netip.MustParsePrefix("::/0")} {
		rt := &netlink.Route{LinkIndex: dev, Dst: ipNet(dst), Table: table, Scope: netlink.SCOPE_LINK}
		if err := netlink.RouteAdd(rt); err != nil {
			return fmt.Errorf("route %s table %d: %w", dst, table, err)
		}
	}
	add := func(family, priority, table int, iif string, to netip.Prefix) error {
		r := netlink.NewRule()
		r.Family, r.Priority, r.Table, r.IifName = family, priority, table, iif
		if to.IsValid() {
			r.Dst = ipNet(to)
		}
		if err := netlink.RuleAdd(r); err != nil {
			return fmt.Errorf("rule %s: %w", r, err)
		}
		return nil
	}
	families := []int{unix.AF_INET, unix.AF_INET6}
	// Exemptions first: what the TUN writes back and what the node sends.
	for _, iif := range []string{tun2socksDev, "lo"} {
		for _, f := range families {
			if err := add(f, prio-1, unix.RT_TABLE_MAIN, iif, netip.Prefix{}); err != nil {
				return err
			}
		}
	}
	for _, f := range families {
		if err := add(f, prio, table, src.HostLink, netip.Prefix{}); err != nil {
			return err
		}
	}
	if err := add(unix.AF_INET, prio, table, "", netip.PrefixFrom(src.IPv4, 32)); err != nil {
		return err
	}
	return add(unix.AF_INET6, prio, table, "", netip.PrefixFrom(src.IPv6, 128))
}

func ipNet(p netip.Prefix) *net.IPNet {
	return &net.IPNet{IP: p.Addr().AsSlice(), Mask: net.CIDRMask(p.Bits(), p.Addr().BitLen())}
}
