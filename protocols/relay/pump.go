package relay

import (
	"errors"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"syscall"

	"golang.org/x/sys/unix"
)

// Conn is what a Pump relays: a net.Conn, or any connection with these
// methods. What else it implements decides how the pump uses it:
//
//   - CloseWrite() error: the end of the other side's data becomes a
//     half-close (a FIN, END_STREAM) of this one; see Pump.
//   - Abort() error (Aborter): a reset closes it abortively; a
//     *net.TCPConn (SetLinger) is closed with SO_LINGER 0.
//   - WhenReadable (ReadNotifier): the direction reading it holds no
//     goroutine while it idles.
//   - WriteBufferedTo (BufferedSource): its received data goes straight
//     to the other side, without a buffer of the pump's.
//   - Metered: the pump tells it what moved.
type Conn interface {
	Read(p []byte) (int, error)
	Write(p []byte) (int, error)
	Close() error
}

// Aborter is a connection that can be closed abortively, so that its peer
// sees a reset (a TCP RST, an HTTP/2 RST_STREAM) rather than an orderly
// end. *stack.Conn and *hbone.Conn are Aborters.
type Aborter interface {
	Abort() error
}

// ReadNotifier is a connection that can call back once a Read would not
// block, instead of a goroutine waiting in Read (*stack.Conn, *hbone.Conn).
type ReadNotifier interface {
	// WhenReadable returns true if a Read would not block now; otherwise
	// it returns false and calls f, once, as soon as one would not, from
	// the goroutine that made it readable (f must not block).
	WhenReadable(f func()) bool
}

// BufferedSource is a ReadNotifier that hands what it has received to a
// writer from its own receive buffer (an HBONE stream).
type BufferedSource interface {
	ReadNotifier
	// WriteBufferedTo writes to w what has been received and not yet
	// read, without waiting for more. eof reports the end of the data,
	// all of it written; err is a reset, a close or a failed write to w.
	WriteBufferedTo(w io.Writer) (n int64, eof bool, err error)
}

// Result is what a pump moved.
type Result struct {
	AToB, BToA int64 // bytes written to b and to a
	Reset      bool  // a reset ended the relay
	// Err is the error that reset the relay (a read or write error of
	// either side), nil if it ended in order or was reset by Pump.Reset.
	Err error
}

// Meter is how a pump reports what it moves: the one count of relayed
// bytes, used for access logs and metrics alike. Every field may be nil.
type Meter struct {
	// AToB and BToA are told of bytes as they are written (live metrics).
	AToB, BToA func(n int)
	// Done is told the result once both sides are closed.
	Done func(Result)
}

// Metered is a connection that brings the meter of the relay it is handed
// to: a hbone.Handler's upstream connection reports its bytes this way
// (the Server relays it as its b side, the stream as a).
type Metered interface {
	RelayMeter() Meter
}

// Pump copies between two connections until both directions are done.
// Each direction ends on its own: the end of one side's data (EOF) becomes
// a half-close of the other (CloseWrite, or Close if that fails) while the
// opposite direction goes on; a connection without CloseWrite stays open
// until both directions ended. A read or write error on either side (a
// reset, a closed connection) resets both, never a half-close. Once both
// directions are done, both sides are closed and Meter.Done is told.
//
// A direction whose source is a ReadNotifier holds a goroutine only while
// the connection is busy: when its source runs dry it arms a callback and
// waits for it for Grace, then lets the goroutine go (Idle). So an idle
// connection through the netstack or an HBONE stream holds no goroutine
// and no buffer for that direction, while one that exchanges messages
// keeps a warm goroutine whose wake-up is a hand-off. Other sources keep
// a goroutine waiting in Read; a kernel socket's waits in the poller
// without a buffer. Read buffers come from pools, small while a direction
// carries small messages and large once reads fill the small one, and go
// back after each read; a BufferedSource needs none.
type Pump struct {
	a, b   Conn
	meter  Meter
	ab, ba half
	reset  atomic.Bool  // the pump was reset
	err    error        // the error that reset it; read after left reaches 0
	left   atomic.Int32 // directions still running
}

// New returns the pump between a and b; Start starts it.
func New(a, b Conn, m Meter) *Pump {
	p := &Pump{a: a, b: b, meter: m}
	p.ab = half{p: p, src: a, dst: b, on: m.AToB}
	p.ba = half{p: p, src: b, dst: a, on: m.BToA}
	for _, h := range []*half{&p.ab, &p.ba} {
		if c, ok := h.src.(*net.TCPConn); ok {
			if rc, err := c.SyscallConn(); err == nil {
				k := &kernelSource{tcp: c, rc: rc}
				k.fill = func(fd uintptr) bool { return h.fillKernel(k, fd) }
				h.kernel = k
			}
		}
	}
	return p
}

// Start starts the pump's two directions and returns at once.
func (p *Pump) Start() {
	p.left.Store(2)
	for _, h := range []*half{&p.ab, &p.ba} {
		h.idle.Init(h.run)
		h.notify = h.idle.Notify
		go h.run()
	}
}

// Start is New and Pump.Start.
func Start(a, b Conn, m Meter) *Pump {
	p := New(a, b, m)
	p.Start()
	return p
}

// Reset closes both sides abortively, once: the relay ends as reset.
func (p *Pump) Reset() { p.resetBoth(nil) }

// resetBoth is Reset for the error err of a direction. It never waits:
// aborting one side may call Reset again (an HBONE stream's reset reaches
// its server's stream-done hook).
func (p *Pump) resetBoth(err error) {
	if !p.reset.CompareAndSwap(false, true) {
		return
	}
	if err != nil {
		// Only a direction passes an error, before its halfDone.
		p.err = err
	}
	Abort(p.a)
	Abort(p.b)
}

// halfDone ends one direction; after the second, both sides are closed
// and the meter is told.
func (p *Pump) halfDone() {
	if p.left.Add(-1) != 0 {
		return
	}
	p.a.Close()
	p.b.Close()
	if p.meter.Done != nil {
		r := Result{AToB: p.ab.moved, BToA: p.ba.moved, Reset: p.reset.Load()}
		if r.Reset {
			r.Err = p.err
		}
		p.meter.Done(r)
	}
}

// Abort closes c so that its peer sees a reset: Abort if c is an Aborter,
// SO_LINGER 0 and Close for a *net.TCPConn, else Close.
func Abort(c io.Closer) {
	switch c := c.(type) {
	case Aborter:
		c.Abort()
		return
	case interface{ SetLinger(int) error }:
		c.SetLinger(0)
	}
	c.Close()
}

// Abandon aborts c, a connection that was to be relayed and will not be,
// and tells its meter (Metered) of a relay that ended reset at once.
func Abandon(c Conn) {
	Abort(c)
	if m, ok := c.(Metered); ok {
		if done := m.RelayMeter().Done; done != nil {
			done(Result{Reset: true})
		}
	}
}

// half is one direction of a pump.
type half struct {
	p        *Pump
	src, dst Conn
	on       func(int)
	moved    int64 // written by the direction's goroutine only
	large    bool  // the last read filled a small buffer
	idle     Idle  // waits for a ReadNotifier source
	notify   func()
	kernel   *kernelSource // src, if it is a kernel socket
}

// kernelSource is a kernel socket source: its raw connection, and
// fillKernel as a value made once, with what it read.
type kernelSource struct {
	tcp  *net.TCPConn
	rc   syscall.RawConn
	fill func(fd uintptr) bool
	b    readBuf
	err  error
}

// count accounts n bytes written to dst.
func (h *half) count(n int64) {
	h.moved += n
	if h.on != nil && n > 0 {
		h.on(int(n))
	}
}

// await arms src's readiness callback and waits for it (Idle). It reports
// whether the caller goes on, src readable; false means its goroutine must
// end, and run starts again on another once src is readable.
func (h *half) await(src ReadNotifier) bool {
	return src.WhenReadable(h.notify) || h.idle.Wait(Grace)
}

// run copies until the direction ends or, for a ReadNotifier source,
// until the source has nothing more for now.
func (h *half) run() {
	switch src := h.src.(type) {
	case BufferedSource:
		h.runBuffered(src)
	case ReadNotifier:
		for {
			if !h.await(src) {
				return // run starts again once there is more
			}
			if h.step() {
				h.p.halfDone()
				return
			}
		}
	default:
		for !h.step() {
		}
		h.p.halfDone()
	}
}

// runBuffered copies a BufferedSource to dst from the source's own buffer
// (dst as it is, so that a kernel socket gets a vectored write).
func (h *half) runBuffered(src BufferedSource) {
	for {
		n, eof, err := src.WriteBufferedTo(h.dst)
		h.count(n)
		switch {
		case err != nil:
			h.p.resetBoth(err)
		case eof:
			h.halfClose()
		case !h.await(src):
			return // run starts again once there is more
		default:
			continue
		}
		h.p.halfDone()
		return
	}
}

// step reads once from src into a pooled buffer and writes what it read
// to dst. It reports whether the direction ended: EOF, which half-closes
// dst, or any other error, which resets both sides.
func (h *half) step() (ended bool) {
	b := h.read()
	defer b.put()
	if b.n > 0 {
		w, werr := h.dst.Write(b.bytes()[:b.n])
		h.count(int64(w))
		if werr != nil {
			h.p.resetBoth(werr)
			return true
		}
		switch {
		case b.small != nil && b.n == smallBuf:
			h.large = true
		case b.big != nil && b.n < smallBuf:
			h.large = false
		}
	}
	switch {
	case b.err == nil:
		return false
	case errors.Is(b.err, io.EOF):
		h.halfClose()
	default:
		h.p.resetBoth(b.err)
	}
	return true
}

// halfClose ends dst's write side (a FIN), or closes dst if that fails; a
// dst without CloseWrite is left open until both directions ended.
func (h *half) halfClose() {
	if hc, ok := h.dst.(interface{ CloseWrite() error }); ok && hc.CloseWrite() != nil {
		h.dst.Close()
	}
}

// Read buffers: small while a direction idles or carries small messages,
// large once reads fill the small one. 64 KiB moves a full TSO segment's
// worth per read on kernel sockets.
const (
	smallBuf = 4 << 10
	largeBuf = 64 << 10
)

var (
	smallBufs = sync.Pool{New: func() any { return new([smallBuf]byte) }}
	largeBufs = sync.Pool{New: func() any { return new([largeBuf]byte) }}
)

// readBuf is one read into a pooled buffer.
type readBuf struct {
	small *[smallBuf]byte
	big   *[largeBuf]byte
	n     int
	err   error
}

func (h *half) get() readBuf {
	if h.large {
		return readBuf{big: largeBufs.Get().(*[largeBuf]byte)}
	}
	return readBuf{small: smallBufs.Get().(*[smallBuf]byte)}
}

func (b *readBuf) bytes() []byte {
	if b.small != nil {
		return b.small[:]
	}
	return b.big[:]
}

// put gives the buffer back.
func (b *readBuf) put() {
	switch {
	case b.small != nil:
		smallBufs.Put(b.small)
	case b.big != nil:
		largeBufs.Put(b.big)
	}
	b.small, b.big = nil, nil
}

// read reads once from src. On a kernel socket the buffer is taken only
// once the read will not block, so a direction waiting for an idle peer
// holds none (ReadNotifier sources are read only once they are readable).
// Other connections are read with the buffer held for the wait.
func (h *half) read() readBuf {
	if h.kernel != nil {
		return h.readKernel(h.kernel)
	}
	b := h.get()
	b.n, b.err = h.src.Read(b.bytes())
	return b
}

// readKernel is read on a kernel socket: the read happens inside the
// poller's callback (fillKernel), with a buffer taken for it alone. The
// runtime's poller calls fillKernel again each time the socket turns
// readable; the buffer goes back to the pool between calls.
func (h *half) readKernel(k *kernelSource) readBuf {
	cerr := k.rc.Read(k.fill)
	b, err := k.b, k.err
	k.b, k.err = readBuf{}, nil
	switch {
	case b.small == nil && b.big == nil: // the wait ended without a read: closed, deadline
		b.n, b.err = 0, cerr
	case err != nil:
		b.n, b.err = 0, &net.OpError{Op: "read", Net: "tcp", Source: k.tcp.LocalAddr(), Addr: k.tcp.RemoteAddr(), Err: os.NewSyscallError("read", err)}
	case b.n == 0:
		b.err = io.EOF
	}
	return b
}

// fillKernel is readKernel's callback: one read(2) into a pooled buffer.
func (h *half) fillKernel(k *kernelSource, fd uintptr) bool {
	k.b = h.get()
	var err error
	for {
		k.b.n, err = unix.Read(int(fd), k.b.bytes())
		if err != unix.EINTR {
			break
		}
	}
	if err == unix.EAGAIN {
		k.b.put()
		return false
	}
	k.err = err
	return true
}
