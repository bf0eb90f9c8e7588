package topo

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/vishvananda/netlink"

	"github.com/meshtun/meshtun/test/cluster"
)

// meshtunBin is built once by TestMain for the topology test.
var meshtunBin string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "meshtun-topo-")
	if err != nil {
		fmt.Fprintln(os.Stderr, "topo:", err)
		os.Exit(1)
	}
	meshtunBin = filepath.Join(dir, "meshtun")
	build := exec.Command("go", "build", "-o", meshtunBin, "github.com/meshtun/meshtun/cmd/meshtun")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "topo: build meshtun:", err)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
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
// server pod and reads it back.
func exchange(t *testing.T, ctx context.Context, p *Path) {
	t.Helper()
	ln, err := p.Dst.Listen("tcp", netip.AddrPortFrom(p.Dst.IPv4, 7900).String())
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
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
	v := &Variant{Meshtun: "/tmp/m", Env: []string{"GOMAXPROCS=1"}, Args: []string{"--x"}}
	if got, want := v.String(), "binary /tmp/m, environment GOMAXPROCS=1, node flags --x"; got != want {
		t.Errorf("String() = %q, want %q", got, want)
	}
}

// TestVariantRunsWithItsOwnSettings builds one path with a variant: the B
// path's proxies, and only they, run with the variant's environment and
// flags, and both paths carry traffic.
func TestVariantRunsWithItsOwnSettings(t *testing.T) {
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
