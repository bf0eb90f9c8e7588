package proxy

import (
	"errors"
	"io"
	"net"
	"os"
	"sync"

	"golang.org/x/sys/unix"
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

// relay copies between a and b until both directions are done, then closes
// both. onAB and onBA, if not nil, are told of every chunk written (for
// live byte metrics). Each direction ends on its own: EOF from one side becomes a
// half-close (FIN) towards the other while the opposite direction goes on.
// A reset on either side becomes a reset on the other, never a FIN.
func relay(a, b net.Conn, onAB, onBA func(int)) relayResult {
	var res relayResult
	var wg sync.WaitGroup
	var resetOnce sync.Once
	resetBoth := func() {
		resetOnce.Do(func() {
			res.Reset = true
			reset(a)
			reset(b)
		})
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		res.BToA = copyHalf(a, b, resetBoth, onBA)
	}()
	res.AToB = copyHalf(b, a, resetBoth, onAB)
	wg.Wait()
	a.Close()
	b.Close()
	return res
}

// copyHalf copies src to dst. On EOF it half-closes dst; on any other error
// (a reset, or a write to a reset peer) it calls abort. A copy buffer is
// taken from the pool only while there is something to copy (see
// readPooled), so an idle connection holds none.
func copyHalf(dst, src net.Conn, abort func(), onWrite func(int)) int64 {
	var total int64
	for {
		bp, n, rerr := readPooled(src)
		if n > 0 {
			w, werr := dst.Write((*bp)[:n])
			total += int64(w)
			if onWrite != nil && w > 0 {
				onWrite(w)
			}
			if werr != nil {
				relayBufs.Put(bp)
				abort()
				return total
			}
		}
		relayBufs.Put(bp)
		if rerr != nil {
			if errors.Is(rerr, io.EOF) {
				if hc, ok := dst.(halfCloser); ok {
					if hc.CloseWrite() == nil {
						return total
					}
				}
				dst.Close()
				return total
			}
			abort()
			return total
		}
	}
}

// readWaiter is a connection that can wait until a Read would not block
// without holding a buffer meanwhile. *stack.Conn is one.
type readWaiter interface {
	WaitReadable()
}

// readPooled reads once from src into a buffer from relayBufs and returns
// it (to be put back by the caller) with what Read returned. For
// connections whose readiness can be awaited without a buffer (netstack
// connections, kernel sockets) the buffer is taken only once the read will
// not block: a relay that waits for an idle peer holds no buffer. Other
// connections are read with the buffer held for the wait.
func readPooled(src net.Conn) (bp *[]byte, n int, err error) {
	switch c := src.(type) {
	case readWaiter:
		c.WaitReadable()
		bp = relayBufs.Get().(*[]byte)
		n, err = src.Read(*bp)
		return bp, n, err
	case *net.TCPConn:
		rc, rerr := c.SyscallConn()
		if rerr != nil {
			break
		}
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
	bp = relayBufs.Get().(*[]byte)
	n, err = src.Read(*bp)
	return bp, n, err
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
