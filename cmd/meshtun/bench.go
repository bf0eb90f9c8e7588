//go:build !nolab

package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/bench"
	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/report"
	"github.com/meshtun/meshtun/bench/topo"
)

// benchFiles is the open-file limit the benchmark needs: 10,000 idle
// connections are a descriptor each in this process (their far ends are
// in a hold server of their own) and in a peer proxy that dials with
// kernel sockets.
const benchFiles = 12000

func runBench(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("bench", flag.ContinueOnError)
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), `usage: meshtun bench [flags]

Builds a sealed network-namespace cluster and measures, interleaved and
repeated, the direct kernel path, meshtun verbatim, passthrough and mesh
(and with --peers other projects on the same topology: tun2socks on the
same TUN path, a wireguard-go tunnel between the nodes, pasta giving the
client pod its network): TCP throughput, request/response and connect
latency, UDP rate and loss, proxy CPU per GB and memory. Needs root.
Prints a table; writes JSON and SVG charts on request.

flags:
`)
		fs.PrintDefaults()
	}
	var (
		quick               bool
		peers               peerFlag
		reps                int
		jsonPath, outDir    string
		cacheDir, logLevel  string
		proxyLevel, binPath string
		holdAddr, pprofDir  string
		pathList            string
		variant             topo.Variant
		variantArgs         string
	)
	defCache := ""
	if d, err := os.UserCacheDir(); err == nil {
		defCache = filepath.Join(d, "meshtun-bench")
	}
	fs.BoolVar(&quick, "quick", false, "smoke run: short measurements, 2 repetitions (under a minute)")
	fs.Var(&peers, "peers", "also measure the peers: alone all of them, or --peers=`list` of "+strings.Join(topo.Peers, ",")+
		" (tun2socks "+topo.Tun2socksVersion+" and wireguard-go are built into --cache the first time, about a minute each; pasta is installed with apt-get if missing)")
	fs.IntVar(&reps, "reps", 0, "repetitions of each scenario on each path (default 5, 2 with --quick)")
	fs.StringVar(&jsonPath, "json", "", "write the results as JSON to `file`")
	fs.StringVar(&outDir, "out", "", "write SVG charts and index.html into `dir`")
	fs.StringVar(&cacheDir, "cache", defCache, "`dir` for the peers' binaries")
	fs.StringVar(&pprofDir, "pprof", "", "after the measurements, take CPU profiles of the meshtun proxies (one TCP stream each way, request/response, connect+request+close, unpaced UDP, per path), every path's CPU seconds per unit of work over the same runs (counters.tsv) and heap profiles at each count of idle connections into `dir`")
	fs.StringVar(&proxyLevel, "proxy-log-level", "", "meshtun node's --log-level (default: its own default, info)")
	fs.StringVar(&binPath, "meshtun", "", "meshtun `binary` the nodes run (default: this one)")
	fs.StringVar(&logLevel, "log-level", "warn", "log `level` of the benchmark itself")
	fs.StringVar(&pathList, "paths", "", "comma-separated meshtun `paths` to measure (verbatim,passthrough,mesh; default all); direct is always measured")
	fs.StringVar(&variant.Meshtun, "variant-meshtun", "", "A/B: also run every meshtun path with this meshtun `binary`, interleaved (the B paths)")
	fs.Func("variant-env", "A/B: `KEY=VALUE` added to the environment of the B paths' nodes (repeatable)", func(s string) error {
		if k, _, ok := strings.Cut(s, "="); !ok || k == "" {
			return fmt.Errorf("%q is not KEY=VALUE", s)
		}
		variant.Env = append(variant.Env, s)
		return nil
	})
	fs.StringVar(&variantArgs, "variant-args", "", "A/B: extra `flags` (space-separated) of the B paths' meshtun node commands")
	fs.StringVar(&variant.Label, "variant-label", "B", "A/B: `label` of the B paths (\"mesh·B\")")
	fs.StringVar(&holdAddr, bench.HoldFlag, "", "internal: serve the idle-connection hold protocol on `addr` (the benchmark runs this itself)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if holdAddr != "" {
		return bench.ServeHold(holdAddr)
	}
	if fs.NArg() > 0 {
		if _, err := topo.ParsePeers(fs.Arg(0)); err == nil && fs.Arg(0) != "true" && fs.Arg(0) != "false" {
			return fmt.Errorf("unexpected arguments: %q (a list of peers goes with an equals sign: --peers=%s)", fs.Args(), fs.Arg(0))
		}
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	var paths []string
	if pathList != "" {
		paths = strings.Split(pathList, ",")
	}
	var vp *topo.Variant
	variant.Args = strings.Fields(variantArgs)
	if variant.Meshtun != "" || len(variant.Env) > 0 || len(variant.Args) > 0 {
		vp = &variant
	}
	if reps < 0 {
		return fmt.Errorf("--reps %d: want a positive count", reps)
	}
	log, err := newLogger(logLevel)
	if err != nil {
		return err
	}
	if err := cluster.Preflight(); err != nil {
		return fmt.Errorf("the benchmark builds network namespaces and TUN devices: %w", err)
	}
	self, err := os.Executable()
	if err != nil {
		return fmt.Errorf("find this binary: %w", err)
	}
	if binPath == "" {
		binPath = self
	}
	if err := raiseFileLimit(benchFiles); err != nil {
		return err
	}
	live := false
	if fi, err := os.Stderr.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
		live = true
	}
	prog := bench.NewProgress(os.Stderr, live)

	var t2s, wg, pasta string
	for _, p := range peers.names {
		switch p {
		case topo.Tun2socks:
			if cacheDir == "" {
				return errors.New("--peers: tun2socks needs --cache (no user cache directory)")
			}
			fmt.Fprintf(os.Stderr, "bench: tun2socks %s from %s\n", topo.Tun2socksVersion, cacheDir)
			t2s, err = topo.BuildTun2socks(ctx, cacheDir, log)
		case topo.WireGuardGo:
			if cacheDir == "" {
				return errors.New("--peers: wireguard-go needs --cache (no user cache directory)")
			}
			fmt.Fprintf(os.Stderr, "bench: wireguard-go %s from %s\n", topo.WireGuardVersion, cacheDir)
			wg, err = topo.BuildWireGuardGo(ctx, cacheDir, log)
		case topo.Pasta:
			if pasta, err = topo.EnsurePasta(ctx, log); err == nil {
				fmt.Fprintf(os.Stderr, "bench: pasta %s (%s %s)\n", pasta, topo.PastaPackage, topo.PastaVersion())
			}
		}
		if err != nil {
			return err
		}
	}
	res, err := bench.Run(ctx, bench.Options{
		Meshtun:       binPath,
		Self:          self,
		Tun2socks:     t2s,
		WireGuardGo:   wg,
		Pasta:         pasta,
		Quick:         quick,
		Repetitions:   reps,
		Paths:         paths,
		Variant:       vp,
		ProxyLogLevel: proxyLevel,
		PprofDir:      pprofDir,
		Command:       "meshtun bench " + strings.Join(args, " "),
		Version:       version(),
		Progress:      prog,
		Log:           log,
	})
	if err != nil {
		return err
	}
	if err := report.WriteTable(os.Stdout, res); err != nil {
		return err
	}
	if jsonPath != "" {
		if err := writeFile(jsonPath, func(f *os.File) error { return report.WriteJSON(f, res) }); err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "bench: results in %s\n", jsonPath)
	}
	if outDir != "" {
		files, err := report.WriteCharts(outDir, res)
		if err != nil {
			return err
		}
		fmt.Fprintf(os.Stderr, "bench: %d charts and index.html in %s\n", len(files)-1, outDir)
	}
	if len(res.Profiles) > 0 {
		fmt.Fprintf(os.Stderr, "bench: %d profiles and counters.tsv in %s (go tool pprof -top <file>)\n", len(res.Profiles), pprofDir)
	}
	fmt.Fprintf(os.Stderr, "bench: %.0f s\n", res.Seconds)
	if len(res.Errors) > 0 {
		return fmt.Errorf("%d measurement(s) failed (listed under the table)", len(res.Errors))
	}
	return nil
}

// raiseFileLimit makes sure this process's open-file limit (inherited by
// the processes it starts) is at least n, raising it if it must and can.
func raiseFileLimit(n uint64) error {
	var lim unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("open-file limit: %w", err)
	}
	if lim.Cur >= n {
		return nil
	}
	lim.Cur = max(min(lim.Max, n), lim.Cur)
	if lim.Max < n {
		lim.Max, lim.Cur = n, n
	}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		return fmt.Errorf("the open-file limit is below the %d that 10,000 idle connections need, and raising it failed: %w", n, err)
	}
	return nil
}

func writeFile(path string, fill func(*os.File) error) error {
	if dir := filepath.Dir(path); dir != "" {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return err
		}
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if err := errors.Join(fill(f), f.Close()); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	return nil
}

// peerFlag is the value of --peers: a boolean flag (alone, every peer)
// that also takes a list (--peers=pasta,wireguard-go).
type peerFlag struct{ names []string }

func (f *peerFlag) String() string { return strings.Join(f.names, ",") }

func (f *peerFlag) Set(s string) error {
	names, err := topo.ParsePeers(s)
	if err != nil {
		return err
	}
	f.names = names
	return nil
}

func (f *peerFlag) IsBoolFlag() bool { return true }
