package hbone

import (
	"bytes"
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
)

// Frame-level tests: a raw http2.Framer client speaks to the server,
// well-formed and not, and checks what comes back.

// Targets of attackHandler.
var (
	echoTarget  = netip.MustParseAddrPort("127.0.0.1:7") // an echo upstream
	blockTarget = netip.MustParseAddrPort("127.0.0.1:9") // Connect blocks until its context ends
)

// attackHandler echoes on echoTarget and blocks on blockTarget, counting
// the Connect calls in progress.
type attackHandler struct {
	calls    atomic.Int64
	inFlight atomic.Int64
	maxSeen  atomic.Int64
	ended    atomic.Int64 // blocked Connects whose context ended
}

func (a *attackHandler) Connect(ctx context.Context, req *Request) (net.Conn, error) {
	a.calls.Add(1)
	switch req.Target {
	case echoTarget:
		x, y := net.Pipe()
		go func() {
			io.Copy(y, y)
			y.Close()
		}()
		return x, nil
	case blockTarget:
		n := a.inFlight.Add(1)
		for {
			m := a.maxSeen.Load()
			if n <= m || a.maxSeen.CompareAndSwap(m, n) {
				break
			}
		}
		<-ctx.Done()
		a.inFlight.Add(-1)
		a.ended.Add(1)
		return nil, ctx.Err()
	}
	return nil, ErrUnreachable
}

// rawClient is a raw HTTP/2 client connection to the fixture's server.
type rawClient struct {
	t    testing.TB
	tc   *tls.Conn
	fr   *http2.Framer
	henc *hpack.Encoder
	hbuf bytes.Buffer
}

// newRawClient connects, sends the preface and an empty SETTINGS.
func newRawClient(t testing.TB, f *fixture) *rawClient {
	t.Helper()
	cfg, _ := f.clientTLS(f.client, f.server)
	cfg = cfg.Clone()
	cfg.NextProtos = []string{"h2"}
	tc, err := tls.Dial("tcp", f.endpoint.String(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { tc.Close() })
	tc.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(tc, http2.ClientPreface); err != nil {
		t.Fatal(err)
	}
	rc := &rawClient{t: t, tc: tc, fr: http2.NewFramer(tc, tc)}
	rc.fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
	rc.fr.SetMaxReadFrameSize(MaxFrameSize)
	rc.henc = hpack.NewEncoder(&rc.hbuf)
	if err := rc.fr.WriteSettings(); err != nil {
		t.Fatal(err)
	}
	return rc
}

// block encodes a CONNECT to target with extra fields.
func (rc *rawClient) block(target netip.AddrPort, extra ...hpack.HeaderField) []byte {
	rc.hbuf.Reset()
	rc.henc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
	rc.henc.WriteField(hpack.HeaderField{Name: ":authority", Value: target.String()})
	for _, f := range extra {
		rc.henc.WriteField(f)
	}
	return bytes.Clone(rc.hbuf.Bytes())
}

func (rc *rawClient) connect(id uint32, target netip.AddrPort, extra ...hpack.HeaderField) {
	rc.t.Helper()
	err := rc.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: rc.block(target, extra...), EndHeaders: true})
	if err != nil {
		rc.t.Fatal(err)
	}
}

// until reads frames until match returns true; it fails the test if the
// connection ends first.
func (rc *rawClient) until(what string, match func(http2.Frame) bool) http2.Frame {
	rc.t.Helper()
	for {
		f, err := rc.fr.ReadFrame()
		if err != nil {
			rc.t.Fatalf("waiting for %s: %v", what, err)
		}
		if sf, ok := f.(*http2.SettingsFrame); ok && !sf.IsAck() {
			rc.fr.WriteSettingsAck()
		}
		if match(f) {
			return f
		}
	}
}

// status waits for the response HEADERS of stream id.
func (rc *rawClient) status(id uint32) string {
	rc.t.Helper()
	f := rc.until("response", func(f http2.Frame) bool {
		mh, ok := f.(*http2.MetaHeadersFrame)
		return ok && mh.StreamID == id
	})
	return f.(*http2.MetaHeadersFrame).PseudoValue("status")
}

// rst waits for RST_STREAM on id and returns its code.
func (rc *rawClient) rst(id uint32) http2.ErrCode {
	rc.t.Helper()
	f := rc.until("RST_STREAM", func(f http2.Frame) bool {
		r, ok := f.(*http2.RSTStreamFrame)
		return ok && r.StreamID == id
	})
	return f.(*http2.RSTStreamFrame).ErrCode
}

// goAway waits for GOAWAY, returns its code, and checks that the server
// then closes the connection.
func (rc *rawClient) goAway() http2.ErrCode {
	rc.t.Helper()
	var code http2.ErrCode
	for {
		f, err := rc.fr.ReadFrame()
		if err != nil {
			rc.t.Fatalf("connection ended without GOAWAY: %v", err)
		}
		if g, ok := f.(*http2.GoAwayFrame); ok {
			code = g.ErrCode
			break
		}
	}
	for {
		if _, err := rc.fr.ReadFrame(); err != nil {
			if !errors.Is(err, io.EOF) && !errors.Is(err, net.ErrClosed) && !strings.Contains(err.Error(), "reset") {
				rc.t.Errorf("after GOAWAY: %v, want the server to close", err)
			}
			return code
		}
	}
}

// echoWorks checks that a stream on this raw connection echoes.
func (rc *rawClient) echoWorks(id uint32) {
	rc.t.Helper()
	rc.connect(id, echoTarget)
	if s := rc.status(id); s != "200" {
		rc.t.Fatalf("stream %d: status %s, want 200", id, s)
	}
	rc.fr.WriteData(id, false, []byte("ping"))
	d := rc.until("echo", func(f http2.Frame) bool {
		df, ok := f.(*http2.DataFrame)
		return ok && df.StreamID == id && len(df.Data()) > 0
	})
	if got := string(d.(*http2.DataFrame).Data()); got != "ping" {
		rc.t.Fatalf("echo %q", got)
	}
}

// healthy checks that the fixture's client still gets an echo: other
// connections are unharmed.
func healthy(t testing.TB, f *fixture) {
	t.Helper()
	c, err := f.dial(ctxTimeout(t, 5*time.Second), echoTarget)
	if err != nil {
		t.Fatalf("a well-formed connection after the attack: %v", err)
	}
	defer c.Close()
	if _, err := c.Write([]byte("hello")); err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 5)
	if _, err := io.ReadFull(c, buf); err != nil || string(buf) != "hello" {
		t.Fatalf("echo after the attack: %q, %v", buf, err)
	}
}

func TestFramesMalformedHeadersResetOnlyTheStream(t *testing.T) {
	ah := &attackHandler{}
	f := newFixture(t, ah)
	rc := newRawClient(t, f)
	tests := []struct {
		name  string
		extra []hpack.HeaderField
	}{
		{"upper-case name", []hpack.HeaderField{{Name: "X-Upper", Value: "v"}}},
		{"newline in value", []hpack.HeaderField{{Name: "x-a", Value: "a\nb"}}},
		{"pseudo after regular", []hpack.HeaderField{{Name: "x-a", Value: "b"}, {Name: ":path", Value: "/"}}},
		{"unknown pseudo", []hpack.HeaderField{{Name: ":bogus", Value: "1"}}},
	}
	id := uint32(1)
	for _, tt := range tests {
		rc.connect(id, echoTarget, tt.extra...)
		if code := rc.rst(id); code != http2.ErrCodeProtocol {
			t.Errorf("%s: RST_STREAM %v, want PROTOCOL_ERROR", tt.name, code)
		}
		id += 2
	}
	// The connection goes on.
	rc.echoWorks(id)
	if n := ah.calls.Load(); n != 1 {
		t.Errorf("handler called %d times, want once (for the good stream)", n)
	}
	// A connection-specific header is a bad request (400).
	rc.connect(id+2, echoTarget, hpack.HeaderField{Name: "connection", Value: "close"})
	if s := rc.status(id + 2); s != "400" {
		t.Errorf("CONNECT with a connection header: %s, want 400", s)
	}
	healthy(t, f)
}

func TestFramesConnectionErrors(t *testing.T) {
	ah := &attackHandler{}
	f := newFixture(t, ah)
	tests := []struct {
		name string
		send func(rc *rawClient)
		want http2.ErrCode
	}{
		{"DATA on an idle stream", func(rc *rawClient) { rc.fr.WriteData(5, false, []byte("x")) }, http2.ErrCodeProtocol},
		{"HEADERS on an even stream", func(rc *rawClient) {
			rc.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 2, BlockFragment: rc.block(echoTarget), EndHeaders: true})
		}, http2.ErrCodeProtocol},
		{"HEADERS reusing a closed stream id", func(rc *rawClient) {
			rc.echoWorks(3)
			rc.connect(1, echoTarget)
		}, http2.ErrCodeStreamClosed},
		{"connection window overflow", func(rc *rawClient) { rc.fr.WriteWindowUpdate(0, maxWindow) }, http2.ErrCodeFlowControl},
		{"frame over MAX_FRAME_SIZE", func(rc *rawClient) {
			var h [9]byte
			h[0], h[1], h[2] = 0x20, 0, 0 // 2 MiB
			h[3] = byte(http2.FrameData)
			binary.BigEndian.PutUint32(h[5:], 1)
			rc.tc.Write(h[:])
		}, http2.ErrCodeFrameSize},
		{"PUSH_PROMISE from a client", func(rc *rawClient) {
			rc.connect(1, echoTarget)
			rc.fr.WritePushPromise(http2.PushPromiseParam{StreamID: 1, PromiseID: 2, BlockFragment: rc.block(echoTarget), EndHeaders: true})
		}, http2.ErrCodeProtocol},
		{"bad SETTINGS value", func(rc *rawClient) {
			rc.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 31})
		}, http2.ErrCodeFlowControl},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rc := newRawClient(t, f)
			tt.send(rc)
			if code := rc.goAway(); code != tt.want {
				t.Errorf("GOAWAY %v, want %v", code, tt.want)
			}
			healthy(t, f)
		})
	}
}

func TestFramesFirstFrameMustBeSettings(t *testing.T) {
	f := newFixture(t, &attackHandler{})
	cfg, _ := f.clientTLS(f.client, f.server)
	tc, err := tls.Dial("tcp", f.endpoint.String(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer tc.Close()
	tc.SetDeadline(time.Now().Add(10 * time.Second))
	io.WriteString(tc, http2.ClientPreface)
	rc := &rawClient{t: t, tc: tc, fr: http2.NewFramer(tc, tc)}
	rc.fr.WritePing(false, [8]byte{})
	if code := rc.goAway(); code != http2.ErrCodeProtocol {
		t.Errorf("GOAWAY %v, want PROTOCOL_ERROR", code)
	}
}

func TestFramesStreamFlowControl(t *testing.T) {
	// The upstream never reads, so the server never returns window: the
	// client may send StreamWindow bytes and not one more.
	hold := HandlerFunc(func(ctx context.Context, req *Request) (net.Conn, error) {
		x, y := net.Pipe()
		context.AfterFunc(ctx, func() { y.Close() })
		return x, nil
	})
	f := newFixture(t, hold)
	rc := newRawClient(t, f)
	// Our SETTINGS let the server send nothing large; we do not need it.
	rc.connect(1, echoTarget)
	if s := rc.status(1); s != "200" {
		t.Fatalf("status %s", s)
	}
	chunk := make([]byte, MaxFrameSize)
	for range StreamWindow / MaxFrameSize {
		if err := rc.fr.WriteData(1, false, chunk); err != nil {
			t.Fatal(err)
		}
	}
	rc.fr.WriteData(1, false, []byte("x"))
	if code := rc.rst(1); code != http2.ErrCodeFlowControl {
		t.Errorf("RST_STREAM %v after the stream window was exceeded, want FLOW_CONTROL_ERROR", code)
	}
	// A stream window overflow is a stream error too.
	rc.connect(3, echoTarget)
	if s := rc.status(3); s != "200" {
		t.Fatalf("status %s", s)
	}
	rc.fr.WriteWindowUpdate(3, maxWindow)
	if code := rc.rst(3); code != http2.ErrCodeFlowControl {
		t.Errorf("RST_STREAM %v after a stream window overflow, want FLOW_CONTROL_ERROR", code)
	}
}

func TestFramesHeaderListTooLarge(t *testing.T) {
	ah := &attackHandler{}
	f := newFixture(t, ah)
	rc := newRawClient(t, f)
	big := strings.Repeat("a", 35<<10)
	rc.connect(1, echoTarget, hpack.HeaderField{Name: "x-a", Value: big}, hpack.HeaderField{Name: "x-b", Value: big})
	if s := rc.status(1); s != "431" {
		t.Errorf("status %s for a header list over 64 KiB, want 431", s)
	}
	rc.echoWorks(3)
	if n := ah.calls.Load(); n != 1 {
		t.Errorf("handler called %d times, want once", n)
	}
}

func TestFramesContinuationFlood(t *testing.T) {
	ah := &attackHandler{}
	f := newFixture(t, ah)
	rc := newRawClient(t, f)
	rc.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: rc.block(echoTarget), EndHeaders: false})
	field := strings.Repeat("b", 1000)
	done := make(chan struct{})
	go func() {
		defer close(done)
		// Endless CONTINUATIONs: the server must give up long before
		// the sender does.
		for range 100000 {
			rc.hbuf.Reset()
			rc.henc.WriteField(hpack.HeaderField{Name: "x-flood", Value: field})
			if rc.fr.WriteContinuation(1, false, rc.hbuf.Bytes()) != nil {
				return
			}
		}
	}()
	if code := rc.goAway(); code != http2.ErrCodeProtocol {
		t.Errorf("GOAWAY %v, want PROTOCOL_ERROR", code)
	}
	rc.tc.Close()
	<-done
	if n := ah.calls.Load(); n != 0 {
		t.Errorf("handler called %d times", n)
	}
	healthy(t, f)
}

func TestFramesRapidReset(t *testing.T) {
	ah := &attackHandler{}
	f := newFixture(t, ah)
	rc := newRawClient(t, f)
	go func() {
		block := rc.block(blockTarget)
		for id := uint32(1); id < 20000; id += 2 {
			if rc.fr.WriteHeaders(http2.HeadersFrameParam{StreamID: id, BlockFragment: block, EndHeaders: true}) != nil {
				return
			}
			if rc.fr.WriteRSTStream(id, http2.ErrCodeCancel) != nil {
				return
			}
		}
	}()
	if code := rc.goAway(); code != http2.ErrCodeEnhanceYourCalm {
		t.Errorf("GOAWAY %v, want ENHANCE_YOUR_CALM", code)
	}
	if m := ah.maxSeen.Load(); m > MaxStreamsPerConn {
		t.Errorf("%d Connects ran at once, over the %d streams allowed", m, MaxStreamsPerConn)
	}
	// Every Connect's context ends.
	deadline := time.Now().Add(5 * time.Second)
	for ah.inFlight.Load() != 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%d Connects still running after the connection closed", ah.inFlight.Load())
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Logf("%d Connect calls before the connection was closed, at most %d at once", ah.calls.Load(), ah.maxSeen.Load())
	healthy(t, f)
}

func TestFramesControlFloods(t *testing.T) {
	f := newFixture(t, &attackHandler{})
	for _, tt := range []struct {
		name string
		send func(fr *http2.Framer) error
	}{
		{"SETTINGS", func(fr *http2.Framer) error { return fr.WriteSettings() }},
		{"PING", func(fr *http2.Framer) error { return fr.WritePing(false, [8]byte{1}) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rc := newRawClient(t, f)
			go func() {
				for range 100000 {
					if tt.send(rc.fr) != nil {
						return
					}
				}
			}()
			if code := rc.goAway(); code != http2.ErrCodeEnhanceYourCalm {
				t.Errorf("GOAWAY %v, want ENHANCE_YOUR_CALM", code)
			}
			healthy(t, f)
		})
	}
}

func TestFramesTooManyStreamsRefused(t *testing.T) {
	ah := &attackHandler{}
	f := newFixture(t, ah)
	rc := newRawClient(t, f)
	id := uint32(1)
	for range MaxStreamsPerConn {
		rc.connect(id, echoTarget)
		id += 2
	}
	rc.connect(id, echoTarget)
	if code := rc.rst(id); code != http2.ErrCodeRefusedStream {
		t.Errorf("stream %d past the limit: RST_STREAM %v, want REFUSED_STREAM", MaxStreamsPerConn+1, code)
	}
	// Ending one stream makes room.
	rc.fr.WriteRSTStream(1, http2.ErrCodeCancel)
	rc.echoWorks(id + 2)
}

// TestFramesDrain: GOAWAY(NO_ERROR) with the last stream processed; open
// streams go on; new ones are refused; the server closes once the last
// stream ended.
func TestFramesDrain(t *testing.T) {
	f := newFixture(t, &attackHandler{})
	rc := newRawClient(t, f)
	rc.echoWorks(1)
	f.srv.Drain(context.Background())
	g := rc.until("GOAWAY", func(f http2.Frame) bool { _, ok := f.(*http2.GoAwayFrame); return ok }).(*http2.GoAwayFrame)
	if g.ErrCode != http2.ErrCodeNo || g.LastStreamID != 1 {
		t.Errorf("GOAWAY %v last %d, want NO_ERROR, last 1", g.ErrCode, g.LastStreamID)
	}
	rc.connect(3, echoTarget)
	if code := rc.rst(3); code != http2.ErrCodeRefusedStream {
		t.Errorf("new stream while draining: %v, want REFUSED_STREAM", code)
	}
	// Stream 1 still works.
	rc.fr.WriteData(1, false, []byte("more"))
	d := rc.until("echo", func(f http2.Frame) bool { df, ok := f.(*http2.DataFrame); return ok && df.StreamID == 1 })
	if string(d.(*http2.DataFrame).Data()) != "more" {
		t.Errorf("echo after drain: %q", d.(*http2.DataFrame).Data())
	}
	// The echo upstream cannot half-close: end the stream with a reset.
	rc.fr.WriteRSTStream(1, http2.ErrCodeCancel)
	start := time.Now()
	for {
		if _, err := rc.fr.ReadFrame(); err != nil {
			break // closed once idle
		}
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("drained connection closed %s after its last stream ended", d)
	}
}

// fakeServers accepts TLS connections and runs fn on each with its index.
func fakeServers(t *testing.T, ids *identities, fn func(i int, fr *http2.Framer, c *tls.Conn)) netip.AddrPort {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	go func() {
		for i := 0; ; i++ {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer c.Close()
				tc := tls.Server(c, ids.serverTLS)
				tc.SetDeadline(time.Now().Add(10 * time.Second))
				if tc.Handshake() != nil {
					return
				}
				preface := make([]byte, len(http2.ClientPreface))
				if _, err := io.ReadFull(tc, preface); err != nil {
					return
				}
				fr := http2.NewFramer(tc, tc)
				fr.ReadMetaHeaders = hpack.NewDecoder(4096, nil)
				fr.WriteSettings()
				fn(i, fr, tc)
			}()
		}
	}()
	return ln.Addr().(*net.TCPAddr).AddrPort()
}

// TestDialRetriesUnprocessedStreams: a stream the server did not process
// (REFUSED_STREAM, or beyond a GOAWAY's last stream) is retried once on a
// fresh connection.
func TestDialRetriesUnprocessedStreams(t *testing.T) {
	for _, how := range []string{"REFUSED_STREAM", "GOAWAY"} {
		t.Run(how, func(t *testing.T) {
			ids := newIdentities(t)
			var conns atomic.Int32
			ep := fakeServers(t, ids, func(i int, fr *http2.Framer, c *tls.Conn) {
				conns.Add(1)
				for {
					f, err := fr.ReadFrame()
					if err != nil {
						return
					}
					mh, ok := f.(*http2.MetaHeadersFrame)
					if !ok {
						continue
					}
					switch {
					case i > 0:
						var b bytes.Buffer
						hpack.NewEncoder(&b).WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
						fr.WriteHeaders(http2.HeadersFrameParam{StreamID: mh.StreamID, BlockFragment: b.Bytes(), EndHeaders: true})
					case how == "GOAWAY":
						fr.WriteGoAway(0, http2.ErrCodeNo, nil)
					default:
						fr.WriteRSTStream(mh.StreamID, http2.ErrCodeRefusedStream)
					}
				}
			})
			c, err := NewClient(ClientConfig{TLS: ids.clientTLS, Logger: testLogger(t)})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			conn, err := c.Dial(ctxTimeout(t, 5*time.Second), DialRequest{Source: ids.client, Destination: ids.server, Endpoint: ep, Target: echoTarget})
			if err != nil {
				t.Fatalf("Dial: %v, want a retry on a fresh connection to succeed", err)
			}
			conn.Abort()
			if n := conns.Load(); n != 2 {
				t.Errorf("%d connections, want 2", n)
			}
		})
	}
}

// TestClientRespectsServerStreamLimit: a server allowing 2 streams gets no
// third on the connection; the client opens another.
func TestClientRespectsServerStreamLimit(t *testing.T) {
	ids := newIdentities(t)
	var conns atomic.Int32
	ep := fakeServers(t, ids, func(i int, fr *http2.Framer, c *tls.Conn) {
		conns.Add(1)
		fr.WriteSettings(http2.Setting{ID: http2.SettingMaxConcurrentStreams, Val: 2})
		open := 0
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.SettingsFrame:
				if !f.IsAck() {
					fr.WriteSettingsAck()
				}
			case *http2.MetaHeadersFrame:
				open++
				if open > 2 {
					t.Errorf("connection %d: stream %d is the %dth open, over the limit of 2", i, f.StreamID, open)
				}
				var b bytes.Buffer
				hpack.NewEncoder(&b).WriteField(hpack.HeaderField{Name: ":status", Value: "200"})
				fr.WriteHeaders(http2.HeadersFrameParam{StreamID: f.StreamID, BlockFragment: b.Bytes(), EndHeaders: true})
			}
		}
	})
	c, err := NewClient(ClientConfig{TLS: ids.clientTLS, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var all []*Conn
	for range 3 {
		conn, err := c.Dial(ctxTimeout(t, 5*time.Second), DialRequest{Source: ids.client, Destination: ids.server, Endpoint: ep, Target: echoTarget})
		if err != nil {
			t.Fatal(err)
		}
		all = append(all, conn)
	}
	if s := c.Stats(); s.Conns != 2 || s.Streams != 3 {
		t.Errorf("3 streams with a server limit of 2: %+v, want 2 connections", s)
	}
	for _, x := range all {
		x.Abort()
	}
}

// TestStreamWriteToHandsOverData: Conn.WriteTo delivers the response to a
// writer and returns nil at the server's END_STREAM.
func TestStreamWriteTo(t *testing.T) {
	f := newFixture(t, dialHandler)
	up := newUpstream(t)
	conn, err := f.dial(ctxTimeout(t, 5*time.Second), up.addr)
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	uc := up.accept(t)
	data := randomBytes(t, 5<<20+3)
	go func() {
		uc.Write(data)
		uc.CloseWrite()
	}()
	var got bytes.Buffer
	n, err := conn.WriteTo(&got)
	if err != nil || n != int64(len(data)) || !bytes.Equal(got.Bytes(), data) {
		t.Fatalf("WriteTo = %d, %v; want %d bytes, byte-exact", n, err, len(data))
	}
}

// FuzzServerFrames feeds arbitrary bytes after the client preface to a
// server while a well-formed stream of another connection keeps echoing.
func FuzzServerFrames(f *testing.F) {
	// The test writer may not be used from inside the fuzz target.
	fx := newFixture(f, &attackHandler{}, func(s *ServerConfig, c *ClientConfig) {
		s.Logger, c.Logger = zerolog.Nop(), zerolog.Nop()
	})
	good, err := fx.dial(ctxTimeout(f, time.Minute), echoTarget)
	if err != nil {
		f.Fatal(err)
	}
	defer good.Close()
	// Seeds: SETTINGS, then a CONNECT, DATA and more, as a client sends.
	var seed bytes.Buffer
	fr := http2.NewFramer(&seed, nil)
	fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 20})
	var hb bytes.Buffer
	enc := hpack.NewEncoder(&hb)
	enc.WriteField(hpack.HeaderField{Name: ":method", Value: "CONNECT"})
	enc.WriteField(hpack.HeaderField{Name: ":authority", Value: echoTarget.String()})
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: hb.Bytes(), EndHeaders: true})
	fr.WriteData(1, false, []byte("hello"))
	fr.WriteWindowUpdate(1, 100)
	fr.WritePing(false, [8]byte{})
	fr.WriteRSTStream(1, http2.ErrCodeCancel)
	fr.WriteData(1, true, nil)
	fr.WriteGoAway(1, http2.ErrCodeNo, nil)
	f.Add(seed.Bytes())
	f.Add([]byte{0, 0, 0, 4, 0, 0, 0, 0, 0})
	f.Add([]byte("junk that is not a frame"))
	cfg, _ := fx.clientTLS(fx.client, fx.server)
	cfg = cfg.Clone()
	cfg.NextProtos = []string{"h2"}
	f.Fuzz(func(t *testing.T, data []byte) {
		tc, err := tls.Dial("tcp", fx.endpoint.String(), cfg)
		if err != nil {
			t.Fatal(err)
		}
		defer tc.Close()
		tc.SetDeadline(time.Now().Add(200 * time.Millisecond))
		tc.Write([]byte(http2.ClientPreface))
		tc.Write(data)
		io.Copy(io.Discard, tc) // until the server closes or the deadline
		if _, err := good.Write([]byte("x")); err != nil {
			t.Fatalf("the well-formed stream failed: %v", err)
		}
		var b [1]byte
		if _, err := io.ReadFull(good, b[:]); err != nil {
			t.Fatalf("the well-formed stream failed: %v", err)
		}
	})
}

// TestFramesResetWhileConnectingReturnsWindow: DATA sent on a stream that
// the client resets while its Connect runs is given back to the
// connection window; otherwise a few such streams would leave the
// connection without window for good.
func TestFramesResetWhileConnectingReturnsWindow(t *testing.T) {
	ah := &attackHandler{}
	f := newFixture(t, ah)
	rc := newRawClient(t, f)
	rc.connect(1, blockTarget)
	chunk := make([]byte, MaxFrameSize)
	for range StreamWindow / MaxFrameSize {
		if err := rc.fr.WriteData(1, false, chunk); err != nil {
			t.Fatal(err)
		}
	}
	rc.fr.WriteRSTStream(1, http2.ErrCodeCancel)
	rc.tc.SetReadDeadline(time.Now().Add(3 * time.Second))
	var got uint32
	for got < StreamWindow {
		f := rc.until("connection WINDOW_UPDATE", func(f http2.Frame) bool {
			w, ok := f.(*http2.WindowUpdateFrame)
			return ok && w.StreamID == 0
		})
		got += f.(*http2.WindowUpdateFrame).Increment
		if got == ConnWindow-initialWindow {
			got = 0 // the initial one
		}
	}
}

// abortConn is an upstream whose writes block until it is closed, and
// which reports an Abort.
type abortConn struct {
	net.Conn
	aborted chan struct{}
	once    sync.Once
}

func (a *abortConn) Abort() error {
	a.once.Do(func() { close(a.aborted) })
	return a.Conn.Close()
}

// TestFramesResetAbortsBlockedUpstream: RST_STREAM from the client aborts
// the upstream even while the relay is blocked writing to it (an upstream
// that does not read), so that a reset stream, which no longer counts
// against the stream limit, holds no relay.
func TestFramesResetAbortsBlockedUpstream(t *testing.T) {
	ups := make(chan *abortConn, 1)
	f := newFixture(t, HandlerFunc(func(ctx context.Context, req *Request) (net.Conn, error) {
		x, y := net.Pipe() // nobody reads y: writes to x block
		t.Cleanup(func() { y.Close() })
		a := &abortConn{Conn: x, aborted: make(chan struct{})}
		ups <- a
		return a, nil
	}))
	rc := newRawClient(t, f)
	rc.connect(1, echoTarget)
	if s := rc.status(1); s != "200" {
		t.Fatalf("status %s", s)
	}
	a := <-ups
	rc.fr.WriteData(1, false, []byte("stuck"))
	rc.fr.WriteRSTStream(1, http2.ErrCodeCancel)
	select {
	case <-a.aborted:
	case <-time.After(3 * time.Second):
		t.Fatal("upstream not aborted 3 s after RST_STREAM from the client")
	}
}

// TestClientResetBeforeResponseReturnsWindow: DATA a server sent on a
// stream before resetting it without a response is given back to the
// connection window, not kept by a stream Dial dropped.
func TestClientResetBeforeResponseReturnsWindow(t *testing.T) {
	ids := newIdentities(t)
	returned := make(chan uint32, 1)
	ep := fakeServers(t, ids, func(i int, fr *http2.Framer, c *tls.Conn) {
		var got uint32
		for {
			f, err := fr.ReadFrame()
			if err != nil {
				return
			}
			switch f := f.(type) {
			case *http2.SettingsFrame:
				if !f.IsAck() {
					fr.WriteSettingsAck()
				}
			case *http2.MetaHeadersFrame:
				chunk := make([]byte, 1<<20)
				for range StreamWindow / len(chunk) {
					fr.WriteData(f.StreamID, false, chunk)
				}
				fr.WriteRSTStream(f.StreamID, http2.ErrCodeInternal)
			case *http2.WindowUpdateFrame:
				if f.StreamID != 0 || f.Increment == ConnWindow-initialWindow {
					continue
				}
				if got += f.Increment; got >= StreamWindow {
					returned <- got
					return
				}
			}
		}
	})
	c, err := NewClient(ClientConfig{TLS: ids.clientTLS, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.Dial(ctxTimeout(t, 5*time.Second), DialRequest{Source: ids.client, Destination: ids.server, Endpoint: ep, Target: echoTarget}); err == nil {
		t.Fatal("Dial succeeded on a stream reset without a response")
	}
	select {
	case <-returned:
	case <-time.After(3 * time.Second):
		t.Fatal("the reset stream's DATA was not given back to the connection window")
	}
}

// floodTarget is an upstream that sends without end.
var floodTarget = netip.MustParseAddrPort("127.0.0.1:19")

// floodHandler connects floodTarget to an upstream that writes until its
// connection is closed.
type floodHandler struct{}

func (floodHandler) Connect(ctx context.Context, req *Request) (net.Conn, error) {
	if req.Target != floodTarget {
		return nil, ErrUnreachable
	}
	x, y := net.Pipe()
	go func() {
		buf := make([]byte, 64<<10)
		for {
			if _, err := y.Write(buf); err != nil {
				y.Close()
				return
			}
		}
	}()
	return x, nil
}

// TestFramesPeerThatStopsReadingIsClosed: a client that grants a huge
// window, then never reads while it keeps sending frames (so the
// keepalive, which counts frames received, never pings), blocks the
// server's writes. The server must close that connection once its writes
// made no progress for PingTimeout, rather than keep the relay, its
// upstream and every stream of the connection stuck for good.
func TestFramesPeerThatStopsReadingIsClosed(t *testing.T) {
	f := newFixture(t, floodHandler{}, func(s *ServerConfig, _ *ClientConfig) {
		s.PingInterval, s.PingTimeout = 50*time.Millisecond, 200*time.Millisecond
	})
	rc := newRawClient(t, f)
	rc.tc.SetDeadline(time.Time{})
	if err := rc.fr.WriteSettings(http2.Setting{ID: http2.SettingInitialWindowSize, Val: 1 << 30}); err != nil {
		t.Fatal(err)
	}
	if err := rc.fr.WriteWindowUpdate(0, 1<<30); err != nil {
		t.Fatal(err)
	}
	rc.connect(1, floodTarget)
	deadline := time.Now().Add(10 * time.Second)
	for i := uint64(0); ; i++ {
		// Frames keep coming in; none is read.
		var data [8]byte
		binary.BigEndian.PutUint64(data[:], i)
		rc.tc.SetWriteDeadline(time.Now().Add(time.Second))
		werr := rc.fr.WritePing(false, data)
		if n := f.srv.OpenConns(); n == 0 || werr != nil {
			return // closed: the server gave up on the peer
		}
		if time.Now().After(deadline) {
			t.Fatalf("the server still serves a peer that has read nothing for 10 s (PingTimeout 200 ms)")
		}
		time.Sleep(20 * time.Millisecond) // the pace of the peer's PINGs, not a wait for the server
	}
}
