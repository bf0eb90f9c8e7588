package e2e

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/sha256"
	"crypto/tls"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
	"github.com/meshtun/meshtun/mesh/identity"
)

// caRefusal waits for the certificate service's refusal line that names
// asked and contains reason, and returns it.
func caRefusal(t *testing.T, ca *noderun.Process, since int, asked, reason string) noderun.Line {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	l, err := ca.WaitLogSince(ctx, since, func(l noderun.Line) bool {
		return l.Str("message") == "certificate request refused" && l.Str("asked_for") == asked && strings.Contains(l.Str("reason"), reason)
	})
	if err != nil {
		t.Fatalf("no refusal log line for %s with %q: %v\nCA log:\n%s", asked, reason, err, ca.Logs())
	}
	return l
}

// caClient is a client of the certificate service that speaks from inside
// node n's namespace with the node credential in credDir.
func caClient(t *testing.T, c *cluster.Cluster, n *cluster.Node, credDir string) pb.IstioCertificateServiceClient {
	t.Helper()
	cred, err := identity.OpenNodeCredential(credDir)
	if err != nil {
		t.Fatal(err)
	}
	tc := &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cred.Get() }}
	conn, err := grpc.NewClient("passthrough:///"+noderun.CAAddr(c), grpc.WithTransportCredentials(credentials.NewTLS(tc)),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) { return n.Dial(ctx, "tcp", addr) }))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return pb.NewIstioCertificateServiceClient(conn)
}

// request asks for impersonate with a CSR whose SAN is san.
func request(t *testing.T, cl pb.IstioCertificateServiceClient, san, impersonate string) error {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	csr, err := identity.NewCSR(key, spiffeid.RequireFromString(san))
	if err != nil {
		t.Fatal(err)
	}
	md, _ := structpb.NewStruct(map[string]any{identity.ImpersonatedIdentityKey: impersonate})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, err = cl.CreateCertificate(ctx, &pb.IstioCertificateRequest{Csr: string(csr), ValidityDuration: 60, Metadata: md})
	return err
}

// TestIdentityRefusals runs `meshtun ca` on the control host and asks it,
// from node n1's namespace as a node proxy would, for what a compromised
// node would want: every request is refused, with a log line saying who
// asked for what and why not.
func TestIdentityRefusals(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "idref", Nodes: 2, PodsPerNode: 2, NoExternal: true, Control: true})
	n1, n2 := c.Nodes[0], c.Nodes[1]
	cfg := writeConfig(t, c, noderun.Mesh{})
	ca := startCA(t, c, cfg)
	ctx := context.Background()
	cred1, err := noderun.IssueNodeCredential(ctx, meshtunBin, cfg, n1)
	if err != nil {
		t.Fatal(err)
	}
	cl := caClient(t, c, n1, cred1)
	if err := request(t, cl, id("n1p1"), id("n1p1")); err != nil {
		t.Fatalf("n1 asking for its own workload n1p1: %v\nCA log:\n%s", err, ca.Logs())
	}

	t.Run("another node's workload", func(t *testing.T) {
		mark := ca.Len()
		err := request(t, cl, id("n2p1"), id("n2p1"))
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("n1 asking for n2p1: %v, want PermissionDenied", err)
		}
		l := caRefusal(t, ca, mark, id("n2p1"), "its workloads run on node(s) n2, not on n1")
		if l.Str("node") != "n1" || !strings.Contains(l.Str("caller"), "spiffe://cluster.local/meshtun/node/n1") {
			t.Errorf("refusal does not say who asked: %v", l)
		}
	})

	t.Run("CSR SAN differs from the identity asked for", func(t *testing.T) {
		mark := ca.Len()
		err := request(t, cl, id("n1p2"), id("n1p1"))
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("CSR for n1p2 asking for n1p1: %v, want PermissionDenied", err)
		}
		caRefusal(t, ca, mark, id("n1p1"), "CSR SAN "+id("n1p2")+" differs from the identity asked for "+id("n1p1"))
	})

	t.Run("expired node credential", func(t *testing.T) {
		dir, err := noderun.IssueNodeCredential(ctx, meshtunBin, cfg, n1, "--ttl", "1s")
		if err != nil {
			t.Fatal(err)
		}
		cred, _ := identity.OpenNodeCredential(dir)
		cert, _ := cred.Get()
		// Certificate times have one-second resolution: wait past it.
		time.Sleep(time.Until(cert.Leaf.NotAfter) + 1100*time.Millisecond)
		mark := ca.Len()
		err = request(t, caClient(t, c, n1, dir), id("n1p1"), id("n1p1"))
		if status.Code(err) != codes.Unauthenticated {
			t.Fatalf("expired credential: %v, want Unauthenticated", err)
		}
		caRefusal(t, ca, mark, id("n1p1"), "expired at")
	})

	t.Run("revoked node credential", func(t *testing.T) {
		dir, err := noderun.IssueNodeCredential(ctx, meshtunBin, cfg, n2)
		if err != nil {
			t.Fatal(err)
		}
		cred, _ := identity.OpenNodeCredential(dir)
		cert, _ := cred.Get()
		serial := cert.Leaf.SerialNumber.Text(16)
		cl2 := caClient(t, c, n2, dir)
		if err := request(t, cl2, id("n2p1"), id("n2p1")); err != nil {
			t.Fatalf("n2 before revocation: %v", err)
		}
		mark := ca.Len()
		writeConfig(t, c, noderun.Mesh{CAExtra: fmt.Sprintf(", revokedNodeCredentials: [%q]", serial)})
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if _, err := ca.WaitLogSince(wctx, mark, func(l noderun.Line) bool {
			return l.Str("message") == "config reloaded" && l.Num("revoked") == 1
		}); err != nil {
			t.Fatalf("the CA did not reload the config: %v", err)
		}
		mark = ca.Len()
		err = request(t, cl2, id("n2p1"), id("n2p1"))
		if status.Code(err) != codes.Unauthenticated {
			t.Fatalf("revoked credential: %v, want Unauthenticated", err)
		}
		caRefusal(t, ca, mark, id("n2p1"), "serial "+serial+" is revoked")
		// n1's credential is not affected.
		if err := request(t, cl, id("n1p1"), id("n1p1")); err != nil {
			t.Errorf("n1 after n2's revocation: %v", err)
		}
	})

	t.Run("node removed from the config", func(t *testing.T) {
		// A config without node n2 (and its workloads moved to n1): n2's
		// credential is valid, but n2 may have nothing.
		dir, err := noderun.IssueNodeCredential(ctx, meshtunBin, cfg, n2)
		if err != nil {
			t.Fatal(err)
		}
		mark := ca.Len()
		data, err := os.ReadFile(cfg)
		if err != nil {
			t.Fatal(err)
		}
		var kept []string
		for _, line := range strings.Split(string(data), "\n") {
			if !strings.Contains(line, "name: n2,") && !strings.Contains(line, "node: n2,") {
				kept = append(kept, line)
			}
		}
		if err := os.WriteFile(cfg, []byte(strings.Join(kept, "\n")), 0o644); err != nil {
			t.Fatal(err)
		}
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		defer cancel()
		if _, err := ca.WaitLogSince(wctx, mark, func(l noderun.Line) bool {
			return l.Str("message") == "config reloaded" && l.Num("nodes") == 1
		}); err != nil {
			t.Fatalf("the CA did not reload the config: %v", err)
		}
		mark = ca.Len()
		err = request(t, caClient(t, c, n2, dir), id("n2p1"), id("n2p1"))
		if status.Code(err) != codes.PermissionDenied {
			t.Fatalf("removed node: %v, want PermissionDenied", err)
		}
		caRefusal(t, ca, mark, id("n2p1"), "node n2 is not in the config file")
	})
}

// streamer sends bytes from a mesh client to a mesh server through the
// mesh for as long as it runs, and checks at the end that every byte
// arrived, in order, on the one connection.
type streamer struct {
	sent, recv atomic.Int64
	stop       chan struct{}
	done       chan error
	sum        chan [32]byte
	sentSum    [32]byte
}

func startStream(t *testing.T, from, to *cluster.Pod, port int) *streamer {
	t.Helper()
	ln, err := to.Listen("tcp", fmt.Sprintf("%s:%d", to.IPv4, port))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	s := &streamer{stop: make(chan struct{}), done: make(chan error, 1), sum: make(chan [32]byte, 1)}
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		h := sha256.New()
		n, err := io.Copy(io.MultiWriter(h, counter{&s.recv}), c)
		_ = n
		var sum [32]byte
		h.Sum(sum[:0])
		if err != nil {
			sum = [32]byte{}
		}
		s.sum <- sum
	}()
	conn := dial(t, from.NS, to.IPv4, port)
	go func() {
		h := sha256.New()
		buf := make([]byte, 64<<10)
		var i byte
		for {
			select {
			case <-s.stop:
				h.Sum(s.sentSum[:0])
				s.done <- conn.(*net.TCPConn).CloseWrite()
				return
			default:
			}
			for j := range buf {
				buf[j] = i + byte(j)
			}
			i++
			conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
			if _, err := conn.Write(buf); err != nil {
				h.Sum(s.sentSum[:0])
				s.done <- err
				return
			}
			h.Write(buf)
			s.sent.Add(int64(len(buf)))
			time.Sleep(5 * time.Millisecond) // a long transfer, not a flood
		}
	}()
	return s
}

type counter struct{ n *atomic.Int64 }

func (c counter) Write(p []byte) (int, error) { c.n.Add(int64(len(p))); return len(p), nil }

// finish stops the sender and checks that the receiver got every byte.
func (s *streamer) finish(t *testing.T) {
	t.Helper()
	close(s.stop)
	if err := <-s.done; err != nil {
		t.Fatalf("sender: %v (sent %d bytes)", err, s.sent.Load())
	}
	select {
	case sum := <-s.sum:
		if sum != s.sentSum || s.recv.Load() != s.sent.Load() {
			t.Fatalf("received %d of %d bytes (checksum match %v): the transfer lost bytes or was reset", s.recv.Load(), s.sent.Load(), sum == s.sentSum)
		}
	case <-time.After(20 * time.Second):
		t.Fatalf("receiver did not see the end of the stream: %d of %d bytes", s.recv.Load(), s.sent.Load())
	}
}

// pingMesh opens a new connection from → to through the mesh (a new TLS
// handshake with the current certificates and roots) and echoes on it.
func pingMesh(t *testing.T, from, to *cluster.Pod, port int) error {
	t.Helper()
	ln, err := to.Listen("tcp", fmt.Sprintf("%s:%d", to.IPv4, port))
	if err != nil {
		return err
	}
	defer ln.Close()
	go func() {
		c, err := ln.Accept()
		if err == nil {
			io.Copy(c, c)
			c.Close()
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := from.Dial(ctx, "tcp", fmt.Sprintf("%s:%d", to.IPv4, port))
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(5 * time.Second))
	msg := []byte("new connection")
	if _, err := c.Write(msg); err != nil {
		return err
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return fmt.Errorf("echo: %w", err)
	}
	return nil
}

// waitNodeLog waits for a line with message on node m after mark.
func waitNodeLog(t *testing.T, m nodeProc, mark int, timeout time.Duration, message string) noderun.Line {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	l, err := m.WaitLogSince(ctx, mark, func(l noderun.Line) bool { return l.Str("message") == message })
	if err != nil {
		t.Fatalf("no %q on %s within %s: %v", message, m.Node.Name(), timeout, err)
	}
	return l
}

const shortTTL = 10 * time.Second

// TestCAOutage stops `meshtun ca` for longer than half an SVID's life
// while traffic flows: the nodes keep serving with their certificates,
// report the failing renewals (log, metric), stay ready, and renew once
// the service is back.
func TestCAOutage(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "idout", Nodes: 2, PodsPerNode: 2, NoExternal: true, Control: true})
	n1, n2 := c.Nodes[0], c.Nodes[1]
	p1, p2 := n1.Pods[0], n2.Pods[0]
	q1, q2 := n1.Pods[1], n2.Pods[1]
	cfg := writeConfig(t, c, noderun.Mesh{SVIDTTL: shortTTL})
	ca := startCA(t, c, cfg)
	m1 := startWithConfig(t, n1, cfg)
	m2 := startWithConfig(t, n2, cfg)
	stream := startStream(t, p1, p2, 7001)

	// Stop the CA right after a renewal, so the outage is measured from a
	// fresh certificate: 6 s > half of 10 s, < 10 s.
	mark1 := m1.Len()
	waitNodeLog(t, m1, mark1, 2*shortTTL, "renewed SVID")
	if err := ca.Stop(syscall.SIGTERM); err != nil {
		t.Fatalf("stop meshtun ca: %v", err)
	}
	stopped := time.Now()
	mark1, mark2 := m1.Len(), m2.Len()
	waitNodeLog(t, m1, mark1, shortTTL, "SVID renewal failed; the current certificate stays in use until it expires")
	fams := scrape(t, n1)
	if v := value(fams, "meshtun_certificates_renewal_failing", nil); v < 1 {
		t.Errorf("meshtun_certificates_renewal_failing = %v during the outage, want ≥ 1", v)
	}
	if v := value(fams, "meshtun_certificate_renewal_failures_total", nil); v < 1 {
		t.Errorf("meshtun_certificate_renewal_failures_total = %v during the outage, want ≥ 1", v)
	}
	// New connections keep working on the certificates the nodes hold:
	// new handshakes (a pair of identities the pool has no connection
	// for), then streams on them.
	for port := 7100; time.Since(stopped) < shortTTL*6/10; port++ {
		from, to := q1, q2
		if port%2 == 1 {
			from, to = q2, q1
		}
		if err := pingMesh(t, from, to, port); err != nil {
			t.Fatalf("new connection %s after the CA stopped: %v", time.Since(stopped).Round(time.Millisecond), err)
		}
		if code, _ := httpGet(t, n1.NS, "http://127.0.0.1:15021/healthz/ready"); code != 200 {
			t.Fatalf("node n1 not ready during the outage (certificates still valid): %d", code)
		}
		time.Sleep(200 * time.Millisecond)
	}
	outage := time.Since(stopped)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ca2, err := noderun.StartCA(ctx, meshtunBin, c, cfg, "--log-level", "debug")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("restarted meshtun ca log:\n%s", ca2.Logs())
		}
	})
	waitNodeLog(t, m1, mark1, shortTTL, "SVID renewed after failures")
	waitNodeLog(t, m2, mark2, shortTTL, "SVID renewed after failures")
	// Every identity of both nodes renewed since the CA came back: only
	// n1's were fresh when it stopped, so an identity of n2 may have
	// expired during the outage, and the handshake below needs its new
	// certificate (a renewal of one identity says nothing of the other).
	for _, nm := range []struct {
		m    nodeProc
		n    *cluster.Node
		mark int
	}{{m1, n1, mark1}, {m2, n2, mark2}} {
		for _, p := range nm.n.Pods {
			ctx, cancel := context.WithTimeout(context.Background(), shortTTL)
			_, err := nm.m.WaitLogSince(ctx, nm.mark, func(l noderun.Line) bool {
				return l.Str("identity") == id(p.ID) && (l.Str("message") == "SVID renewed after failures" || l.Str("message") == "renewed SVID")
			})
			cancel()
			if err != nil {
				t.Fatalf("%s not renewed after the CA came back: %v", p.ID, err)
			}
		}
	}
	t.Logf("CA stopped for %s (SVID lifetime %s); both nodes renewed after it came back", outage.Round(time.Millisecond), shortTTL)
	// A handshake with the renewed certificates: n2p1 → n1p1 is a pair the
	// pool has not seen (the long transfer goes the other way).
	if err := pingMesh(t, p2, p1, 7099); err != nil {
		t.Fatalf("new connection after the renewal: %v", err)
	}
	if v := value(scrape(t, n1), "meshtun_certificates_renewal_failing", nil); v != 0 {
		t.Errorf("meshtun_certificates_renewal_failing = %v after the renewal, want 0", v)
	}
	stream.finish(t)
	t.Logf("long transfer across the outage: %d bytes, all delivered", stream.sent.Load())
}

// TestRootRotation rotates the CA's root (prepare, activate, retire)
// during a long mesh transfer: the transfer loses no byte and is not
// reset, and new connections work after each step.
func TestRootRotation(t *testing.T) {
	// One pair of pods per step: HBONE pools connections per (source,
	// destination) identity, and each step must make new handshakes.
	c := cluster.NewT(t, cluster.Spec{Name: "idrot", Nodes: 2, PodsPerNode: 4, NoExternal: true, Control: true})
	n1, n2 := c.Nodes[0], c.Nodes[1]
	p1, p2 := n1.Pods[0], n2.Pods[0]
	cfg := writeConfig(t, c, noderun.Mesh{SVIDTTL: shortTTL})
	ca := startCA(t, c, cfg)
	m1 := startWithConfig(t, n1, cfg)
	m2 := startWithConfig(t, n2, cfg)
	stream := startStream(t, p1, p2, 7001)
	firstRoot := readRoot(t, caDir(t, c))

	root := func(step string) {
		t.Helper()
		out, err := execMeshtun("ca", "root", step, "--config", cfg)
		if err != nil {
			t.Fatalf("meshtun ca root %s: %v\n%s", step, err, out)
		}
	}
	// waitRoots waits until every identity of both nodes has been issued
	// a certificate after the CA reloaded its roots: the nodes then hold
	// its new bundle, and certificates from its current signing root.
	waitRoots := func(step string, mark, roots int) {
		t.Helper()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, err := ca.WaitLogSince(ctx, mark, func(l noderun.Line) bool {
			return l.Str("message") == "CA roots reloaded" && int(l.Num("trusted_roots")) == roots
		}); err != nil {
			t.Fatalf("after %s: the CA did not reload to %d roots: %v\n%s", step, roots, err, ca.Logs())
		}
		mark = ca.Len()
		for _, p := range c.Pods() {
			ctx, cancel := context.WithTimeout(context.Background(), 2*shortTTL)
			_, err := ca.WaitLogSince(ctx, mark, func(l noderun.Line) bool {
				return l.Str("message") == "certificate issued" && l.Str("identity") == id(p.ID)
			})
			cancel()
			if err != nil {
				t.Fatalf("after %s: no certificate issued for %s: %v", step, p.ID, err)
			}
		}
	}
	port, pair := 7100, 0
	check := func(step string) {
		t.Helper()
		pair++
		a, b := n1.Pods[pair], n2.Pods[pair]
		port++
		if err := pingMesh(t, a, b, port); err != nil {
			t.Fatalf("new connection %s → %s after %s: %v", a.ID, b.ID, step, err)
		}
		port++
		if err := pingMesh(t, b, a, port); err != nil {
			t.Fatalf("new connection %s → %s after %s: %v", b.ID, a.ID, step, err)
		}
	}

	mark := ca.Len()
	root("prepare")
	waitRoots("prepare", mark, 2)
	check("prepare")
	mark = ca.Len()
	root("activate")
	waitRoots("activate", mark, 2)
	check("activate")
	if newRoot := readRoot(t, caDir(t, c)); newRoot == firstRoot {
		t.Fatal("activate did not change the signing root")
	}
	// Node credentials were signed by the old root: issue new ones before
	// it goes (the nodes read the files again when they change).
	for _, n := range c.Nodes {
		if _, err := noderun.IssueNodeCredential(context.Background(), meshtunBin, cfg, n); err != nil {
			t.Fatal(err)
		}
	}
	mark = ca.Len()
	root("retire")
	waitRoots("retire", mark, 1)
	check("retire")
	for _, m := range []nodeProc{m1, m2} {
		for _, l := range m.Lines() {
			if l.Str("level") == "error" || strings.Contains(l.Str("message"), "renewal failed") {
				t.Errorf("%s during the rotation: %v", m.Node.Name(), l)
			}
		}
	}
	stream.finish(t)
	t.Logf("long transfer across the rotation: %d bytes, all delivered on one connection", stream.sent.Load())
}

func readRoot(t *testing.T, dir string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, identity.RootCertFile))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func execMeshtun(args ...string) (string, error) {
	out, err := exec.Command(meshtunBin, args...).CombinedOutput()
	return string(out), err
}
