package hbone

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/net/http2"
)

// recordHeader16K is a TLS record header announcing a 16 KiB handshake
// record, whose body never comes: the server buffers what it was promised.
var recordHeader16K = []byte{0x16, 0x03, 0x01, 0x40, 0x00}

// dialFrom opens a TCP connection to ep from the loopback address src
// (any of 127/8) and sends first (nothing if nil). It returns nil if the
// server reset the connection already (refused at once).
func dialFrom(t testing.TB, src string, ep netip.AddrPort, first []byte) *net.TCPConn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	c, err := d.Dial("tcp", ep.String())
	if errors.Is(err, syscall.ECONNRESET) {
		return nil
	}
	if err != nil {
		t.Fatalf("dial %s from %s: %v", ep, src, err)
	}
	t.Cleanup(func() { c.Close() })
	if first != nil {
		if _, err := c.Write(first); errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) {
			c.Close()
			return nil
		} else if err != nil {
			t.Fatalf("write to %s from %s: %v", ep, src, err)
		}
	}
	return c.(*net.TCPConn)
}

// waitFor polls cond (the server's own counters) until it holds.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// settled waits until the server has taken in n connections: pending, or
// refused by a bound.
func settled(t testing.TB, f *fixture, n int) {
	t.Helper()
	waitFor(t, fmt.Sprintf("%d connections pending or refused", n), func() bool {
		total, _ := f.srv.PendingHandshakes()
		r := f.srv.Refused()
		return total+int(r[RefusedSourceLimit]+r[RefusedHandshakeLimit]+r[RefusedEvicted]) >= n
	})
}

// isReset reports whether c was closed by the server (reset or EOF)
// within a second.
func isReset(c net.Conn) bool {
	c.SetReadDeadline(time.Now().Add(time.Second))
	_, err := c.Read(make([]byte, 1))
	var ne net.Error
	return err != nil && !(errors.As(err, &ne) && ne.Timeout())
}

func openFDs(t testing.TB) int {
	t.Helper()
	des, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	return len(des)
}

func memInUse() uint64 {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.HeapInuse + ms.StackInuse
}

// TestHandshakeFloodBounded: a flood of idle connections and of
// connections that announce a 16 KiB record, from 32 source addresses,
// holds no more than the bound of pending handshakes (descriptors and
// memory of the server stay within it: the rest is reset at once), and a
// mesh client from another address still connects during the flood.
func TestHandshakeFloodBounded(t *testing.T) {
	const maxHS, idle, big = 64, 2000, 1000
	f := newFixture(t, &attackHandler{}, func(s *ServerConfig, _ *ClientConfig) {
		s.MaxHandshakes, s.MaxHandshakesPerSource = maxHS, 16
		s.HandshakeTimeout = time.Minute // the bound, not the timeout, holds them
	})
	fds0, mem0 := openFDs(t), memInUse()
	var conns []*net.TCPConn
	for i := range idle + big {
		src := fmt.Sprintf("127.0.0.%d", 2+i%32)
		var first []byte
		if i >= idle {
			first = recordHeader16K
		}
		if c := dialFrom(t, src, f.endpoint, first); c != nil {
			conns = append(conns, c)
		}
		if i%500 == 499 {
			if total, _ := f.srv.PendingHandshakes(); total > maxHS {
				t.Fatalf("%d handshakes pending during the flood, bound %d", total, maxHS)
			}
		}
	}
	settled(t, f, idle+big)
	// The client's own descriptors are counted too: one per connection
	// (those the server reset too, until closed).
	fds, mem := openFDs(t), memInUse()
	serverFDs := fds - fds0 - len(conns)
	t.Logf("flood of %d: server holds %d descriptors more, %d KiB more in use in the process (client's included); refused %v",
		len(conns), serverFDs, (int64(mem)-int64(mem0))>>10, f.srv.Refused())
	if serverFDs > maxHS+16 {
		t.Errorf("server holds %d descriptors more during a flood of %d, want at most about the bound %d", serverFDs, len(conns), maxHS)
	}
	// Unbounded, every 16 KiB announcement costs its buffer and every
	// connection a goroutine: tens of MiB.
	if grown := int64(mem) - int64(mem0); grown > 8<<20 {
		t.Errorf("heap and stacks grew by %d KiB during the flood, want under 8 MiB", grown>>10)
	}
	if total, _ := f.srv.PendingHandshakes(); total > maxHS {
		t.Errorf("%d handshakes pending, bound %d", total, maxHS)
	}
	healthy(t, f) // from 127.0.0.1, a source holding none
	if n := f.srv.Refused()[RefusedSourceLimit] + f.srv.Refused()[RefusedHandshakeLimit]; n < idle+big-2*maxHS {
		t.Errorf("%d connections refused, want at least %d", n, idle+big-2*maxHS)
	}
}

// TestHandshakeFairShare: one source cannot hold more than its bound of
// pending handshakes; when all are taken, a source holding fewer takes the
// slot of the oldest of the source holding the most, which is reset; and a
// mesh client from a third address still gets through.
func TestHandshakeFairShare(t *testing.T) {
	f := newFixture(t, &attackHandler{}, func(s *ServerConfig, _ *ClientConfig) {
		s.MaxHandshakes, s.MaxHandshakesPerSource = 8, 6
		s.HandshakeTimeout = time.Minute
	})
	a := netip.MustParseAddr("127.0.0.2")
	b := netip.MustParseAddr("127.0.0.3")
	var fromA []*net.TCPConn
	for range 20 {
		fromA = append(fromA, dialFrom(t, a.String(), f.endpoint, nil))
		settled(t, f, len(fromA)) // in order: the first six are held
	}
	if _, per := f.srv.PendingHandshakes(); per[a] != 6 {
		t.Fatalf("source %s holds %d pending handshakes, want its bound 6", a, per[a])
	}
	if n := f.srv.Refused()[RefusedSourceLimit]; n != 14 {
		t.Errorf("%d refused for the source bound, want 14", n)
	}
	for range 4 {
		dialFrom(t, b.String(), f.endpoint, recordHeader16K)
	}
	waitFor(t, "two of A's handshakes evicted", func() bool { return f.srv.Refused()[RefusedEvicted] == 2 })
	if _, per := f.srv.PendingHandshakes(); per[a] != 4 || per[b] != 4 {
		t.Errorf("pending per source %v, want 4 each", per)
	}
	// The evicted ones are A's oldest; A's others stay.
	if !isReset(fromA[0]) || !isReset(fromA[1]) {
		t.Errorf("A's two oldest connections are still open after their eviction")
	}
	if isReset(fromA[5]) {
		t.Errorf("A's newest held connection was reset, want its oldest")
	}
	for i, c := range fromA[6:] {
		if c != nil && !isReset(c) {
			t.Errorf("A's connection %d beyond its bound is open", 6+i)
		}
	}
	healthy(t, f)
	if _, per := f.srv.PendingHandshakes(); per[a]+per[b] != 7 {
		t.Errorf("pending per source %v after a mesh client's handshake, want 7 in all", per)
	}
}

// TestHandshakeTimeout: a connection that sends nothing is reset after
// the handshake timeout, and counted.
func TestHandshakeTimeout(t *testing.T) {
	f := newFixture(t, &attackHandler{}, func(s *ServerConfig, _ *ClientConfig) {
		s.HandshakeTimeout = 300 * time.Millisecond
	})
	start := time.Now()
	c := dialFrom(t, "127.0.0.2", f.endpoint, recordHeader16K)
	c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := io.ReadAll(c); err != nil && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("idle connection: %v, want the server to close it", err)
	}
	if d := time.Since(start); d > 2*time.Second {
		t.Errorf("idle connection closed after %s, want about the timeout 300ms", d)
	}
	waitFor(t, "a handshake_timeout refusal", func() bool { return f.srv.Refused()[RefusedHandshakeTimeout] == 1 })
	if DefaultHandshakeTimeout > 5*time.Second {
		t.Errorf("default handshake timeout %s, want at most 5s", DefaultHandshakeTimeout)
	}
}

// tlsTo completes a TLS handshake with the fixture's server as the client
// identity src, and its HTTP/2 preface and SETTINGS; it returns the
// connection and whether the server answered with its SETTINGS.
func tlsTo(t *testing.T, f *fixture, src string) (*tls.Conn, bool) {
	t.Helper()
	id := f.client
	if src == "client2" {
		id = f.client2
	}
	cfg, _ := f.clientTLS(id, f.server)
	cfg = cfg.Clone()
	cfg.NextProtos = []string{"h2"}
	tc, err := tls.Dial("tcp", f.endpoint.String(), cfg)
	if err != nil {
		return nil, false
	}
	t.Cleanup(func() { tc.Close() })
	tc.SetDeadline(time.Now().Add(5 * time.Second))
	io.WriteString(tc, http2.ClientPreface)
	fr := http2.NewFramer(tc, tc)
	fr.WriteSettings()
	fm, err := fr.ReadFrame()
	if err != nil {
		return tc, false
	}
	_, ok := fm.(*http2.SettingsFrame)
	return tc, ok
}

// TestPeerConnLimit: one peer identity's authenticated connections are
// bounded; one beyond is reset after its handshake, another identity is
// not affected, and a closed connection gives its room back.
func TestPeerConnLimit(t *testing.T) {
	f := newFixture(t, &attackHandler{}, func(s *ServerConfig, _ *ClientConfig) {
		s.MaxConnsPerPeer = 2
	})
	a, ok1 := tlsTo(t, f, "client")
	_, ok2 := tlsTo(t, f, "client")
	if !ok1 || !ok2 {
		t.Fatalf("first two connections of an identity refused")
	}
	waitFor(t, "two connections of the client", func() bool { return f.srv.PeerConns(f.client) == 2 })
	if _, ok := tlsTo(t, f, "client"); ok {
		t.Errorf("third connection of an identity served, bound 2")
	}
	waitFor(t, "a peer_limit refusal", func() bool { return f.srv.Refused()[RefusedPeerLimit] == 1 })
	if _, ok := tlsTo(t, f, "client2"); !ok {
		t.Errorf("another identity's connection refused")
	}
	a.Close()
	waitFor(t, "the client's closed connection ended", func() bool { return f.srv.PeerConns(f.client) == 1 })
	if _, ok := tlsTo(t, f, "client"); !ok {
		t.Errorf("a connection of the identity refused after one of its two closed")
	}
}

// lineCounter counts log lines whose message is msg.
type lineCounter struct {
	mu  sync.Mutex
	msg string
	n   int
}

func (c *lineCounter) Write(p []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.n += bytes.Count(p, []byte(`"message":"`+c.msg+`"`))
	return len(p), nil
}

func (c *lineCounter) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

// TestRefusalLogLimited: connections refused before any request (here
// garbage instead of a ClientHello) are logged at most DefaultLogRate a
// second after a burst of as many; the counter has them all.
func TestRefusalLogLimited(t *testing.T) {
	lines := &lineCounter{msg: "hbone: connection refused before any request"}
	f := newFixture(t, &attackHandler{}, func(s *ServerConfig, _ *ClientConfig) {
		s.Logger = zerolog.New(lines)
	})
	const n = 200
	start := time.Now()
	for i := range n {
		c := dialFrom(t, fmt.Sprintf("127.0.0.%d", 2+i%8), f.endpoint, []byte("GET / HTTP/1.1\r\n\r\n"))
		io.Copy(io.Discard, c)
		c.Close()
	}
	waitFor(t, "every refusal counted", func() bool { return f.srv.Refused()[RefusedHandshakeFailed] == n })
	elapsed := time.Since(start)
	allowed := DefaultLogRate + int(elapsed.Seconds()*DefaultLogRate) + 1
	t.Logf("%d refusals in %s: %d lines logged", n, elapsed, lines.count())
	if got := lines.count(); got > allowed || got == 0 {
		t.Errorf("%d refusal lines for %d refusals in %s, want 1 to %d", got, n, elapsed, allowed)
	}
}

// TestLogLimiter: the bucket's burst, its rate, and the count of lines
// held back given with the next one let through.
func TestLogLimiter(t *testing.T) {
	now := time.Unix(0, 0)
	l := NewLogLimiter(10)
	l.now = func() time.Time { return now }
	allowed := 0
	for range 100 {
		if ok, _ := l.Allow(); ok {
			allowed++
		}
	}
	if allowed != 10 {
		t.Errorf("burst: %d let through, want 10", allowed)
	}
	now = now.Add(500 * time.Millisecond)
	ok, held := l.Allow()
	if !ok || held != 90 {
		t.Errorf("after 0.5 s: ok %v, held back %d; want true, 90", ok, held)
	}
	allowed = 1
	for range 100 {
		if ok, _ := l.Allow(); ok {
			allowed++
		}
	}
	if allowed != 5 {
		t.Errorf("0.5 s at 10/s: %d let through, want 5", allowed)
	}
}

// TestAcceptSurvivesEMFILE: out of descriptors, the accept loop waits and
// retries instead of ending; once descriptors are free again, the same
// listener serves a mesh client. The process's own descriptor limit is
// lowered for the test (no other test runs meanwhile).
func TestAcceptSurvivesEMFILE(t *testing.T) {
	lines := &lineCounter{msg: "hbone: accept failed"}
	ids := newIdentities(t)
	srv, err := NewServer(ServerConfig{TLS: ids.serverTLS, Handler: &attackHandler{}, Logger: zerolog.New(lines),
		HandshakeTimeout: time.Minute})
	if err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ep := ln.Addr().(*net.TCPAddr).AddrPort()
	// Connections queued before the server accepts: the kernel completes
	// them in the listener's backlog.
	var conns []*net.TCPConn
	for range 40 {
		conns = append(conns, dialFrom(t, "127.0.0.2", ep, nil))
	}
	var lim syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	low := lim
	low.Cur = uint64(openFDs(t) + 10)
	if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &low); err != nil {
		t.Fatal(err)
	}
	restored := false
	restore := func() {
		if !restored {
			restored = true
			if err := syscall.Setrlimit(syscall.RLIMIT_NOFILE, &lim); err != nil {
				t.Fatal(err)
			}
		}
	}
	defer restore()
	served := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer func() {
		cancel()
		if err := <-served; err != nil {
			t.Errorf("Serve: %v", err)
		}
	}()
	go func() { served <- srv.Serve(ctx, ln) }()
	waitFor(t, "accept to fail for lack of descriptors", func() bool {
		select {
		case err := <-served:
			served <- err
			restore()
			t.Fatalf("Serve ended out of descriptors: %v", err)
		default:
		}
		return lines.count() >= 2
	})
	for _, c := range conns {
		c.Close()
	}
	restore()
	select {
	case err := <-served:
		served <- err
		t.Fatalf("Serve ended out of descriptors: %v", err)
	default:
	}
	cl, err := NewClient(ClientConfig{TLS: ids.clientTLS, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	c, err := cl.Dial(ctxTimeout(t, 10*time.Second), DialRequest{Source: ids.client, Destination: ids.server, Endpoint: ep, Target: echoTarget})
	if err != nil {
		t.Fatalf("a mesh client after the descriptors came back: %v", err)
	}
	defer c.Close()
	c.Write([]byte("ping"))
	buf := make([]byte, 4)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "ping" {
		t.Fatalf("echo after recovery: %q, %v", buf, err)
	}
}

// freshRounds makes new HBONE connections (a TLS handshake each: a new
// Client every round) to f's server from 127.0.0.1 for d, each carrying
// one echo stream, and returns the rounds per second and the failures.
func freshRounds(b *testing.B, f *fixture, d time.Duration) (rate float64, failed int) {
	var ok int
	start := time.Now()
	for time.Since(start) < d {
		cl, err := NewClient(ClientConfig{TLS: f.identities.clientTLS, Logger: zerolog.Nop()})
		if err != nil {
			b.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		c, err := cl.Dial(ctx, DialRequest{Source: f.client, Destination: f.server, Endpoint: f.endpoint, Target: echoTarget})
		if err == nil {
			c.Write([]byte("ping"))
			buf := make([]byte, 4)
			_, err = io.ReadFull(c, buf)
			c.Close()
		}
		cancel()
		cl.Close()
		if err != nil {
			failed++
			continue
		}
		ok++
	}
	return float64(ok) / time.Since(start).Seconds(), failed
}

// flood holds up to slots connections to ep from 32 loopback addresses
// (127.0.0.2-33) that never handshake, half announcing a 16 KiB record,
// opening a new one for each the server resets, until stop; it returns
// the connections it opened.
func flood(ep netip.AddrPort, slots int, stop <-chan struct{}) int64 {
	var wg sync.WaitGroup
	var n atomic.Int64
	sem := make(chan struct{}, slots)
	for w := range 32 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			src := &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(2+w))}
			for i := 0; ; i++ {
				select {
				case sem <- struct{}{}:
				case <-stop:
					return
				}
				n.Add(1)
				dl := net.Dialer{LocalAddr: src, Timeout: time.Second}
				c, err := dl.Dial("tcp", ep.String())
				if err == nil && i%2 == 1 {
					_, err = c.Write(recordHeader16K)
				}
				if err != nil {
					if c != nil {
						c.Close()
					}
					<-sem
					continue
				}
				wg.Add(1)
				go func() {
					defer wg.Done()
					go func() { <-stop; c.Close() }()
					io.Copy(io.Discard, c)
					c.Close()
					<-sem
				}()
			}
		}()
	}
	<-stop
	wg.Wait()
	return n.Load()
}

// TestFloodHelper is the flooding process of
// BenchmarkFreshHandshakeDuringFlood, started by it with
// HBONE_TEST_FLOOD=<ip:port>: it floods until its standard input closes
// and prints how many connections it opened. Otherwise it does nothing.
func TestFloodHelper(t *testing.T) {
	target := os.Getenv("HBONE_TEST_FLOOD")
	if target == "" {
		return
	}
	ep := netip.MustParseAddrPort(target)
	var lim syscall.Rlimit
	syscall.Getrlimit(syscall.RLIMIT_NOFILE, &lim)
	stop := make(chan struct{})
	go func() { io.Copy(io.Discard, os.Stdin); close(stop) }()
	fmt.Printf("flood-opened %d\n", flood(ep, min(20000, int(lim.Cur)-1024), stop))
}

// floodProcess starts TestFloodHelper against ep in a process of its own;
// stop ends it and returns the connections it opened.
func floodProcess(b *testing.B, ep string) (stop func() int64) {
	cmd := exec.Command(os.Args[0], "-test.run=^TestFloodHelper$")
	cmd.Env = append(os.Environ(), "HBONE_TEST_FLOOD="+ep)
	in, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	var out bytes.Buffer
	cmd.Stdout = &out
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	return func() int64 {
		in.Close()
		if err := cmd.Wait(); err != nil {
			b.Fatalf("flood process: %v: %s", err, out.String())
		}
		var opened int64
		if i := strings.Index(out.String(), "flood-opened "); i >= 0 {
			fmt.Sscanf(out.String()[i:], "flood-opened %d", &opened)
		}
		return opened
	}
}

// BenchmarkFreshHandshakeDuringFlood: the rate of new mesh connections
// (handshake, one echo stream, close) from 127.0.0.1 to a server with the
// default bounds, in the same run: alone; while another process (this
// test binary, TestFloodHelper) holds up to 20,000 connections to the
// server from 32 other loopback addresses that never handshake (half
// announcing 16 KiB), re-opening each one reset; and while the same flood
// hits a bare listener of this process that resets every connection it
// accepts (the floor: what the flood costs the machine whatever the
// server does). The new connections' source holds nothing pending, so
// each takes the slot of a flooding source's oldest.
//
//	go test -run '^$' -bench FreshHandshakeDuringFlood -benchtime 1x ./protocols/hbone
func BenchmarkFreshHandshakeDuringFlood(b *testing.B) {
	f := newFixture(b, &attackHandler{}, func(s *ServerConfig, _ *ClientConfig) { s.Logger = zerolog.Nop() })
	bare, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer bare.Close()
	go func() {
		for {
			c, err := bare.Accept()
			if err != nil {
				return
			}
			c.(*net.TCPConn).SetLinger(0)
			c.Close()
		}
	}()
	const d = 5 * time.Second
	var rateU, rateF, rateB, attempts float64
	var failed int
	for range b.N {
		u, fu := freshRounds(b, f, d)
		stop := floodProcess(b, f.endpoint.String())
		time.Sleep(time.Second) // the flood builds up
		l, fl := freshRounds(b, f, d)
		attempts += float64(stop()) / (d + time.Second).Seconds()
		stop = floodProcess(b, bare.Addr().String())
		time.Sleep(time.Second)
		r, fr := freshRounds(b, f, d)
		stop()
		rateU += u
		rateF += l
		rateB += r
		failed += fu + fl + fr
	}
	k := float64(b.N)
	b.ReportMetric(rateU/k, "conn/s-unloaded")
	b.ReportMetric(rateF/k, "conn/s-flood")
	b.ReportMetric(rateB/k, "conn/s-flood-elsewhere")
	if rateU > 0 && rateB > 0 {
		b.ReportMetric(rateF/rateU, "ratio")
		b.ReportMetric(rateF/rateB, "ratio-to-elsewhere")
	}
	b.ReportMetric(attempts/k, "flood-conn/s")
	b.ReportMetric(float64(failed), "failed")
	b.ReportMetric(float64(f.srv.Refused()[RefusedEvicted]), "evicted")
}

// TestHandshakeGateStaleSlot: with every slot taken by sources holding
// one each, a new source is refused until the oldest handshake has waited
// handshakeMinAge, then takes its slot; a source that already holds one
// never evicts that way (no churn).
func TestHandshakeGateStaleSlot(t *testing.T) {
	now := time.Unix(0, 0)
	g := newHandshakeGate(4, 4)
	g.now = func() time.Time { return now }
	aborted := map[int]bool{}
	for i := range 4 {
		if _, r := g.admit(netip.AddrFrom4([4]byte{10, 0, 0, byte(i)}), func() { aborted[i] = true }); r != "" {
			t.Fatalf("source %d refused: %s", i, r)
		}
		now = now.Add(100 * time.Millisecond)
	}
	newSrc := netip.MustParseAddr("10.0.0.9")
	if _, r := g.admit(newSrc, func() {}); r != RefusedHandshakeLimit {
		t.Errorf("new source with no handshake stale: %q, want %s", r, RefusedHandshakeLimit)
	}
	now = now.Add(time.Second)
	if _, r := g.admit(netip.MustParseAddr("10.0.0.1"), func() {}); r != RefusedHandshakeLimit {
		t.Errorf("a source holding one, the oldest stale: %q, want %s (no churn)", r, RefusedHandshakeLimit)
	}
	if _, r := g.admit(newSrc, func() {}); r != "" || !aborted[0] || len(aborted) != 1 {
		t.Errorf("new source with the oldest stale: %q, aborted %v; want admitted, the oldest (0) aborted", r, aborted)
	}
	if total, per := g.load(); total != 4 || per[newSrc] != 1 {
		t.Errorf("load %d %v, want 4 with the new source holding 1", total, per)
	}
}
