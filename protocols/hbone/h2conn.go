package hbone

import (
	"bufio"
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// This file is the HTTP/2 connection both ends share: one reader goroutine
// per connection that handles control frames inline and appends DATA to
// the streams' receive buffers, and a write side without a goroutine of its
// own. Stream writes put DATA frames straight onto the connection under
// wmu; control frames (SETTINGS and PING acks, WINDOW_UPDATE, RST_STREAM,
// HEADERS, GOAWAY) are queued in pend and written by whoever holds wmu next,
// so that the reader never blocks on a write (two peers whose readers both
// waited for their socket to drain would deadlock).
//
// Lock order: wmu, then mu, then pmu. Never take wmu while holding mu.

const (
	initialWindow = 65535 // RFC 9113 initial flow-control windows
	maxWindow     = 1<<31 - 1
	// Consumed bytes are given back to the peer (WINDOW_UPDATE) once a
	// quarter of the window is free, so that a steady sender never waits.
	streamUpdateThreshold = StreamWindow / 4
	connUpdateThreshold   = ConnWindow / 4
	// maxHeaderListSize bounds a decoded header list (SETTINGS_MAX_HEADER_LIST_SIZE).
	maxHeaderListSize = 64 << 10
	// maxPending bounds the control frames queued for a peer that does not
	// read them (PING or SETTINGS floods).
	maxPending   = 1 << 20
	writeBufSize = 16 << 10
	readBufSize  = 16 << 10
	// Rapid reset (CVE-2023-44487): more early resets (a stream reset by
	// the client before it was answered, or a stream we refused) than
	// this within resetWindow closes the connection.
	maxEarlyResets = 200
	resetWindow    = time.Second
	// maxControlFrames bounds SETTINGS and PING frames within resetWindow.
	maxControlFrames = 1000
)

// connError is a connection-level protocol error: GOAWAY with code, then
// close.
type connError struct {
	code   http2.ErrCode
	reason string
}

func (e *connError) Error() string { return fmt.Sprintf("%v: %s", e.code, e.reason) }

func connErrorf(code http2.ErrCode, format string, args ...any) error {
	return &connError{code: code, reason: fmt.Sprintf(format, args...)}
}

// errConnClosed is the error of streams on a connection closed without a
// more precise reason.
var errConnClosed = errors.New("hbone: connection closed")

// role is what differs between the client and the server end.
type role interface {
	// onHeaders handles a HEADERS block (with its CONTINUATIONs). No lock
	// is held.
	onHeaders(f *http2.MetaHeadersFrame) error
	// onStreamDone is called once per stream after it left the stream
	// table (both halves ended, or reset). No lock is held.
	onStreamDone(s *stream)
	// onGoAway is called after a GOAWAY from the peer was applied. No
	// lock is held.
	onGoAway()
}

// h2conn is one HTTP/2 connection.
type h2conn struct {
	nc     net.Conn
	client bool
	role   role
	log    zerolog.Logger

	fr *http2.Framer // reads only, by the reader goroutine

	wmu  sync.Mutex
	bw   *bufio.Writer
	werr error   // sticky write error; guarded by wmu
	dhdr [9]byte // DATA frame header scratch; guarded by wmu
	// spare is the drained pending buffer, reused; guarded by wmu.
	spare []byte

	pmu        sync.Mutex
	pend       pendBuf       // queued control frames
	cfr        *http2.Framer // writes into pend
	henc       *hpack.Encoder
	hbuf       bytes.Buffer
	hasPending atomic.Bool

	mu       sync.Mutex
	sendCond sync.Cond // on mu: send windows grew or streams' state changed
	streams  map[uint32]*stream
	done     []*stream // left the table; onStreamDone runs at unlock
	// Flow control. sendWindow is what we may still send on the
	// connection; recvWindow what the peer may still send us, recvUnacked
	// what was consumed but not yet given back.
	sendWindow      int64
	recvWindow      int64
	recvUnacked     int64
	peerInitWindow  int64
	peerMaxFrame    int
	closed          bool
	closeErr        error
	goAwaySent      bool
	goAwayRecv      bool
	goAwayLast      uint32 // from the peer's GOAWAY
	lastPeerID      uint32 // server: highest client stream id seen
	nextID          uint32 // client: next stream id
	connecting      int    // server: streams whose Handler.Connect runs
	resetCount      int    // early resets in the current window
	resetStart      time.Time
	ctrlCount       int // SETTINGS and PING frames in the current window
	ctrlStart       time.Time
	sawSettings     bool
	peerMaxStreams  atomic.Uint32 // SETTINGS_MAX_CONCURRENT_STREAMS; 0: none
	usable          atomic.Bool   // open and no GOAWAY either way
	framesRead      atomic.Uint64
	pingOut         atomic.Bool // a keepalive PING awaits its ack
	pingData        [8]byte
	pingSent        time.Time
	keepalive       *time.Timer
	pingInterval    time.Duration
	pingTimeout     time.Duration
	lastFramesCheck uint64
	closedCh        chan struct{}
	// batch, if not nil, is the connection beneath TLS, which holds the
	// TLS records written under wmu until flushAndUnlock (batchConn).
	batch *batchConn
	// written counts the writes that got through to the peer, below TLS
	// where the connection is a batchConn, else at nc. The keepalive timer (stallSeen, stallSince:
	// its own) closes a connection whose writer has been blocked without
	// progress for pingTimeout.
	written    *atomic.Uint64
	stallSeen  uint64
	stallSince time.Time
}

// countingConn counts the writes to a connection that got bytes through.
type countingConn struct {
	net.Conn
	n *atomic.Uint64
}

func (c countingConn) Write(b []byte) (int, error) {
	n, err := c.Conn.Write(b)
	if n > 0 {
		c.n.Add(1)
	}
	return n, err
}

// countWrites wraps a connection so that its writes are counted.
func countWrites(c net.Conn) (net.Conn, *atomic.Uint64) {
	n := new(atomic.Uint64)
	return countingConn{Conn: c, n: n}, n
}

// pendBuf is an io.Writer appending to a byte slice.
type pendBuf struct{ b []byte }

func (p *pendBuf) Write(b []byte) (int, error) { p.b = append(p.b, b...); return len(b), nil }

// newH2Conn returns the HTTP/2 connection on nc. batch, if not nil, is the
// connection beneath nc's TLS (newBatchConn): it batches the records and
// counts the writes; if nil, writes to nc are counted.
func newH2Conn(nc net.Conn, batch *batchConn, client bool, r role, log zerolog.Logger, pingInterval, pingTimeout time.Duration) *h2conn {
	c := &h2conn{
		nc:             nc,
		client:         client,
		role:           r,
		log:            log,
		streams:        make(map[uint32]*stream),
		sendWindow:     initialWindow,
		recvWindow:     ConnWindow,
		peerInitWindow: initialWindow,
		peerMaxFrame:   16384,
		nextID:         1,
		pingInterval:   pingInterval,
		pingTimeout:    pingTimeout,
		closedCh:       make(chan struct{}),
	}
	c.sendCond.L = &c.mu
	var w io.Writer
	if batch != nil {
		c.batch = batch
		c.written = &batch.written
		w = batchWriter{tls: nc, batch: batch}
	} else {
		w, c.written = countWrites(nc)
	}
	c.bw = bufio.NewWriterSize(w, writeBufSize)
	c.fr = http2.NewFramer(nil, bufio.NewReaderSize(nc, readBufSize))
	c.fr.SetMaxReadFrameSize(MaxFrameSize)
	c.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	c.fr.MaxHeaderListSize = maxHeaderListSize
	c.fr.SetReuseFrames()
	c.cfr = http2.NewFramer(&c.pend, nil)
	c.henc = hpack.NewEncoder(&c.hbuf)
	c.usable.Store(true)
	return c
}

// start writes the preface (client), our SETTINGS and the connection window
// and arms the keepalive. The caller then runs readLoop.
func (c *h2conn) start() error {
	settings := []http2.Setting{
		{ID: http2.SettingInitialWindowSize, Val: StreamWindow},
		{ID: http2.SettingMaxFrameSize, Val: MaxFrameSize},
		{ID: http2.SettingMaxHeaderListSize, Val: maxHeaderListSize},
	}
	if c.client {
		settings = append([]http2.Setting{{ID: http2.SettingEnablePush, Val: 0}}, settings...)
	} else {
		settings = append(settings, http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: MaxStreamsPerConn})
	}
	c.wmu.Lock()
	if c.client {
		c.bw.WriteString(http2.ClientPreface)
	}
	c.queue(func(fr *http2.Framer) error {
		if err := fr.WriteSettings(settings...); err != nil {
			return err
		}
		return fr.WriteWindowUpdate(0, ConnWindow-initialWindow)
	})
	err := c.flushAndUnlock()
	c.keepalive = time.AfterFunc(c.pingInterval, c.checkAlive)
	return err
}

// queue appends control frames to the pending buffer. It never blocks on
// the network; kick (or the next writer) sends them.
func (c *h2conn) queue(write func(fr *http2.Framer) error) error {
	c.pmu.Lock()
	err := write(c.cfr)
	n := len(c.pend.b)
	c.pmu.Unlock()
	c.hasPending.Store(true)
	if err != nil {
		return err
	}
	if n > maxPending {
		return connErrorf(http2.ErrCodeEnhanceYourCalm, "%d bytes of control frames queued for a peer that does not read them", n)
	}
	return nil
}

// kick sends queued control frames unless another goroutine is writing
// (which then sends them). It may block on the network: the reader
// goroutine uses kickAsync.
func (c *h2conn) kick() {
	if c.hasPending.Load() && c.wmu.TryLock() {
		c.flushAndUnlock()
	}
}

// kickAsync is kick for the reader goroutine: the write, which may block,
// runs on a goroutine of its own (at most one, as it holds wmu).
func (c *h2conn) kickAsync() {
	if c.hasPending.Load() && c.wmu.TryLock() {
		go c.flushAndUnlock()
	}
}

// drainLocked writes the pending control frames into bw. wmu is held.
func (c *h2conn) drainLocked() {
	if !c.hasPending.Load() {
		return
	}
	c.pmu.Lock()
	c.hasPending.Store(false)
	buf := c.pend.b
	c.pend.b = c.spare[:0]
	c.pmu.Unlock()
	if c.werr == nil {
		_, c.werr = c.bw.Write(buf)
	}
	if cap(buf) > 64<<10 {
		buf = nil // do not keep a flood's buffer
	}
	c.spare = buf
}

// flushAndUnlock writes pending control frames, flushes, and releases wmu;
// it takes wmu again for frames queued meanwhile that nobody else will send.
func (c *h2conn) flushAndUnlock() error {
	for {
		c.drainLocked()
		if c.werr == nil && c.bw.Buffered() > 0 {
			c.werr = c.bw.Flush()
		}
		if c.batch != nil {
			// The flush point: the records held beneath TLS go out
			// now, in one write; the batch's buffer is released even
			// after an error.
			if err := c.batch.end(); c.werr == nil {
				c.werr = err
			}
		}
		err := c.werr
		c.wmu.Unlock()
		if err != nil {
			c.close(fmt.Errorf("hbone: write to %s: %w", c.nc.RemoteAddr(), err))
			return err
		}
		if !c.hasPending.Load() || !c.wmu.TryLock() {
			return nil
		}
	}
}

// writeDataLocked writes DATA frames for data, each at most maxFrame bytes.
// wmu is held.
func (c *h2conn) writeDataLocked(id uint32, data []byte, end bool, maxFrame int) error {
	if c.werr != nil {
		return c.werr
	}
	for first := true; first || len(data) > 0; first = false {
		n := min(len(data), maxFrame)
		var flags byte
		if end && n == len(data) {
			flags = byte(http2.FlagDataEndStream)
		}
		h := c.dhdr[:]
		h[0], h[1], h[2] = byte(n>>16), byte(n>>8), byte(n)
		h[3] = byte(http2.FrameData)
		h[4] = flags
		binary.BigEndian.PutUint32(h[5:], id)
		if _, err := c.bw.Write(h); err != nil {
			c.werr = err
			return err
		}
		if _, err := c.bw.Write(data[:n]); err != nil {
			c.werr = err
			return err
		}
		data = data[n:]
	}
	return nil
}

// unlock releases mu and then runs onStreamDone for the streams that left
// the table meanwhile.
func (c *h2conn) unlock() {
	done := c.done
	c.done = nil
	c.mu.Unlock()
	for _, s := range done {
		c.role.onStreamDone(s)
	}
}

// close closes the connection: every open stream fails with err. It is
// idempotent and may be called from any goroutine, with wmu held or not.
func (c *h2conn) close(err error) {
	if err == nil {
		err = errConnClosed
	}
	c.mu.Lock()
	if c.closed {
		c.mu.Unlock()
		return
	}
	c.closed = true
	c.closeErr = err
	c.usable.Store(false)
	for _, s := range c.streams {
		s.failLocked(fmt.Errorf("connection lost: %w", err))
	}
	c.sendCond.Broadcast()
	c.unlock()
	if c.keepalive != nil {
		c.keepalive.Stop()
	}
	if c.batch != nil {
		// A writer may be blocked writing the batch, outside of TLS's
		// Write, where tls.Conn.Close would wait for it to send its
		// close_notify: close the socket first, as crypto/tls does
		// when a Write is in flight.
		if c.wmu.TryLock() {
			c.wmu.Unlock()
		} else {
			c.batch.Conn.Close()
		}
	}
	c.nc.Close()
	close(c.closedCh)
}

// goAwayAndClose sends GOAWAY(code) and closes. The write is bounded so
// that a peer that does not read cannot hold the caller.
func (c *h2conn) goAwayAndClose(code http2.ErrCode, reason string) {
	c.mu.Lock()
	last := c.lastPeerID
	c.goAwaySent = true
	c.usable.Store(false)
	c.mu.Unlock()
	c.queue(func(fr *http2.Framer) error { return fr.WriteGoAway(last, code, []byte(reason)) })
	c.nc.SetWriteDeadline(time.Now().Add(time.Second))
	c.wmu.Lock()
	c.flushAndUnlock()
	c.close(fmt.Errorf("hbone: %v: %s", code, reason))
}

// sendGoAway sends GOAWAY(NO_ERROR) with the last stream processed: the
// server drains.
func (c *h2conn) sendGoAway() {
	c.mu.Lock()
	if c.goAwaySent || c.closed {
		c.mu.Unlock()
		return
	}
	c.goAwaySent = true
	c.usable.Store(false)
	last := c.lastPeerID
	idle := len(c.streams) == 0
	c.mu.Unlock()
	c.queue(func(fr *http2.Framer) error { return fr.WriteGoAway(last, http2.ErrCodeNo, nil) })
	c.kick()
	if idle {
		c.closeIdleLater()
	}
}

// closeIdleLater closes a connection that sent GOAWAY and has no streams,
// after a moment in which the client can close it itself (which is
// cleaner: a close with unread data would reset the connection and could
// lose the GOAWAY).
func (c *h2conn) closeIdleLater() {
	time.AfterFunc(time.Second, func() { c.close(nil) })
}

// checkAlive is the keepalive timer: a PING after pingInterval without
// frames, the connection closed if it is unanswered after pingTimeout.
func (c *h2conn) checkAlive() {
	if c.isClosed() {
		return
	}
	if c.writeStalled() {
		c.log.Warn().Dur("timeout", c.pingTimeout).Msg("hbone: peer reads nothing, closing connection")
		c.close(fmt.Errorf("hbone: %s read nothing for %s", c.nc.RemoteAddr(), c.pingTimeout))
		return
	}
	if c.pingOut.Load() {
		if time.Since(c.pingSent) >= c.pingTimeout {
			c.log.Warn().Dur("timeout", c.pingTimeout).Msg("hbone: PING unanswered, closing connection")
			c.close(fmt.Errorf("hbone: %s did not answer PING within %s", c.nc.RemoteAddr(), c.pingTimeout))
			return
		}
		c.keepalive.Reset(c.pingTimeout - time.Since(c.pingSent))
		return
	}
	n := c.framesRead.Load()
	if n != c.lastFramesCheck {
		c.lastFramesCheck = n
		c.keepalive.Reset(c.pingInterval)
		return
	}
	var data [8]byte
	binary.BigEndian.PutUint64(data[:], uint64(time.Now().UnixNano()))
	c.pingData = data
	c.pingSent = time.Now()
	c.pingOut.Store(true)
	c.queue(func(fr *http2.Framer) error { return fr.WritePing(false, data) })
	c.kick()
	c.keepalive.Reset(c.pingTimeout)
}

// writeStalled reports whether a write to the peer has been in progress,
// without any of it getting through, for pingTimeout: a peer that keeps
// sending but does not read. Frames it sends keep the PING keepalive
// quiet, so this is what notices it. Only the keepalive timer calls it.
func (c *h2conn) writeStalled() bool {
	if c.wmu.TryLock() {
		c.wmu.Unlock()
		c.stallSince = time.Time{}
		return false
	}
	now, n := time.Now(), c.written.Load()
	if c.stallSince.IsZero() || n != c.stallSeen {
		c.stallSince, c.stallSeen = now, n
		return false
	}
	return now.Sub(c.stallSince) >= c.pingTimeout
}

func (c *h2conn) isClosed() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.closed
}

// readLoop reads frames until the connection fails or closes, and then
// closes it. It returns why it stopped.
func (c *h2conn) readLoop() error {
	err := c.readFrames()
	var ce *connError
	var h2ce http2.ConnectionError
	switch {
	case errors.As(err, &ce):
		c.log.Warn().Str("code", ce.code.String()).Str("reason", ce.reason).Msg("hbone: connection error, sending GOAWAY")
		c.goAwayAndClose(ce.code, ce.reason)
	case errors.As(err, &h2ce):
		reason := "malformed frame"
		if d := c.fr.ErrorDetail(); d != nil {
			reason = d.Error()
		}
		c.log.Warn().Str("code", http2.ErrCode(h2ce).String()).Str("reason", reason).Msg("hbone: connection error, sending GOAWAY")
		c.goAwayAndClose(http2.ErrCode(h2ce), reason)
	case errors.Is(err, http2.ErrFrameTooLarge):
		c.log.Warn().Int("max", MaxFrameSize).Msg("hbone: frame over SETTINGS_MAX_FRAME_SIZE, sending GOAWAY")
		c.goAwayAndClose(http2.ErrCodeFrameSize, "frame too large")
	default:
		if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !errors.Is(err, os.ErrDeadlineExceeded) {
			c.log.Debug().Err(err).Msg("hbone: connection read failed")
		}
		c.close(err)
	}
	return err
}

func (c *h2conn) readFrames() error {
	for {
		f, err := c.fr.ReadFrame()
		if err != nil {
			var se http2.StreamError
			if errors.As(err, &se) {
				// A malformed frame of one stream (bad header field,
				// zero window increment): reset that stream only.
				c.log.Info().Uint32("stream", se.StreamID).Str("code", se.Code.String()).Err(se.Cause).
					Msg("hbone: malformed frame from peer, resetting stream")
				if err := c.peerStreamError(se.StreamID, se.Code); err != nil {
					return err
				}
				continue
			}
			return err
		}
		c.framesRead.Add(1)
		if !c.sawSettings {
			sf, ok := f.(*http2.SettingsFrame)
			if !ok || sf.IsAck() {
				return connErrorf(http2.ErrCodeProtocol, "first frame is %v, not SETTINGS", f.Header().Type)
			}
			c.sawSettings = true
		}
		if err := c.handle(f); err != nil {
			return err
		}
	}
}

func (c *h2conn) handle(f http2.Frame) error {
	switch f := f.(type) {
	case *http2.DataFrame:
		return c.onData(f)
	case *http2.MetaHeadersFrame:
		return c.role.onHeaders(f)
	case *http2.SettingsFrame:
		return c.onSettings(f)
	case *http2.PingFrame:
		return c.onPing(f)
	case *http2.WindowUpdateFrame:
		return c.onWindowUpdate(f)
	case *http2.RSTStreamFrame:
		return c.onRSTStream(f)
	case *http2.GoAwayFrame:
		return c.onGoAway(f)
	case *http2.PushPromiseFrame:
		return connErrorf(http2.ErrCodeProtocol, "PUSH_PROMISE on stream %d: push is disabled", f.StreamID)
	}
	// PRIORITY, unknown extension frames: ignored.
	return nil
}

// controlFlood counts a SETTINGS or PING frame; too many close the
// connection.
func (c *h2conn) controlFlood() error {
	now := time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	if now.Sub(c.ctrlStart) > resetWindow {
		c.ctrlStart, c.ctrlCount = now, 0
	}
	c.ctrlCount++
	if c.ctrlCount > maxControlFrames {
		return connErrorf(http2.ErrCodeEnhanceYourCalm, "more than %d SETTINGS and PING frames within %s", maxControlFrames, resetWindow)
	}
	return nil
}

// earlyReset counts a stream reset before it was answered or refused by
// us; too many close the connection (rapid reset).
func (c *h2conn) earlyResetLocked() error {
	now := time.Now()
	if now.Sub(c.resetStart) > resetWindow {
		c.resetStart, c.resetCount = now, 0
	}
	c.resetCount++
	if c.resetCount > maxEarlyResets {
		return connErrorf(http2.ErrCodeEnhanceYourCalm, "more than %d streams reset before their response within %s (rapid reset)", maxEarlyResets, resetWindow)
	}
	return nil
}

func (c *h2conn) onSettings(f *http2.SettingsFrame) error {
	if f.IsAck() {
		return nil
	}
	if err := c.controlFlood(); err != nil {
		return err
	}
	c.mu.Lock()
	err := f.ForeachSetting(func(s http2.Setting) error {
		if err := s.Valid(); err != nil {
			return err
		}
		switch s.ID {
		case http2.SettingInitialWindowSize:
			delta := int64(s.Val) - c.peerInitWindow
			for _, st := range c.streams {
				if st.sendWindow+delta > maxWindow {
					return connErrorf(http2.ErrCodeFlowControl, "SETTINGS_INITIAL_WINDOW_SIZE %d overflows the window of stream %d", s.Val, st.id)
				}
			}
			for _, st := range c.streams {
				st.sendWindow += delta
			}
			c.peerInitWindow = int64(s.Val)
			c.sendCond.Broadcast()
		case http2.SettingMaxFrameSize:
			c.peerMaxFrame = int(s.Val)
		case http2.SettingMaxConcurrentStreams:
			c.peerMaxStreams.Store(max(s.Val, 1))
		case http2.SettingHeaderTableSize:
			c.pmu.Lock()
			c.henc.SetMaxDynamicTableSizeLimit(s.Val)
			c.pmu.Unlock()
		}
		return nil
	})
	c.mu.Unlock()
	if err != nil {
		var ce *connError
		if errors.As(err, &ce) {
			return err
		}
		var h2ce http2.ConnectionError
		if errors.As(err, &h2ce) {
			return connErrorf(http2.ErrCode(h2ce), "bad SETTINGS: %v", err)
		}
		return connErrorf(http2.ErrCodeProtocol, "bad SETTINGS: %v", err)
	}
	if err := c.queue(func(fr *http2.Framer) error { return fr.WriteSettingsAck() }); err != nil {
		return err
	}
	c.kickAsync()
	return nil
}

func (c *h2conn) onPing(f *http2.PingFrame) error {
	if f.IsAck() {
		if c.pingOut.Load() && f.Data == c.pingData {
			c.pingOut.Store(false)
		}
		return nil
	}
	if err := c.controlFlood(); err != nil {
		return err
	}
	data := f.Data
	if err := c.queue(func(fr *http2.Framer) error { return fr.WritePing(true, data) }); err != nil {
		return err
	}
	c.kickAsync()
	return nil
}

// streamOrUnlock returns stream id, with c.mu still held. If there is no
// such stream it releases c.mu and returns nil and, for a frame (named
// frame, for the error) on a stream that was never opened, the connection
// error; a frame for a stream that has closed is ignored (nil error).
func (c *h2conn) streamOrUnlock(id uint32, frame string) (*stream, error) {
	if s := c.streams[id]; s != nil {
		return s, nil
	}
	idle := c.isIdleLocked(id)
	c.mu.Unlock()
	if idle {
		return nil, connErrorf(http2.ErrCodeProtocol, "%s on idle stream %d", frame, id)
	}
	return nil, nil
}

// isIdleLocked reports whether id names a stream that was never opened.
func (c *h2conn) isIdleLocked(id uint32) bool {
	if c.client {
		return id%2 == 0 || id >= c.nextID
	}
	return id%2 == 1 && id > c.lastPeerID
}

func (c *h2conn) onWindowUpdate(f *http2.WindowUpdateFrame) error {
	inc := int64(f.Increment)
	c.mu.Lock()
	if f.StreamID == 0 {
		if c.sendWindow+inc > maxWindow {
			c.mu.Unlock()
			return connErrorf(http2.ErrCodeFlowControl, "WINDOW_UPDATE +%d overflows the connection window %d", inc, c.sendWindow)
		}
		c.sendWindow += inc
		c.sendCond.Broadcast()
		c.mu.Unlock()
		return nil
	}
	s, err := c.streamOrUnlock(f.StreamID, "WINDOW_UPDATE")
	if s == nil {
		return err
	}
	if s.sendWindow+inc > maxWindow {
		c.log.Info().Uint32("stream", s.id).Int64("increment", inc).Msg("hbone: WINDOW_UPDATE overflows the stream window, resetting stream")
		s.resetLocked(http2.ErrCodeFlowControl, fmt.Errorf("%w: window overflow from peer", ErrReset))
		c.unlock()
		c.kickAsync()
		return nil
	}
	s.sendWindow += inc
	c.sendCond.Broadcast()
	c.mu.Unlock()
	return nil
}

func (c *h2conn) onRSTStream(f *http2.RSTStreamFrame) error {
	c.mu.Lock()
	s, err := c.streamOrUnlock(f.StreamID, "RST_STREAM")
	if s == nil {
		return err
	}
	if !c.client && s.connecting {
		if err := c.earlyResetLocked(); err != nil {
			c.mu.Unlock()
			return err
		}
	}
	s.peerResetLocked(f.ErrCode)
	c.unlock()
	return nil
}

func (c *h2conn) onGoAway(f *http2.GoAwayFrame) error {
	c.mu.Lock()
	c.goAwayRecv = true
	c.goAwayLast = f.LastStreamID
	c.usable.Store(false)
	if c.client {
		for id, s := range c.streams {
			if id > f.LastStreamID {
				s.failLocked(fmt.Errorf("%w: GOAWAY (last stream %d)", errUnprocessed, f.LastStreamID))
			}
		}
	}
	c.unlock()
	ev := c.log.Debug()
	if f.ErrCode != http2.ErrCodeNo {
		ev = c.log.Info()
	}
	ev.Str("code", f.ErrCode.String()).Uint32("last_stream", f.LastStreamID).Bytes("debug", f.DebugData()).Msg("hbone: GOAWAY from peer")
	c.role.onGoAway()
	return nil
}

// errUnprocessed marks a stream the server did not process (GOAWAY with a
// lower last stream id, or REFUSED_STREAM): Dial may retry it elsewhere.
var errUnprocessed = errors.New("hbone: stream not processed by the server")

func (c *h2conn) onData(f *http2.DataFrame) error {
	id := f.StreamID
	flen := int64(f.Length)
	data := f.Data()
	c.mu.Lock()
	if flen > c.recvWindow {
		c.mu.Unlock()
		return connErrorf(http2.ErrCodeFlowControl, "DATA of %d bytes on stream %d exceeds the connection window (%d left)", flen, id, c.recvWindow)
	}
	c.recvWindow -= flen
	s := c.streams[id]
	if s == nil || s.recvEnded || s.rst {
		// Closed or never opened: give the bytes back to the connection.
		idle := s == nil && c.isIdleLocked(id)
		if s != nil && s.recvEnded && !s.rst {
			c.log.Info().Uint32("stream", id).Msg("hbone: DATA after END_STREAM from peer, resetting stream")
			s.resetLocked(http2.ErrCodeStreamClosed, fmt.Errorf("%w: DATA after END_STREAM from peer", ErrReset))
		}
		c.returnConnLocked(flen)
		c.unlock()
		c.kickAsync()
		if idle {
			return connErrorf(http2.ErrCodeProtocol, "DATA on idle stream %d", id)
		}
		return nil
	}
	if flen > s.recvWindow {
		c.log.Info().Uint32("stream", id).Int64("bytes", flen).Int64("window", s.recvWindow).
			Msg("hbone: DATA exceeds the stream window, resetting stream")
		s.resetLocked(http2.ErrCodeFlowControl, fmt.Errorf("%w: peer exceeded the flow-control window", ErrReset))
		c.returnConnLocked(flen)
		c.unlock()
		c.kickAsync()
		return nil
	}
	s.recvWindow -= flen
	if pad := flen - int64(len(data)); pad > 0 {
		c.returnConnLocked(pad)
		s.returnLocked(pad)
	}
	if len(data) > 0 {
		if s.readClosed {
			c.returnConnLocked(int64(len(data)))
		} else {
			s.buf.write(data)
			s.rcond.Signal()
			s.notifyReadLocked()
		}
	}
	if f.StreamEnded() {
		s.recvEnded = true
		s.rcond.Broadcast()
		s.notifyReadLocked()
		c.sendCond.Broadcast()
		s.finishLocked()
	}
	c.unlock()
	c.kickAsync()
	return nil
}

// returnConnLocked gives n consumed or discarded bytes back to the peer's
// connection window, with a WINDOW_UPDATE once enough accumulated.
func (c *h2conn) returnConnLocked(n int64) {
	c.recvUnacked += n
	if c.recvUnacked >= connUpdateThreshold && !c.closed {
		inc := c.recvUnacked
		c.recvUnacked = 0
		c.recvWindow += inc
		c.queue(func(fr *http2.Framer) error { return fr.WriteWindowUpdate(0, uint32(inc)) })
	}
}

// peerStreamError resets stream id after a malformed frame of it.
func (c *h2conn) peerStreamError(id uint32, code http2.ErrCode) error {
	c.mu.Lock()
	if s := c.streams[id]; s != nil {
		s.resetLocked(code, fmt.Errorf("%w: malformed frame from peer (%v)", ErrReset, code))
		c.unlock()
		c.kickAsync()
		return nil
	}
	if !c.client && id%2 == 1 && id > c.lastPeerID {
		// A bad HEADERS opening a stream: the id is used up.
		c.lastPeerID = id
	}
	c.mu.Unlock()
	if err := c.queue(func(fr *http2.Framer) error { return fr.WriteRSTStream(id, code) }); err != nil {
		return err
	}
	c.kickAsync()
	return nil
}

// writeHeaders queues a HEADERS block (split into CONTINUATIONs past the
// peer's frame size). pmu must not be held; the hpack encoder's state is
// shared, so encoding and queueing happen under pmu in wire order.
func (c *h2conn) writeHeadersLocked(id uint32, fields []hpack.HeaderField, end bool, maxFrame int) error {
	c.pmu.Lock()
	c.hbuf.Reset()
	for _, f := range fields {
		c.henc.WriteField(f)
	}
	block := c.hbuf.Bytes()
	first := true
	var err error
	for first || len(block) > 0 {
		n := min(len(block), maxFrame)
		frag := block[:n]
		block = block[n:]
		if first {
			err = c.cfr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: frag, EndStream: end, EndHeaders: len(block) == 0})
			first = false
		} else {
			err = c.cfr.WriteContinuation(id, len(block) == 0, frag)
		}
		if err != nil {
			break
		}
	}
	c.pmu.Unlock()
	c.hasPending.Store(true)
	return err
}
