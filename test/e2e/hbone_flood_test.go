package e2e

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/meshtun/meshtun/bench/cluster"
)

// recordHeader16K is a TLS record header announcing a 16 KiB handshake
// record whose body never comes.
var recordHeader16K = []byte{0x16, 0x03, 0x01, 0x40, 0x00}

// handshakeFlood holds up to max connections from a namespace to an HBONE
// port without ever completing a handshake: every other one idle, the
// others sending a record header that announces 16 KiB. Each connection
// the node resets (or closes) is replaced by a new one, until stop.
type handshakeFlood struct {
	attempts, refused atomic.Int64
	open              atomic.Int64
	stopped           atomic.Bool
	done              chan struct{}
	slots             chan struct{}
	wg                sync.WaitGroup
	mu                sync.Mutex
	conns             map[net.Conn]struct{}
}

func startHandshakeFlood(t testing.TB, ns *cluster.NS, dst netip.AddrPort, max int) *handshakeFlood {
	t.Helper()
	limit, err := fileLimit()
	if err != nil {
		t.Fatal(err)
	}
	f, capped := newHandshakeFlood(ns.Do, dst, max, limit)
	if capped {
		t.Logf("flood of %d connections capped at %d by this process's descriptor limit %d", max, limit-2048, limit)
	}
	t.Cleanup(f.stop)
	return f
}

// newHandshakeFlood starts a flood of up to max connections to dst, each
// dial run through do (entering the flooder's namespace), and reports
// whether max was capped by the descriptor limit.
func newHandshakeFlood(do func(func() error) error, dst netip.AddrPort, max int, limit uint64) (*handshakeFlood, bool) {
	capped := false
	if uint64(max)+2048 > limit {
		// The flooder's own descriptors: the node resets all but a few
		// at once, so the slots are only full if the node holds them.
		max, capped = int(limit-2048), true
	}
	f := &handshakeFlood{slots: make(chan struct{}, max), done: make(chan struct{}), conns: map[net.Conn]struct{}{}}
	// Three dialers, each entering the namespace once per batch of
	// dials: the flood is as fast as the test can make it.
	for w := range 3 {
		f.wg.Add(1)
		go func() {
			defer f.wg.Done()
			i := w
			for !f.stopped.Load() {
				do(func() error {
					for range 256 {
						select {
						case f.slots <- struct{}{}:
						case <-f.done:
							return nil
						}
						f.dialOne(dst, i%2 == 1)
						i += 3
					}
					return nil
				})
			}
		}()
	}
	return f, capped
}

// dialOne opens one connection of the flood, on the calling thread (in
// the flood's namespace), holding a slot; big: it announces 16 KiB.
func (f *handshakeFlood) dialOne(dst netip.AddrPort, big bool) {
	f.attempts.Add(1)
	c, err := net.DialTimeout("tcp", dst.String(), 5*time.Second)
	if err == nil && big {
		if _, err = c.Write(recordHeader16K); err != nil {
			c.Close()
		}
	}
	if err != nil {
		f.refused.Add(1)
		<-f.slots
		return
	}
	f.open.Add(1)
	f.mu.Lock()
	f.conns[c] = struct{}{}
	f.mu.Unlock()
	f.wg.Add(1)
	go func() { // reads need no namespace
		defer f.wg.Done()
		io.Copy(io.Discard, c) // until the node resets or closes it, or stop
		c.Close()
		f.mu.Lock()
		delete(f.conns, c)
		f.mu.Unlock()
		f.open.Add(-1)
		f.refused.Add(1)
		<-f.slots
	}()
}

// stop closes every connection of the flood and waits for its goroutines.
func (f *handshakeFlood) stop() {
	if f.stopped.Swap(true) {
		return
	}
	close(f.done)
	f.mu.Lock()
	for c := range f.conns {
		c.Close()
	}
	f.mu.Unlock()
	f.wg.Wait()
}

// fileLimit raises the process's descriptor limit to its hard limit (Go
// does at start; a container may not let even root go beyond it) and
// returns it.
func fileLimit() (uint64, error) {
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		return 0, err
	}
	if lim.Cur < lim.Max {
		lim.Cur = lim.Max
		if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
			return 0, fmt.Errorf("raise RLIMIT_NOFILE to %d: %w", lim.Max, err)
		}
	}
	return lim.Cur, nil
}

// procUsage returns the resident memory and open descriptors of process
// pid.
func procUsage(t testing.TB, pid int) (rss int64, fds int) {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				t.Fatalf("VmRSS of %d: %q: %v", pid, v, err)
			}
			rss = kb << 10
		}
	}
	des, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	return rss, len(des)
}

// procCPU returns the CPU time process pid has used.
func procCPU(t testing.TB, pid int) time.Duration {
	t.Helper()
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		t.Fatal(err)
	}
	// The fields after the command name, which is in parentheses.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+2:]))
	ut, _ := strconv.ParseInt(f[11], 10, 64)        // utime, field 14
	st, _ := strconv.ParseInt(f[12], 10, 64)        // stime, field 15
	return time.Duration(ut+st) * time.Second / 100 // USER_HZ
}

// meshRound opens a connection through the mesh from client to dst's
// echo server, sends a request, reads the answer and closes.
func meshRound(ctx context.Context, client *cluster.NS, dst netip.AddrPort) error {
	c, err := client.Dial(ctx, "tcp", dst.String())
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	msg := []byte("GET / through the mesh\n")
	if _, err := c.Write(msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return fmt.Errorf("echo from %s: %w", dst, err)
	}
	return nil
}

// meshRate runs meshRound from workers goroutines for d and returns the
// rounds per second and the failures.
func meshRate(client *cluster.NS, dst netip.AddrPort, workers int, d time.Duration) (rate float64, failed int64, lastErr error) {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	var ok, bad atomic.Int64
	var mu sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	for range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for ctx.Err() == nil {
				if err := meshRound(context.Background(), client, dst); err != nil {
					if ctx.Err() == nil {
						bad.Add(1)
						mu.Lock()
						lastErr = err
						mu.Unlock()
					}
					continue
				}
				ok.Add(1)
			}
		}()
	}
	wg.Wait()
	return float64(ok.Load()) / time.Since(start).Seconds(), bad.Load(), lastErr
}

// refusalLines counts m's log lines about connections refused before any
// request: the HBONE server's and the access log's.
func refusalLines(m nodeProc) int {
	n := 0
	for _, l := range m.Lines() {
		switch l.Str("message") {
		case "hbone: connection refused before any request", "hbone: no HTTP/2 client preface":
			n++
		case "connection refused":
			if l.Str("response_flags") == "TLS_FAILURE" {
				n++
			}
		}
	}
	return n
}

// TestHBONEHandshakeFlood: a pod outside the mesh floods a mesh pod's
// port 15008 (the node's kernel HBONE listener; then, with
// --hbone-netstack, the netstack's) with 9,000 connections that never
// complete a handshake, half of them announcing a 16 KiB record,
// re-opening each one the node resets. The node holds no more than its
// bound of pending handshakes from that source (descriptors and memory
// stay flat), counts the refusals by reason, logs them within its rate,
// and mesh traffic to the pod still flows during the flood.
func TestHBONEHandshakeFlood(t *testing.T) {
	for _, socket := range []string{"kernel", "netstack"} {
		t.Run(socket, func(t *testing.T) { testHBONEHandshakeFlood(t, socket) })
	}
}

func testHBONEHandshakeFlood(t *testing.T, socket string) {
	mc := newMeshCluster(t, "hf"+socket[:1])
	mc.m1 = mc.start(t, mc.n1)
	if socket == "netstack" {
		mc.m2 = mc.start(t, mc.n2, "--hbone-netstack")
	} else {
		mc.m2 = mc.start(t, mc.n2)
	}
	outsider, client, server := mc.p13, mc.p11, mc.p21
	serve(t, server, 7300, func(c net.Conn) { io.Copy(c, c) })
	dst := netip.AddrPortFrom(server.IPv4, 7300)
	if err := meshRound(context.Background(), client.NS, dst); err != nil {
		t.Fatalf("mesh traffic before the flood: %v", err)
	}
	pid := mc.m2.Pid()
	rss0, fds0 := procUsage(t, pid)
	lines0 := refusalLines(mc.m2)
	start := time.Now()

	const conns = 9000
	f := startHandshakeFlood(t, outsider.NS, netip.AddrPortFrom(server.IPv4, 15008), conns)
	deadline := time.Now().Add(60 * time.Second)
	var peakFDs int
	var peakRSS int64
	for f.attempts.Load() < 3*conns {
		if time.Now().After(deadline) {
			t.Fatalf("flood made only %d attempts in 60 s", f.attempts.Load())
		}
		rss, fds := procUsage(t, pid)
		peakRSS, peakFDs = max(peakRSS, rss), max(peakFDs, fds)
		if err := meshRound(context.Background(), client.NS, dst); err != nil {
			t.Errorf("mesh traffic during the flood (%d attempts): %v", f.attempts.Load(), err)
		}
	}
	rss, fds := procUsage(t, pid)
	peakRSS, peakFDs = max(peakRSS, rss), max(peakFDs, fds)
	elapsed := time.Since(start)
	fams := scrape(t, mc.n2)
	refused := map[string]float64{}
	for _, r := range []string{"source_limit", "handshake_limit", "evicted", "handshake_timeout", "handshake_failed"} {
		refused[r] = value(fams, "meshtun_hbone_connections_refused_total", map[string]string{"reason": r})
	}
	pending := value(fams, "meshtun_hbone_handshakes_pending", nil)
	lines := refusalLines(mc.m2) - lines0
	t.Logf("flood: %d attempts in %s, %d held open by the flooder; node 2: RSS %d → peak %d MiB, descriptors %d → peak %d; pending %v; refused %v; %d refusal log lines",
		f.attempts.Load(), elapsed.Round(time.Millisecond), f.open.Load(), rss0>>20, peakRSS>>20, fds0, peakFDs, pending, refused, lines)

	// The source's bound is 64 pending handshakes (the default).
	if grown := peakFDs - fds0; grown > 64+64 {
		t.Errorf("node 2 opened %d descriptors more during the flood, want at most the source's bound 64 and some slack", grown)
	}
	if grown := peakRSS - rss0; grown > 64<<20 {
		t.Errorf("node 2's RSS grew by %d MiB during the flood, want under 64 MiB", grown>>20)
	}
	if pending > 64 {
		t.Errorf("%v handshakes pending, want at most 64", pending)
	}
	if refused["source_limit"] == 0 {
		t.Errorf("no refusal counted for the source bound: %v", refused)
	}
	if allowed := 2*10 + int(elapsed.Seconds()*2*10) + 2; lines > allowed {
		t.Errorf("%d refusal log lines in %s, want at most %d (10/s from the server, 10/s in the access log)", lines, elapsed, allowed)
	}
	f.stop()
	// The listener is still the kernel's, and serves.
	if err := meshRound(context.Background(), client.NS, dst); err != nil {
		t.Fatalf("mesh traffic after the flood: %v", err)
	}
	if n := value(scrape(t, mc.n2), "meshtun_hbone_inbound_connections_total", map[string]string{"socket": socket}); n == 0 {
		t.Errorf("no inbound HBONE on the %s socket", socket)
	}
}

// BenchmarkHandshakeFloodCRR measures the connect+request+close rate of a
// legitimate mesh client (n1p1 → n2p1, through both nodes and HBONE to
// node 2's kernel listener) unloaded and while n1p3, outside the mesh,
// holds up to 20,000 connections to n2p1's port 15008 that never
// handshake (half of them announcing a 16 KiB record), opening a new one
// for each the node resets, in the same run; and node 2's RSS and
// descriptors before and at their peak during the flood, and node 2's CPU
// (in cores) in each phase. It reports the rates and their ratios to the
// unloaded one (the goal is ≥ 50 %) for two floods:
//
//   - "-own": the flooder is a process of its own held to half a core by
//     a CPU cgroup (floodProc), as an attacker on another machine takes
//     none of the node's CPU: what is left is the node's cost of the flood.
//   - "-shared": the flooder runs in the test process, on the same two
//     CPUs as both nodes, the client and the server, taking as much as it
//     can (the measurement of the first round).
//
// Run it on its own:
//
//	go test -run '^$' -bench HandshakeFloodCRR -benchtime 1x ./test/e2e
func BenchmarkHandshakeFloodCRR(b *testing.B) {
	mc := newMeshCluster(b, "bhf")
	mc.m1 = mc.start(b, mc.n1)
	mc.m2 = mc.start(b, mc.n2)
	dst := netip.AddrPortFrom(mc.p21.IPv4, 7432)
	serve(b, mc.p21, 7432, func(c net.Conn) { io.Copy(c, c) })
	if err := meshRound(context.Background(), mc.p11.NS, dst); err != nil {
		b.Fatalf("mesh traffic: %v", err)
	}
	const d, workers, flood, floodCores = 5 * time.Second, 4, 20000, 0.5
	pid := mc.m2.Pid()
	hbone := netip.AddrPortFrom(mc.p21.IPv4, 15008)
	// phase measures the legitimate rate for d while the flood that
	// start begins runs (none: unloaded).
	type result struct {
		rate, attempts, cores float64
		failed                int64
		rss                   int64
		fds                   int
	}
	phase := func(start func() (attempts func() int64, stop func())) result {
		var r result
		attempts, stop := func() int64 { return 0 }, func() {}
		rss0, fds0 := procUsage(b, pid)
		if start != nil {
			attempts, stop = start()
		}
		halt := make(chan struct{})
		peak := make(chan [2]int64, 1)
		go func() {
			var rss int64
			var fds int
			for {
				r, n := procUsage(b, pid)
				rss, fds = max(rss, r), max(fds, n)
				select {
				case <-halt:
					peak <- [2]int64{rss, int64(fds)}
					return
				case <-time.After(50 * time.Millisecond):
				}
			}
		}()
		a0, c0 := attempts(), procCPU(b, pid)
		rate, failed, lerr := meshRate(mc.p11.NS, dst, workers, d)
		r.cores = (procCPU(b, pid) - c0).Seconds() / d.Seconds()
		r.attempts = float64(attempts()-a0) / d.Seconds()
		close(halt)
		p := <-peak
		stop()
		if failed > 0 {
			b.Logf("%d failed, last: %v", failed, lerr)
		}
		r.rate, r.failed, r.rss, r.fds = rate, failed, p[0]-rss0, int(p[1])-fds0
		return r
	}
	own := func() (func() int64, func()) {
		f := startFloodProcess(b, mc.p13.NS, hbone, flood, floodCores)
		return f.attempts.Load, f.stop
	}
	shared := func() (func() int64, func()) {
		f := startHandshakeFlood(b, mc.p13.NS, hbone, flood)
		return f.attempts.Load, f.stop
	}
	var sum [3]result
	for range b.N {
		for i, start := range []func() (func() int64, func()){nil, own, shared} {
			r := phase(start)
			s := &sum[i]
			s.rate += r.rate
			s.attempts += r.attempts
			s.cores += r.cores
			s.failed += r.failed
			s.rss, s.fds = max(s.rss, r.rss), max(s.fds, r.fds)
		}
	}
	n := float64(b.N)
	b.ReportMetric(sum[0].rate/n, "crr/s-unloaded")
	b.ReportMetric(sum[0].cores/n, "node2-cores-unloaded")
	for i, name := range []string{"", "own", "shared"} {
		if i == 0 {
			continue
		}
		s := sum[i]
		b.ReportMetric(s.rate/n, "crr/s-"+name)
		if sum[0].rate > 0 {
			b.ReportMetric(s.rate/sum[0].rate, "ratio-"+name)
		}
		b.ReportMetric(s.attempts/n, "flood-conn/s-"+name)
		b.ReportMetric(float64(s.rss)/(1<<20), "rss-growth-MiB-"+name)
		b.ReportMetric(float64(s.fds), "fd-growth-"+name)
		b.ReportMetric(s.cores/n, "node2-cores-"+name)
	}
	b.ReportMetric(float64(sum[0].failed+sum[1].failed+sum[2].failed), "failed")
}
