package hbone

import (
	"context"
	"io"
	"net"
	"net/netip"
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
