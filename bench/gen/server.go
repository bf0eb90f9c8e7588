// Package gen holds the benchmark's traffic generators: a server that runs
// in the destination pod (TCP sink, source, echo and hold ports and a UDP
// sink) and the clients that drive it from the source pod. Both ends live
// in the benchmark process, so a client reads the server's counters
// directly: throughput is counted where the bytes arrive.
package gen

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"

	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"
)

// Netns is where sockets are opened: Do runs fn on a thread inside the
// namespace (see cluster.NS.Do). Sockets keep the namespace they were
// created in, so they can be used from any goroutine afterwards.
type Netns interface {
	Do(fn func() error) error
}

// Default ports of a Server, in order: sink, source, echo, hold, UDP sink.
const (
	PortSink   = 7100
	PortSource = 7101
	PortEcho   = 7102
	PortHold   = 7103
	PortUDP    = 7104
)

// chunk is the read and write size of the bulk-transfer loops.
const chunk = 128 << 10

// udpReadBuffer is the receive buffer asked for on the UDP sink, so that
// the receiving process's scheduling is not what drops datagrams.
const udpReadBuffer = 8 << 20

// Server is the destination end of every scenario. Its address fields say
// where each service listens.
type Server struct {
	// Sink discards what it receives, counting bytes.
	Sink netip.AddrPort
	// Source sends without end until the client goes away.
	Source netip.AddrPort
	// Echo writes back whatever it reads.
	Echo netip.AddrPort
	// Hold keeps connections open until the client closes them, counting
	// how many are open.
	Hold netip.AddrPort
	// UDP counts the datagrams it receives.
	UDP netip.AddrPort

	sinkBytes  atomic.Int64
	udpPackets atomic.Int64

	mu      sync.Mutex
	active  int           // open TCP connections, all services
	held    int           // open connections on Hold
	changed chan struct{} // closed and replaced when active or held change

	closers []io.Closer
	wg      sync.WaitGroup
	closed  atomic.Bool
}

// Serve starts a Server on addr inside ns. The five services listen on
// consecutive ports from port0 (PortSink for the defaults); port0 == 0
// picks a free port for each.
func Serve(ns Netns, addr netip.Addr, port0 uint16) (*Server, error) {
	s := &Server{changed: make(chan struct{})}
	port := func(i uint16) uint16 {
		if port0 == 0 {
			return 0
		}
		return port0 + i
	}
	var lns [4]net.Listener
	var pc net.PacketConn
	err := ns.Do(func() error {
		for i := range lns {
			ln, err := net.Listen("tcp", netip.AddrPortFrom(addr, port(uint16(i))).String())
			if err != nil {
				return err
			}
			lns[i] = ln
			s.closers = append(s.closers, ln)
		}
		var err error
		pc, err = net.ListenPacket("udp", netip.AddrPortFrom(addr, port(4)).String())
		if err != nil {
			return err
		}
		s.closers = append(s.closers, pc)
		return nil
	})
	if err != nil {
		s.Close()
		return nil, fmt.Errorf("gen: serve on %s: %w", addr, err)
	}
	ap := func(a net.Addr) netip.AddrPort {
		switch a := a.(type) {
		case *net.TCPAddr:
			return a.AddrPort()
		case *net.UDPAddr:
			return a.AddrPort()
		}
		return netip.AddrPort{}
	}
	unmap := func(p netip.AddrPort) netip.AddrPort { return netip.AddrPortFrom(p.Addr().Unmap(), p.Port()) }
	s.Sink, s.Source, s.Echo, s.Hold = unmap(ap(lns[0].Addr())), unmap(ap(lns[1].Addr())), unmap(ap(lns[2].Addr())), unmap(ap(lns[3].Addr()))
	s.UDP = unmap(ap(pc.LocalAddr()))
	if u, ok := pc.(*net.UDPConn); ok {
		u.SetReadBuffer(udpReadBuffer) // best effort: capped by net.core.rmem_max
	}
	s.accept(lns[0], s.sink, false)
	s.accept(lns[1], s.source, false)
	s.accept(lns[2], s.echo, false)
	s.accept(lns[3], s.hold, true)
	s.wg.Add(1)
	go s.udp(pc)
	return s, nil
}

// Close stops every service and closes open connections' listeners. It
// waits for the accept loops and the UDP reader to end; connections a
// client still holds end when the client closes them.
func (s *Server) Close() error {
	if s.closed.Swap(true) {
		return nil
	}
	var errs []error
	for _, c := range s.closers {
		if err := c.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	s.wg.Wait()
	return errors.Join(errs...)
}

// SinkBytes returns the bytes the sink has received so far.
func (s *Server) SinkBytes() int64 { return s.sinkBytes.Load() }

// UDPPackets returns the datagrams the UDP sink has received so far.
func (s *Server) UDPPackets() int64 { return s.udpPackets.Load() }

func (s *Server) accept(ln net.Listener, handle func(net.Conn), hold bool) {
	s.wg.Add(1)
	go func() {
		defer s.wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return // listener closed
			}
			s.track(+1, hold)
			go func() {
				defer s.track(-1, hold)
				defer c.Close()
				handle(c)
			}()
		}
	}()
}

func (s *Server) track(d int, hold bool) {
	s.mu.Lock()
	s.active += d
	if hold {
		s.held += d
	}
	close(s.changed)
	s.changed = make(chan struct{})
	s.mu.Unlock()
}

// wait blocks until cond holds for (active, held), or ctx ends.
func (s *Server) wait(ctx context.Context, cond func(active, held int) bool) error {
	for {
		s.mu.Lock()
		ok, ch := cond(s.active, s.held), s.changed
		s.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

// WaitIdle waits until the server has no open TCP connection, or ctx ends.
func (s *Server) WaitIdle(ctx context.Context) error {
	return s.wait(ctx, func(active, _ int) bool { return active == 0 })
}

// WaitHeld waits until at least n connections are open on Hold.
func (s *Server) WaitHeld(ctx context.Context, n int) error {
	return s.wait(ctx, func(_, held int) bool { return held >= n })
}

// Held returns the number of connections open on Hold.
func (s *Server) Held() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.held
}

func (s *Server) sink(c net.Conn) {
	buf := make([]byte, chunk)
	for {
		n, err := c.Read(buf)
		s.sinkBytes.Add(int64(n))
		if err != nil {
			return
		}
	}
}

func (s *Server) source(c net.Conn) {
	buf := make([]byte, chunk)
	for {
		if _, err := c.Write(buf); err != nil {
			return
		}
	}
}

// echo writes back what it reads, with a plain loop (io.Copy between two
// TCP connections would splice, a different code path for small
// messages).
func (s *Server) echo(c net.Conn) {
	buf := make([]byte, 4096)
	for {
		n, err := c.Read(buf)
		if n > 0 {
			if _, werr := c.Write(buf[:n]); werr != nil {
				return
			}
		}
		if err != nil {
			return
		}
	}
}

func (s *Server) hold(c net.Conn) {
	buf := make([]byte, 512)
	for {
		if _, err := c.Read(buf); err != nil {
			return
		}
	}
}

func (s *Server) udp(pc net.PacketConn) {
	defer s.wg.Done()
	// recvmmsg: up to udpBatch datagrams per system call, so that the
	// sink is not what limits the rate.
	bc := newBatchConn(pc)
	msgs := make([]ipv4.Message, udpBatch)
	for i := range msgs {
		msgs[i].Buffers = [][]byte{make([]byte, 2048)}
	}
	for {
		n, err := bc.ReadBatch(msgs, 0)
		if err != nil {
			if s.closed.Load() {
				return
			}
			continue // e.g. an ICMP error reported on the socket
		}
		s.udpPackets.Add(int64(n))
	}
}

// udpBatch is how many datagrams one sendmmsg or recvmmsg moves at most.
const udpBatch = 64

// batchConn reads and writes datagrams in batches (recvmmsg, sendmmsg).
type batchConn interface {
	ReadBatch(ms []ipv4.Message, flags int) (int, error)
	WriteBatch(ms []ipv4.Message, flags int) (int, error)
}

// newBatchConn wraps a UDP socket for batched I/O in its address family.
func newBatchConn(c net.PacketConn) batchConn {
	if a, ok := c.LocalAddr().(*net.UDPAddr); ok && a.IP.To4() == nil && a.IP != nil && !a.IP.IsUnspecified() {
		return ipv6.NewPacketConn(c)
	}
	return ipv4.NewPacketConn(c)
}
