package hbone

import (
	"context"
	"crypto/aes"
	"crypto/cipher"
	"fmt"
	"io"
	"net"
	"net/netip"
	"runtime"
	"syscall"
	"testing"
	"time"
)

// echoUpstream is a TCP echo server on loopback.
func echoUpstream(b *testing.B) netip.AddrPort {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				io.Copy(c, c)
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// BenchmarkStreamRoundTrip: 128-byte request, 128-byte echo, on one open
// stream (client -> server -> TCP upstream and back).
func BenchmarkStreamRoundTrip(b *testing.B) {
	f := newFixture(b, dialHandler)
	target := echoUpstream(b)
	conn, err := f.dial(ctxTimeout(b, 5*time.Second), target)
	if err != nil {
		b.Fatal(err)
	}
	defer conn.Close()
	msg := make([]byte, 128)
	buf := make([]byte, 128)
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		if _, err := conn.Write(msg); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(conn, buf); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkDialRequestClose: a new stream on a pooled connection, one
// round trip, a clean close in both directions.
func BenchmarkDialRequestClose(b *testing.B) {
	f := newFixture(b, dialHandler)
	target := echoUpstream(b)
	msg := make([]byte, 128)
	buf := make([]byte, 128)
	ctx := context.Background()
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		conn, err := f.dial(ctx, target)
		if err != nil {
			b.Fatal(err)
		}
		if _, err := conn.Write(msg); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(conn, buf); err != nil {
			b.Fatal(err)
		}
		conn.CloseWrite()
		if _, err := io.Copy(io.Discard, conn); err != nil {
			b.Fatal(err)
		}
		conn.Close()
	}
}

// BenchmarkRecordAEAD seals and opens full TLS 1.3 records (16 KiB of
// plaintext and the content-type byte, 5-byte header as additional data)
// with TLS 1.3's AES-GCM suites, as crypto/tls does below an HBONE
// connection: the throughput of the cipher alone on this CPU, the floor
// of a mesh byte's encryption cost (each byte is sealed once on the
// client's node and opened once on the server's). Go picks AES-128-GCM
// when both ends have AES hardware.
func BenchmarkRecordAEAD(b *testing.B) {
	const plain = 16384 + 1
	for _, c := range []struct {
		name string
		new  func() (cipher.AEAD, error)
	}{
		{"AES-128-GCM", func() (cipher.AEAD, error) { return newGCM(16) }},
		{"AES-256-GCM", func() (cipher.AEAD, error) { return newGCM(32) }},
	} {
		aead, err := c.new()
		if err != nil {
			b.Fatal(err)
		}
		nonce := make([]byte, aead.NonceSize())
		ad := []byte{23, 3, 3, 0x40, 0x11}
		msg := make([]byte, plain)
		sealed := aead.Seal(nil, nonce, msg, ad)
		out := make([]byte, 0, len(sealed))
		b.Run(c.name+"/seal", func(b *testing.B) {
			b.SetBytes(plain)
			defer cpuPerGB(b, plain)()
			for range b.N {
				aead.Seal(out[:0], nonce, msg, ad)
			}
		})
		b.Run(c.name+"/open", func(b *testing.B) {
			b.SetBytes(plain)
			defer cpuPerGB(b, plain)()
			for range b.N {
				if _, err := aead.Open(out[:0], nonce, sealed, ad); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// cpuPerGB reports, when the function it returns is called, the process's
// CPU seconds per GB of b.N operations of size bytes: unlike the wall-clock
// MB/s it holds on a machine shared with other work.
func cpuPerGB(b *testing.B, size int) func() {
	var r0 syscall.Rusage
	syscall.Getrusage(syscall.RUSAGE_SELF, &r0)
	return func() {
		var r1 syscall.Rusage
		syscall.Getrusage(syscall.RUSAGE_SELF, &r1)
		cpu := time.Duration(r1.Utime.Nano() + r1.Stime.Nano() - r0.Utime.Nano() - r0.Stime.Nano())
		b.ReportMetric(cpu.Seconds()/(float64(size)*float64(b.N)/1e9), "CPU-s/GB")
	}
}

func newGCM(keyLen int) (cipher.AEAD, error) {
	blk, err := aes.NewCipher(make([]byte, keyLen))
	if err != nil {
		return nil, err
	}
	return cipher.NewGCM(blk)
}

// BenchmarkLoopbackWrite moves bytes over a loopback TCP connection in
// writes of one TLS record (16 KiB + 22 bytes of record overhead, as
// crypto/tls writes each record of a large Write on its own) and of four
// records at once, read in 64 KiB reads, and reports the process's CPU
// seconds per GB (both ends, with the kernel's TCP): what a write per
// record costs the TLS leg of a mesh transfer.
func BenchmarkLoopbackWrite(b *testing.B) {
	for _, size := range []int{16384 + 22, 4 * (16384 + 22)} {
		b.Run(fmt.Sprintf("%dB", size), func(b *testing.B) {
			ln, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				b.Fatal(err)
			}
			defer ln.Close()
			done := make(chan error, 1)
			go func() {
				c, err := ln.Accept()
				if err != nil {
					done <- err
					return
				}
				defer c.Close()
				buf := make([]byte, 64<<10)
				for {
					if _, err := c.Read(buf); err != nil {
						done <- nil
						return
					}
				}
			}()
			c, err := net.Dial("tcp", ln.Addr().String())
			if err != nil {
				b.Fatal(err)
			}
			msg := make([]byte, size)
			b.SetBytes(int64(size))
			report := cpuPerGB(b, size)
			b.ResetTimer()
			for range b.N {
				if _, err := c.Write(msg); err != nil {
					b.Fatal(err)
				}
			}
			c.Close()
			if err := <-done; err != nil {
				b.Fatal(err)
			}
			b.StopTimer()
			report()
		})
	}
}

// BenchmarkStreamIdle: streams to a TCP echo upstream that made one round
// trip each and then idle past the relay's grace period; reports what one
// idle stream holds in the whole process (client, server relay and the
// echo upstream's own goroutine): goroutines and heap bytes.
func BenchmarkStreamIdle(b *testing.B) {
	const n = 200
	f := newFixture(b, dialHandler)
	target := echoUpstream(b)
	msg := make([]byte, 128)
	buf := make([]byte, 128)
	for range b.N {
		runtime.GC()
		var before runtime.MemStats
		runtime.ReadMemStats(&before)
		base := runtime.NumGoroutine()
		conns := make([]*Conn, n)
		for i := range conns {
			c, err := f.dial(ctxTimeout(b, 10*time.Second), target)
			if err != nil {
				b.Fatal(err)
			}
			conns[i] = c
			if _, err := c.Write(msg); err != nil {
				b.Fatal(err)
			}
			if _, err := io.ReadFull(c, buf); err != nil {
				b.Fatal(err)
			}
		}
		time.Sleep(100 * time.Millisecond) // past the relay's grace period (no signal: goroutines end on their own clock)
		runtime.GC()
		var after runtime.MemStats
		runtime.ReadMemStats(&after)
		b.ReportMetric(float64(runtime.NumGoroutine()-base)/n, "goroutines/idle")
		b.ReportMetric(float64(int64(after.HeapAlloc)-int64(before.HeapAlloc))/n, "heapB/idle")
		for _, c := range conns {
			c.Close()
		}
	}
}
