package hbone

import (
	"bytes"
	"errors"
	"io"
	"net"
	"testing"
)

// recConn records the Writes that reach it; err, if set, fails them.
type recConn struct {
	net.Conn
	writes [][]byte
	err    error
}

func (c *recConn) Write(b []byte) (int, error) {
	if c.err != nil {
		return 0, c.err
	}
	c.writes = append(c.writes, bytes.Clone(b))
	return len(b), nil
}

func record(n int, fill byte) []byte { return bytes.Repeat([]byte{fill}, n) }

const tlsRecord = 16384 + 22 // a full TLS 1.3 record on the wire

func TestBatchConnFlushPoint(t *testing.T) {
	rc := &recConn{}
	c := newBatchConn(rc)

	// Outside a batch (the handshake, an alert): straight through, and
	// no buffer taken.
	if _, err := c.Write(record(100, 'h')); err != nil {
		t.Fatal(err)
	}
	if len(rc.writes) != 1 {
		t.Fatalf("write outside a batch: %d writes below, want 1", len(rc.writes))
	}
	if _, held := c.held(); held {
		t.Fatal("a buffer is held outside a batch")
	}

	// A batch: five records (a 64 KiB relay read as one DATA frame) are
	// held and go out in one write at end, in order.
	c.begin()
	var want []byte
	for i, n := range []int{tlsRecord, tlsRecord, tlsRecord, tlsRecord, 9 + 22} {
		r := record(n, byte('a'+i))
		want = append(want, r...)
		if k, err := c.Write(r); err != nil || k != n {
			t.Fatalf("Write: %d, %v", k, err)
		}
	}
	if len(rc.writes) != 1 {
		t.Fatalf("%d writes below before the flush point, want none", len(rc.writes)-1)
	}
	if n, _ := c.held(); n != len(want) {
		t.Fatalf("held %d bytes, want %d", n, len(want))
	}
	if err := c.end(); err != nil {
		t.Fatal(err)
	}
	if len(rc.writes) != 2 || !bytes.Equal(rc.writes[1], want) {
		t.Fatalf("after end: %d writes below, want one more with the five records in order", len(rc.writes)-1)
	}
	if _, held := c.held(); held {
		t.Fatal("a buffer is held after end: an idle connection must hold none")
	}
	if got := c.written.Load(); got != 2 {
		t.Fatalf("written = %d, want 2", got)
	}

	// A small write (a request) goes out at the flush point too.
	c.begin()
	c.Write(record(60, 's'))
	if err := c.end(); err != nil {
		t.Fatal(err)
	}
	if len(rc.writes) != 3 || len(rc.writes[2]) != 60 {
		t.Fatalf("small write: %d writes below, want 3 with the last of 60 bytes", len(rc.writes))
	}
	// end without anything held writes nothing.
	c.begin()
	if err := c.end(); err != nil || len(rc.writes) != 3 {
		t.Fatalf("empty batch: %v, %d writes", err, len(rc.writes))
	}
}

func TestBatchConnBound(t *testing.T) {
	rc := &recConn{}
	c := newBatchConn(rc)
	c.begin()
	var want []byte
	for i := range 20 {
		r := record(tlsRecord, byte(i))
		want = append(want, r...)
		if _, err := c.Write(r); err != nil {
			t.Fatal(err)
		}
		if n, _ := c.held(); n > batchSize {
			t.Fatalf("holds %d bytes, over the bound %d", n, batchSize)
		}
	}
	// A write larger than the bound is not copied.
	big := record(batchSize+1, 'B')
	want = append(want, big...)
	if _, err := c.Write(big); err != nil {
		t.Fatal(err)
	}
	if n, _ := c.held(); n != 0 {
		t.Fatalf("holds %d bytes after a write over the bound", n)
	}
	if err := c.end(); err != nil {
		t.Fatal(err)
	}
	var got []byte
	for _, w := range rc.writes {
		if len(w) > batchSize && len(w) != len(big) {
			t.Fatalf("a write of %d bytes below, over the bound %d", len(w), batchSize)
		}
		got = append(got, w...)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("bytes below differ from the records written")
	}
	// 20 records of 16,406 bytes, four to a write, then the big one.
	if len(rc.writes) != 6 {
		t.Fatalf("%d writes below, want 6", len(rc.writes))
	}
}

func TestBatchConnErrors(t *testing.T) {
	boom := errors.New("boom")
	rc := &recConn{}
	c := newBatchConn(rc)

	// The flush point's write fails: end returns the error and releases
	// the buffer.
	c.begin()
	c.Write(record(100, 'x'))
	rc.err = boom
	if err := c.end(); !errors.Is(err, boom) {
		t.Fatalf("end: %v, want %v", err, boom)
	}
	if _, held := c.held(); held {
		t.Fatal("a buffer is held after a failed end")
	}

	// A write that does not fit makes the held records go out; its
	// failure is Write's error.
	rc.err = nil
	c.begin()
	for range 4 {
		if _, err := c.Write(record(tlsRecord, 'y')); err != nil {
			t.Fatal(err)
		}
	}
	rc.err = boom
	if _, err := c.Write(record(tlsRecord, 'z')); !errors.Is(err, boom) {
		t.Fatalf("Write over the bound: %v, want %v", err, boom)
	}
	c.end()

	// Straight through: the error as is.
	if _, err := c.Write(record(10, 'w')); !errors.Is(err, boom) {
		t.Fatalf("Write outside a batch: %v, want %v", err, boom)
	}
}

// TestBatchedStreamWrite: a 64 KiB stream write crosses the TLS leg as one
// system call (it was five, one per TLS record), arrives whole, and the
// connection holds no batch buffer afterwards.
func TestBatchedStreamWrite(t *testing.T) {
	f := newFixture(t, dialHandler)
	conn, up := f.stream(t)
	h := conn.pc.h
	if h.batch == nil {
		t.Fatal("the client's connection has no batchConn beneath TLS")
	}
	msg := make([]byte, 64<<10)
	for i := range msg {
		msg[i] = byte(i * 7)
	}
	for round := range 4 { // past crypto/tls's small first records
		before := h.written.Load()
		if _, err := conn.Write(msg); err != nil {
			t.Fatal(err)
		}
		writes := h.written.Load() - before
		got := make([]byte, len(msg))
		if _, err := io.ReadFull(up, got); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(got, msg) {
			t.Fatal("upstream received other bytes")
		}
		if _, held := h.batch.held(); held {
			t.Fatal("the connection holds a batch buffer while idle")
		}
		if round >= 2 && writes != 1 {
			t.Fatalf("round %d: a 64 KiB write took %d writes below TLS, want 1", round, writes)
		}
	}
}
