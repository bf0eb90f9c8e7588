package relay

import (
	"io"
	"net"
	"runtime"
	"testing"
	"time"
)

// BenchmarkRelayKernel: 1 MiB writes relayed between two loopback TCP
// connections (the passthrough path's kernel-socket relay).
func BenchmarkRelayKernel(b *testing.B) {
	client, a := tcpPairB(b)
	bb, server := tcpPairB(b)
	res := make(chan Result, 1)
	Start(a, bb, Meter{Done: func(r Result) { res <- r }})
	chunk := make([]byte, 1<<20)
	done := make(chan int64, 1)
	go func() {
		n, _ := io.Copy(io.Discard, server)
		done <- n
	}()
	b.SetBytes(int64(len(chunk)))
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if _, err := client.Write(chunk); err != nil {
			b.Fatal(err)
		}
	}
	client.CloseWrite()
	n := <-done
	b.StopTimer()
	if n != int64(b.N*len(chunk)) {
		b.Fatalf("server got %d bytes, want %d", n, b.N*len(chunk))
	}
	server.CloseWrite()
	<-res
}

// BenchmarkRelayPingPong: one 128-byte message each way per iteration
// through a relay between two readiness-notifying connections (as
// *stack.Conn is): the wake-up and copy cost of a busy relay, and its
// allocations.
func BenchmarkRelayPingPong(b *testing.B) {
	a, c := newMemConn(), newMemConn()
	res := make(chan Result, 1)
	Start(a, c, Meter{Done: func(r Result) { res <- r }})
	msg := make([]byte, 128)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		a.feed(msg)
		<-c.out
		c.feed(msg)
		<-a.out
	}
	b.StopTimer()
	a.feed(nil)
	c.feed(nil)
	<-res
}

// BenchmarkRelayIdle: relays between readiness-notifying connections that
// exchanged one message each way and then idle past the grace period;
// reports what one idle relay holds (goroutines, heap bytes).
func BenchmarkRelayIdle(b *testing.B) {
	const n = 1000
	for range b.N {
		runtime.GC()
		var before runtime.MemStats
		runtime.ReadMemStats(&before)
		base := runtime.NumGoroutine()
		conns := make([][2]*memConn, n)
		res := make(chan Result, n)
		msg := make([]byte, 128)
		for i := range conns {
			a, c := newMemConn(), newMemConn()
			conns[i] = [2]*memConn{a, c}
			Start(a, c, Meter{Done: func(r Result) { res <- r }})
			a.feed(msg)
			<-c.out
			c.feed(msg)
			<-a.out
		}
		deadline := time.Now().Add(10 * time.Second)
		for runtime.NumGoroutine() > base+n/100 && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		runtime.GC()
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(runtime.NumGoroutine()-base)/n, "goroutines/idle")
		b.ReportMetric(float64(int64(after.HeapAlloc)-int64(before.HeapAlloc))/n, "heapB/idle")
		for _, p := range conns {
			p[0].feed(nil)
			p[1].feed(nil)
		}
		for range n {
			<-res
		}
	}
}

// tcpPairB is tcpPair for a benchmark.
func tcpPairB(b *testing.B) (client, server *net.TCPConn) {
	b.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		b.Fatal(err)
	}
	defer ln.Close()
	c, err := net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		b.Fatal(err)
	}
	s, err := ln.AcceptTCP()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { c.Close(); s.Close() })
	return c, s
}
