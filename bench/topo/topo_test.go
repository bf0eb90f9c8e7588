package topo

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/vishvananda/netlink"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
	"github.com/meshtun/meshtun/test/fixture"
)

// meshtunBin is built once by TestMain for the topology test.
var meshtunBin string

func TestMain(m *testing.M) {
	fixture.MainWithBinary(m, &meshtunBin, "meshtun", "github.com/meshtun/meshtun/cmd/meshtun", "-tags", noderun.BuildTags)
}

// tunBytes returns the bytes through the TUN device of node n's meshtun,
// both ways, 0 if n has none. (Bytes, not packets: with segmentation
// offload one packet on the TUN may carry 64 KB.)
func tunBytes(t *testing.T, n *cluster.Node) uint64 {
	t.Helper()
	var pk uint64
	err := n.Do(func() error {
		l, err := netlink.LinkByName("meshtun0")
		if err != nil {
			return nil // no TUN on this node
		}
		pk = l.Attrs().Statistics.RxBytes + l.Attrs().Statistics.TxBytes
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return pk
}

// TestPathsGoWhereTheySay builds the topology without the peer and sends
// a megabyte down each path and back: it must arrive, the TUN of every
// node whose proxy is on the path must carry it, and the TUNs of other
// paths must not (a few packets of background, such as the pods' IPv6
// multicast reports, are allowed).
func TestPathsGoWhereTheySay(t *testing.T) {
	fixture.RequireRoot(t, "network namespaces and /dev/net/tun")
	if err := cluster.Preflight(); err != nil {
		t.Fatalf("this test needs root, network namespaces and /dev/net/tun: %v", err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	topo, err := Build(ctx, Spec{Meshtun: meshtunBin, Log: zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := topo.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	}()
	var names []string
	for _, p := range topo.Paths {
		names = append(names, p.Name)
	}
	if fmt.Sprint(names) != "[direct verbatim passthrough mesh]" {
		t.Fatalf("paths %v", names)
	}
	wantProxies := map[string]int{Direct: 0, Verbatim: 2, Passthrough: 1, Mesh: 2}
	for _, p := range topo.Paths {
		if len(p.Proxies) != wantProxies[p.Name] {
			t.Errorf("%s: %d proxies %v, want %d", p.Name, len(p.Proxies), p.Proxies, wantProxies[p.Name])
		}
		if p.Src.Node == p.Dst.Node {
			t.Errorf("%s: both pods on %s", p.Name, p.Src.Node.Name())
		}
	}

	for _, p := range topo.Paths {
		before := map[*cluster.Node]uint64{}
		for _, n := range topo.Cluster.Nodes {
			before[n] = tunBytes(t, n)
		}
		exchange(t, ctx, p)
		onPath := map[*cluster.Node]bool{}
		switch p.Name {
		case Verbatim, Mesh:
			onPath[p.Src.Node], onPath[p.Dst.Node] = true, true
		case Passthrough:
			onPath[p.Src.Node] = true
		}
		for _, n := range topo.Cluster.Nodes {
			d := tunBytes(t, n) - before[n]
			if onPath[n] && d < 1<<20 || !onPath[n] && d > 64<<10 {
				t.Errorf("%s: TUN of %s carried %d bytes, on the path: %v", p.Name, n.Name(), d, onPath[n])
			}
		}
	}

	// A restart brings the proxies back, with new processes.
	m := topo.Path(Mesh)
	old := m.Proxies[0].Pid
	if err := topo.Restart(ctx, m); err != nil {
		t.Fatal(err)
	}
	if m.Proxies[0].Pid == old {
		t.Errorf("restart kept pid %d", old)
	}
	exchange(t, ctx, m)
}

// exchange sends a megabyte from p's client pod to an echo server in its
// server pod, reads it back and returns the client's address as the
// server saw it.
func exchange(t *testing.T, ctx context.Context, p *Path) netip.Addr {
	t.Helper()
	ln, err := p.Dst.Listen("tcp", netip.AddrPortFrom(p.Dst.IPv4, 7900).String())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	from := make(chan netip.Addr, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			from <- netip.Addr{}
			return
		}
		defer c.Close()
		from <- c.RemoteAddr().(*net.TCPAddr).AddrPort().Addr().Unmap()
		io.Copy(c, c)
	}()
	c, err := p.Src.Dial(ctx, "tcp", netip.AddrPortFrom(p.Dst.IPv4, 7900).String())
	if err != nil {
		t.Fatalf("%s: %v", p.Name, err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	msg := bytes.Repeat([]byte("through "+p.Name+" "), 1<<20/len(p.Name))
	werr := make(chan error, 1)
	go func() {
		_, err := c.Write(msg)
		werr <- err
	}()
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, msg) {
		t.Fatalf("%s: echo of %d bytes: %v (equal: %v)", p.Name, len(msg), err, bytes.Equal(got, msg))
	}
	if err := <-werr; err != nil {
		t.Fatalf("%s: %v", p.Name, err)
	}
	c.(*net.TCPConn).CloseWrite()
	return <-from
}

func TestChoosePlans(t *testing.T) {
	names := func(spec Spec) string {
		ps, err := choosePlans(spec)
		if err != nil {
			return "error: " + err.Error()
		}
		var s []string
		for _, p := range ps {
			s = append(s, p.name+"/"+p.kind+"/"+p.variantOf)
		}
		return fmt.Sprint(s)
	}
	for _, tc := range []struct {
		spec Spec
		want string
	}{
		{Spec{}, "[direct/direct/ verbatim/verbatim/ passthrough/passthrough/ mesh/mesh/]"},
		{Spec{Tun2socks: "t"}, "[direct/direct/ verbatim/verbatim/ passthrough/passthrough/ mesh/mesh/ tun2socks/tun2socks/]"},
		{Spec{Pasta: "p", WireGuardGo: "w", Paths: []string{Passthrough}},
			"[direct/direct/ passthrough/passthrough/ wireguard-go/wireguard-go/ pasta/pasta/]"},
		{Spec{Pasta: "p", Tun2socks: "t", WireGuardGo: "w", Paths: []string{Mesh}, Variant: &Variant{}},
			"[direct/direct/ mesh/mesh/ mesh·B/mesh/mesh tun2socks/tun2socks/ wireguard-go/wireguard-go/ pasta/pasta/]"},
		{Spec{Paths: []string{Mesh}}, "[direct/direct/ mesh/mesh/]"},
		{Spec{Paths: []string{Mesh, Passthrough}, Variant: &Variant{Env: []string{"A=1"}}},
			"[direct/direct/ passthrough/passthrough/ passthrough·B/passthrough/passthrough mesh/mesh/ mesh·B/mesh/mesh]"},
		{Spec{Paths: []string{Verbatim}, Variant: &Variant{Label: "new"}}, "[direct/direct/ verbatim/verbatim/ verbatim·new/verbatim/verbatim]"},
		{Spec{Paths: []string{"direct"}}, `error: topo: no meshtun path "direct" (want verbatim, passthrough or mesh)`},
	} {
		if got := names(tc.spec); got != tc.want {
			t.Errorf("%+v:\n got %s\nwant %s", tc.spec, got, tc.want)
		}
	}
	if ps, _ := choosePlans(Spec{WireGuardGo: "w", Pasta: "p"}); !ps[len(ps)-1].peer || !ps[len(ps)-2].peer || ps[0].peer {
		t.Errorf("peer marks wrong: %+v", ps)
	}
	v := &Variant{Meshtun: "/tmp/m", Env: []string{"GOMAXPROCS=1"}, Args: []string{"--x"}}
	if got, want := v.String(), "binary /tmp/m, environment GOMAXPROCS=1, node flags --x"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}

// TestVariantRunsWithItsOwnSettings builds one path with a variant: the B
// path's proxies, and only they, run with the variant's environment and
// flags, and both paths carry traffic.
func TestVariantRunsWithItsOwnSettings(t *testing.T) {
	fixture.RequireRoot(t, "network namespaces and /dev/net/tun")
	if err := cluster.Preflight(); err != nil {
		t.Fatalf("this test needs root, network namespaces and /dev/net/tun: %v", err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), time.Minute)
	defer cancel()
	topo, err := Build(ctx, Spec{Meshtun: meshtunBin, Paths: []string{Verbatim},
		Variant: &Variant{Env: []string{"MESHTUN_BENCH_AB=b"}, Args: []string{"--drain-period", "1s"}},
		Log:     zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)})
	if err != nil {
		t.Fatal(err)
	}
	defer topo.Close()
	a, b := topo.Path(Verbatim), topo.Path(Verbatim+"·B")
	if a == nil || b == nil || b.VariantOf != Verbatim || b.Kind != Verbatim || len(b.Proxies) != 2 {
		t.Fatalf("paths %+v", topo.Paths)
	}
	for _, p := range []*Path{a, b} {
		for _, x := range p.Proxies {
			env, err := os.ReadFile(fmt.Sprintf("/proc/%d/environ", x.Pid))
			if err != nil {
				t.Fatal(err)
			}
			cmdline, err := os.ReadFile(fmt.Sprintf("/proc/%d/cmdline", x.Pid))
			if err != nil {
				t.Fatal(err)
			}
			hasEnv := bytes.Contains(env, []byte("\x00MESHTUN_BENCH_AB=b\x00")) || bytes.HasPrefix(env, []byte("MESHTUN_BENCH_AB=b\x00"))
			hasArg := bytes.Contains(cmdline, []byte("\x00--drain-period\x001s\x00"))
			if want := p == b; hasEnv != want || hasArg != want {
				t.Errorf("%s %s: variant environment %v, flags %v; want %v", p.Name, x.Name, hasEnv, hasArg, want)
			}
		}
		exchange(t, ctx, p)
	}
}

func TestParsePeers(t *testing.T) {
	for in, want := range map[string]string{
		"true":                      "[tun2socks wireguard-go pasta]",
		"false":                     "[]",
		"pasta":                     "[pasta]",
		"pasta,wireguard,tun2socks": "[tun2socks wireguard-go pasta]",
		"wg, pasta":                 "[wireguard-go pasta]",
		"wireguard-go,wireguard-go": "[wireguard-go]",
		"tun2socks,boringtun":       `error: no peer "boringtun" (want a comma-separated list of tun2socks, wireguard-go, pasta)`,
		"pasta,":                    `error: no peer "" (want a comma-separated list of tun2socks, wireguard-go, pasta)`,
	} {
		ps, err := ParsePeers(in)
		got := fmt.Sprint(ps)
		if err != nil {
			got = "error: " + err.Error()
		}
		if got != want {
			t.Errorf("ParsePeers(%q) = %s, want %s", in, got, want)
		}
	}
}

// peerBinaries builds or installs the wireguard-go and pasta peers, into
// and from the same cache as `meshtun bench --peers` (once per machine).
func peerBinaries(t *testing.T, ctx context.Context, log zerolog.Logger) (wg, pasta string) {
	t.Helper()
	cache, err := os.UserCacheDir()
	if err != nil {
		t.Fatal(err)
	}
	if wg, err = BuildWireGuardGo(ctx, filepath.Join(cache, "meshtun-bench"), log); err != nil {
		t.Fatal(err)
	}
	if pasta, err = EnsurePasta(ctx, log); err != nil {
		t.Fatal(err)
	}
	return wg, pasta
}

// linkStats returns the counters of interface name in ns.
func linkStats(t *testing.T, ns *cluster.NS, name string) (kind string, st netlink.LinkStatistics) {
	t.Helper()
	err := ns.Do(func() error {
		l, err := netlink.LinkByName(name)
		if err != nil {
			return err
		}
		kind, st = l.Type(), *l.Attrs().Statistics
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return kind, st
}

// TestPeersCarryTraffic builds the wireguard-go and pasta peer paths and
// sends a megabyte down each and back: on wireguard-go's path both
// devices and both ends' UAPI counters must carry it, with segmentation
// offload (packets on the device larger than its MTU); on pasta's the
// client pod's interface must be pasta's tap, carry it, and the server
// must see the connection come from the node (pasta's socket), not the
// pod. After a restart of their proxies both carry traffic again.
func TestPeersCarryTraffic(t *testing.T) {
	fixture.RequireRoot(t, "network namespaces and /dev/net/tun")
	if err := cluster.Preflight(); err != nil {
		t.Fatalf("this test needs root, network namespaces and /dev/net/tun: %v", err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Minute)
	defer cancel()
	log := zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.WarnLevel)
	wgBin, pastaBin := peerBinaries(t, ctx, log)
	topo, err := Build(ctx, Spec{Meshtun: meshtunBin, Paths: []string{Verbatim}, WireGuardGo: wgBin, Pasta: pastaBin, Log: log})
	if err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := topo.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	}()
	var names []string
	for _, p := range topo.Paths {
		names = append(names, p.Name)
	}
	if fmt.Sprint(names) != "[direct verbatim wireguard-go pasta]" {
		t.Fatalf("paths %v", names)
	}
	wg, pa := topo.Path(WireGuardGo), topo.Path(Pasta)
	if !wg.Peer || !pa.Peer || len(wg.Proxies) != 2 || len(pa.Proxies) != 1 {
		t.Fatalf("wireguard-go %+v, pasta %+v", wg, pa)
	}

	checkWG := func() {
		t.Helper()
		devs := []*cluster.Node{wg.Src.Node, wg.Dst.Node}
		type counts struct{ rx, tx, devRx, devTx, devTxPk uint64 }
		read := func() []counts {
			var out []counts
			for _, n := range devs {
				rx, tx, err := wgTraffic(ctx, wgDevName(n))
				if err != nil {
					t.Fatal(err)
				}
				_, st := linkStats(t, n.NS, wgDevName(n))
				out = append(out, counts{rx, tx, st.RxBytes, st.TxBytes, st.TxPackets})
			}
			return out
		}
		before := read()
		exchange(t, ctx, wg)
		after := read()
		for i, n := range devs {
			b, a := before[i], after[i]
			if a.rx-b.rx < 1<<20 || a.tx-b.tx < 1<<20 || a.devRx-b.devRx < 1<<20 || a.devTx-b.devTx < 1<<20 {
				t.Errorf("wireguard-go on %s: tunnel rx %d tx %d, device rx %d tx %d bytes; want ≥ 1 MiB each",
					n.Name(), a.rx-b.rx, a.tx-b.tx, a.devRx-b.devRx, a.devTx-b.devTx)
			}
			// With TUN segmentation offload the kernel writes TCP
			// segments of many MTUs into the device as one packet.
			if pk := a.devTxPk - b.devTxPk; pk == 0 || (a.devTx-b.devTx)/pk <= 1420 {
				t.Errorf("wireguard-go on %s: %d bytes in %d packets into the device: no segmentation offload", n.Name(), a.devTx-b.devTx, pk)
			}
		}
	}
	checkPasta := func() {
		t.Helper()
		kind, before := linkStats(t, pa.Src.NS, pa.Src.Link)
		if kind != "tuntap" {
			t.Errorf("pasta: the client pod's %s is a %s, want pasta's tap", pa.Src.Link, kind)
		}
		from := exchange(t, ctx, pa)
		if from != pa.Src.Node.IPv4 {
			t.Errorf("pasta: the server saw the client at %s, want its node %s (pasta's socket)", from, pa.Src.Node.IPv4)
		}
		_, after := linkStats(t, pa.Src.NS, pa.Src.Link)
		if rx, tx := after.RxBytes-before.RxBytes, after.TxBytes-before.TxBytes; rx < 1<<20 || tx < 1<<20 {
			t.Errorf("pasta: the pod's tap carried rx %d tx %d bytes, want ≥ 1 MiB each", rx, tx)
		}
	}
	checkWG()
	checkPasta()
	// The direct path is untouched by either: the server sees the pod.
	if from := exchange(t, ctx, topo.Path(Direct)); from != topo.Path(Direct).Src.IPv4 {
		t.Errorf("direct: the server saw %s", from)
	}

	for _, p := range []*Path{wg, pa} {
		old := p.Proxies[0].Pid
		if err := topo.Restart(ctx, p); err != nil {
			t.Fatal(err)
		}
		if p.Proxies[0].Pid == old {
			t.Errorf("%s: restart kept pid %d", p.Name, old)
		}
	}
	checkWG()
	checkPasta()
}

// wgTraffic returns the bytes wireguard-go's device dev has received
// from and sent to its peers, as its UAPI reports them.
func wgTraffic(ctx context.Context, dev string) (rx, tx uint64, err error) {
	lines, err := uapi(ctx, dev, "get=1\n\n")
	if err != nil {
		return 0, 0, err
	}
	for _, l := range lines {
		k, v, _ := strings.Cut(l, "=")
		var dst *uint64
		switch k {
		case "rx_bytes":
			dst = &rx
		case "tx_bytes":
			dst = &tx
		default:
			continue
		}
		x, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			return 0, 0, fmt.Errorf("UAPI %s: %q: %w", dev, l, err)
		}
		*dst += x
	}
	return rx, tx, nil
}
