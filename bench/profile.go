package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/meshtun/meshtun/bench/gen"
	"github.com/meshtun/meshtun/bench/procstat"
	"github.com/meshtun/meshtun/bench/topo"
)

// profileSeconds is the length of each CPU profile.
const profileSeconds = 5

// countersFile is the table, in the profile directory, of what each
// profiled run moved and what CPU it took (see profileLane).
const countersFile = "counters.tsv"

// profileRun is one load run during which the proxies are profiled.
type profileRun struct {
	name string // file name part: up, down, rr, crr, udp, rr-trace, crr-trace
	unit string // what units counts
	// trace takes a runtime execution trace instead of a CPU profile.
	trace bool
	// run drives the load for a little longer than the profile and
	// returns how many units were done between open() and the function
	// open returned (the window CPU is charged over).
	run func(ctx context.Context, l *lane, open func() func()) (units float64, err error)
}

// profileRuns are the loads of a profiled lane: one TCP stream each way,
// request/response, connect+request+close and unpaced UDP, each as the
// measurements of the run do it (pl's message and datagram sizes), then
// request/response and connect+request+close again under an execution
// trace (the time goroutines wait to run: go tool trace -pprof=sched).
func profileRuns(pl plan) []profileRun {
	d := (profileSeconds + 1) * time.Second
	tcp := func(f func(context.Context, gen.Netns, *gen.Server, gen.TCPConfig) (gen.Throughput, error)) func(context.Context, *lane, func() func()) (float64, error) {
		return func(ctx context.Context, l *lane, open func() func()) (float64, error) {
			// The stream outlasts the profile on both ends.
			r, err := f(ctx, l.Src.NS, l.srv, gen.TCPConfig{Streams: 1, Warmup: 200 * time.Millisecond, Duration: d, Window: open})
			return float64(r.Bytes) / 1e9, err
		}
	}
	whole := func(f func(context.Context, *lane) (float64, error)) func(context.Context, *lane, func() func()) (float64, error) {
		return func(ctx context.Context, l *lane, open func() func()) (float64, error) {
			closed := open()
			n, err := f(ctx, l)
			closed()
			return n, err
		}
	}
	rr := whole(func(ctx context.Context, l *lane) (float64, error) {
		lat, err := gen.RequestResponse(ctx, l.Src.NS, l.srv, pl.msg, d, 0)
		return float64(len(lat)), err
	})
	crr := whole(func(ctx context.Context, l *lane) (float64, error) {
		lat, _, err := gen.ConnectRequestClose(ctx, l.Src.NS, l.srv, pl.msg, d, 0)
		return float64(len(lat)), err
	})
	return []profileRun{
		{name: "up", unit: "GB", run: tcp(gen.Upload)},
		{name: "down", unit: "GB", run: tcp(gen.Download)},
		{name: "rr", unit: "round trip", run: rr},
		{name: "crr", unit: "connection", run: crr},
		{name: "udp", unit: "datagram received", run: whole(func(ctx context.Context, l *lane) (float64, error) {
			r, err := gen.UDP(ctx, l.Src.NS, l.srv, gen.UDPConfig{Size: pl.udpSize, Duration: d})
			return float64(r.Received), err
		})},
		{name: "rr-trace", unit: "round trip", run: rr, trace: true},
		{name: "crr-trace", unit: "connection", run: crr, trace: true},
	}
}

// profileLane runs each of profileRuns on l, takes a CPU profile of every
// proxy on l that serves pprof meanwhile, into dir as
// <path>-<node>-<run>.pprof (an execution trace <path>-<node>-<run> for
// the runs that take one), and appends to dir/counters.tsv, per run,
// the units done and the CPU seconds taken and voluntary context
// switches made over the same window by each proxy and by this process
// (the load generators: client and server), and the busy CPU seconds of
// the whole machine (/proc/stat, all CPUs, so other work on it too). It
// does this for a lane without proxies as well (direct: the generators'
// own cost and ceiling). It returns the profiles written.
func profileLane(ctx context.Context, l *lane, pl plan, dir string) ([]string, error) {
	var files []string
	pprof := slices.ContainsFunc(l.Proxies, func(x topo.Proxy) bool { return x.Pprof != "" })
	for _, pr := range profileRuns(pl) {
		if pr.trace && !pprof {
			continue // the same counters as the untraced run
		}
		var (
			wg   sync.WaitGroup
			mu   sync.Mutex
			errs []error
		)
		for _, x := range l.Proxies {
			if x.Pprof == "" {
				continue
			}
			name := fmt.Sprintf("%s-%s-%s.pprof", l.Name, strings.ReplaceAll(x.Name, " ", "-"), pr.name)
			what := fmt.Sprintf("profile?seconds=%d", profileSeconds)
			if pr.trace {
				name = fmt.Sprintf("%s-%s-%s", l.Name, strings.ReplaceAll(x.Name, " ", "-"), pr.name)
				what = fmt.Sprintf("trace?seconds=%d", profileSeconds)
			}
			wg.Go(func() {
				p := filepath.Join(dir, name)
				err := fetchProfile(ctx, x, what, p)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs = append(errs, err)
				} else {
					files = append(files, p)
				}
			})
		}
		var c counters
		units, err := pr.run(ctx, l, func() func() {
			c0, err0 := readCounters(l)
			return func() {
				c1, err1 := readCounters(l)
				if err := errors.Join(err0, err1); err != nil {
					mu.Lock()
					errs = append(errs, err)
					mu.Unlock()
					return
				}
				c = c1.sub(c0)
			}
		})
		wg.Wait()
		if err := errors.Join(append(errs, err)...); err != nil {
			return files, err
		}
		if err := appendCounters(filepath.Join(dir, countersFile), l, pr, units, c); err != nil {
			return files, err
		}
	}
	return files, nil
}

// counters are CPU times and sleeps over one window.
type counters struct {
	wall, self, machine time.Duration
	proxies             []time.Duration
	// selfSleeps and proxySleeps count voluntary context switches (a
	// thread blocked, to be woken later) of this process and of each
	// proxy, over all their threads.
	selfSleeps  int64
	proxySleeps []int64
}

// readCounters samples the clock, this process's CPU time, the machine's
// busy time and l's proxies' CPU times.
func readCounters(l *lane) (counters, error) {
	c := counters{wall: time.Duration(time.Now().UnixNano())}
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return c, fmt.Errorf("bench: getrusage: %w", err)
	}
	c.self = time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
	busy, err := machineBusy()
	if err != nil {
		return c, err
	}
	c.machine = busy
	if c.selfSleeps, err = sleeps(os.Getpid()); err != nil {
		return c, err
	}
	for _, x := range l.Proxies {
		s, err := procstat.Read("/proc", x.Pid)
		if err != nil {
			return c, err
		}
		c.proxies = append(c.proxies, s.CPU)
		n, err := sleeps(x.Pid)
		if err != nil {
			return c, err
		}
		c.proxySleeps = append(c.proxySleeps, n)
	}
	return c, nil
}

// sleeps sums voluntary_ctxt_switches over the threads of process pid
// (a thread that exits meanwhile takes its count with it).
func sleeps(pid int) (int64, error) {
	dirs, err := filepath.Glob(fmt.Sprintf("/proc/%d/task/*/status", pid))
	if err != nil || len(dirs) == 0 {
		return 0, fmt.Errorf("bench: threads of pid %d: none found (%v)", pid, err)
	}
	var sum int64
	for _, f := range dirs {
		b, err := os.ReadFile(f)
		if err != nil {
			continue // the thread has exited
		}
		n, err := parseSleeps(b)
		if err != nil {
			return 0, fmt.Errorf("bench: %s: %w", f, err)
		}
		sum += n
	}
	return sum, nil
}

// parseSleeps returns voluntary_ctxt_switches from the contents of
// /proc/<pid>/task/<tid>/status.
func parseSleeps(b []byte) (int64, error) {
	for line := range strings.Lines(string(b)) {
		if v, ok := strings.CutPrefix(line, "voluntary_ctxt_switches:"); ok {
			return strconv.ParseInt(strings.TrimSpace(v), 10, 64)
		}
	}
	return 0, errors.New("no voluntary_ctxt_switches line")
}

func (c counters) sub(o counters) counters {
	d := counters{wall: c.wall - o.wall, self: c.self - o.self, machine: c.machine - o.machine, selfSleeps: c.selfSleeps - o.selfSleeps}
	for i := range c.proxies {
		d.proxies = append(d.proxies, c.proxies[i]-o.proxies[i])
		d.proxySleeps = append(d.proxySleeps, c.proxySleeps[i]-o.proxySleeps[i])
	}
	return d
}

// machineBusy returns the CPU time all CPUs spent not idle (nor waiting
// for I/O) since boot, from /proc/stat.
func machineBusy() (time.Duration, error) {
	b, err := os.ReadFile("/proc/stat")
	if err != nil {
		return 0, fmt.Errorf("bench: %w", err)
	}
	return parseBusy(b)
}

// parseBusy sums the first line of /proc/stat's contents b ("cpu" and
// its counters in USER_HZ) without idle and iowait.
func parseBusy(b []byte) (time.Duration, error) {
	line, _, _ := strings.Cut(string(b), "\n")
	f := strings.Fields(line)
	if len(f) < 6 || f[0] != "cpu" {
		return 0, fmt.Errorf("bench: /proc/stat: first line %q: want cpu and at least 5 counters", line)
	}
	var busy int64
	for i, s := range f[1:] {
		if i == 3 || i == 4 { // idle, iowait
			continue
		}
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("bench: /proc/stat: counter %q: %w", s, err)
		}
		busy += v
	}
	return time.Duration(busy) * time.Second / 100, nil // USER_HZ
}

// appendCounters appends one run's line to the counters table at path,
// with a header if the file is new: per proxy its CPU seconds and its
// CPU microseconds per unit (per GB for the TCP runs: seconds per GB ×
// 1e6).
func appendCounters(path string, l *lane, pr profileRun, units float64, c counters) error {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o644)
	if err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	st, err := f.Stat()
	if err == nil && st.Size() == 0 {
		_, err = fmt.Fprintln(f, "path\trun\tunits\tunit\twall s\tgenerators CPU s\tgenerators sleeps\tmachine busy CPU s\tproxy\tproxy CPU s\tproxy CPU µs per unit\tproxy sleeps")
	}
	write := func(proxy string, cpu time.Duration, sleeps int64) {
		if err != nil {
			return
		}
		per := 0.0
		if units > 0 {
			per = cpu.Seconds() * 1e6 / units
		}
		_, err = fmt.Fprintf(f, "%s\t%s\t%.6g\t%s\t%.3f\t%.3f\t%d\t%.3f\t%s\t%.3f\t%.4g\t%d\n", l.Name, pr.name, units, pr.unit,
			c.wall.Seconds(), c.self.Seconds(), c.selfSleeps, c.machine.Seconds(), proxy, cpu.Seconds(), per, sleeps)
	}
	if len(l.Proxies) == 0 {
		write("-", 0, 0)
	}
	for i, x := range l.Proxies {
		if i < len(c.proxies) {
			write(x.Name, c.proxies[i], c.proxySleeps[i])
		}
	}
	if err := errors.Join(err, f.Close()); err != nil {
		return fmt.Errorf("bench: %s: %w", path, err)
	}
	return nil
}

// heapProfiles fetches a heap profile (after a GC) of every proxy on l
// that serves pprof into dir as <path>-<node>-idle<n>.heap.pprof.
func heapProfiles(ctx context.Context, l *lane, n int, dir string) ([]string, error) {
	var (
		files []string
		errs  []error
	)
	for _, x := range l.Proxies {
		if x.Pprof == "" {
			continue
		}
		p := filepath.Join(dir, fmt.Sprintf("%s-%s-idle%d.heap.pprof", l.Name, strings.ReplaceAll(x.Name, " ", "-"), n))
		if err := fetchProfile(ctx, x, "heap?gc=1", p); err != nil {
			errs = append(errs, err)
			continue
		}
		files = append(files, p)
	}
	return files, errors.Join(errs...)
}

// fetchProfile fetches /debug/pprof/<what> of proxy x through its admin
// socket into path.
func fetchProfile(ctx context.Context, x topo.Proxy, what, path string) error {
	client := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", x.Pprof)
		},
	}}
	defer client.CloseIdleConnections()
	url := "http://admin/debug/pprof/" + what
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("bench: profile of %s: %w", x.Name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("bench: profile of %s: %s: %s", x.Name, resp.Status, b)
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("bench: profile of %s: %w", x.Name, err)
	}
	_, err = io.Copy(f, resp.Body)
	if err = errors.Join(err, f.Close()); err != nil {
		return fmt.Errorf("bench: profile of %s: write %s: %w", x.Name, path, err)
	}
	return nil
}
