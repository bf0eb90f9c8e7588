package e2e

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"golang.org/x/sys/unix"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/protocols/hbone"
)

// sniffer captures every frame on the fabric (the node-to-node bridge)
// with an AF_PACKET socket, so a test can ask whether some bytes crossed
// the wire in plaintext.
type sniffer struct {
	f       *os.File
	mu      sync.Mutex
	data    []byte        // all frames so far, concatenated
	changed chan struct{} // closed and replaced on every frame
	done    chan struct{}
}

func sniff(t testing.TB, fabric *cluster.NS) *sniffer {
	t.Helper()
	var fd int
	err := fabric.Do(func() (err error) {
		fd, err = unix.Socket(unix.AF_PACKET, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, int(htons(unix.ETH_P_ALL)))
		return err
	})
	if err != nil {
		t.Fatalf("AF_PACKET socket in %s: %v", fabric.Name(), err)
	}
	unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 64<<20)
	s := &sniffer{f: os.NewFile(uintptr(fd), "sniffer"), changed: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(s.done)
		buf := make([]byte, 1<<16)
		for {
			n, err := s.f.Read(buf)
			if err != nil {
				return
			}
			s.mu.Lock()
			s.data = append(s.data, buf[:n]...)
			close(s.changed)
			s.changed = make(chan struct{})
			s.mu.Unlock()
		}
	}()
	t.Cleanup(func() { s.f.Close(); <-s.done })
	return s
}

func htons(v uint16) uint16 { return v<<8 | v>>8 }

// seen reports whether marker appeared in any captured frame.
func (s *sniffer) seen(marker []byte) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return bytes.Contains(s.data, marker)
}

// waitSeen waits until marker has been captured, or timeout.
func (s *sniffer) waitSeen(marker []byte, timeout time.Duration) bool {
	deadline := time.After(timeout)
	for {
		s.mu.Lock()
		found, ch := bytes.Contains(s.data, marker), s.changed
		s.mu.Unlock()
		if found {
			return true
		}
		select {
		case <-ch:
		case <-deadline:
			return false
		}
	}
}

// captured reports how many bytes were captured.
func (s *sniffer) captured() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.data)
}

// TestSecurity checks that mesh traffic crosses the wire encrypted and
// that the HBONE endpoint of a node refuses every peer without a valid
// identity, delivering nothing.
func TestSecurity(t *testing.T) {
	mc := newMeshCluster(t, "sec")
	mc.m1 = mc.start(t, mc.n1)
	mc.m2 = mc.start(t, mc.n2)
	p11, p21, p22 := mc.p11, mc.p21, mc.p22

	t.Run("mesh payload never on the wire in plaintext; passthrough is", func(t *testing.T) {
		sn := sniff(t, mc.c.Fabric)
		send := func(srv *cluster.Pod, port int, marker []byte) {
			serve(t, srv, port, func(c net.Conn) { io.Copy(c, c) })
			cl := dial(t, p11.NS, srv.IPv4, port)
			cl.SetDeadline(time.Now().Add(10 * time.Second))
			for i := 0; i < 50; i++ {
				if _, err := cl.Write(marker); err != nil {
					t.Fatal(err)
				}
				if _, err := io.ReadFull(cl, make([]byte, len(marker))); err != nil {
					t.Fatal(err)
				}
			}
			cl.Close()
		}
		meshMarker := []byte(fmt.Sprintf("MESHTUN-SECRET-%d-mesh", time.Now().UnixNano()))
		plainMarker := []byte(fmt.Sprintf("MESHTUN-SECRET-%d-plain", time.Now().UnixNano()))
		send(p21, 7020, meshMarker)  // mesh workload: HBONE
		send(p22, 7021, plainMarker) // outside the mesh: passthrough
		// The passthrough marker is the capture's own readiness signal:
		// once it shows, the capture is running and saw that traffic.
		if !sn.waitSeen(plainMarker, 5*time.Second) {
			t.Fatalf("the plaintext marker never showed in %d captured bytes: the capture does not see the wire", sn.captured())
		}
		if sn.seen(meshMarker) {
			t.Fatalf("the mesh marker crossed the node-to-node link in plaintext")
		}
		if !sn.seen([]byte{0x17, 0x03, 0x03}) {
			t.Fatalf("no TLS application-data record seen on the wire")
		}
	})

	ca, err := identity.OpenCA(identity.CAConfig{Dir: caDir(t, mc.c), TrustDomain: td(t, "cluster.local")})
	if err != nil {
		t.Fatal(err)
	}
	realBundle := ca.Bundle()
	target := netip.AddrPortFrom(p21.IPv4, 7030)
	srv := serve(t, p21, 7030, func(c net.Conn) { io.Copy(c, c) })
	endpoint := netip.AddrPortFrom(p21.IPv4, hbone.Port)

	// attack dials the HBONE endpoint of n2p1 from the external host with
	// tlsConf and expects a refusal whose node-side log names wantLog.
	attack := func(t *testing.T, tlsConf *tls.Config, dst spiffeid.ID, wantErr, wantLog string) {
		t.Helper()
		hc, err := hbone.NewClient(hbone.ClientConfig{
			TLS:  func(_, _ spiffeid.ID) (*tls.Config, error) { return tlsConf, nil },
			Dial: mc.ext.Dial,
		})
		if err != nil {
			t.Fatal(err)
		}
		defer hc.Close()
		mark := mc.m2.Len()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := hc.Dial(ctx, hbone.DialRequest{
			Source: id2(t, "n1p1"), Destination: dst, Endpoint: endpoint, Target: target,
		})
		if err == nil {
			c.Close()
			t.Fatalf("HBONE stream opened; want refusal")
		}
		if !strings.Contains(err.Error(), wantErr) {
			t.Errorf("client error %q, want it to mention %q", err, wantErr)
		}
		if wantLog != "" {
			lctx, lcancel := context.WithTimeout(context.Background(), 5*time.Second)
			defer lcancel()
			l, err := mc.m2.WaitLogSince(lctx, mark, func(l noderun.Line) bool {
				return strings.HasPrefix(l.Str("peer_addr"), mc.ext.IPv4.String()+":") &&
					strings.Contains(l.Str("error"), wantLog)
			})
			if err != nil {
				t.Errorf("node 2 logged no refusal mentioning %q for the external host: %v", wantLog, err)
			} else {
				t.Logf("node 2: %s: %s", l.Str("message"), l.Str("error"))
			}
		}
		select {
		case p := <-srv.peers:
			t.Fatalf("the workload received a connection from %s", p)
		default:
		}
	}
	issue := func(t *testing.T, caDir string, trustDomain string, now func() time.Time, ttl time.Duration) *x509svid.SVID {
		t.Helper()
		tdom := td(t, trustDomain)
		rogue, err := identity.OpenCA(identity.CAConfig{Dir: caDir, TrustDomain: tdom, Now: now, SVIDTTL: ttl})
		if err != nil {
			t.Fatal(err)
		}
		wid, err := identity.WorkloadID(tdom, "default", "n1p1")
		if err != nil {
			t.Fatal(err)
		}
		svid, err := rogue.Issue(context.Background(), wid)
		if err != nil {
			t.Fatal(err)
		}
		return svid
	}
	// presenting makes a client configuration that trusts the real mesh
	// CA (so the attacker gets as far as presenting its certificate) and
	// presents svid.
	presenting := func(svid *x509svid.SVID) *tls.Config {
		return identity.ClientTLS(staticSource{svid, realBundle}, id2(t, "n2p1"))
	}

	t.Run("rogue CA of the same trust domain", func(t *testing.T) {
		svid := issue(t, t.TempDir(), "cluster.local", nil, 0)
		attack(t, presenting(svid), id2(t, "n2p1"), "", "signed by unknown authority")
	})
	t.Run("wrong trust domain", func(t *testing.T) {
		svid := issue(t, t.TempDir(), "evil.example", nil, 0)
		attack(t, presenting(svid), id2(t, "n2p1"), "", `no X.509 bundle found for trust domain: "evil.example"`)
	})
	t.Run("expired certificate", func(t *testing.T) {
		past := func() time.Time { return time.Now().Add(-48 * time.Hour) }
		svid := issue(t, caDir(t, mc.c), "cluster.local", past, time.Hour)
		attack(t, presenting(svid), id2(t, "n2p1"), "", "expired")
	})
	t.Run("client without certificate", func(t *testing.T) {
		conf := &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS13}
		attack(t, conf, id2(t, "n2p1"), "", "client didn't provide a certificate")
	})
	t.Run("server presenting another identity", func(t *testing.T) {
		// A legitimate client of the mesh that expects n2p3 behind
		// n2p1's address must refuse n2p1's certificate.
		svid, err := ca.Issue(context.Background(), id2(t, "n1p1"))
		if err != nil {
			t.Fatal(err)
		}
		conf := identity.ClientTLS(staticSource{svid, realBundle}, id2(t, "n2p3"))
		attack(t, conf, id2(t, "n2p3"), "want "+id2(t, "n2p3").String(), "bad certificate")
	})
	t.Run("refused handshakes are counted as TLS_FAILURE", func(t *testing.T) {
		// The five refusals above: four clients the server refused, and
		// the client that refused the server (its handshake fails at the
		// server too).
		fams := scrape(t, mc.n2)
		want := map[string]string{"reporter": "destination", "destination_workload": "n2p1", "response_flags": "TLS_FAILURE"}
		if got := value(fams, "istio_tcp_connections_opened_total", want); got != 5 {
			t.Errorf("istio_tcp_connections_opened_total%v = %v, want 5", want, got)
		}
	})
	t.Run("a valid client gets through", func(t *testing.T) {
		// The control: the same path with a real certificate works, so
		// the refusals above are the identity checks, not a broken path.
		svid, err := ca.Issue(context.Background(), id2(t, "n1p1"))
		if err != nil {
			t.Fatal(err)
		}
		hc, err := hbone.NewClient(hbone.ClientConfig{
			TLS: func(_, _ spiffeid.ID) (*tls.Config, error) {
				return identity.ClientTLS(staticSource{svid, realBundle}, id2(t, "n2p1")), nil
			},
			Dial: mc.ext.Dial,
		})
		if err != nil {
			t.Fatal(err)
		}
		defer hc.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		c, err := hc.Dial(ctx, hbone.DialRequest{Source: id2(t, "n1p1"), Destination: id2(t, "n2p1"), Endpoint: endpoint, Target: target})
		if err != nil {
			t.Fatalf("valid client refused: %v", err)
		}
		defer c.Close()
		echo(t, c)
		srv.peer(t)
	})
}

func td(t testing.TB, s string) spiffeid.TrustDomain {
	t.Helper()
	d, err := spiffeid.TrustDomainFromString(s)
	if err != nil {
		t.Fatal(err)
	}
	return d
}

func id2(t testing.TB, pod string) spiffeid.ID {
	t.Helper()
	i, err := spiffeid.FromString(id(pod))
	if err != nil {
		t.Fatal(err)
	}
	return i
}

// staticSource presents one SVID and trusts one bundle.
type staticSource struct {
	svid   *x509svid.SVID
	bundle *x509bundle.Bundle
}

func (s staticSource) GetX509SVID() (*x509svid.SVID, error) { return s.svid, nil }
func (s staticSource) GetX509BundleForTrustDomain(d spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	if d != s.bundle.TrustDomain() {
		return nil, errors.New("no bundle for " + d.String())
	}
	return s.bundle, nil
}
