package hbone

import (
	"net"
	"sync"
	"sync/atomic"
)

// batchConn is the connection beneath TLS on an HBONE connection. crypto/tls
// writes each record (up to 16 KiB of plaintext) with a Write of its own; a
// write system call per record costs the TLS leg about twice the CPU per
// byte of a write per four records (BenchmarkLoopbackWrite). While the
// HTTP/2 layer writes (between begin, called on its first write to TLS, and
// end, at its flush point, both under wmu), batchConn gathers the records
// in one buffer and writes them with one system call at end, or earlier
// once the next record would not fit in batchSize. Outside of that window
// (the handshake, a close_notify, a KeyUpdate answered while nobody
// writes) a Write goes straight through. The buffer comes from a pool at
// the first record and goes back at end: an idle connection holds none.
//
// It also counts the writes that got bytes through to the peer (written),
// for h2conn's stall detection.
type batchConn struct {
	net.Conn
	written atomic.Uint64

	// mu serializes Writes (crypto/tls's own lock does too, but end runs
	// outside of it) and guards the fields below. Close does not take it,
	// so that it can break a Write blocked under it.
	mu       sync.Mutex
	batching bool
	buf      *[]byte // from batchBufs while records are held, else nil
}

// batchSize bounds the bytes a batchConn holds: one 64 KiB relay read
// framed as one HTTP/2 DATA frame (9-byte header) is five TLS records,
// four of 16 KiB and one of 9 bytes, 65,682 bytes on the wire with their
// headers and tags; this holds them all, so that such a write is one
// system call.
const batchSize = 66 << 10

var batchBufs = sync.Pool{New: func() any { b := make([]byte, 0, batchSize); return &b }}

// newBatchConn wraps c (the TCP connection TLS runs on).
func newBatchConn(c net.Conn) *batchConn { return &batchConn{Conn: c} }

// begin starts holding the records written until end.
func (c *batchConn) begin() {
	c.mu.Lock()
	c.batching = true
	c.mu.Unlock()
}

// end writes the records held since begin, in one Write, and stops
// holding; the buffer goes back to the pool. It returns the error of that
// write.
func (c *batchConn) end() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.batching = false
	err := c.flushLocked()
	if c.buf != nil {
		*c.buf = (*c.buf)[:0]
		batchBufs.Put(c.buf)
		c.buf = nil
	}
	return err
}

// Write holds b while batching (writing what is held first if b does not
// fit), else writes it at once.
func (c *batchConn) Write(b []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if !c.batching {
		return c.writeLocked(b)
	}
	if c.buf != nil && len(*c.buf)+len(b) > batchSize {
		if err := c.flushLocked(); err != nil {
			return 0, err
		}
	}
	if len(b) > batchSize {
		return c.writeLocked(b)
	}
	if c.buf == nil {
		c.buf = batchBufs.Get().(*[]byte)
	}
	*c.buf = append(*c.buf, b...)
	return len(b), nil
}

// flushLocked writes what is held. The buffer is kept (end returns it).
func (c *batchConn) flushLocked() error {
	if c.buf == nil || len(*c.buf) == 0 {
		return nil
	}
	_, err := c.writeLocked(*c.buf)
	*c.buf = (*c.buf)[:0]
	return err
}

func (c *batchConn) writeLocked(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if n > 0 {
		c.written.Add(1)
	}
	return n, err
}

// held reports the bytes held and whether a buffer is held (tests).
func (c *batchConn) held() (int, bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.buf == nil {
		return 0, false
	}
	return len(*c.buf), true
}

// batchWriter is what the HTTP/2 layer's bufio.Writer writes to: TLS, with
// the batch begun first.
type batchWriter struct {
	tls   net.Conn
	batch *batchConn
}

func (w batchWriter) Write(p []byte) (int, error) {
	w.batch.begin()
	return w.tls.Write(p)
}
