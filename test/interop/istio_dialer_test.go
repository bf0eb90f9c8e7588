package interop

import (
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	istiohbone "istio.io/istio/pkg/hbone"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/test/interop/internal/istioid"
)

// istioDialer is Istio's HBONE dialer to proxy, presenting cert (none if
// nil) and requiring the server to be want.
func istioDialer(m *mesh, proxy netip.AddrPort, cert *tls.Certificate, want spiffeid.ID, state *tlsState) istiohbone.Dialer {
	return istiohbone.NewDialer(istiohbone.Config{
		ProxyAddress: proxy.String(),
		TLS:          m.istioClientTLS(cert, want, state),
	})
}

func istioDial(t *testing.T, d istiohbone.Dialer, target netip.AddrPort) (net.Conn, error) {
	t.Helper()
	return within(t, "Istio's dialer to "+target.String(), func() (net.Conn, error) {
		return d.Dial("tcp", target.String())
	})
}

// Istio's dialer, holding an SVID from our CA, reaches a workload through
// our server: a few MiB each way, byte-exact and at the same time; our
// handler sees the Istio client's identity; closing Istio's connection
// (END_STREAM) reaches the workload as EOF.
func TestIstioDialerThroughOurServer(t *testing.T) {
	m := newMesh(t)
	upload, download := payload(1, 4<<20+17), payload(2, 3<<20+5)

	gotUpload := make(chan []byte, 1)
	afterUpload := make(chan error, 1)
	workload := startWorkload(t, "tcp", "127.0.0.1:0", func(c *net.TCPConn) {
		var wg sync.WaitGroup
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.Write(download)
		}()
		buf := make([]byte, len(upload))
		n, _ := io.ReadFull(c, buf)
		gotUpload <- buf[:n]
		// Istio's dialer cannot half-close: its Close ends the stream,
		// which must arrive here as a clean EOF with nothing more.
		rest, err := io.ReadAll(c)
		if err == nil && len(rest) > 0 {
			err = fmt.Errorf("%d bytes after the upload", len(rest))
		}
		afterUpload <- err
		wg.Wait()
	})

	reqs := make(chan *hbone.Request, 4)
	srv := startOurServer(t, m, dialingHandler(reqs, nil))
	cert := m.istioCert(t, istioClientID)
	var state tlsState
	d := istioDialer(m, srv.addr, &cert, meshtunServerID, &state)

	c, err := istioDial(t, d, workload)
	if err != nil {
		t.Fatalf("Istio's dialer through our server: %v", err)
	}
	defer c.Close()

	writeErr := make(chan error, 1)
	go func() {
		_, err := c.Write(upload)
		writeErr <- err
	}()
	got, err := within(t, "reading the download", func() ([]byte, error) {
		b := make([]byte, len(download))
		n, err := io.ReadFull(c, b)
		return b[:n], err
	})
	if err != nil {
		t.Fatalf("Istio's dialer reading the workload's bytes: %v", err)
	}
	equalBytes(t, "workload -> Istio's dialer", got, download)
	if err := wait(t, "writing the upload", writeErr); err != nil {
		t.Fatalf("Istio's dialer writing: %v", err)
	}
	equalBytes(t, "Istio's dialer -> workload", wait(t, "workload reading the upload", gotUpload), upload)

	req := wait(t, "handler request", reqs)
	if req.Peer != istioClientID {
		t.Errorf("our handler saw peer %s, want the Istio client's SVID identity %s", req.Peer, istioClientID)
	}
	if req.Target != workload {
		t.Errorf("our handler saw target %s, want %s", req.Target, workload)
	}
	if !req.PeerAddr.Addr().IsLoopback() || req.LocalAddr != srv.addr {
		t.Errorf("our handler saw %s -> %s, want loopback -> %s", req.PeerAddr, req.LocalAddr, srv.addr)
	}

	// The TLS session, from both ends: TLS 1.3, h2, no SNI (the proxy
	// address is an IP), our server's identity as Istio reads it.
	cs := state.get()
	switch {
	case cs == nil:
		t.Error("Istio's dialer recorded no handshake")
	case cs.Version != tls.VersionTLS13 || cs.NegotiatedProtocol != "h2":
		t.Errorf("Istio's dialer negotiated TLS %#x ALPN %q, want TLS 1.3 and h2", cs.Version, cs.NegotiatedProtocol)
	default:
		if id, err := istioid.PeerID(cs.PeerCertificates[0].Raw); err != nil || id != meshtunServerID.String() {
			t.Errorf("Istio reads our server's identity as %q (%v), want %s", id, err, meshtunServerID)
		}
	}
	hellos := srv.hellos.all()
	if len(hellos) != 1 {
		t.Fatalf("our server saw %d ClientHellos, want 1", len(hellos))
	}
	if hellos[0].ServerName != "" || !slices.Contains(hellos[0].SupportedProtos, "h2") {
		t.Errorf("Istio's ClientHello: SNI %q, ALPN %q; want no SNI and h2", hellos[0].ServerName, hellos[0].SupportedProtos)
	}

	c.Close()
	if err := wait(t, "workload EOF after Istio's close", afterUpload); err != nil {
		t.Errorf("workload after Istio's dialer closed: %v, want a clean EOF", err)
	}
}

// Our server's refusals reach Istio's dialer as errors carrying the status:
// 401 for a policy denial, 503 for an unreachable target, 400 for an
// :authority that is not ip:port. A refusal is per stream: the pooled
// connection goes on carrying the next stream.
func TestIstioDialerRefusedByOurServer(t *testing.T) {
	m := newMesh(t)
	workload := startWorkload(t, "tcp", "127.0.0.1:0", echo)
	denied := startWorkload(t, "tcp", "127.0.0.1:0", func(c *net.TCPConn) {
		t.Errorf("denied workload was connected from %s", c.RemoteAddr())
	})
	unreachable := closedPort(t)

	reqs := make(chan *hbone.Request, 8)
	srv := startOurServer(t, m, dialingHandler(reqs, func(r *hbone.Request) error {
		if r.Target == denied {
			return fmt.Errorf("%w: %s may not call %s", hbone.ErrDenied, r.Peer, r.Target)
		}
		return nil
	}))
	cert := m.istioCert(t, istioClientID)
	d := istioDialer(m, srv.addr, &cert, meshtunServerID, nil)

	for _, tc := range []struct {
		name   string
		target string
		status string
	}{
		{"denied", denied.String(), "401 Unauthorized"},
		{"unreachable", unreachable.String(), "503 Service Unavailable"},
		{"host name", "localhost:" + strconv.Itoa(int(workload.Port())), "400 Bad Request"},
	} {
		c, err := within(t, "Istio's dialer to "+tc.target, func() (net.Conn, error) { return d.Dial("tcp", tc.target) })
		if err == nil {
			c.Close()
			t.Errorf("%s: Istio's dialer connected to %s, want an error with %s", tc.name, tc.target, tc.status)
			continue
		}
		if !strings.Contains(err.Error(), tc.status) {
			t.Errorf("%s: Istio's dialer error %q does not carry %q", tc.name, err, tc.status)
		}
		if tc.name == "host name" {
			continue // refused before the handler
		}
		if req := wait(t, "handler request", reqs); req.Peer != istioClientID || req.Target.String() != tc.target {
			t.Errorf("%s: handler saw %s -> %s, want %s -> %s", tc.name, req.Peer, req.Target, istioClientID, tc.target)
		}
	}

	c, err := istioDial(t, d, workload)
	if err != nil {
		t.Fatalf("Istio's dialer after three refusals: %v", err)
	}
	defer c.Close()
	<-reqs
	msg := []byte("still going")
	if _, err := c.Write(msg); err != nil {
		t.Fatal(err)
	}
	got, err := within(t, "echo", func() ([]byte, error) {
		b := make([]byte, len(msg))
		_, err := io.ReadFull(c, b)
		return b, err
	})
	if err != nil || string(got) != string(msg) {
		t.Errorf("echo after refusals: %q, %v", got, err)
	}
	if n := srv.OpenConns(); n != 1 {
		t.Errorf("our server serves %d connections, want Istio's one pooled connection", n)
	}
}

// Our server refuses Istio's dialer at the TLS handshake when it presents
// no certificate, or one from a CA of the same trust domain that we do not
// trust; the handler never runs.
func TestIstioDialerWithoutValidSVIDRefused(t *testing.T) {
	m := newMesh(t)
	workload := startWorkload(t, "tcp", "127.0.0.1:0", echo)
	reqs := make(chan *hbone.Request, 4)
	srv := startOurServer(t, m, dialingHandler(reqs, nil))

	rogue, err := identity.OpenCA(identity.CAConfig{Dir: t.TempDir(), TrustDomain: td})
	if err != nil {
		t.Fatal(err)
	}
	svid, err := rogue.Issue(t.Context(), istioClientID)
	if err != nil {
		t.Fatal(err)
	}
	rogueCert := tlsCert(svid)

	for _, tc := range []struct {
		name string
		cert *tls.Certificate
	}{{"no certificate", nil}, {"rogue CA", &rogueCert}} {
		d := istioDialer(m, srv.addr, tc.cert, meshtunServerID, nil)
		c, err := istioDial(t, d, workload)
		if err == nil {
			c.Close()
			t.Errorf("%s: Istio's dialer got through our server", tc.name)
			continue
		}
		t.Logf("%s: %v", tc.name, err)
	}
	select {
	case r := <-reqs:
		t.Errorf("handler ran for %s -> %s", r.Peer, r.Target)
	default:
	}
}

// Many concurrent Istio streams over one pooled connection to our server,
// each byte-exact.
func TestIstioDialerConcurrentStreams(t *testing.T) {
	m := newMesh(t)
	workload := startWorkload(t, "tcp", "127.0.0.1:0", echo)
	reqs := make(chan *hbone.Request, 64)
	srv := startOurServer(t, m, dialingHandler(reqs, nil))
	cert := m.istioCert(t, istioClientID)
	d := istioDialer(m, srv.addr, &cert, meshtunServerID, nil)

	const streams = 16
	errs := make(chan error, streams)
	for i := range streams {
		go func() {
			errs <- func() error {
				c, err := d.Dial("tcp", workload.String())
				if err != nil {
					return err
				}
				defer c.Close()
				data := payload(uint64(100+i), 256<<10+i)
				go c.Write(data)
				got := make([]byte, len(data))
				if _, err := io.ReadFull(c, got); err != nil {
					return fmt.Errorf("stream %d: %w", i, err)
				}
				if string(got) != string(data) {
					return fmt.Errorf("stream %d: echo differs", i)
				}
				return nil
			}()
		}()
	}
	var failed []error
	for range streams {
		if err := wait(t, "concurrent stream", errs); err != nil {
			failed = append(failed, err)
		}
	}
	if err := errors.Join(failed...); err != nil {
		t.Fatal(err)
	}
	if n := srv.OpenConns(); n != 1 {
		t.Errorf("our server serves %d connections for %d concurrent Istio streams, want 1", n, streams)
	}
}

// A server-first workload that sends and closes at once, reached by Istio's
// dialer through our server: Istio's dialer, which never half-closes, reads
// every byte and then EOF, which our server sends (END_STREAM) as soon as
// the workload's FIN arrives.
func TestIstioDialerUpstreamFINFirst(t *testing.T) {
	m := newMesh(t)
	banner := payload(6, 1<<20+7)
	workload := startWorkload(t, "tcp", "127.0.0.1:0", func(c *net.TCPConn) {
		c.Write(banner)
	})
	reqs := make(chan *hbone.Request, 1)
	srv := startOurServer(t, m, dialingHandler(reqs, nil))
	cert := m.istioCert(t, istioClientID)
	c, err := istioDial(t, istioDialer(m, srv.addr, &cert, meshtunServerID, nil), workload)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	got, err := within(t, "reading the banner", func() ([]byte, error) { return io.ReadAll(c) })
	if err != nil {
		t.Fatalf("Istio's dialer reading a server-first workload: %v", err)
	}
	equalBytes(t, "workload -> Istio's dialer", got, banner)
}

// A workload that resets its connection: our server resets the stream
// (RST_STREAM), and Istio's dialer turns that into an orderly EOF for its
// application. The bytes before the reset arrive; the reset itself is lost
// at Istio's end, as with ztunnel (ztunnel#1483).
func TestIstioDialerSeesOurResetAsEOF(t *testing.T) {
	m := newMesh(t)
	head := []byte("before the reset")
	workload := startWorkload(t, "tcp", "127.0.0.1:0", func(c *net.TCPConn) {
		c.Write(head)
		// Wait for the client's go-ahead so the bytes are out first.
		b := make([]byte, 1)
		if _, err := io.ReadFull(c, b); err != nil {
			return
		}
		c.SetLinger(0)
	})
	reqs := make(chan *hbone.Request, 1)
	srv := startOurServer(t, m, dialingHandler(reqs, nil))
	cert := m.istioCert(t, istioClientID)
	c, err := istioDial(t, istioDialer(m, srv.addr, &cert, meshtunServerID, nil), workload)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	got, err := within(t, "reading the head", func() ([]byte, error) {
		b := make([]byte, len(head))
		_, err := io.ReadFull(c, b)
		return b, err
	})
	if err != nil || string(got) != string(head) {
		t.Fatalf("Istio's dialer read %q, %v; want %q", got, err, head)
	}
	if _, err := c.Write([]byte("!")); err != nil {
		t.Fatal(err)
	}
	rest, err := within(t, "reading after the reset", func() ([]byte, error) { return io.ReadAll(c) })
	if err != nil || len(rest) != 0 {
		t.Errorf("Istio's dialer after our RST_STREAM: %d bytes, %v; want a plain EOF (Istio drops resets)", len(rest), err)
	}
}

// Istio's dialer over IPv6: proxy and target [::1]:port; our server parses
// the bracketed :authority and connects.
func TestIstioDialerIPv6(t *testing.T) {
	m := newMesh(t)
	workload := startWorkload(t, "tcp", "[::1]:0", echo)
	reqs := make(chan *hbone.Request, 1)
	srv := startOurServerOn(t, m, dialingHandler(reqs, nil), "[::1]:0")
	cert := m.istioCert(t, istioClientID)
	c, err := istioDial(t, istioDialer(m, srv.addr, &cert, meshtunServerID, nil), workload)
	if err != nil {
		t.Fatalf("Istio's dialer via [::1]: %v", err)
	}
	defer c.Close()
	msg := payload(7, 64<<10)
	go c.Write(msg)
	got, err := within(t, "echo", func() ([]byte, error) {
		b := make([]byte, len(msg))
		_, err := io.ReadFull(c, b)
		return b, err
	})
	if err != nil {
		t.Fatal(err)
	}
	equalBytes(t, "echo over IPv6", got, msg)
	if req := wait(t, "handler request", reqs); req.Target != workload || !req.PeerAddr.Addr().Is6() {
		t.Errorf("our handler saw %s from %s, want %s from an IPv6 peer", req.Target, req.PeerAddr, workload)
	}
}
