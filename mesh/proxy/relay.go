package proxy

import (
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/protocols/relay"
)

// relayBufSize is the copy buffer per direction. 64 KiB moves a full TSO
// segment's worth per read on kernel sockets.
const relayBufSize = 64 << 10

var relayBufs = sync.Pool{New: func() any { b := make([]byte, relayBufSize); return &b }}

// Aborter is a connection that can be closed abortively, so that its peer
// sees a reset (a TCP RST, an HTTP/2 RST_STREAM) rather than an orderly end.
// *stack.Conn and *hbone.Conn are Aborters.
type Aborter interface {
	Abort() error
}

// halfCloser is a connection that can end its write side alone.
type halfCloser interface {
	CloseWrite() error
}

// relayResult is what a relay moved, for access logs and metrics.
type relayResult struct {
	AToB, BToA int64 // bytes
	Reset      bool  // a reset ended the connection
}

// readNotifier is a connection that can call back once a Read would not
// block, instead of a goroutine waiting in Read: *stack.Conn and
// *hbone.Conn are readNotifiers.
type readNotifier interface {
	// WhenReadable returns true if a Read would not block now; otherwise
	// it returns false and calls f, once, as soon as one would not, from
	// the goroutine that made it readable (f must not block).
	WhenReadable(f func()) bool
}

// startRelay copies between a and b until both directions are done, then
// closes both and calls done with what moved; it returns at once. onAB and
// onBA, if not nil, are told of every chunk written (for live byte
// metrics). Each direction ends on its own: EOF from one side becomes a
// half-close (FIN) towards the other while the opposite direction goes on.
// A reset on either side becomes a reset on the other, never a FIN.
//
// A direction whose source is a readNotifier holds a goroutine only while
// the connection is busy: when its source runs dry it arms a callback and
// waits for it on its goroutine for relay.Grace, then lets the goroutine
// go (relay.Idle). So an idle connection through the netstack or an HBONE
// stream holds no goroutine and no buffer for that direction, while one
// that exchanges messages keeps a warm goroutine whose wake-up is a
// hand-off. Other sources (kernel sockets) keep a goroutine waiting in the
// poller, without a buffer (readPooled).
func startRelay(a, b net.Conn, onAB, onBA func(int), done func(relayResult)) {
	r := &relayRun{a: a, b: b, done: done}
	r.left.Store(2)
	ab := &relayHalf{r: r, src: a, dst: b, onWrite: onAB, moved: &r.res.AToB}
	ba := &relayHalf{r: r, src: b, dst: a, onWrite: onBA, moved: &r.res.BToA}
	for _, h := range []*relayHalf{ab, ba} {
		h.idle.Init(h.run)
		h.notify = h.idle.Notify
		h.out = countingWriter{w: h.dst, on: h.onWrite}
		go h.run()
	}
}

// relayRun is one relay's shared state.
type relayRun struct {
	a, b      net.Conn
	res       relayResult // each half writes its own count before it ends
	resetOnce sync.Once
	left      atomic.Int32 // directions still running
	done      func(relayResult)
}

// resetBoth closes both sides abortively, once.
func (r *relayRun) resetBoth() {
	r.resetOnce.Do(func() {
		r.res.Reset = true
		reset(r.a)
		reset(r.b)
	})
}

// halfDone ends one direction; after the second, both sides are closed
// and done is told.
func (r *relayRun) halfDone() {
	if r.left.Add(-1) == 0 {
		r.a.Close()
		r.b.Close()
		r.done(r.res)
	}
}

// relayHalf is one direction of a relay.
type relayHalf struct {
	r        *relayRun
	src, dst net.Conn
	onWrite  func(int)
	moved    *int64
	idle     relay.Idle     // waits for a readNotifier source
	notify   func()         // idle.Notify, as a value made once
	out      countingWriter // dst, counted, for an HBONE source
}

// await arms src's readiness callback and waits for it (relay.Idle). It
// reports whether the caller goes on, src readable; false means its
// goroutine must end, and run starts again on another once src is
// readable.
func (h *relayHalf) await(src readNotifier) bool {
	return src.WhenReadable(h.notify) || h.idle.Wait(relay.Grace)
}

// run copies until the direction ends or, for a readNotifier source,
// until the source has nothing more for now.
func (h *relayHalf) run() {
	switch src := h.src.(type) {
	case *hbone.Conn:
		h.runStream(src)
	case readNotifier:
		for {
			if !h.await(src) {
				return // run starts again once there is more
			}
			if h.step() {
				h.r.halfDone()
				return
			}
		}
	default:
		for !h.step() {
		}
		h.r.halfDone()
	}
}

// runStream copies an HBONE stream to dst: its DATA goes from the stream's
// receive buffer straight to dst, without a copy buffer of our own.
func (h *relayHalf) runStream(src *hbone.Conn) {
	for {
		n, eof, err := src.WriteBufferedTo(&h.out)
		*h.moved += n
		switch {
		case err != nil:
			h.r.resetBoth()
		case eof:
			h.halfClose()
		case !h.await(src):
			return // run starts again once there is more
		default:
			continue
		}
		h.r.halfDone()
		return
	}
}

// step reads once from src (see readPooled) and writes what it read to dst.
// It reports whether the direction ended: EOF, which half-closes dst, or
// any other error (a reset, or a write to a reset peer), which resets both
// sides.
func (h *relayHalf) step() (ended bool) {
	bp, n, rerr := readPooled(h.src)
	defer relayBufs.Put(bp)
	if n > 0 {
		w, werr := h.dst.Write((*bp)[:n])
		*h.moved += int64(w)
		if h.onWrite != nil && w > 0 {
			h.onWrite(w)
		}
		if werr != nil {
			h.r.resetBoth()
			return true
		}
	}
	switch {
	case rerr == nil:
		return false
	case errors.Is(rerr, io.EOF):
		h.halfClose()
	default:
		h.r.resetBoth()
	}
	return true
}

// halfClose ends dst's write side (a FIN), or closes dst if it cannot.
func (h *relayHalf) halfClose() {
	if hc, ok := h.dst.(halfCloser); ok && hc.CloseWrite() == nil {
		return
	}
	h.dst.Close()
}

// countingWriter tells on of every chunk it writes to w.
type countingWriter struct {
	w  io.Writer
	on func(int)
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	if c.on != nil && n > 0 {
		c.on(n)
	}
	return n, err
}

// readPooled reads once from src into a buffer from relayBufs and returns
// it (to be put back by the caller) with what Read returned. On a kernel
// socket the buffer is taken only once the read will not block, so a
// relay waiting for an idle peer holds none (readNotifier sources are
// read only once they are readable). Other connections are read with the
// buffer held for the wait.
func readPooled(src net.Conn) (bp *[]byte, n int, err error) {
	if c, ok := src.(*net.TCPConn); ok {
		if rc, rerr := c.SyscallConn(); rerr == nil {
			return readKernel(c, rc)
		}
	}
	bp = relayBufs.Get().(*[]byte)
	n, err = src.Read(*bp)
	return bp, n, err
}

// readKernel is readPooled on a kernel socket: the read happens inside
// the poller's callback, with a buffer taken for it alone.
func readKernel(src *net.TCPConn, rc syscall.RawConn) (bp *[]byte, n int, err error) {
	// The runtime's poller calls the function again each time the
	// socket turns readable; the buffer goes back to the pool
	// between calls.
	cerr := rc.Read(func(fd uintptr) bool {
		bp = relayBufs.Get().(*[]byte)
		for {
			n, err = unix.Read(int(fd), *bp)
			if err != unix.EINTR {
				break
			}
		}
		if err == unix.EAGAIN {
			relayBufs.Put(bp)
			bp = nil
			return false
		}
		return true
	})
	if bp == nil { // the wait ended without a read: closed, deadline
		bp = relayBufs.Get().(*[]byte)
		return bp, 0, cerr
	}
	switch {
	case err != nil:
		return bp, 0, &net.OpError{Op: "read", Net: "tcp", Source: src.LocalAddr(), Addr: src.RemoteAddr(), Err: os.NewSyscallError("read", err)}
	case n == 0:
		return bp, 0, io.EOF
	}
	return bp, n, nil
}

// reset closes c abortively.
func reset(c net.Conn) {
	switch c := c.(type) {
	case Aborter:
		c.Abort()
	case *net.TCPConn:
		c.SetLinger(0)
		c.Close()
	default:
		c.Close()
	}
}
