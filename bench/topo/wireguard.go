package topo

import (
	"bufio"
	"context"
	"crypto/ecdh"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"hash/fnv"
	"net"
	"net/netip"
	"path/filepath"
	"strings"
	"time"

	"github.com/rs/zerolog"
	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/bench/cluster"
)

// WireGuardModule and WireGuardVersion name the wireguard-go peer. The
// module has no release tags, only pseudo-versions; this one is what the
// Go module proxy served as the newest on 2026-12-01 (`go list -m
// golang.zx2c4.com/wireguard@latest`); wireguard-go itself reports it as
// 0.0.20250522.
const (
	WireGuardModule  = "golang.zx2c4.com/wireguard"
	WireGuardVersion = "v0.0.0-20260522210424-ecfc5a8d5446"
)

// wgPort is the UDP port wireguard-go listens on, on every node uplink.
const wgPort = 51820

// wgSocketDir is where wireguard-go puts the UAPI socket of each device,
// <dev>.sock. The directory is the machine's, shared by every network
// namespace, so device names must be unique machine-wide (see wgDevName).
const wgSocketDir = "/var/run/wireguard"

// BuildWireGuardGo returns the path of a wireguard-go binary of
// WireGuardVersion under cacheDir, building it there from the Go module
// proxy the first time (like BuildTun2socks). Its Linux offloads (TUN
// segmentation offload through virtio-net headers, UDP GSO and GRO on the
// tunnel socket) need no flag: it turns them on whenever the kernel has
// them.
func BuildWireGuardGo(ctx context.Context, cacheDir string, log zerolog.Logger) (string, error) {
	return buildGoPeer(ctx, cacheDir, "wireguard-go", WireGuardModule, WireGuardVersion, log)
}

// wgEnd is one end of the wireguard-go tunnel of a path: the node it runs
// on, its device, its key pair, and the other end's public key, endpoint
// and the pod addresses behind it.
type wgEnd struct {
	node    *cluster.Node
	dev     string
	private [32]byte
	public  [32]byte
	peerPub [32]byte
	peerEP  netip.AddrPort
	remote  []netip.Prefix // the far pod's addresses, routed into the tunnel
}

// wgDevName returns a device name for wireguard-go on node n, unique to
// the cluster and node (the UAPI socket path is machine-wide) and within
// the 15 characters of an interface name.
func wgDevName(n *cluster.Node) string {
	h := fnv.New32a()
	h.Write([]byte(n.Name()))
	return fmt.Sprintf("mtwg%08x", h.Sum32())
}

// newWGPair returns the two ends of a tunnel between the nodes of src and
// dst, with fresh X25519 keys: each end routes the other end's pod into
// the tunnel and reaches the other node's uplink at wgPort.
func newWGPair(src, dst *cluster.Pod) ([2]*wgEnd, error) {
	var ends [2]*wgEnd
	for i, pod := range []*cluster.Pod{src, dst} {
		k, err := ecdh.X25519().GenerateKey(rand.Reader)
		if err != nil {
			return ends, fmt.Errorf("topo: wireguard key: %w", err)
		}
		e := &wgEnd{node: pod.Node, dev: wgDevName(pod.Node)}
		copy(e.private[:], k.Bytes())
		copy(e.public[:], k.PublicKey().Bytes())
		ends[i] = e
	}
	for i, far := range []*cluster.Pod{dst, src} {
		e, other := ends[i], ends[1-i]
		e.peerPub = other.public
		e.peerEP = netip.AddrPortFrom(far.Node.IPv4, wgPort)
		e.remote = []netip.Prefix{netip.PrefixFrom(far.IPv4, 32), netip.PrefixFrom(far.IPv6, 128)}
	}
	return ends, nil
}

// uapiConfig is the UAPI "set" body that configures end e: its key and
// port, and one peer, the other end, allowed the far pod's addresses.
func (e *wgEnd) uapiConfig() string {
	var b strings.Builder
	fmt.Fprintf(&b, "private_key=%s\nlisten_port=%d\nreplace_peers=true\n", hex.EncodeToString(e.private[:]), wgPort)
	fmt.Fprintf(&b, "public_key=%s\nendpoint=%s\nreplace_allowed_ips=true\n", hex.EncodeToString(e.peerPub[:]), e.peerEP)
	for _, p := range e.remote {
		fmt.Fprintf(&b, "allowed_ip=%s\n", p)
	}
	return b.String()
}

// startWireGuard runs wireguard-go in the foreground on e's node with a
// device of its own, waits until it serves its UAPI socket, configures it
// through that socket (the text protocol `wg` speaks to userspace
// implementations, so no wireguard-tools are needed), brings the device up
// and routes the far pod's addresses into it. Everything else stays
// wireguard-go's default: MTU 1420 (the fabric's 1500 less the tunnel's
// overhead; pods learn it by path MTU discovery), queue length, offloads.
func startWireGuard(ctx context.Context, bin string, e *wgEnd, log zerolog.Logger) (*cluster.Proc, error) {
	n := e.node
	proc, err := startLogged(ctx, n, []string{"LOG_LEVEL=verbose", "WG_PROCESS_FOREGROUND=1"}, func(line []byte) bool {
		return strings.Contains(string(line), "UAPI listener started")
	}, bin, "-f", e.dev)
	if err != nil {
		return nil, err
	}
	fail := func(err error) (*cluster.Proc, error) {
		proc.Stop(time.Second)
		return nil, fmt.Errorf("topo: wireguard-go on %s: %w", n.Name(), err)
	}
	if _, err := uapi(ctx, e.dev, "set=1\n"+e.uapiConfig()+"\n"); err != nil {
		return fail(err)
	}
	err = n.Do(func() error {
		link, err := netlink.LinkByName(e.dev)
		if err != nil {
			return fmt.Errorf("find %s: %w", e.dev, err)
		}
		const addrGenModeNone = 1
		if err := netlink.LinkSetIP6AddrGenMode(link, addrGenModeNone); err != nil && !errors.Is(err, unix.EOPNOTSUPP) {
			return fmt.Errorf("addrgenmode of %s: %w", e.dev, err)
		}
		if err := netlink.LinkSetUp(link); err != nil {
			return fmt.Errorf("bring %s up: %w", e.dev, err)
		}
		for _, p := range e.remote {
			rt := &netlink.Route{LinkIndex: link.Attrs().Index, Dst: ipNet(p), Scope: netlink.SCOPE_LINK}
			if err := netlink.RouteAdd(rt); err != nil {
				return fmt.Errorf("route %s dev %s: %w", p, e.dev, err)
			}
		}
		return nil
	})
	if err != nil {
		return fail(err)
	}
	log.Debug().Int("pid", proc.Cmd.Process.Pid).Str("node", n.Name()).Str("dev", e.dev).Msg("topo: wireguard-go ready")
	return proc, nil
}

// uapiTimeout bounds one exchange on a UAPI socket.
const uapiTimeout = 5 * time.Second

// uapi sends req (a complete "set=1" or "get=1" request, ending in an
// empty line) to the UAPI socket of wireguard-go's device dev and returns
// the response's lines before its errno line, failing if errno is not 0.
func uapi(ctx context.Context, dev, req string) ([]string, error) {
	var d net.Dialer
	ctx, cancel := context.WithTimeout(ctx, uapiTimeout)
	defer cancel()
	path := filepath.Join(wgSocketDir, dev+".sock")
	c, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("UAPI: %w", err)
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	if _, err := c.Write([]byte(req)); err != nil {
		return nil, fmt.Errorf("UAPI %s: %w", path, err)
	}
	var lines []string
	sc := bufio.NewScanner(c)
	for sc.Scan() {
		l := sc.Text()
		if l == "" {
			break
		}
		lines = append(lines, l)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("UAPI %s: %w", path, err)
	}
	if len(lines) == 0 {
		return nil, fmt.Errorf("UAPI %s: empty response", path)
	}
	last := lines[len(lines)-1]
	errno, ok := strings.CutPrefix(last, "errno=")
	if !ok {
		return nil, fmt.Errorf("UAPI %s: response ends in %q, not errno", path, last)
	}
	if errno != "0" {
		return nil, fmt.Errorf("UAPI %s: errno %s", path, errno)
	}
	return lines[:len(lines)-1], nil
}
