package hbone

import (
	"context"
	"crypto/x509"
	"errors"
	"net"
	"net/netip"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
)

// closeWatch is a connection whose Close is signalled on closed.
type closeWatch struct {
	net.Conn
	once   sync.Once
	closed chan struct{}
}

func (c *closeWatch) Close() error {
	c.once.Do(func() { close(c.closed) })
	return c.Conn.Close()
}

// holdOpened is a zerolog hook that, when the client logs that a
// connection opened, waits until that connection was closed (the server's
// refusal read): the client then goes on with a connection already dead,
// the order in which a loaded machine once made it dial again.
type holdOpened struct {
	mu    sync.Mutex
	conns []*closeWatch
	held  atomic.Int32
}

func (h *holdOpened) Run(e *zerolog.Event, _ zerolog.Level, msg string) {
	if msg != "hbone: connection opened" {
		return
	}
	h.mu.Lock()
	c := h.conns[len(h.conns)-1]
	h.mu.Unlock()
	select {
	case <-c.closed:
		h.held.Add(1)
	case <-time.After(5 * time.Second):
	}
}

// refusing is an HBONE server that refuses every client certificate
// (after release is closed, if not nil) and a client whose dials and
// handshakes are counted and whose "connection opened" waits for the
// server's refusal (holdOpened).
type refusing struct {
	*fixture
	hold       *holdOpened
	dials      atomic.Int32
	handshakes atomic.Int32
}

func newRefusing(t *testing.T, release chan struct{}) *refusing {
	r := &refusing{hold: &holdOpened{}}
	r.fixture = newFixture(t, dialHandler, func(s *ServerConfig, c *ClientConfig) {
		s.TLS = s.TLS.Clone()
		s.TLS.VerifyPeerCertificate = func([][]byte, [][]*x509.Certificate) error {
			r.handshakes.Add(1)
			if release != nil {
				<-release
			}
			return errors.New("test: client certificate refused")
		}
		c.Logger = testLogger(t).Level(zerolog.DebugLevel).Hook(zerolog.HookFunc(r.hold.Run))
		c.Dial = func(ctx context.Context, network, addr string) (net.Conn, error) {
			r.dials.Add(1)
			var d net.Dialer
			raw, err := d.DialContext(ctx, network, addr)
			if err != nil {
				return nil, err
			}
			w := &closeWatch{Conn: raw, closed: make(chan struct{})}
			r.hold.mu.Lock()
			r.hold.conns = append(r.hold.conns, w)
			r.hold.mu.Unlock()
			return w, nil
		}
	})
	return r
}

// check asserts one dial and one server handshake in all, and an empty
// pool.
func (r *refusing) check(t *testing.T) {
	t.Helper()
	if r.hold.held.Load() == 0 {
		t.Fatal("the test hook never saw a connection closed by the server's refusal; the test does not test the race")
	}
	if n := r.dials.Load(); n != 1 {
		t.Errorf("the client dialled %d connections, want 1", n)
	}
	if n := r.handshakes.Load(); n != 1 {
		t.Errorf("the server checked %d client certificates, want 1", n)
	}
	if s := r.cl.Stats(); s.Conns != 0 || s.Streams != 0 {
		t.Errorf("pool after the refusal: %+v, want empty", s)
	}
}

// TestRefusedClientCertificateIsOneFailure: in TLS 1.3 the client's
// handshake completes before the server has checked the client's
// certificate, so a refusal arrives as an alert on a connection the client
// already pooled. That is one failed Dial, one connection, one handshake
// at the server: the client must not open a second connection by itself
// (the server counts each as a TLS failure).
func TestRefusedClientCertificateIsOneFailure(t *testing.T) {
	r := newRefusing(t, nil)
	_, err := r.dial(ctxTimeout(t, 2*time.Second), netip.MustParseAddrPort("127.0.0.1:9"))
	if err == nil {
		t.Fatal("Dial with a refused client certificate succeeded")
	}
	if !strings.Contains(err.Error(), "bad certificate") {
		t.Errorf("Dial: %v, want the server's refusal (bad certificate)", err)
	}
	r.check(t)
}

// TestRefusedClientCertificateConcurrentDials: Dials that wait for
// another's connection to the same key share its refusal instead of each
// dialling again.
func TestRefusedClientCertificateConcurrentDials(t *testing.T) {
	release := make(chan struct{})
	r := newRefusing(t, release)
	const n = 4
	errs := make(chan error, n)
	for range n {
		go func() {
			_, err := r.dial(ctxTimeout(t, 2*time.Second), netip.MustParseAddrPort("127.0.0.1:9"))
			errs <- err
		}()
	}
	// The first Dial's connection is held until the server refuses it,
	// which waits for release: the others wait for that connection.
	waitGoroutines(t, "hbone.(*Client).reserve", "[select", n-1)
	close(release)
	for range n {
		err := <-errs
		if err == nil {
			t.Fatal("Dial with a refused client certificate succeeded")
		}
		if !strings.Contains(err.Error(), "bad certificate") {
			t.Errorf("Dial: %v, want the server's refusal (bad certificate)", err)
		}
	}
	r.check(t)
}

// waitGoroutines waits until want goroutines are blocked in state (as
// runtime.Stack prints it) with fn the innermost function.
func waitGoroutines(t *testing.T, fn, state string, want int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	buf := make([]byte, 1<<20)
	for {
		got := 0
		for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
			lines := strings.SplitN(g, "\n", 3)
			if len(lines) >= 2 && strings.Contains(lines[0], state) && strings.Contains(lines[1], fn+"(") {
				got++
			}
		}
		if got >= want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines %s in %s after 10s, want %d", got, state, fn, want)
		}
		runtime.Gosched()
		time.Sleep(time.Millisecond)
	}
}
