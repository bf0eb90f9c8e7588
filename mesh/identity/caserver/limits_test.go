package caserver

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/rsa"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"net"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshtun/meshtun/mesh/identity"
)

// newLimitedFixture is newFixture with limits.
func newLimitedFixture(t *testing.T, l Limits) (*fixture, *Server) {
	t.Helper()
	f := &fixture{logs: &syncBuffer{}, dir: t.TempDir()}
	var err error
	f.ca, err = identity.OpenCA(identity.CAConfig{Dir: f.dir + "/ca", TrustDomain: td, SVIDTTL: time.Hour})
	if err != nil {
		t.Fatal(err)
	}
	f.file = NewFileMode(td, f.ca.Roots)
	f.file.Update([]string{"n1", "n2"}, workloads(), nil)
	srv, err := New(Config{CA: f.ca, Authenticators: []Authenticator{f.file}, Authorizer: f.file,
		Limits: l, Logger: zerolog.New(f.logs)})
	if err != nil {
		t.Fatal(err)
	}
	f.addr = serveLoopback(t, srv)
	return f, srv
}

// stall opens n TCP connections to addr from the loopback address src
// that never send a byte.
func stall(t *testing.T, addr, src string, n int) []net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}, Timeout: 5 * time.Second}
	var out []net.Conn
	for range n {
		c, err := d.Dial("tcp", addr)
		if errors.Is(err, syscall.ECONNRESET) {
			continue // refused (reset) before connect returned
		}
		if err != nil {
			t.Fatalf("dial from %s: %v", src, err)
		}
		t.Cleanup(func() { c.Close() })
		out = append(out, c)
	}
	return out
}

// waitClosed waits until the server closed c (a read returns EOF or a
// reset) and returns when; a read deadline at limit is a failure.
func waitClosed(c net.Conn, limit time.Time) (time.Time, error) {
	c.SetReadDeadline(limit)
	_, err := c.Read(make([]byte, 1))
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return time.Time{}, errors.New("still open")
	}
	return time.Now(), nil
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// Connections that never complete a handshake are bounded per source and
// in total, closed beyond the bounds at once and within the handshake
// timeout otherwise; a node from another address still gets its
// certificate while one address floods.
func TestStalledHandshakesAreClosedAndBounded(t *testing.T) {
	const timeout = time.Second
	f, srv := newLimitedFixture(t, Limits{HandshakeTimeout: timeout, MaxConnections: 45, MaxConnectionsPerSource: 20})
	start := time.Now()
	flood := stall(t, f.addr, "127.0.0.2", 30)
	waitFor(t, "30 connections accepted or refused", func() bool { return srv.OpenConnections()+int(srv.RefusedConnections()) >= 30 })
	if open, refused := srv.OpenConnections(), srv.RefusedConnections(); open != 20 || refused != 10 {
		t.Fatalf("one source, 30 stalled connections: %d open, %d refused; want 20 and 10", open, refused)
	}

	// A node at another address is served meanwhile.
	cfg := identity.RemoteConfig{Address: f.addr, TrustDomain: td, Bundle: identity.NewTrustBundle(td, f.ca.Roots()),
		Dial: func(ctx context.Context, addr string) (net.Conn, error) {
			d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP("127.0.0.3")}}
			return d.DialContext(ctx, "tcp", addr)
		}}
	cred, err := identity.OpenNodeCredential(f.credential(t, "n1", time.Hour))
	if err != nil {
		t.Fatal(err)
	}
	cfg.Credential = cred.Get
	r, err := identity.DialCA(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Issue(context.Background(), wid("default", "a")); err != nil {
		t.Fatalf("node at another address during the flood: %v\n%s", err, f.logs)
	}
	r.Close()

	// More sources: the total bound holds.
	flood = append(flood, stall(t, f.addr, "127.0.0.4", 20)...)
	flood = append(flood, stall(t, f.addr, "127.0.0.5", 20)...)
	waitFor(t, "70 connections accepted or refused", func() bool { return srv.OpenConnections()+int(srv.RefusedConnections()) >= 70 })
	if open := srv.OpenConnections(); open > 45 {
		t.Fatalf("%d connections open, above the bound of 45", open)
	}
	if !strings.Contains(f.logs.String(), "connection refused") {
		t.Errorf("no refusal log line: %s", f.logs)
	}

	// Every stalled connection is closed within the timeout of the last
	// one's opening (plus slack for a loaded machine), not gRPC's default
	// of 120 s.
	limit := time.Now().Add(timeout + 3*time.Second)
	var wg sync.WaitGroup
	var stillOpen atomic.Int32
	var latest atomic.Int64
	for _, c := range flood {
		wg.Add(1)
		go func() {
			defer wg.Done()
			at, err := waitClosed(c, limit)
			if err != nil {
				stillOpen.Add(1)
				return
			}
			for {
				l := latest.Load()
				if at.UnixNano() <= l || latest.CompareAndSwap(l, at.UnixNano()) {
					break
				}
			}
		}()
	}
	wg.Wait()
	if n := stillOpen.Load(); n > 0 {
		t.Fatalf("%d of %d stalled connections still open %v after they were opened (handshake timeout %v)", n, len(flood), time.Since(start).Round(time.Millisecond), timeout)
	}
	t.Logf("%d stalled connections: the last closed %v after the first was opened", len(flood), time.Unix(0, latest.Load()).Sub(start).Round(time.Millisecond))
	waitFor(t, "no connection open", func() bool { return srv.OpenConnections() == 0 })
}

// A request above MaxRecvMsgSize is refused before it is decoded, with
// gRPC's ResourceExhausted naming the sizes.
func TestOversizedRequestIsRefused(t *testing.T) {
	f := newFixture(t)
	cred, _ := identity.OpenNodeCredential(f.credential(t, "n1", time.Hour))
	c, err := dialRaw(f, cred)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.create(strings.Repeat("A", DefaultMaxRecvMsgSize+1), "")
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "larger than max") {
		t.Fatalf("request of %d bytes: %v; want ResourceExhausted, larger than max", DefaultMaxRecvMsgSize+1, err)
	}
	t.Logf("refused: %v", err)
}

// largestRequest is the largest request the service would grant: an
// RSA-4096 CSR whose URI SAN is a SPIFFE ID of 2048 bytes, that ID also in
// ImpersonatedIdentity.
func largestRequest(t *testing.T) (*pb.IstioCertificateRequest, spiffeid.ID) {
	t.Helper()
	prefix := "spiffe://cluster.local/ns/default/sa/"
	id := spiffeid.RequireFromString(prefix + strings.Repeat("a", maxIDLen-len(prefix)))
	key, err := rsa.GenerateKey(rand.Reader, 4096)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.CreateCertificateRequest(rand.Reader, &x509.CertificateRequest{URIs: []*url.URL{id.URL()}}, key)
	if err != nil {
		t.Fatal(err)
	}
	md, _ := structpb.NewStruct(map[string]any{identity.ImpersonatedIdentityKey: id.String()})
	return &pb.IstioCertificateRequest{Csr: string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE REQUEST", Bytes: der})),
		ValidityDuration: 86400, Metadata: md}, id
}

// The largest legitimate request fits with a margin of 4× and gets past
// the size limit to authorization.
func TestLargestRequestFits(t *testing.T) {
	req, id := largestRequest(t)
	size := proto.Size(req)
	t.Logf("largest legitimate request: %d bytes (limit %d, %.1f×)", size, DefaultMaxRecvMsgSize, float64(DefaultMaxRecvMsgSize)/float64(size))
	if size*4 > DefaultMaxRecvMsgSize {
		t.Errorf("largest request %d bytes; the limit %d leaves less than 4× margin", size, DefaultMaxRecvMsgSize)
	}
	f := newFixture(t)
	cred, _ := identity.OpenNodeCredential(f.credential(t, "n1", time.Hour))
	c, err := dialRaw(f, cred)
	if err != nil {
		t.Fatal(err)
	}
	_, err = c.c.CreateCertificate(context.Background(), req)
	if status.Code(err) != codes.PermissionDenied || !strings.Contains(err.Error(), "may not have") {
		t.Fatalf("largest request (%s…): %v; want refused by authorization only", id.String()[:40], err)
	}
}

// A caller-supplied string is logged cut to maxLogged bytes.
func TestHugeIdentityIsLoggedTruncated(t *testing.T) {
	f := newFixture(t)
	cred, _ := identity.OpenNodeCredential(f.credential(t, "n1", time.Hour))
	c, err := dialRaw(f, cred)
	if err != nil {
		t.Fatal(err)
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	csr, _ := identity.NewCSR(key, wid("default", "a"))
	huge := "spiffe://cluster.local/ns/default/sa/" + strings.Repeat("x", 12000)
	if _, err := c.create(string(csr), huge); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("identity of %d bytes: %v, want InvalidArgument", len(huge), err)
	}
	logs := f.logs.String()
	if !strings.Contains(logs, RefusedMessage) || !strings.Contains(logs, "…(12037 bytes)") {
		t.Fatalf("no truncated refusal line: %.2000s", logs)
	}
	if len(logs) > 2000 {
		t.Fatalf("%d bytes of log for one refused request with a %d-byte identity; want it truncated", len(logs), len(huge))
	}
}

func TestClip(t *testing.T) {
	if clip("short") != "short" {
		t.Error("short string changed")
	}
	s := strings.Repeat("é", 200) // 400 bytes
	got := clip(s)
	if !strings.HasSuffix(got, "…(400 bytes)") || !strings.HasPrefix(got, strings.Repeat("é", 128)) || strings.Contains(got, "\uFFFD") {
		t.Errorf("clip of 400 bytes of é: %q", got)
	}
}

// countingReviewer counts the reviews; tokens "good*" authenticate.
type countingReviewer struct {
	n    atomic.Int32
	gate chan struct{} // if set, each review waits for it
}

func (c *countingReviewer) Review(ctx context.Context, token string, aud []string) (*TokenReview, error) {
	c.n.Add(1)
	if c.gate != nil {
		<-c.gate
	}
	if !strings.HasPrefix(token, "good") {
		return &TokenReview{Error: "invalid bearer token"}, nil
	}
	return &TokenReview{Authenticated: true, Username: "system:serviceaccount:meshtun-system:meshtun", Audiences: aud,
		Extra: map[string][]string{ExtraPodName: {"meshtun-abc"}, ExtraPodUID: {"u1"}}}, nil
}

func kubeModeWith(rv TokenReviewer) *KubeMode {
	return &KubeMode{TrustDomain: td, Audience: DefaultAudience, NodeAccounts: []string{"meshtun-system/meshtun"}, Reviewer: rv,
		Pods: fakePods{
			{Namespace: "meshtun-system", Name: "meshtun-abc", UID: "u1", ServiceAccount: "meshtun", Node: "k1", Running: true},
			{Namespace: "default", Name: "a-1", ServiceAccount: "a", Node: "k1", Running: true},
		}}
}

// Repeated requests with one token cost one TokenReview within the TTL;
// a failure is never reused; the cache is bounded.
func TestTokenReviewsAreCached(t *testing.T) {
	rv := &countingReviewer{}
	k := kubeModeWith(rv)
	for range 5 {
		if c, err := k.Authenticate(bearer("good1")); err != nil || c.Node != "k1" {
			t.Fatalf("good token: %+v %v", c, err)
		}
	}
	if n := rv.n.Load(); n != 1 {
		t.Fatalf("5 requests with one token: %d TokenReviews, want 1", n)
	}
	for range 3 {
		if _, err := k.Authenticate(bearer("bad")); err == nil {
			t.Fatal("bad token accepted")
		}
	}
	if n := rv.n.Load(); n != 4 {
		t.Fatalf("3 requests with a refused token: %d more reviews, want 3 (failures not cached)", n-1)
	}
	// After the TTL the token is reviewed again.
	k.cache.now = func() time.Time { return time.Now().Add(DefaultReviewTTL + time.Second) }
	k.Authenticate(bearer("good1"))
	if n := rv.n.Load(); n != 5 {
		t.Fatalf("after the TTL: %d reviews in all, want 5", n)
	}
	k.cache.now = time.Now
	// Bounded.
	for i := range DefaultReviewCacheSize + 100 {
		k.Authenticate(bearer("good-" + string(rune('a'+i%26)) + strings.Repeat("x", i/26)))
	}
	if l := k.cache.len(); l > DefaultReviewCacheSize {
		t.Fatalf("%d cached reviews, above the bound %d", l, DefaultReviewCacheSize)
	}
	// Concurrent requests with one new token share one review.
	rv2 := &countingReviewer{gate: make(chan struct{})}
	k2 := kubeModeWith(rv2)
	var wg sync.WaitGroup
	for range 10 {
		wg.Add(1)
		go func() { defer wg.Done(); k2.Authenticate(bearer("good2")) }()
	}
	waitFor(t, "9 requests waiting for the first one's review, or 10 reviews", func() bool {
		return rv2.n.Load() >= 10 || k2.reviews().waiting.Load() == 9
	})
	close(rv2.gate)
	wg.Wait()
	if n := rv2.n.Load(); n != 1 {
		t.Fatalf("10 concurrent requests with one token: %d reviews, want 1", n)
	}
}

// A malformed request costs no TokenReview: the CSR and the identity are
// checked first. An overlong token is refused unreviewed.
func TestCheapChecksBeforeTokenReview(t *testing.T) {
	f := newFixture(t)
	rv := &countingReviewer{}
	srv, err := New(Config{CA: f.ca, Authenticators: []Authenticator{kubeModeWith(rv)}, Authorizer: kubeModeWith(rv), Logger: zerolog.New(f.logs)})
	if err != nil {
		t.Fatal(err)
	}
	f.addr = serveLoopback(t, srv)
	c, err := dialRaw(f, nil)
	if err != nil {
		t.Fatal(err)
	}
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer good1")
	for _, req := range []*pb.IstioCertificateRequest{
		{Csr: "garbage"},
		{Csr: "-----BEGIN CERTIFICATE REQUEST-----\nAAAA\n-----END CERTIFICATE REQUEST-----\n"},
	} {
		if _, err := c.c.CreateCertificate(ctx, req); status.Code(err) != codes.InvalidArgument {
			t.Errorf("malformed CSR: %v, want InvalidArgument", err)
		}
	}
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	csr, _ := identity.NewCSR(key, wid("default", "b"))
	md, _ := structpb.NewStruct(map[string]any{identity.ImpersonatedIdentityKey: wid("default", "a").String()})
	if _, err := c.c.CreateCertificate(ctx, &pb.IstioCertificateRequest{Csr: string(csr), Metadata: md}); status.Code(err) != codes.PermissionDenied {
		t.Errorf("SAN mismatch: %v, want PermissionDenied", err)
	}
	if n := rv.n.Load(); n != 0 {
		t.Fatalf("%d TokenReviews for malformed requests, want 0", n)
	}
	long := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer good"+strings.Repeat("x", maxTokenLen))
	csr, _ = identity.NewCSR(key, wid("default", "a"))
	if _, err := c.c.CreateCertificate(long, &pb.IstioCertificateRequest{Csr: string(csr)}); status.Code(err) != codes.Unauthenticated {
		t.Errorf("token of %d bytes: %v, want Unauthenticated", maxTokenLen+4, err)
	}
	if n := rv.n.Load(); n != 0 {
		t.Fatalf("an overlong token was reviewed")
	}
	// A well-formed request is reviewed and granted.
	if _, err := c.c.CreateCertificate(ctx, &pb.IstioCertificateRequest{Csr: string(csr)}); err != nil {
		t.Fatalf("well-formed request: %v\n%s", err, f.logs)
	}
	if n := rv.n.Load(); n != 1 {
		t.Fatalf("%d reviews for one good request", n)
	}
}
