package gen

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/netip"
	"strings"
	"testing"
	"time"
)

// here is the current namespace: the tests run on loopback.
type here struct{}

func (here) Do(fn func() error) error { return fn() }

func serveLoopback(t *testing.T) *Server {
	t.Helper()
	srv, err := Serve(here{}, netip.MustParseAddr("127.0.0.1"), 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { srv.Close() })
	return srv
}

func TestUploadDownloadCountBytes(t *testing.T) {
	srv := serveLoopback(t)
	ctx := t.Context()
	windows := 0
	cfg := TCPConfig{Streams: 2, Warmup: 20 * time.Millisecond, Duration: 100 * time.Millisecond,
		Window: func() func() { windows++; return func() { windows++ } }}
	up, err := Upload(ctx, here{}, srv, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if up.Bytes <= 0 || up.Elapsed < cfg.Duration || up.Gbps() <= 0 {
		t.Errorf("upload: %+v (%.3f Gbit/s), want bytes over at least %v", up, up.Gbps(), cfg.Duration)
	}
	if windows != 2 {
		t.Errorf("window callbacks: %d calls, want open and close", windows)
	}
	down, err := Download(ctx, here{}, srv, cfg)
	if err != nil {
		t.Fatal(err)
	}
	if down.Bytes <= 0 || down.Elapsed < cfg.Duration {
		t.Errorf("download: %+v", down)
	}
	// Every connection is gone once a run returns.
	wctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err := srv.WaitIdle(wctx); err != nil {
		t.Errorf("server still has connections after the runs: %v", err)
	}
}

func TestTCPConfigRejected(t *testing.T) {
	srv := serveLoopback(t)
	if _, err := Upload(t.Context(), here{}, srv, TCPConfig{Streams: 0, Duration: time.Second}); err == nil {
		t.Error("zero streams: no error")
	}
}

func TestRequestResponse(t *testing.T) {
	srv := serveLoopback(t)
	lat, err := RequestResponse(t.Context(), here{}, srv, 64, time.Second, 200)
	if err != nil {
		t.Fatal(err)
	}
	if len(lat) != 200 {
		t.Fatalf("%d samples, want the 200 asked for", len(lat))
	}
	for i, d := range lat {
		if d <= 0 {
			t.Fatalf("sample %d = %v", i, d)
		}
	}
}

func TestConnectRequestClose(t *testing.T) {
	srv := serveLoopback(t)
	lat, elapsed, err := ConnectRequestClose(t.Context(), here{}, srv, 64, time.Second, 50)
	if err != nil {
		t.Fatal(err)
	}
	if len(lat) != 50 || elapsed <= 0 {
		t.Fatalf("%d samples in %v, want 50", len(lat), elapsed)
	}
	var sum time.Duration
	for _, d := range lat {
		sum += d
	}
	if sum > elapsed {
		t.Errorf("rounds add up to %v, more than the %v elapsed", sum, elapsed)
	}
}

func TestConnectFailsOnClosedPort(t *testing.T) {
	// A server whose echo address nothing listens on (port 1).
	dead := &Server{Echo: netip.MustParseAddrPort("127.0.0.1:1")}
	if _, _, err := ConnectRequestClose(t.Context(), here{}, dead, 64, time.Second, 1); err == nil {
		t.Error("connect to a closed port: no error")
	}
}

func TestUDPPacedRate(t *testing.T) {
	srv := serveLoopback(t)
	cfg := UDPConfig{Size: 1200, Rate: 20000, Duration: 200 * time.Millisecond}
	r, err := UDP(t.Context(), here{}, srv, cfg)
	if err != nil {
		t.Fatal(err)
	}
	// 20,000/s for 0.2 s is 4,000 datagrams. Pacing must hold the sender
	// to the rate (unpaced, loopback takes tens of thousands in 0.2 s); a
	// busy machine may make it send fewer, which is not pacing's fault.
	if r.Sent <= 0 || r.Sent > 4100 {
		t.Errorf("sent %d datagrams, want at most about 4000", r.Sent)
	}
	if r.Received <= 0 || r.Received > r.Sent {
		t.Errorf("received %d of %d", r.Received, r.Sent)
	}
	if l := r.Loss(); l < 0 || l > 1 {
		t.Errorf("loss %v out of [0,1]", l)
	}
	if r.PPS() <= 0 {
		t.Errorf("pps %v", r.PPS())
	}
}

func TestUDPResultMath(t *testing.T) {
	r := UDPResult{Sent: 1000, Received: 990, Elapsed: time.Second / 2}
	if r.SentPPS() != 2000 {
		t.Errorf("SentPPS = %v, want 2000", r.SentPPS())
	}
	if r.PPS() != 1980 {
		t.Errorf("PPS = %v, want 1980", r.PPS())
	}
	if l := r.Loss(); l < 0.00999 || l > 0.01001 {
		t.Errorf("Loss = %v, want 0.01", l)
	}
	if (UDPResult{Sent: 5, Received: 7}).Loss() != 0 {
		t.Error("more received than sent must not be negative loss")
	}
	if (Throughput{Bytes: 125_000_000, Elapsed: time.Second}).Gbps() != 1 {
		t.Error("125 MB in 1 s is not 1 Gbit/s")
	}
}

func TestOpenIdleHeldByServer(t *testing.T) {
	srv := serveLoopback(t)
	set, err := OpenIdle(t.Context(), here{}, srv.Holder(), nil, 30)
	if err != nil {
		t.Fatal(err)
	}
	set, err = OpenIdle(t.Context(), here{}, srv.Holder(), set, 20)
	if err != nil {
		t.Fatal(err)
	}
	if set.Len() != 50 || srv.Held() != 50 {
		t.Fatalf("set %d, server holds %d; want 50 and 50", set.Len(), srv.Held())
	}
	set.Close()
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Second)
	defer cancel()
	if err := srv.WaitIdle(ctx); err != nil {
		t.Errorf("server still holds %d after Close: %v", srv.Held(), err)
	}
}

// stuckHolder is a Holder that never holds the connections it is sent.
type stuckHolder struct{ Holder }

func (stuckHolder) WaitHeld(ctx context.Context, n int) error {
	return fmt.Errorf("held fewer than %d", n)
}

// TestOpenIdleFailureKeepsConnections: a failed step leaves the
// connections it opened open in the set, so that the caller sees the
// proxies as they were at the failure (a proxy at its open-file limit is
// still at it); the set's Close closes them.
func TestOpenIdleFailureKeepsConnections(t *testing.T) {
	srv := serveLoopback(t)
	set, err := OpenIdle(t.Context(), here{}, srv.Holder(), nil, 5)
	if err != nil {
		t.Fatal(err)
	}
	set, err = OpenIdle(t.Context(), here{}, stuckHolder{srv.Holder()}, set, 10)
	if err == nil {
		t.Fatal("OpenIdle succeeded with a holder that holds nothing new")
	}
	if set.Len() != 15 {
		t.Fatalf("set has %d connections after the failed step, want 15", set.Len())
	}
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if err := srv.Holder().WaitHeld(ctx, 15); err != nil {
		t.Fatalf("server holds %d after the failed step, want 15: %v", srv.Held(), err)
	}
	set.Close()
	if err := srv.WaitIdle(ctx); err != nil {
		t.Errorf("server still holds %d after Close: %v", srv.Held(), err)
	}
}

func TestHoldProtocol(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	// The serving side reads commands from one pipe and answers on another,
	// as a child process would on its stdin and stdout.
	cmdR, cmdW := io.Pipe()
	outR, outW := io.Pipe()
	served := make(chan error, 1)
	go func() {
		served <- ServeHold(ln, cmdR, outW)
		outW.Close()
	}()
	h, err := DialHolder(cmdW, outR)
	if err != nil {
		t.Fatal(err)
	}
	if h.Addr() != ln.Addr().(*net.TCPAddr).AddrPort() {
		t.Errorf("holder address %v, listener %v", h.Addr(), ln.Addr())
	}
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	set, err := OpenIdle(ctx, here{}, h, nil, 25)
	if err != nil {
		t.Fatal(err)
	}
	if n, err := h.Held(ctx); err != nil || n != 25 {
		t.Fatalf("held %d, %v; want 25", n, err)
	}
	set.Close()
	cmdW.Close() // end of input: the server closes everything and returns
	if err := <-served; err != nil {
		t.Errorf("ServeHold: %v", err)
	}
}

func TestHoldProtocolErrors(t *testing.T) {
	if _, err := DialHolder(io.Discard, strings.NewReader("hello\n")); err == nil {
		t.Error("DialHolder accepted a server that did not say ready")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var out strings.Builder
	if err := ServeHold(ln, strings.NewReader("jump 3\n"), &out); err == nil {
		t.Error("ServeHold accepted an unknown command")
	}
	if !strings.HasPrefix(out.String(), "ready 127.0.0.1:") {
		t.Errorf("ServeHold said %q first, want ready <addr>", out.String())
	}
}
