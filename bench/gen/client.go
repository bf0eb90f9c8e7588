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
	"time"

	"golang.org/x/net/ipv4"
)

// dialTimeout bounds every connection attempt of a client.
const dialTimeout = 10 * time.Second

// stopGrace bounds the wait for the server to see a scenario's
// connections closed before the next scenario starts.
const stopGrace = 3 * time.Second

// dial opens one connection to dst; it must run inside Netns.Do.
func dial(ctx context.Context, network string, dst netip.AddrPort) (net.Conn, error) {
	d := net.Dialer{Timeout: dialTimeout}
	return d.DialContext(ctx, network, dst.String())
}

// dialN opens n TCP connections to dst from inside ns.
func dialN(ctx context.Context, ns Netns, dst netip.AddrPort, n int) ([]net.Conn, error) {
	conns := make([]net.Conn, 0, n)
	err := ns.Do(func() error {
		for range n {
			c, err := dial(ctx, "tcp", dst)
			if err != nil {
				return err
			}
			conns = append(conns, c)
		}
		return nil
	})
	if err != nil {
		closeAll(conns)
		return nil, fmt.Errorf("gen: connect to %s: %w", dst, err)
	}
	return conns, nil
}

func closeAll(conns []net.Conn) {
	for _, c := range conns {
		c.Close()
	}
}

// Throughput is the result of a bulk-transfer run.
type Throughput struct {
	// Bytes arrived at the receiving end during the measured window.
	Bytes int64
	// Elapsed is the length of the measured window.
	Elapsed time.Duration
}

// Gbps returns the throughput in Gbit/s.
func (t Throughput) Gbps() float64 {
	if t.Elapsed <= 0 {
		return 0
	}
	return float64(t.Bytes) * 8 / t.Elapsed.Seconds() / 1e9
}

// TCPConfig shapes a bulk-transfer run.
type TCPConfig struct {
	// Streams is the number of parallel connections (at least 1).
	Streams int
	// Warmup runs before the measured window opens (slow start, window
	// growth).
	Warmup time.Duration
	// Duration is the measured window.
	Duration time.Duration
	// Window, if set, is called as the measured window opens; the function
	// it returns is called as it closes. The caller samples the proxy's
	// CPU time there.
	Window func() (closed func())
}

func (cfg TCPConfig) check() error {
	if cfg.Streams < 1 || cfg.Duration <= 0 || cfg.Warmup < 0 {
		return fmt.Errorf("gen: TCP config %+v: want at least 1 stream and a positive duration", cfg)
	}
	return nil
}

// Upload sends from ns to srv's sink over cfg.Streams connections and
// counts what the sink receives (client→server).
func Upload(ctx context.Context, ns Netns, srv *Server, cfg TCPConfig) (Throughput, error) {
	return bulk(ctx, ns, srv, srv.Sink, cfg, srv.SinkBytes, func(c net.Conn) error {
		buf := make([]byte, chunk)
		for {
			if _, err := c.Write(buf); err != nil {
				return err
			}
		}
	})
}

// Download receives in ns from srv's source over cfg.Streams connections
// and counts what arrives (server→client).
func Download(ctx context.Context, ns Netns, srv *Server, cfg TCPConfig) (Throughput, error) {
	var got atomic.Int64
	return bulk(ctx, ns, srv, srv.Source, cfg, got.Load, func(c net.Conn) error {
		buf := make([]byte, chunk)
		for {
			n, err := c.Read(buf)
			got.Add(int64(n))
			if err != nil {
				return err
			}
		}
	})
}

// bulk runs loop on cfg.Streams connections to dst, measures how count
// grows over the window, then stops the loops by expiring the
// connections' deadlines.
func bulk(ctx context.Context, ns Netns, srv *Server, dst netip.AddrPort, cfg TCPConfig,
	count func() int64, loop func(net.Conn) error) (Throughput, error) {
	if err := cfg.check(); err != nil {
		return Throughput{}, err
	}
	conns, err := dialN(ctx, ns, dst, cfg.Streams)
	if err != nil {
		return Throughput{}, err
	}
	var (
		stopping atomic.Bool
		wg       sync.WaitGroup
		errMu    sync.Mutex
		firstErr error
	)
	for _, c := range conns {
		wg.Go(func() {
			if err := loop(c); err != nil && !stopping.Load() {
				errMu.Lock()
				if firstErr == nil {
					firstErr = fmt.Errorf("gen: transfer with %s: %w", dst, err)
				}
				errMu.Unlock()
			}
		})
	}
	stop := func() {
		stopping.Store(true)
		for _, c := range conns {
			c.SetDeadline(time.Now())
		}
		wg.Wait()
		closeAll(conns)
		wctx, cancel := context.WithTimeout(ctx, stopGrace)
		defer cancel()
		srv.WaitIdle(wctx) // best effort: the next run should not share the path with this one's teardown
	}
	failed := func() error {
		errMu.Lock()
		defer errMu.Unlock()
		return firstErr
	}
	if err := sleep(ctx, cfg.Warmup); err != nil {
		stop()
		return Throughput{}, err
	}
	var closed func()
	if cfg.Window != nil {
		closed = cfg.Window()
	}
	b0, t0 := count(), time.Now()
	err = sleep(ctx, cfg.Duration)
	b1, t1 := count(), time.Now()
	if closed != nil {
		closed()
	}
	stop()
	if err != nil {
		return Throughput{}, err
	}
	if err := failed(); err != nil {
		return Throughput{}, err
	}
	return Throughput{Bytes: b1 - b0, Elapsed: t1.Sub(t0)}, nil
}

func sleep(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// RequestResponse sends size-byte requests to srv's echo service over one
// connection, one at a time, for dur (at most max requests if max > 0),
// and returns the round-trip time of each.
func RequestResponse(ctx context.Context, ns Netns, srv *Server, size int, dur time.Duration, max int) ([]time.Duration, error) {
	conns, err := dialN(ctx, ns, srv.Echo, 1)
	if err != nil {
		return nil, err
	}
	c := conns[0]
	defer c.Close()
	if tc, ok := c.(*net.TCPConn); ok {
		tc.SetNoDelay(true)
	}
	req, resp := make([]byte, size), make([]byte, size)
	var lat []time.Duration
	end := time.Now().Add(dur)
	c.SetDeadline(end.Add(dialTimeout))
	for t0 := time.Now(); t0.Before(end) && (max <= 0 || len(lat) < max); t0 = time.Now() {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if _, err := c.Write(req); err != nil {
			return nil, fmt.Errorf("gen: request %d to %s: %w", len(lat)+1, srv.Echo, err)
		}
		if _, err := io.ReadFull(c, resp); err != nil {
			return nil, fmt.Errorf("gen: response %d from %s: %w", len(lat)+1, srv.Echo, err)
		}
		lat = append(lat, time.Since(t0))
	}
	return lat, nil
}

// ConnectRequestClose opens a connection to srv's echo service, exchanges
// one size-byte request and response and closes it, over and over for dur
// (at most max times if max > 0). It returns the time of each round, from
// connect to close, and the total time taken.
func ConnectRequestClose(ctx context.Context, ns Netns, srv *Server, size int, dur time.Duration, max int) ([]time.Duration, time.Duration, error) {
	var lat []time.Duration
	req, resp := make([]byte, size), make([]byte, size)
	start := time.Now()
	end := start.Add(dur)
	// The whole loop runs inside the namespace: entering it per connection
	// would add a thread switch to every measured round.
	err := ns.Do(func() error {
		for t0 := time.Now(); t0.Before(end) && (max <= 0 || len(lat) < max); t0 = time.Now() {
			if err := ctx.Err(); err != nil {
				return err
			}
			c, err := dial(ctx, "tcp", srv.Echo)
			if err != nil {
				return fmt.Errorf("round %d: connect to %s: %w", len(lat)+1, srv.Echo, err)
			}
			c.SetDeadline(t0.Add(dialTimeout))
			_, err = c.Write(req)
			if err == nil {
				_, err = io.ReadFull(c, resp)
			}
			c.Close()
			if err != nil {
				return fmt.Errorf("round %d: exchange with %s: %w", len(lat)+1, srv.Echo, err)
			}
			lat = append(lat, time.Since(t0))
		}
		return nil
	})
	elapsed := time.Since(start)
	if err != nil {
		return nil, 0, fmt.Errorf("gen: %w", err)
	}
	return lat, elapsed, nil
}

// UDPConfig shapes a UDP run.
type UDPConfig struct {
	// Size is the datagram payload size.
	Size int
	// Rate is the offered rate in datagrams per second; 0 sends as fast
	// as the socket takes them.
	Rate float64
	// Duration is how long to send.
	Duration time.Duration
}

// UDPResult is the outcome of a UDP run.
type UDPResult struct {
	// Sent counts the datagrams the socket accepted, Received those the
	// sink counted.
	Sent, Received int64
	// Elapsed is the sending time.
	Elapsed time.Duration
}

// PPS returns the received datagrams per second of sending time.
func (r UDPResult) PPS() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Received) / r.Elapsed.Seconds()
}

// SentPPS returns the sent datagrams per second of sending time: below
// the offered rate when the socket pushed back.
func (r UDPResult) SentPPS() float64 {
	if r.Elapsed <= 0 {
		return 0
	}
	return float64(r.Sent) / r.Elapsed.Seconds()
}

// Loss returns the fraction of sent datagrams that did not arrive.
func (r UDPResult) Loss() float64 {
	if r.Sent <= 0 || r.Received >= r.Sent {
		return 0
	}
	return 1 - float64(r.Received)/float64(r.Sent)
}

// Quiet period and cap of the wait for datagrams still in flight after a
// UDP run: the sink is read until its count stops moving.
const (
	udpQuiet    = 50 * time.Millisecond
	udpDrainCap = 2 * time.Second
	udpPoll     = 10 * time.Millisecond
)

// UDP sends cfg.Size-byte datagrams from ns to srv's UDP sink at
// cfg.Rate for cfg.Duration and counts what arrives. After sending it
// waits until the sink's count has not moved for 50 ms (2 s at most), as
// no signal says that the last datagram has landed.
func UDP(ctx context.Context, ns Netns, srv *Server, cfg UDPConfig) (UDPResult, error) {
	if cfg.Size < 8 || cfg.Duration <= 0 || cfg.Rate < 0 {
		return UDPResult{}, fmt.Errorf("gen: UDP config %+v: want a size of at least 8, a positive duration and a rate ≥ 0", cfg)
	}
	var c net.Conn
	err := ns.Do(func() error {
		var err error
		c, err = dial(ctx, "udp", srv.UDP)
		return err
	})
	if err != nil {
		return UDPResult{}, fmt.Errorf("gen: UDP socket to %s: %w", srv.UDP, err)
	}
	defer c.Close()
	u := c.(*net.UDPConn)
	u.SetWriteBuffer(udpReadBuffer)
	// sendmmsg: up to udpBatch datagrams per system call, on the connected
	// socket (no address per message).
	bc := newBatchConn(u)
	msgs := make([]ipv4.Message, udpBatch)
	for i := range msgs {
		msgs[i].Buffers = [][]byte{make([]byte, cfg.Size)}
	}
	r0 := srv.UDPPackets()
	var sent, failed int64
	start := time.Now()
	end := start.Add(cfg.Duration)
	var lastErr error
	for now := start; now.Before(end); now = time.Now() {
		if err := ctx.Err(); err != nil {
			return UDPResult{}, err
		}
		due := int64(1 << 62)
		if cfg.Rate > 0 {
			due = int64(now.Sub(start).Seconds() * cfg.Rate)
		}
		if sent+failed >= due {
			time.Sleep(200 * time.Microsecond) // pacing
			continue
		}
		batch := int(min(due-sent-failed, udpBatch))
		for i := range batch {
			b := msgs[i].Buffers[0]
			seq := sent + int64(i)
			b[0], b[1], b[2], b[3] = byte(seq>>24), byte(seq>>16), byte(seq>>8), byte(seq)
		}
		n, err := bc.WriteBatch(msgs[:batch], 0)
		if err != nil {
			// The whole batch is counted as not sent: sendmmsg fails only
			// if its first datagram does.
			failed += int64(batch)
			lastErr = err
			continue
		}
		sent += int64(n)
	}
	elapsed := time.Since(start)
	if sent == 0 {
		return UDPResult{}, fmt.Errorf("gen: UDP to %s: no datagram sent: %w", srv.UDP, lastErr)
	}
	// Drain.
	last, quietSince, capAt := srv.UDPPackets(), time.Now(), time.Now().Add(udpDrainCap)
	for time.Since(quietSince) < udpQuiet && time.Now().Before(capAt) {
		if err := sleep(ctx, udpPoll); err != nil {
			return UDPResult{}, err
		}
		if n := srv.UDPPackets(); n != last {
			last, quietSince = n, time.Now()
		}
	}
	return UDPResult{Sent: sent, Received: last - r0, Elapsed: elapsed}, nil
}

// Idle is a set of open, idle connections to a server's Hold service.
type Idle struct {
	conns []net.Conn
}

// Len returns the number of connections; 0 for a nil set.
func (s *Idle) Len() int {
	if s == nil {
		return 0
	}
	return len(s.conns)
}

// Close closes every connection; a nil set has none.
func (s *Idle) Close() error {
	if s == nil {
		return nil
	}
	closeAll(s.conns)
	s.conns = nil
	return nil
}

// idleWorkers is how many connections OpenIdle opens at once.
const idleWorkers = 4

// OpenIdle opens n more connections from ns to h, adding them to set (a
// new set if nil), and returns once h holds all of them: only then does
// every proxy on the way carry them. On error the connections this call
// opened stay open in set too, until the caller closes it: a proxy that
// gave up at its limit is still at it when the caller looks.
func OpenIdle(ctx context.Context, ns Netns, h Holder, set *Idle, n int) (*Idle, error) {
	if set == nil {
		set = &Idle{}
	}
	before, err := h.Held(ctx)
	if err != nil {
		return set, err
	}
	var (
		mu    sync.Mutex
		added []net.Conn
		wg    sync.WaitGroup
		left  atomic.Int64
		errs  = make([]error, idleWorkers)
	)
	left.Store(int64(n))
	for w := range idleWorkers {
		wg.Go(func() {
			errs[w] = ns.Do(func() error {
				for left.Add(-1) >= 0 {
					c, err := dial(ctx, "tcp", h.Addr())
					if err != nil {
						return err
					}
					mu.Lock()
					added = append(added, c)
					mu.Unlock()
				}
				return nil
			})
		})
	}
	wg.Wait()
	set.conns = append(set.conns, added...)
	if err := errors.Join(errs...); err != nil {
		return set, fmt.Errorf("gen: open idle connection %d of %d to %s: %w", len(added)+1, n, h.Addr(), err)
	}
	if err := h.WaitHeld(ctx, before+n); err != nil {
		return set, fmt.Errorf("gen: %d connections to %s opened, not all held: %w", n, h.Addr(), err)
	}
	return set, nil
}
