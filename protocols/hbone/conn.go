package hbone

import (
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/net/http2"
)

// ErrDeadline is returned by Conn's deadline setters: a stream cannot time
// out a single Read or Write without ending the stream; use Close or Abort
// from a timer instead.
var ErrDeadline = errors.New("hbone: deadlines are not supported on HBONE streams")

// Conn is one HBONE stream seen from the client: a net.Conn to the target
// whose bytes travel in the tunnel.
//
// Read returns io.EOF when the server ended the response (the upstream sent
// its FIN), and an error wrapping ErrReset when the server reset the stream
// or the connection was lost; any non-EOF error means the data did not
// arrive in full. Write fails with an error wrapping ErrReset once the
// server has reset the stream. WriteTo hands received data to a writer
// without a copy buffer of the caller's.
type Conn struct {
	s      *stream
	pc     *poolConn
	target netip.AddrPort

	readEOF atomic.Bool
	closed  atomic.Bool // Close or Abort called
}

// Read reads from the response body: the bytes the upstream sent.
func (c *Conn) Read(p []byte) (int, error) {
	n, err := c.s.read(p)
	if err != nil {
		if err == io.EOF {
			c.readEOF.Store(true)
			return n, io.EOF
		}
		return n, c.streamError("read", err)
	}
	return n, nil
}

// WriteTo writes the bytes the upstream sends to w as they arrive, straight
// from the stream's receive buffer, until the server ends the stream (it
// then returns nil, as io.Copy does at EOF) or a read or write fails. An
// idle WriteTo holds no buffer.
func (c *Conn) WriteTo(w io.Writer) (int64, error) {
	n, rerr, werr := c.s.writeTo(w)
	switch {
	case werr != nil:
		return n, werr
	case rerr != nil:
		return n, c.streamError("read", rerr)
	}
	c.readEOF.Store(true)
	return n, nil
}

// WhenReadable returns true if a Read (or WriteBufferedTo) would not wait
// now. Otherwise it returns false and calls f, once, as soon as one would
// not wait: data or the end of the stream arrived, the stream was reset or
// closed. f runs on the goroutine that made the stream readable, with the
// connection's lock held: it must not block or use the stream (it
// typically wakes or starts the goroutine that reads). With
// WriteBufferedTo it lets a relay hold neither a goroutine nor a buffer
// while the stream is idle.
func (c *Conn) WhenReadable(f func()) bool { return c.s.whenReadable(f) }

// WriteBufferedTo writes to w what the stream has received and not yet
// read, without waiting for more. eof reports that the server ended the
// stream and all of it was written (WriteTo's nil); err is a reset, a
// close or a failed write to w, as for WriteTo.
func (c *Conn) WriteBufferedTo(w io.Writer) (n int64, eof bool, err error) {
	n, done, rerr, werr := c.s.drainTo(w)
	switch {
	case werr != nil:
		return n, false, werr
	case rerr != nil:
		return n, false, c.streamError("read", rerr)
	case done:
		c.readEOF.Store(true)
		return n, true, nil
	}
	return n, false, nil
}

// Write writes to the request body: bytes for the upstream. It returns once
// the bytes are on the connection (or the stream failed).
func (c *Conn) Write(p []byte) (int, error) {
	n, err := c.s.write(p)
	if err != nil {
		return n, c.streamError("write", err)
	}
	return n, nil
}

func (c *Conn) opError(op string, err error) error {
	return fmt.Errorf("hbone: %s %s: %w", op, c.target, err)
}

func (c *Conn) streamError(op string, err error) error {
	if c.closed.Load() || errors.Is(err, net.ErrClosed) {
		return c.opError(op, net.ErrClosed)
	}
	return c.opError(op, err)
}

// CloseWrite ends the request body (END_STREAM): the server half-closes
// the upstream. Reading goes on.
func (c *Conn) CloseWrite() error {
	if err := c.s.closeWrite(); err != nil {
		return c.streamError("close write", err)
	}
	return nil
}

// Close ends the stream. If the response was read to its end, the stream
// ends cleanly (END_STREAM is sent if CloseWrite was not called). Otherwise
// the stream is cancelled with RST_STREAM(CANCEL), as a TCP close with
// unread data sends a reset. Pending Reads and Writes return net.ErrClosed.
func (c *Conn) Close() error {
	if !c.closed.CompareAndSwap(false, true) {
		return nil
	}
	s := c.s
	h := s.c
	h.mu.Lock()
	if c.readEOF.Load() || (s.recvEnded && s.buf.size == 0 && !s.readClosed) {
		if !s.sentEnded && !s.rst {
			s.endLocked()
		}
	} else {
		s.resetLocked(http2.ErrCodeCancel, net.ErrClosed)
	}
	s.closeReadLocked()
	h.unlock()
	h.kick()
	return nil
}

// Abort resets the stream (RST_STREAM CANCEL) in whatever state it is: the
// server aborts the upstream connection. It implements Aborter.
func (c *Conn) Abort() error {
	c.closed.Store(true)
	c.s.reset(http2.ErrCodeCancel, net.ErrClosed)
	return nil
}

// LocalAddr returns the local address of the TLS connection carrying the
// stream.
func (c *Conn) LocalAddr() net.Addr { return c.pc.tls.LocalAddr() }

// RemoteAddr returns the target, the :authority of the stream.
func (c *Conn) RemoteAddr() net.Addr { return net.TCPAddrFromAddrPort(c.target) }

// Endpoint returns the HBONE endpoint the stream goes through.
func (c *Conn) Endpoint() netip.AddrPort { return c.pc.key.endpoint }

// PeerID returns the server's verified SPIFFE ID.
func (c *Conn) PeerID() spiffeid.ID { return c.pc.peer }

// SetDeadline returns ErrDeadline.
func (c *Conn) SetDeadline(time.Time) error { return ErrDeadline }

// SetReadDeadline returns ErrDeadline.
func (c *Conn) SetReadDeadline(time.Time) error { return ErrDeadline }

// SetWriteDeadline returns ErrDeadline.
func (c *Conn) SetWriteDeadline(time.Time) error { return ErrDeadline }

var (
	_ net.Conn    = (*Conn)(nil)
	_ Aborter     = (*Conn)(nil)
	_ io.WriterTo = (*Conn)(nil)
)
