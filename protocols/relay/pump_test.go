package relay

import (
	"bytes"
	"errors"
	"io"
	"net"
	"runtime"
	"sync"
	"syscall"
	"testing"
	"time"
)

// tcpPair returns the two ends of a loopback TCP connection.
func tcpPair(t *testing.T) (client, server *net.TCPConn) {
	t.Helper()
	ln, err := net.ListenTCP("tcp", &net.TCPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	c, err := net.DialTCP("tcp", nil, ln.Addr().(*net.TCPAddr))
	if err != nil {
		t.Fatal(err)
	}
	s, err := ln.AcceptTCP()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close(); s.Close() })
	return c, s
}

// startKernelRelay relays between two kernel connections and returns the far
// ends: the client's (whose peer is the relay's a) and the server's.
func startKernelRelay(t *testing.T) (client, server *net.TCPConn, result <-chan Result) {
	client, a := tcpPair(t)
	b, server := tcpPair(t)
	res := make(chan Result, 1)
	go func() { res <- relayAndWait(a, b, nil, nil) }()
	return client, server, res
}

func waitResult(t *testing.T, res <-chan Result) Result {
	t.Helper()
	select {
	case r := <-res:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("relay did not end")
	}
	return Result{}
}

// TestRelayHalfClose: data crosses both ways (more than one copy buffer's
// worth), the client's FIN reaches the server while the server's reply
// still flows, and the relay ends after both directions ended.
func TestRelayHalfClose(t *testing.T) {
	client, server, res := startKernelRelay(t)
	req := bytes.Repeat([]byte("request."), 3*largeBuf/8)
	go func() {
		client.Write(req)
		client.CloseWrite()
	}()
	got, err := io.ReadAll(server)
	if err != nil || !bytes.Equal(got, req) {
		t.Fatalf("server read %d bytes (%v), want the %d sent then EOF", len(got), err, len(req))
	}
	reply := []byte("the reply after the client's FIN")
	if _, err := server.Write(reply); err != nil {
		t.Fatal(err)
	}
	server.CloseWrite()
	got, err = io.ReadAll(client)
	if err != nil || !bytes.Equal(got, reply) {
		t.Fatalf("client read %q (%v), want %q then EOF", got, err, reply)
	}
	r := waitResult(t, res)
	if r.Reset || r.AToB != int64(len(req)) || r.BToA != int64(len(reply)) {
		t.Fatalf("relay result %+v, want %d and %d bytes, no reset", r, len(req), len(reply))
	}
}

// TestRelayReset: a reset from the server reaches the client as a reset,
// not a FIN, while the client's side is idle.
func TestRelayReset(t *testing.T) {
	client, server, res := startKernelRelay(t)
	server.SetLinger(0)
	server.Close()
	client.SetReadDeadline(time.Now().Add(10 * time.Second))
	_, err := client.Read(make([]byte, 1))
	if !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("client read %v, want a reset", err)
	}
	if r := waitResult(t, res); !r.Reset {
		t.Fatalf("relay result %+v, want a reset", r)
	}
}

// TestRelayCloseWhileIdle: closing the relayed connections from outside
// (as a drain's abort does) ends a relay whose both directions are idle.
func TestRelayCloseWhileIdle(t *testing.T) {
	client, a := tcpPair(t)
	b, _ := tcpPair(t)
	res := make(chan Result, 1)
	go func() { res <- relayAndWait(a, b, nil, nil) }()
	// The relay is idle once the client's data has crossed.
	if _, err := client.Write([]byte("x")); err != nil {
		t.Fatal(err)
	}
	Abort(b)
	if r := waitResult(t, res); !r.Reset {
		t.Fatalf("relay result %+v, want a reset", r)
	}
}

// relayAndWait relays between a and b and returns what moved once both
// directions are done.
func relayAndWait(a, b net.Conn, onAB, onBA func(int)) Result {
	ch := make(chan Result, 1)
	Start(a, b, Meter{AToB: onAB, BToA: onBA, Done: func(r Result) { ch <- r }})
	return <-ch
}

// memConn is an in-memory connection with a readiness callback, a
// ReadNotifier like *stack.Conn: Read returns what feed gave it, Write
// hands the bytes to out.
type memConn struct {
	net.Conn // not used by the relay; nil
	mu       sync.Mutex
	in       []byte
	inEOF    bool
	closed   bool
	armed    func()
	out      chan string
}

func newMemConn() *memConn { return &memConn{out: make(chan string, 16)} }

// feed makes b (or, if nil, the end of the data) readable and fires an
// armed callback from this goroutine, as the netstack would.
func (c *memConn) feed(b []byte) {
	c.mu.Lock()
	if b == nil {
		c.inEOF = true
	}
	c.in = append(c.in, b...)
	f := c.armed
	c.armed = nil
	c.mu.Unlock()
	if f != nil {
		f()
	}
}

func (c *memConn) WhenReadable(f func()) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if len(c.in) > 0 || c.inEOF || c.closed {
		return true
	}
	c.armed = f
	return false
}

func (c *memConn) Read(b []byte) (int, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch {
	case c.closed:
		return 0, net.ErrClosed
	case len(c.in) > 0:
		n := copy(b, c.in)
		c.in = c.in[n:]
		return n, nil
	case c.inEOF:
		return 0, io.EOF
	}
	return 0, errors.New("memConn: read while not readable")
}

func (c *memConn) Write(b []byte) (int, error) { c.out <- string(b); return len(b), nil }
func (c *memConn) CloseWrite() error           { return nil }
func (c *memConn) Close() error {
	c.mu.Lock()
	c.closed = true
	f := c.armed
	c.armed = nil
	c.mu.Unlock()
	if f != nil {
		f()
	}
	return nil
}

// TestRelayIdleHoldsNoGoroutine: between messages, once the grace period
// has passed, a relay between two ReadNotifier connections holds no
// goroutine; the next message starts one and arrives; both ends' EOFs end
// the relay with every byte counted.
func TestRelayIdleHoldsNoGoroutine(t *testing.T) {
	base := runtime.NumGoroutine()
	a, b := newMemConn(), newMemConn()
	res := make(chan Result, 1)
	Start(a, b, Meter{Done: func(r Result) { res <- r }})
	recv := func(c *memConn, want string) {
		t.Helper()
		select {
		case got := <-c.out:
			if got != want {
				t.Fatalf("relayed %q, want %q", got, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("%q not relayed", want)
		}
	}
	a.feed([]byte("ping"))
	recv(b, "ping")
	b.feed([]byte("pong"))
	recv(a, "pong")

	deadline := time.Now().Add(10 * time.Second)
	for runtime.NumGoroutine() > base {
		if time.Now().After(deadline) {
			t.Fatalf("idle relay still holds %d goroutines (%d before it started)", runtime.NumGoroutine(), base)
		}
		time.Sleep(time.Millisecond) // no signal: the goroutines end on their own grace-period clock
	}

	a.feed([]byte("again"))
	recv(b, "again")
	a.feed(nil)
	b.feed(nil)
	select {
	case r := <-res:
		if r.AToB != 9 || r.BToA != 4 || r.Reset {
			t.Errorf("result %+v, want 9 bytes a→b, 4 b→a, no reset", r)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("relay did not end after both EOFs")
	}
}

// meteredMem is a memConn that brings a meter.
type meteredMem struct {
	*memConn
	done chan Result
}

func (c *meteredMem) RelayMeter() Meter { return Meter{Done: func(r Result) { c.done <- r }} }

// TestAbandonTellsMeter: a connection that will not be relayed is closed
// and its meter told of a reset with nothing moved.
func TestAbandonTellsMeter(t *testing.T) {
	c := &meteredMem{memConn: newMemConn(), done: make(chan Result, 1)}
	Abandon(c)
	select {
	case r := <-c.done:
		if !r.Reset || r.AToB != 0 || r.BToA != 0 {
			t.Errorf("meter told %+v, want a reset with nothing moved", r)
		}
	default:
		t.Fatal("Abandon told the meter nothing")
	}
	if !c.closed {
		t.Error("Abandon left the connection open")
	}
}
