package proxy

import (
	"errors"
	"io"
	"net"
	"sync"
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
// (a reset, or a write to a reset peer) it calls abort.
func copyHalf(dst, src net.Conn, abort func(), onWrite func(int)) int64 {
	bp := relayBufs.Get().(*[]byte)
	defer relayBufs.Put(bp)
	buf := *bp
	var total int64
	for {
		n, rerr := src.Read(buf)
		if n > 0 {
			w, werr := dst.Write(buf[:n])
			total += int64(w)
			if onWrite != nil && w > 0 {
				onWrite(w)
			}
			if werr != nil {
				abort()
				return total
			}
		}
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
