package bench

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/gen"
	"github.com/meshtun/meshtun/bench/procstat"
	"github.com/meshtun/meshtun/bench/report"
	"github.com/meshtun/meshtun/bench/stats"
	"github.com/meshtun/meshtun/bench/topo"
)

// Options configure a run.
type Options struct {
	// Meshtun is the meshtun binary the nodes run (required).
	Meshtun string
	// Self is the binary whose `bench --serve-hold` serves the far end of
	// the idle connections (see ServeHold); empty means Meshtun.
	Self string
	// Tun2socks, WireGuardGo and Pasta are the peers' binaries (see
	// topo.BuildTun2socks, topo.BuildWireGuardGo, topo.EnsurePasta); an
	// empty one leaves its peer out.
	Tun2socks, WireGuardGo, Pasta string
	// Quick shortens every measurement to a smoke run of well under a
	// minute.
	Quick bool
	// Repetitions of every scenario on every path; 0 means 5 (2 with
	// Quick).
	Repetitions int
	// ProxyLogLevel is meshtun's --log-level; empty means its default.
	ProxyLogLevel string
	// Paths, if not empty, limits the meshtun paths measured (see
	// topo.Spec.Paths); direct is always measured.
	Paths []string
	// Variant, if not nil, measures every meshtun path a second time as
	// it says, interleaved with the first (see topo.Variant).
	Variant *topo.Variant
	// PprofDir, if set, receives CPU profiles of the meshtun proxies taken
	// after the measurements, during one TCP stream each way,
	// request/response, connect+request+close and unpaced UDP per path
	// (<path>-meshtun-<node>-<up|down|rr|crr|udp>.pprof), execution traces
	// of the same proxies during request/response and
	// connect+request+close (<path>-meshtun-<node>-<rr|crr>-trace), the CPU seconds
	// and units of work of every path (proxies, generators, machine) over
	// the same runs (counters.tsv), and heap profiles of the meshtun
	// proxies with no and with each count of idle connections open
	// (<path>-meshtun-<node>-idle<n>.heap.pprof).
	PprofDir string
	// Command and Version are recorded in the result.
	Command, Version string
	// Progress, if set, receives progress as the run goes.
	Progress *Progress
	// Log receives diagnostics.
	Log zerolog.Logger
}

// plan holds the durations and sizes of a run.
type plan struct {
	reps                      int
	warmup, tcp, rr, crr, udp time.Duration
	msg                       int     // request/response size
	udpSize                   int     // datagram payload
	udpMbps                   float64 // offered rate of the paced UDP run
	idle                      []int   // cumulative idle connection counts
}

func newPlan(o Options) plan {
	p := plan{
		reps: 5, warmup: 300 * time.Millisecond, tcp: 1500 * time.Millisecond,
		rr: 1500 * time.Millisecond, crr: 1500 * time.Millisecond, udp: 1500 * time.Millisecond,
		msg: 64, udpSize: 1200, udpMbps: 300, idle: []int{1000, 10000},
	}
	if o.Quick {
		// A smoke run: every scenario, briefly; idle connections only to
		// 1,000 (10,000 through the slower proxies alone takes a minute).
		p.reps, p.warmup = 2, 100*time.Millisecond
		p.tcp, p.rr, p.crr, p.udp = 200*time.Millisecond, 200*time.Millisecond, 200*time.Millisecond, 200*time.Millisecond
		p.idle = []int{1000}
	}
	if o.Repetitions > 0 {
		p.reps = o.Repetitions
	}
	return p
}

// udpRate is the paced run's offered rate in datagrams per second.
func (p plan) udpRate() float64 { return p.udpMbps * 1e6 / 8 / float64(p.udpSize) }

// lane is a path under test with its server and what it has measured.
type lane struct {
	*topo.Path
	srv     *gen.Server
	samples map[string][]float64 // metric ID → one sample per repetition
	cpu     []time.Duration      // per repetition: proxy CPU in TCP runs
	bytes   []int64              // per repetition: bytes moved in TCP runs
}

func (l *lane) add(metric string, v float64) { l.samples[metric] = append(l.samples[metric], v) }

// proxyCPU returns the summed CPU time of the lane's proxies.
func (l *lane) proxyCPU() (time.Duration, error) {
	var sum time.Duration
	for _, x := range l.Proxies {
		s, err := procstat.Read("/proc", x.Pid)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", x.Name, err)
		}
		sum += s.CPU
	}
	return sum, nil
}

// proxyMem returns the largest RSS and peak RSS among the lane's proxies.
func (l *lane) proxyMem() (rss, hwm int64, err error) {
	for _, x := range l.Proxies {
		s, err := procstat.Read("/proc", x.Pid)
		if err != nil {
			return 0, 0, fmt.Errorf("%s: %w", x.Name, err)
		}
		rss, hwm = max(rss, s.RSS), max(hwm, s.HWM)
	}
	return rss, hwm, nil
}

// scenario is one measurement, run on every path in every repetition.
type scenario struct {
	name string
	run  func(ctx context.Context, l *lane, rep int) error
}

// Run builds the topology, measures every scenario on every path,
// interleaved, and returns the result. A measurement that fails is
// recorded in Result.Errors and the run goes on; Run itself fails only if
// the topology cannot be built or ctx ends.
func Run(ctx context.Context, o Options) (*report.Result, error) {
	if o.Meshtun == "" {
		return nil, errors.New("bench: no meshtun binary")
	}
	pl := newPlan(o)
	started := time.Now()
	res := &report.Result{
		Tool: "meshtun bench", Version: o.Version, Command: o.Command,
		Started: started, Quick: o.Quick, Repetitions: pl.reps,
		Host:     host(),
		Baseline: topo.Direct,
		Generators: "meshtun bench's own Go traffic generators (bench/gen), client and server in the benchmark process, " +
			"sockets in the client and server pod namespaces; iperf3 is not used",
		Method: fmt.Sprintf("every scenario runs on every path before the next one starts (interleaved, the path order rotated each "+
			"repetition), %d repetitions; figures are the median with min–max of the per-repetition figures. TCP: %v warm-up, "+
			"then bytes counted at the receiver for %v. Request/response: %d-byte messages on one connection, each round trip "+
			"timed, for %v; its percentiles per repetition. Connect+request+close: new connection, one %d-byte exchange, close, "+
			"for %v. UDP: %d-byte datagrams for %v, paced at %s Mbit/s and unpaced; received counted at the sink. CPU: "+
			"utime+stime of the path's proxy processes (/proc/<pid>/stat) over the TCP windows ÷ bytes moved. Memory: VmRSS "+
			"at start, VmHWM after the traffic runs, and the VmRSS growth per connection with %v idle connections held open "+
			"through freshly restarted proxies.",
			pl.reps, pl.warmup, pl.tcp, pl.msg, pl.rr, pl.msg, pl.crr, pl.udpSize, pl.udp, report.Num(pl.udpMbps), pl.idle),
	}
	log := o.Log
	o.Progress.note("bench: building the topology")
	if o.Variant != nil {
		res.Variant = o.Variant.String()
	}
	t, err := topo.Build(ctx, topo.Spec{Meshtun: o.Meshtun, Tun2socks: o.Tun2socks, WireGuardGo: o.WireGuardGo, Pasta: o.Pasta, LogLevel: o.ProxyLogLevel,
		Paths: o.Paths, Variant: o.Variant, Log: log})
	if err != nil {
		return nil, fmt.Errorf("bench: %w", err)
	}
	defer func() {
		if err := t.Close(); err != nil {
			log.Warn().Err(err).Msg("bench: tear down")
		}
	}()
	var lanes []*lane
	for _, p := range t.Paths {
		srv, err := gen.Serve(p.Dst.NS, p.Dst.IPv4, gen.PortSink)
		if err != nil {
			return nil, fmt.Errorf("bench: server for %s: %w", p.Name, err)
		}
		defer srv.Close()
		lanes = append(lanes, &lane{Path: p, srv: srv, samples: map[string][]float64{},
			cpu: make([]time.Duration, pl.reps), bytes: make([]int64, pl.reps)})
		var proxies []string
		for _, x := range p.Proxies {
			proxies = append(proxies, x.Name)
		}
		res.Paths = append(res.Paths, report.Path{Name: p.Name, Description: p.Description, Peer: p.Peer,
			VariantOf: p.VariantOf, Proxies: proxies})
	}
	fail := func(l *lane, what string, err error) {
		msg := fmt.Sprintf("%s/%s: %v", l.Name, what, err)
		res.Errors = append(res.Errors, msg)
		o.Progress.note("bench: failed: " + msg)
		log.Debug().Str("path", l.Name).Str("scenario", what).Err(err).Msg("bench: measurement failed")
	}

	scenarios := scenarioList(pl)
	withProxy, withPprof := 0, 0
	for _, l := range lanes {
		if len(l.Proxies) > 0 {
			withProxy++
		}
		if o.PprofDir != "" {
			withPprof++
		}
	}
	o.Progress.setTotal(len(lanes) + pl.reps*len(scenarios)*len(lanes) + withPprof + withProxy*(1+len(pl.idle)))

	// Memory at start, then a warm-up that also proves every path works
	// (and opens the mesh's pooled HBONE connection).
	for _, l := range lanes {
		o.Progress.step("warm-up · " + l.Name)
		if len(l.Proxies) > 0 {
			if rss, _, err := l.proxyMem(); err != nil {
				fail(l, "memory", err)
			} else {
				l.add(mRSSIdle, mib(rss))
			}
		}
		if _, err := gen.RequestResponse(ctx, l.Src.NS, l.srv, pl.msg, time.Second, 50); err != nil {
			fail(l, "warm-up", err)
		}
		if ctx.Err() != nil {
			return nil, ctx.Err()
		}
	}

	for rep := range pl.reps {
		for _, sc := range scenarios {
			for i := range lanes {
				l := lanes[(i+rep)%len(lanes)]
				o.Progress.step(fmt.Sprintf("rep %d/%d · %s · %s", rep+1, pl.reps, sc.name, l.Name))
				if err := sc.run(ctx, l, rep); err != nil {
					if ctx.Err() != nil {
						return nil, ctx.Err()
					}
					fail(l, sc.name, err)
				}
			}
		}
	}
	for _, l := range lanes {
		for rep := range pl.reps {
			if l.bytes[rep] > 0 && len(l.Proxies) > 0 {
				l.add(mCPUPerGB, l.cpu[rep].Seconds()/(float64(l.bytes[rep])/1e9))
			}
		}
		if len(l.Proxies) > 0 {
			if _, hwm, err := l.proxyMem(); err != nil {
				fail(l, "memory", err)
			} else {
				l.add(mPeak, mib(hwm))
			}
		}
	}

	if o.PprofDir != "" {
		if err := os.MkdirAll(o.PprofDir, 0o755); err != nil {
			return nil, fmt.Errorf("bench: %w", err)
		}
		for _, l := range lanes {
			o.Progress.step("CPU profiles · " + l.Name)
			files, err := profileLane(ctx, l, pl, o.PprofDir)
			if err != nil {
				if ctx.Err() != nil {
					return nil, ctx.Err()
				}
				fail(l, "profile", err)
			}
			res.Profiles = append(res.Profiles, files...)
		}
	}

	// Idle connections, through freshly restarted proxies: a process that
	// has moved gigabytes keeps freed heap that new connections would
	// reuse unseen.
	for _, l := range lanes {
		if len(l.Proxies) == 0 {
			continue
		}
		o.Progress.step("restart proxies · " + l.Name)
		if err := t.Restart(ctx, l.Path); err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			fail(l, "restart", err)
			continue
		}
		heaps, err := idleConns(ctx, l, pl, cmp.Or(o.Self, o.Meshtun), o.PprofDir, o.Progress)
		res.Profiles = append(res.Profiles, heaps...)
		if err != nil {
			if ctx.Err() != nil {
				return nil, ctx.Err()
			}
			var full *filesFullError
			if l.Peer && errors.As(err, &full) {
				// A peer's own descriptor budget, not meshtun's: the
				// steps it reached are recorded, the rest is a limit.
				msg := fmt.Sprintf("%s/idle connections: %v", l.Name, err)
				res.Limits = append(res.Limits, msg)
				o.Progress.note("bench: beyond a peer's limit: " + msg)
				continue
			}
			fail(l, "idle connections", err)
		}
	}
	o.Progress.finish()

	for _, m := range metricDefs(pl) {
		m.Values = map[string]report.Value{}
		for _, l := range lanes {
			if s := l.samples[m.ID]; len(s) > 0 {
				m.Values[l.Name] = report.NewValue(s)
			}
		}
		res.Metrics = append(res.Metrics, m)
	}
	res.Seconds = time.Since(started).Seconds()
	return res, nil
}

// scenarioList returns the interleaved scenarios of plan pl.
func scenarioList(pl plan) []scenario {
	tcp := func(name, metric string, streams int, down bool) scenario {
		return scenario{name: name, run: func(ctx context.Context, l *lane, rep int) error {
			var cpuErr error
			cfg := gen.TCPConfig{Streams: streams, Warmup: pl.warmup, Duration: pl.tcp}
			if len(l.Proxies) > 0 {
				cfg.Window = func() func() {
					c0, err := l.proxyCPU()
					return func() {
						c1, err1 := l.proxyCPU()
						if cpuErr = errors.Join(err, err1); cpuErr == nil {
							l.cpu[rep] += c1 - c0
						}
					}
				}
			}
			f := gen.Upload
			if down {
				f = gen.Download
			}
			r, err := f(ctx, l.Src.NS, l.srv, cfg)
			if err != nil {
				return err
			}
			if cpuErr != nil {
				return cpuErr
			}
			l.bytes[rep] += r.Bytes
			l.add(metric, r.Gbps())
			return nil
		}}
	}
	return []scenario{
		tcp("TCP → 1 stream", mTCPUp1, 1, false),
		tcp("TCP → 4 streams", mTCPUp4, 4, false),
		tcp("TCP ← 1 stream", mTCPDown1, 1, true),
		tcp("TCP ← 4 streams", mTCPDown4, 4, true),
		{name: "request/response", run: func(ctx context.Context, l *lane, _ int) error {
			lat, err := gen.RequestResponse(ctx, l.Src.NS, l.srv, pl.msg, pl.rr, 0)
			if err != nil {
				return err
			}
			ps := stats.Percentiles(micros(lat), 50, 90, 99)
			l.add(mRRp50, ps[0])
			l.add(mRRp90, ps[1])
			l.add(mRRp99, ps[2])
			return nil
		}},
		{name: "connect+request+close", run: func(ctx context.Context, l *lane, _ int) error {
			lat, elapsed, err := gen.ConnectRequestClose(ctx, l.Src.NS, l.srv, pl.msg, pl.crr, 0)
			if err != nil {
				return err
			}
			ps := stats.Percentiles(micros(lat), 50, 90, 99)
			l.add(mCRRRate, float64(len(lat))/elapsed.Seconds())
			l.add(mCRRp50, ps[0])
			l.add(mCRRp90, ps[1])
			l.add(mCRRp99, ps[2])
			return nil
		}},
		{name: "UDP paced", run: func(ctx context.Context, l *lane, _ int) error {
			r, err := gen.UDP(ctx, l.Src.NS, l.srv, gen.UDPConfig{Size: pl.udpSize, Rate: pl.udpRate(), Duration: pl.udp})
			if err != nil {
				return err
			}
			l.add(mUDPSent, r.SentPPS()/1000)
			l.add(mUDPPPS, r.PPS()/1000)
			l.add(mUDPLoss, r.Loss()*100)
			return nil
		}},
		{name: "UDP unpaced", run: func(ctx context.Context, l *lane, _ int) error {
			r, err := gen.UDP(ctx, l.Src.NS, l.srv, gen.UDPConfig{Size: pl.udpSize, Duration: pl.udp})
			if err != nil {
				return err
			}
			l.add(mUDPMaxSent, r.SentPPS()/1000)
			l.add(mUDPMaxPPS, r.PPS()/1000)
			l.add(mUDPMaxLoss, r.Loss()*100)
			return nil
		}},
	}
}

// idleConns holds pl.idle connections open through l's proxies, step by
// step, and records each proxy's RSS growth per connection; the worst
// proxy's figure is the path's. The connections' far end is a hold server
// in a process of its own (started from bin), so that each process stays
// within its open-file limit. If dir is not empty, heap profiles of the
// proxies that serve pprof are taken into it before the first step and
// after each (see heapProfiles); the files written are returned.
func idleConns(ctx context.Context, l *lane, pl plan, bin, dir string, prog *Progress) (files []string, err error) {
	h, stop, err := startHolder(ctx, l.Dst, bin)
	if err != nil {
		return nil, err
	}
	defer stop()
	// The heap profiles are taken after the RSS readings: their GC does
	// not touch what was read.
	heap := func(n int) error {
		if dir == "" {
			return nil
		}
		f, err := heapProfiles(ctx, l, n, dir)
		files = append(files, f...)
		return err
	}
	base := make([]int64, len(l.Proxies))
	for i, x := range l.Proxies {
		s, err := procstat.Read("/proc", x.Pid)
		if err != nil {
			return files, err
		}
		base[i] = s.RSS
	}
	if err := heap(0); err != nil {
		return files, err
	}
	var set *gen.Idle
	defer set.Close()
	for _, n := range pl.idle {
		prog.step(fmt.Sprintf("%d idle connections · %s", n, l.Name))
		var err error
		if set, err = gen.OpenIdle(ctx, l.Src.NS, h, set, n-set.Len()); err != nil {
			if note := filesNote(l); note != "" {
				return files, &filesFullError{err: err, note: note}
			}
			return files, err
		}
		worst := 0.0
		for i, x := range l.Proxies {
			s, err := procstat.Read("/proc", x.Pid)
			if err != nil {
				return files, err
			}
			worst = max(worst, float64(s.RSS-base[i])/float64(n)/1024)
		}
		l.add(idleMetric(n), worst)
		if err := heap(n); err != nil {
			return files, err
		}
	}
	return files, nil
}

// filesFullError is an idle-connection step that failed while a proxy of
// the path held as many descriptors as its open-file limit allows.
type filesFullError struct {
	err  error
	note string
}

func (e *filesFullError) Error() string { return fmt.Sprintf("%v%s", e.err, e.note) }
func (e *filesFullError) Unwrap() error { return e.err }

// filesReserve is how close to its open-file limit a proxy counts as out
// of descriptors: 1 % of the limit, at least 16. A proxy may need a few
// descriptors more for each new connection than it keeps (pasta stopped
// accepting at 19,8xx of 20,000, two per connection), so the count taken
// after the failure can sit just under the limit.
func filesReserve(limit uint64) uint64 { return max(16, limit/100) }

// filesNote names the proxies of l that have used up their open-file
// limit (a proxy that holds descriptors per connection stops accepting
// there), as a note to append to an error; "" if none has.
func filesNote(l *lane) string {
	var full []string
	for _, x := range l.Proxies {
		if open, limit, err := procstat.Files("/proc", x.Pid); err == nil && uint64(open)+filesReserve(limit) >= limit {
			full = append(full, fmt.Sprintf("%s holds %d descriptors of its open-file limit of %d", x.Name, open, limit))
		}
	}
	if len(full) == 0 {
		return ""
	}
	return " (" + strings.Join(full, "; ") + ")"
}

// HoldFlag is the flag of `meshtun bench` that runs the hold server of the
// idle-connection measurement (see ServeHold); the benchmark starts it in
// the destination pod.
const HoldFlag = "serve-hold"

// holdPort is where the hold server listens.
const holdPort = gen.PortUDP + 1

// ServeHold listens on addr and runs the hold protocol (gen.ServeHold) on
// stdin and stdout until stdin ends: the body of `meshtun bench
// --serve-hold <addr>`.
func ServeHold(addr string) error {
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("bench: hold server: %w", err)
	}
	return gen.ServeHold(ln, os.Stdin, os.Stdout)
}

// startHolder starts `bin bench --serve-hold` in pod's namespace and
// returns a Holder for it and a function that stops it.
func startHolder(ctx context.Context, pod *cluster.Pod, bin string) (gen.Holder, func(), error) {
	addr := netip.AddrPortFrom(pod.IPv4, holdPort).String()
	cmd := pod.Command(context.WithoutCancel(ctx), bin, "bench", "--"+HoldFlag, addr)
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, nil, fmt.Errorf("bench: hold server: %w", err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, nil, fmt.Errorf("bench: hold server: %w", err)
	}
	var stderr strings.Builder
	cmd.Stderr = &stderr
	proc, err := pod.Start(cmd)
	if err != nil {
		return nil, nil, fmt.Errorf("bench: hold server in %s: %w", pod.ID, err)
	}
	stop := func() {
		in.Close() // the server closes its connections and exits
		proc.Stop(5 * time.Second)
	}
	h, err := gen.DialHolder(in, out)
	if err != nil {
		stop()
		return nil, nil, fmt.Errorf("bench: hold server in %s: %w; stderr: %s", pod.ID, err, stderr.String())
	}
	return h, stop, nil
}

func micros(ds []time.Duration) []float64 {
	out := make([]float64, len(ds))
	for i, d := range ds {
		out[i] = float64(d) / float64(time.Microsecond)
	}
	return out
}

func mib(b int64) float64 { return float64(b) / (1 << 20) }

// host describes this machine.
func host() report.Host {
	h := report.Host{CPUs: runtime.NumCPU(), Go: runtime.Version()}
	if b, err := os.ReadFile("/proc/sys/kernel/osrelease"); err == nil {
		h.Kernel = strings.TrimSpace(string(b))
	}
	return h
}
