package stack

import (
	"errors"
	"io"
	"net"
	"net/netip"
	"sync/atomic"
	"syscall"

	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/adapters/gonet"
	"gvisor.dev/gvisor/pkg/tcpip/transport/tcp"
	"gvisor.dev/gvisor/pkg/waiter"
)

// TCPRequest is an intercepted TCP connection whose handshake is pending.
type TCPRequest struct {
	// Src is the client's address: the original source of the SYN.
	Src netip.AddrPort
	// Dst is the address the client connected to: the original destination.
	Dst netip.AddrPort

	r    *tcp.ForwarderRequest
	st   *Stack
	done bool // Accept or Reject was called
}

func (st *Stack) newRequest(r *tcp.ForwarderRequest) *TCPRequest {
	id := r.ID()
	return &TCPRequest{
		Src: addrPort(id.RemoteAddress, id.RemotePort),
		Dst: addrPort(id.LocalAddress, id.LocalPort),
		r:   r,
		st:  st,
	}
}

// Accept completes the handshake with the client and returns the
// connection.
func (q *TCPRequest) Accept() (*Conn, error) {
	var wq waiter.Queue
	ep, terr := q.r.CreateEndpoint(&wq)
	q.finish()
	if terr != nil {
		q.r.Complete(true)
		q.st.cls.Release(q.Dst, q.Src)
		return nil, &net.OpError{Op: "accept", Net: "tcp", Source: net.TCPAddrFromAddrPort(q.Src), Addr: net.TCPAddrFromAddrPort(q.Dst), Err: tcpipError(terr)}
	}
	q.r.Complete(false)
	ep.SocketOptions().SetKeepAlive(true)
	return q.st.newConn(&wq, ep, q.Dst, q.Src), nil
}

// Reject refuses the connection with a TCP reset, as a host with nothing
// listening on the port would.
func (q *TCPRequest) Reject() {
	q.finish()
	q.r.Complete(true)
	q.st.cls.Release(q.Dst, q.Src)
}

// finish ends the request's count against its source's pending share.
func (q *TCPRequest) finish() {
	if !q.done {
		q.done = true
		q.st.pending.done(q.Src.Addr())
	}
}

// Conn is a TCP connection terminated in the netstack. LocalAddr is the
// address the netstack stands in for, RemoteAddr the peer's.
type Conn struct {
	*gonet.TCPConn
	ep            tcpip.Endpoint
	wq            *waiter.Queue
	local, remote netip.AddrPort
	notice        readNotice // WhenReadable's
	st            *Stack
	released      atomic.Bool
}

func (st *Stack) newConn(wq *waiter.Queue, ep tcpip.Endpoint, local, remote netip.AddrPort) *Conn {
	return &Conn{TCPConn: gonet.NewTCPConn(wq, ep), ep: ep, wq: wq, local: local, remote: remote, st: st}
}

// release hands the flow back to the classifier once the connection is
// closed: it then lingers for the classifier's close timeout, so that the
// closing handshake still reaches the netstack.
func (c *Conn) release() {
	if c.released.CompareAndSwap(false, true) {
		c.st.cls.Release(c.local, c.remote)
	}
}

// Close implements net.Conn.
func (c *Conn) Close() error {
	err := c.TCPConn.Close()
	c.release()
	return err
}

// readEvents are the events after which a Read does not wait: data or the
// peer's FIN (readable), a reset or other failure, the connection closed.
const readEvents = waiter.ReadableEvents | waiter.EventHUp | waiter.EventErr

// WhenReadable returns true if a Read would not block now, and arranges
// nothing; otherwise it returns false and calls f once, as soon as a Read
// would not block (data, the peer's FIN, a failure, Close and Abort
// count). f runs on the goroutine that made the connection readable, with
// the netstack's locks held: it must not block or use the connection (it
// typically wakes or starts the goroutine that reads). It lets a relay
// hold neither a goroutine nor a buffer while the connection is idle. One
// reader at a time may use WhenReadable; each call replaces what the
// previous one armed.
func (c *Conn) WhenReadable(f func()) bool {
	n := &c.notice
	if !n.registered {
		// Registered once, for the connection's life: arming is then
		// two atomic operations, not the queue's lock twice.
		n.e.Init(n, readEvents)
		c.wq.EventRegister(&n.e)
		n.registered = true
	}
	if c.ep.Readiness(readEvents) != 0 {
		return true
	}
	n.fn = f
	n.armed.Store(true)
	// Readiness may have come between the check and the arming, with
	// nobody to tell.
	if c.ep.Readiness(readEvents) != 0 && n.armed.CompareAndSwap(true, false) {
		return true
	}
	return false
}

// readNotice is WhenReadable's waiter entry, one per connection.
type readNotice struct {
	e          waiter.Entry
	armed      atomic.Bool // fn is to be called; cleared by whoever calls it
	fn         func()      // written by the reader before it arms
	registered bool        // only the reader touches it
}

// NotifyEvent runs under the queue's lock, from whichever goroutine made
// the endpoint readable, on every such event: it fires the callback if
// one is armed.
func (n *readNotice) NotifyEvent(waiter.EventMask) {
	if n.armed.CompareAndSwap(true, false) {
		n.fn()
	}
}

// LocalAddrPort returns the connection's local address.
func (c *Conn) LocalAddrPort() netip.AddrPort { return c.local }

// RemoteAddrPort returns the connection's remote address.
func (c *Conn) RemoteAddrPort() netip.AddrPort { return c.remote }

// LocalAddr implements net.Conn.
func (c *Conn) LocalAddr() net.Addr { return net.TCPAddrFromAddrPort(c.local) }

// RemoteAddr implements net.Conn.
func (c *Conn) RemoteAddr() net.Addr { return net.TCPAddrFromAddrPort(c.remote) }

// Read implements net.Conn. A reset by the peer is reported as an error
// matching syscall.ECONNRESET, as it is on a kernel socket.
func (c *Conn) Read(b []byte) (int, error) {
	n, err := c.TCPConn.Read(b)
	return n, c.translate(err)
}

// Write implements net.Conn, with errors translated as for Read.
func (c *Conn) Write(b []byte) (int, error) {
	n, err := c.TCPConn.Write(b)
	return n, c.translate(err)
}

// Abort closes the connection abortively: the peer receives a TCP RST
// instead of a FIN.
func (c *Conn) Abort() error {
	c.ep.Abort()
	return c.Close()
}

var (
	resetText = (&tcpip.ErrConnectionReset{}).String()
	abortText = (&tcpip.ErrConnectionAborted{}).String()
)

// translate turns gonet's string-only errors for a reset connection back
// into errors that errors.Is recognises.
func (c *Conn) translate(err error) error {
	if err == nil || err == io.EOF {
		return err
	}
	var op *net.OpError
	if errors.As(err, &op) && op.Err != nil {
		switch op.Err.Error() {
		case resetText, abortText:
			op.Err = syscall.ECONNRESET
		}
	}
	return err
}

// tcpipError maps netstack errors to the syscall errors of the same meaning.
func tcpipError(err tcpip.Error) error {
	switch err.(type) {
	case *tcpip.ErrConnectionRefused:
		return syscall.ECONNREFUSED
	case *tcpip.ErrConnectionReset:
		return syscall.ECONNRESET
	case *tcpip.ErrTimeout:
		return syscall.ETIMEDOUT
	case *tcpip.ErrHostUnreachable, *tcpip.ErrNoNet:
		return syscall.EHOSTUNREACH
	case *tcpip.ErrNetworkUnreachable:
		return syscall.ENETUNREACH
	case *tcpip.ErrPortInUse:
		return syscall.EADDRINUSE
	}
	return errors.New(err.String())
}
