package topo

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"time"

	"github.com/rs/zerolog"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/bench/cluster"
)

// PastaPackage is the Debian package pasta comes in.
const PastaPackage = "passt"

// EnsurePasta returns the path of the pasta binary, installing Debian's
// passt package with apt-get first if pasta is not in PATH (which needs
// root; `apt-get update` is run once more if the install fails, for a
// machine whose package lists are missing or stale).
func EnsurePasta(ctx context.Context, log zerolog.Logger) (string, error) {
	if p, err := exec.LookPath("pasta"); err == nil {
		return p, nil
	}
	if _, err := exec.LookPath("apt-get"); err != nil {
		return "", errors.New("topo: pasta is not installed and there is no apt-get to install Debian's " + PastaPackage + " package with")
	}
	if os.Geteuid() != 0 {
		return "", errors.New("topo: pasta is not installed; installing Debian's " + PastaPackage + " package needs root")
	}
	log.Info().Str("package", PastaPackage).Msg("installing the pasta peer with apt-get (once)")
	install := []string{"install", "-y", "--no-install-recommends", PastaPackage}
	out, err := aptGet(ctx, install...)
	if err != nil {
		if uout, uerr := aptGet(ctx, "update"); uerr != nil {
			return "", fmt.Errorf("topo: apt-get install %s: %w\n%s\napt-get update: %w\n%s", PastaPackage, err, out, uerr, uout)
		}
		if out, err = aptGet(ctx, install...); err != nil {
			return "", fmt.Errorf("topo: apt-get install %s: %w\n%s", PastaPackage, err, out)
		}
	}
	p, err := exec.LookPath("pasta")
	if err != nil {
		return "", fmt.Errorf("topo: %s installed, but pasta is not in PATH: %w", PastaPackage, err)
	}
	return p, nil
}

func aptGet(ctx context.Context, args ...string) ([]byte, error) {
	cmd := exec.CommandContext(ctx, "apt-get", args...)
	cmd.Env = append(os.Environ(), "DEBIAN_FRONTEND=noninteractive")
	return cmd.CombinedOutput()
}

// PastaVersion returns the version of the installed passt package, as
// Debian numbers it (pasta itself may call itself "unknown version"), or
// "" if dpkg does not know it.
func PastaVersion() string {
	out, err := exec.Command("dpkg-query", "-W", "-f=${Version}", PastaPackage).Output()
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(out))
}

// detachPod removes pod's veth pair, and with it the node's routes to the
// pod: the pod is left with its loopback alone, for pasta to give it a
// network.
func detachPod(pod *cluster.Pod) error {
	err := pod.Node.Do(func() error {
		l, err := netlink.LinkByName(pod.HostLink)
		if err != nil {
			return fmt.Errorf("find %s: %w", pod.HostLink, err)
		}
		return netlink.LinkDel(l)
	})
	if err != nil {
		return fmt.Errorf("topo: detach %s from %s: %w", pod.ID, pod.Node.Name(), err)
	}
	return nil
}

// pastaArgs are pasta's arguments for pod src, whose node runs it: in
// the foreground, still root (pasta drops to "nobody" by default, which
// could not enter the pod's namespace), logging to logFile; the tap
// named like the pod's interface, configured by pasta itself with the
// pod's own addresses and its node's gateway addresses as default routes
// (the node's uplink is the template, as the node has no default route);
// no port forwarding either way (nothing here listens for the other side)
// and no DHCP, DHCPv6 or router advertisements (the addresses are
// static). Everything else, such as the tap's MTU of 65520, stays pasta's
// default, as rootless Podman runs it.
func pastaArgs(src *cluster.Pod, logFile string) []string {
	n := src.Node
	return []string{
		"--foreground", "--runas", "0", "--log-file", logFile,
		"--tcp-ports", "none", "--udp-ports", "none", "--tcp-ns", "none", "--udp-ns", "none",
		"--no-dhcp", "--no-dhcpv6", "--no-ra",
		"--interface", n.Uplink,
		"--address", src.IPv4.String(), "--netmask", strconv.Itoa(n.PodPrefix4.Bits()), "--gateway", n.Gateway4.String(),
		"--address", src.IPv6.String(), "--gateway", n.Gateway6.String(),
		"--config-net", "--ns-ifname", src.Link,
		"--netns", src.Path(),
	}
}

// startPasta runs pasta on the node of pod src, giving src's namespace
// its network (see pastaArgs): what src sends to the server pod becomes
// sockets of pasta's in the node's namespace, routed by the node like any
// of its own connections. It returns once the pod's interface is up with
// its address and default route. src must have been detached
// (detachPod).
func startPasta(ctx context.Context, bin string, src *cluster.Pod, logFile string, log zerolog.Logger) (*cluster.Proc, error) {
	n := src.Node
	os.Remove(logFile) // a restart's log starts afresh
	proc, err := startLogged(ctx, n, nil, nil, bin, pastaArgs(src, logFile)...)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*cluster.Proc, error) {
		proc.Stop(time.Second)
		tail := ""
		if b, rerr := os.ReadFile(logFile); rerr == nil {
			lines := strings.Split(strings.TrimSpace(string(b)), "\n")
			tail = strings.Join(lines[max(0, len(lines)-keptLines):], "\n")
		}
		return nil, fmt.Errorf("topo: pasta on %s for %s: %w; its log:\n%s", n.Name(), src.ID, err, tail)
	}
	deadline := time.NewTimer(readyTimeout)
	defer deadline.Stop()
	for wait := time.Millisecond; ; wait = min(2*wait, 50*time.Millisecond) {
		ok, err := pastaReady(src)
		if err != nil {
			return fail(err)
		}
		if ok {
			break
		}
		t := time.NewTimer(wait)
		select {
		case <-proc.Done():
			t.Stop()
			return fail(fmt.Errorf("exited (%v) before the pod's network was up", proc.Wait()))
		case <-deadline.C:
			t.Stop()
			return fail(fmt.Errorf("the pod's network not up within %v", readyTimeout))
		case <-ctx.Done():
			t.Stop()
			return fail(ctx.Err())
		case <-t.C:
		}
	}
	log.Debug().Int("pid", proc.Cmd.Process.Pid).Str("node", n.Name()).Str("pod", src.ID).Msg("topo: pasta ready")
	return proc, nil
}

// pastaReady reports whether pod's interface, as pasta configures it, is
// up with the pod's IPv4 address and has an IPv4 default route.
func pastaReady(pod *cluster.Pod) (bool, error) {
	ready := false
	err := pod.Do(func() error {
		l, err := netlink.LinkByName(pod.Link)
		if err != nil {
			var nf netlink.LinkNotFoundError
			if errors.As(err, &nf) {
				return nil
			}
			return err
		}
		if l.Attrs().Flags&net.FlagUp == 0 {
			return nil
		}
		addrs, err := netlink.AddrList(l, unix.AF_INET)
		if err != nil {
			return err
		}
		have := false
		for _, a := range addrs {
			if ip, ok := netip.AddrFromSlice(a.IP); ok && ip.Unmap() == pod.IPv4 {
				have = true
			}
		}
		if !have {
			return nil
		}
		routes, err := netlink.RouteList(l, unix.AF_INET)
		if err != nil {
			return err
		}
		for _, r := range routes {
			if r.Gw == nil {
				continue
			}
			if r.Dst == nil {
				ready = true
			} else if ones, _ := r.Dst.Mask.Size(); ones == 0 {
				ready = true
			}
		}
		return nil
	})
	return ready, err
}
