package hbone

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"golang.org/x/net/http2"
)

var (
	errStreamEnded = errors.New("hbone: stream ended")
	errAborted     = errors.New("hbone: stream aborted")
	// ErrDeadline is returned by Conn's deadline setters: a stream cannot
	// time out a single Read or Write without ending the stream; use
	// Close or Abort from a timer instead.
	ErrDeadline = errors.New("hbone: deadlines are not supported on HBONE streams")
)

// Conn is one HBONE stream seen from the client: a net.Conn to the target
// whose bytes travel in the tunnel.
//
// Read returns io.EOF when the server ended the response (the upstream sent
// its FIN), and an error wrapping ErrReset when the server reset the stream;
// any non-EOF error means the data did not arrive in full. Write fails with
// an error wrapping ErrReset once the server has ended or reset the stream.
type Conn struct {
	client *Client
	pc     *poolConn
	target netip.AddrPort
	body   io.ReadCloser // response body; set once the server answered 200
	pw     *io.PipeWriter
	cancel context.CancelFunc

	releaseOnce sync.Once
	abortOnce   sync.Once
	readEOF     atomic.Bool
	writeClosed atomic.Bool
	closed      atomic.Bool // Close or Abort called
}

// requestBody is the request body handed to x/net/http2. The transport
// closes it when the stream is over, which is when the stream's pool slot
// is given back.
type requestBody struct {
	pr   *io.PipeReader
	conn *Conn
	once sync.Once
}

func (b *requestBody) Read(p []byte) (int, error) { return b.pr.Read(p) }

func (b *requestBody) Close() error {
	b.once.Do(func() {
		b.pr.CloseWithError(errStreamEnded)
		// Not finish: cancelling the request context now could drop
		// response data the transport has not buffered yet (it closes
		// the body early, for instance, when the status is not 2xx).
		b.conn.release()
	})
	return nil
}

// release gives the stream's slot back to the pool.
func (c *Conn) release() {
	c.releaseOnce.Do(func() { c.client.release(c.pc) })
}

// finish cancels the stream's context, which resets the stream unless it
// has ended, and releases its pool slot.
func (c *Conn) finish() {
	c.cancel()
	c.release()
}

// Read reads from the response body: the bytes the upstream sent.
func (c *Conn) Read(p []byte) (int, error) {
	if c.closed.Load() {
		return 0, c.opError("read", net.ErrClosed)
	}
	n, err := c.body.Read(p)
	switch {
	case err == nil:
		return n, nil
	case err == io.EOF:
		c.readEOF.Store(true)
		return n, io.EOF
	}
	return n, c.streamError("read", err)
}

// Write writes to the request body: bytes for the upstream. It returns once
// the transport has taken them.
func (c *Conn) Write(p []byte) (int, error) {
	if c.closed.Load() {
		return 0, c.opError("write", net.ErrClosed)
	}
	if c.writeClosed.Load() {
		return 0, c.opError("write", errors.New("write after CloseWrite"))
	}
	n, err := c.pw.Write(p)
	if err != nil {
		return n, c.streamError("write", err)
	}
	return n, nil
}

func (c *Conn) opError(op string, err error) error {
	return fmt.Errorf("hbone: %s %s: %w", op, c.target, err)
}

func (c *Conn) streamError(op string, err error) error {
	var se http2.StreamError
	switch {
	case c.closed.Load():
		return c.opError(op, net.ErrClosed)
	case errors.As(err, &se):
		return fmt.Errorf("hbone: %s %s: %w by peer (%v)", op, c.target, ErrReset, se.Code)
	case errors.Is(err, errStreamEnded) || errors.Is(err, io.ErrClosedPipe):
		return fmt.Errorf("hbone: %s %s: peer ended the stream: %w", op, c.target, ErrReset)
	}
	return c.opError(op, err)
}

// CloseWrite ends the request body (END_STREAM): the server half-closes
// the upstream. Reading goes on.
func (c *Conn) CloseWrite() error {
	c.writeClosed.Store(true)
	return c.pw.Close()
}

// Close ends the stream. If the response was read to its end, the stream
// ends cleanly (END_STREAM is sent if CloseWrite was not called). Otherwise
// the stream is cancelled with RST_STREAM(CANCEL), as a TCP close with
// unread data sends a reset. Pending Reads and Writes return net.ErrClosed.
func (c *Conn) Close() error {
	if !c.closed.CompareAndSwap(false, true) {
		return nil
	}
	c.writeClosed.Store(true)
	c.pw.Close()
	if c.readEOF.Load() {
		// The transport sends END_STREAM after the last data, forgets
		// the stream and then closes the request body, which releases
		// the pool slot. The context is not cancelled: that could reset
		// the stream before END_STREAM is out. It has no parent to
		// unregister from, so nothing leaks.
		return nil
	}
	c.cancel()
	c.body.Close()
	c.finish()
	return nil
}

// Abort resets the stream (RST_STREAM CANCEL) in whatever state it is: the
// server aborts the upstream connection. It implements Aborter.
func (c *Conn) Abort() error {
	c.abortOnce.Do(func() {
		c.closed.Store(true)
		c.writeClosed.Store(true)
		c.pw.CloseWithError(errAborted)
		c.cancel()
		c.body.Close()
		c.finish()
	})
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

var _ net.Conn = (*Conn)(nil)
var _ Aborter = (*Conn)(nil)
