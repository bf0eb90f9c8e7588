package hbone

import (
	"io"
	"net"
	"net/netip"
	"testing"
	"time"
)

// discardUpstream is a TCP server on loopback that reads and discards.
func discardUpstream(t *testing.T) netip.AddrPort {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				io.Copy(io.Discard, c)
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// TestFullRecordsWrite: once TLS has left its small first records behind
// (crypto/tls's dynamic record sizing, the first 128 KB), a stream write of
// FullRecordsWrite bytes leaves the client as four TLS records, one write
// each below TLS, and a 64 KiB write as five.
func TestFullRecordsWrite(t *testing.T) {
	f := newFixture(t, dialHandler)
	conn, err := f.dial(ctxTimeout(t, 10*time.Second), discardUpstream(t))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	if _, err := conn.Write(make([]byte, 256<<10)); err != nil {
		t.Fatal(err)
	}
	written := conn.pc.h.written
	for _, c := range []struct{ size, records int }{{FullRecordsWrite, 4}, {64 << 10, 5}, {FullRecordsWrite, 4}} {
		before := written.Load()
		if _, err := conn.Write(make([]byte, c.size)); err != nil {
			t.Fatal(err)
		}
		if n := written.Load() - before; n != uint64(c.records) {
			t.Errorf("write of %d bytes: %d writes below TLS, want %d", c.size, n, c.records)
		}
	}
}

// TestWriteSizeHint: the hint is FullRecordsWrite with the knob on, none
// without.
func TestWriteSizeHint(t *testing.T) {
	defer func(v bool) { recordFit = v }(recordFit)
	var c Conn
	recordFit = false
	if n := c.WriteSizeHint(); n != 0 || upstreamReadSize(largeReadBuf) != largeReadBuf {
		t.Fatalf("off: hint %d, upstream read %d", n, upstreamReadSize(largeReadBuf))
	}
	recordFit = true
	if n := c.WriteSizeHint(); n != FullRecordsWrite || upstreamReadSize(largeReadBuf) != FullRecordsWrite || upstreamReadSize(smallReadBuf) != smallReadBuf {
		t.Fatalf("on: hint %d, upstream reads %d %d", n, upstreamReadSize(largeReadBuf), upstreamReadSize(smallReadBuf))
	}
}
