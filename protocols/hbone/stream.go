package hbone

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"

	"golang.org/x/net/http2"
)

// stream is one HTTP/2 stream, the state both ends share. Everything but
// id and c is guarded by c.mu.
type stream struct {
	c  *h2conn
	id uint32

	rcond sync.Cond // on c.mu: data, END_STREAM or reset arrived, or closed

	sendWindow  int64
	recvWindow  int64
	recvUnacked int64
	buf         recvBuf

	sentEnded  bool  // END_STREAM sent (queued)
	recvEnded  bool  // END_STREAM received
	rst        bool  // reset, either way, or the connection failed
	rstErr     error // why, for Read and Write
	rstCode    http2.ErrCode
	readClosed bool // Close or Abort: buffered and further data is dropped
	reading    bool // a WriteTo writes from buf outside the lock
	removed    bool // left c.streams
	// onReadable, if set, is called (with c.mu held) the next time a read
	// would not wait (see whenReadable).
	onReadable func()

	// Client: the response.
	ready       chan struct{} // closed when the response or a reset arrived
	gotResponse bool
	status      int

	// Server.
	connecting bool // Handler.Connect runs
	// peerCounted: the server counts the stream in its peer's load.
	peerCounted bool
	cancel      context.CancelFunc
	// abortUp aborts the relay's upstream; set (under c.mu) once the
	// relay exists, called by onStreamDone for a reset stream.
	abortUp func()
}

func (c *h2conn) newStreamLocked(id uint32) *stream {
	s := &stream{c: c, id: id, sendWindow: c.peerInitWindow, recvWindow: StreamWindow}
	s.rcond.L = &c.mu
	c.streams[id] = s
	return s
}

// finishLocked takes s out of the stream table once both halves ended or
// it was reset.
func (s *stream) finishLocked() {
	if s.removed || !(s.rst || (s.sentEnded && s.recvEnded)) {
		return
	}
	s.removed = true
	delete(s.c.streams, s.id)
	s.c.done = append(s.c.done, s)
	if s.ready != nil && !s.gotResponse {
		s.gotResponse = true
		close(s.ready)
	}
}

// wakeLocked wakes everything waiting on s.
func (s *stream) wakeLocked() {
	s.rcond.Broadcast()
	s.notifyReadLocked()
	s.c.sendCond.Broadcast()
}

// notifyReadLocked calls the onReadable callback, if one is armed: data,
// END_STREAM, a reset or a close has just made a read not wait.
func (s *stream) notifyReadLocked() {
	if f := s.onReadable; f != nil {
		s.onReadable = nil
		f()
	}
}

// whenReadable returns true if a read would not wait now; otherwise it
// arms f, to be called once a read would not wait, and returns false. f
// runs with the connection's lock held, on the goroutine that made the
// stream readable (often the connection's reader): it must not block or
// use the stream. At most one callback is armed at a time.
func (s *stream) whenReadable(f func()) bool {
	c := s.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if s.readableLocked() {
		return true
	}
	s.onReadable = f
	return false
}

// readableLocked reports whether a read would return without waiting.
func (s *stream) readableLocked() bool {
	return (s.buf.size > 0 && !s.readClosed) || s.readErrLocked() != nil
}

// resetLocked resets s from our side: RST_STREAM(code) unless the stream
// had ended both ways. err is what Read and Write return from now on.
func (s *stream) resetLocked(code http2.ErrCode, err error) {
	if s.rst {
		return
	}
	if !(s.sentEnded && s.recvEnded) && !s.c.closed {
		id := s.id
		s.c.queue(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, code) })
	}
	s.rst, s.rstErr, s.rstCode = true, err, code
	s.wakeLocked()
	s.finishLocked()
}

// peerResetLocked applies RST_STREAM from the peer. After a complete
// response (END_STREAM received), RST_STREAM(NO_ERROR) only stops our
// sending: the received data stays readable up to EOF.
func (s *stream) peerResetLocked(code http2.ErrCode) {
	if s.rst {
		return
	}
	s.rst, s.rstCode = true, code
	if code == http2.ErrCodeNo {
		s.rstErr = fmt.Errorf("peer ended the stream: %w", ErrReset)
	} else {
		s.rstErr = fmt.Errorf("%w by peer (%v)", ErrReset, code)
	}
	if code == http2.ErrCodeRefusedStream {
		s.rstErr = fmt.Errorf("%w: REFUSED_STREAM", errUnprocessed)
	}
	s.wakeLocked()
	s.finishLocked()
}

// failLocked ends s without sending anything: the connection failed or
// the peer will not process it.
func (s *stream) failLocked(err error) {
	if s.rst {
		return
	}
	s.rst, s.rstErr, s.rstCode = true, err, http2.ErrCodeCancel
	s.wakeLocked()
	s.finishLocked()
}

// readErrLocked is what a read returns once the buffer is empty; nil while
// more may come.
func (s *stream) readErrLocked() error {
	switch {
	case s.readClosed:
		return net.ErrClosed
	case s.recvEnded:
		return io.EOF
	case s.rst:
		return s.rstErr
	}
	return nil
}

// returnLocked gives n consumed bytes back to the stream's window.
func (s *stream) returnLocked(n int64) {
	if s.recvEnded || s.rst {
		return
	}
	s.recvUnacked += n
	if s.recvUnacked >= streamUpdateThreshold {
		inc := s.recvUnacked
		s.recvUnacked = 0
		s.recvWindow += inc
		id := s.id
		s.c.queue(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(id, uint32(inc)) })
	}
}

// consumedLocked accounts n bytes the application took.
func (s *stream) consumedLocked(n int) {
	s.returnLocked(int64(n))
	s.c.returnConnLocked(int64(n))
}

// read reads buffered data, waiting for some.
func (s *stream) read(p []byte) (int, error) {
	if len(p) == 0 {
		return 0, nil
	}
	c := s.c
	c.mu.Lock()
	for s.buf.size == 0 || s.readClosed {
		if err := s.readErrLocked(); err != nil {
			c.mu.Unlock()
			return 0, err
		}
		s.rcond.Wait()
	}
	n := s.buf.read(p)
	s.consumedLocked(n)
	c.mu.Unlock()
	c.kick()
	return n, nil
}

// writeTo writes the stream's data to w as it arrives, straight from the
// receive buffer, until END_STREAM (rerr nil), a reset or close (rerr), or
// a failed write to w (werr).
func (s *stream) writeTo(w io.Writer) (n int64, rerr, werr error) {
	n, _, rerr, werr = s.copyOut(w, true)
	return n, rerr, werr
}

// drainTo writes what the receive buffer holds to w without waiting for
// more. done reports the end of reading: END_STREAM with everything
// written (rerr nil), a reset or close (rerr), or a failed write (werr).
func (s *stream) drainTo(w io.Writer) (n int64, done bool, rerr, werr error) {
	return s.copyOut(w, false)
}

// copyOut is writeTo (wait) and drainTo (!wait).
func (s *stream) copyOut(w io.Writer, wait bool) (n int64, done bool, rerr, werr error) {
	c := s.c
	var vec [16][]byte
	for {
		c.mu.Lock()
		for s.buf.size == 0 || s.readClosed {
			if err := s.readErrLocked(); err != nil {
				c.mu.Unlock()
				if err == io.EOF {
					err = nil
				}
				return n, true, err, nil
			}
			if !wait {
				c.mu.Unlock()
				return n, false, nil, nil
			}
			s.rcond.Wait()
		}
		bufs := s.buf.peek(vec[:0])
		s.reading = true
		c.mu.Unlock()

		var m int64
		var err error
		if len(bufs) == 1 {
			var k int
			k, err = w.Write(bufs[0])
			m = int64(k)
		} else {
			nb := net.Buffers(bufs)
			m, err = nb.WriteTo(w)
		}
		clear(vec[:])

		c.mu.Lock()
		s.reading = false
		if s.readClosed {
			c.returnConnLocked(int64(s.buf.size))
			s.buf.free()
		} else {
			s.buf.consume(int(m))
			s.consumedLocked(int(m))
		}
		c.mu.Unlock()
		c.kick()
		n += m
		if err != nil {
			return n, true, nil, err
		}
	}
}

// errWriteClosed is the error of a write after CloseWrite.
var errWriteClosed = errors.New("write after CloseWrite")

// write sends p as DATA within the flow-control windows, waiting for window
// when there is none, and flushes before it returns.
func (s *stream) write(p []byte) (int, error) {
	c := s.c
	total := 0
	for first := true; first || len(p) > 0; first = false {
		c.mu.Lock()
		var avail int64
		for {
			if err := s.writeErrLocked(); err != nil {
				c.mu.Unlock()
				return total, err
			}
			if len(p) == 0 {
				break
			}
			avail = min(s.sendWindow, c.sendWindow)
			if avail > 0 {
				break
			}
			c.sendCond.Wait()
		}
		n := int(min(int64(len(p)), avail))
		s.sendWindow -= int64(n)
		c.sendWindow -= int64(n)
		maxFrame := c.peerMaxFrame
		c.mu.Unlock()
		if n == 0 {
			return total, nil
		}
		c.wmu.Lock()
		c.drainLocked()
		err := c.writeDataLocked(s.id, p[:n], false, maxFrame)
		if err == nil {
			err = c.flushAndUnlock()
		} else {
			c.flushAndUnlock()
		}
		if err != nil {
			return total, fmt.Errorf("connection lost: %w: %w", err, ErrReset)
		}
		total += n
		p = p[n:]
	}
	return total, nil
}

func (s *stream) writeErrLocked() error {
	switch {
	case s.rst:
		return s.rstErr
	case s.sentEnded:
		return errWriteClosed
	case s.readClosed:
		return net.ErrClosed
	}
	return nil
}

// closeWrite sends END_STREAM.
func (s *stream) closeWrite() error {
	c := s.c
	c.mu.Lock()
	if s.sentEnded {
		c.mu.Unlock()
		return nil
	}
	if s.rst {
		err := s.rstErr
		c.mu.Unlock()
		return err
	}
	s.endLocked()
	c.unlock()
	c.kick()
	return nil
}

// endLocked queues END_STREAM.
func (s *stream) endLocked() {
	s.sentEnded = true
	id := s.id
	s.c.queue(func(fr *http2.Framer) error { return fr.WriteData(id, true, nil) })
	s.c.sendCond.Broadcast()
	s.finishLocked()
}

// closeRead drops buffered and further data.
func (s *stream) closeReadLocked() {
	if s.readClosed {
		return
	}
	s.readClosed = true
	if !s.reading {
		s.c.returnConnLocked(int64(s.buf.size))
		s.buf.free()
	}
	s.wakeLocked()
}

// reset resets s (RST_STREAM code) and drops its data.
func (s *stream) reset(code http2.ErrCode, err error) {
	c := s.c
	c.mu.Lock()
	s.resetLocked(code, err)
	s.closeReadLocked()
	c.unlock()
	c.kick()
}

// chunkSize is the unit of receive buffers. Chunks come from a pool and go
// back once read, so an idle stream holds none.
const chunkSize = 64 << 10

type chunk struct {
	b    [chunkSize]byte
	r, w int
}

var chunkPool = sync.Pool{New: func() any { return new(chunk) }}

// recvBuf is a FIFO of received bytes in pooled chunks.
type recvBuf struct {
	chunks []*chunk
	size   int
}

func (b *recvBuf) write(p []byte) {
	b.size += len(p)
	for len(p) > 0 {
		var t *chunk
		if k := len(b.chunks); k > 0 && b.chunks[k-1].w < chunkSize {
			t = b.chunks[k-1]
		} else {
			t = chunkPool.Get().(*chunk)
			t.r, t.w = 0, 0
			b.chunks = append(b.chunks, t)
		}
		n := copy(t.b[t.w:], p)
		t.w += n
		p = p[n:]
	}
}

func (b *recvBuf) read(p []byte) int {
	n := 0
	for n < len(p) && len(b.chunks) > 0 {
		h := b.chunks[0]
		k := copy(p[n:], h.b[h.r:h.w])
		n += k
		b.advance(k)
	}
	return n
}

// peek appends the buffered data's slices to dst without consuming it.
func (b *recvBuf) peek(dst [][]byte) [][]byte {
	for _, h := range b.chunks {
		if len(dst) == cap(dst) {
			break
		}
		dst = append(dst, h.b[h.r:h.w])
	}
	return dst
}

// consume drops n bytes from the front.
func (b *recvBuf) consume(n int) {
	for n > 0 {
		k := min(n, b.chunks[0].w-b.chunks[0].r)
		b.advance(k)
		n -= k
	}
}

// advance drops k bytes of the head chunk, at most what it holds.
func (b *recvBuf) advance(k int) {
	h := b.chunks[0]
	h.r += k
	b.size -= k
	if h.r == h.w {
		chunkPool.Put(h)
		b.chunks[0] = nil
		b.chunks = b.chunks[1:]
		if len(b.chunks) == 0 {
			b.chunks = nil
		}
	}
}

func (b *recvBuf) free() {
	for _, h := range b.chunks {
		chunkPool.Put(h)
	}
	b.chunks = nil
	b.size = 0
}
