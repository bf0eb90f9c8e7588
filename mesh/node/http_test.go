package node

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/registry"
)

// onceIssuer issues the first certificate and then fails, like a
// certificate service that went away.
type onceIssuer struct {
	ca    *identity.CA
	calls atomic.Int32
}

func (o *onceIssuer) Issue(ctx context.Context, id spiffeid.ID) (*x509svid.SVID, error) {
	if o.calls.Add(1) > 1 {
		return nil, errors.New("certificate service unreachable")
	}
	return o.ca.Issue(ctx, id)
}

// The node stays ready while renewals fail and its certificates are valid,
// and turns unready only once no local workload holds a valid one.
func TestReadinessFollowsValidCertificates(t *testing.T) {
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	ca, err := identity.OpenCA(identity.CAConfig{Dir: t.TempDir(), TrustDomain: td, SVIDTTL: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	src, err := identity.NewSource(identity.SourceConfig{Issuer: &onceIssuer{ca: ca}, Bundle: ca.Bundle(), TrustDomain: td,
		RetryInterval: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	id := spiffeid.RequireFromString("spiffe://cluster.local/ns/default/sa/a")
	if err := src.Add(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	n := &node{svids: src}
	n.ready.Store(true)
	get := func() (int, string) {
		rec := httptest.NewRecorder()
		n.readiness(rec, httptest.NewRequest(http.MethodGet, "/healthz/ready", nil))
		return rec.Code, rec.Body.String()
	}
	if code, body := get(); code != http.StatusOK {
		t.Fatalf("with a valid certificate: %d %s", code, body)
	}
	// Renewal fails from half-life on; the certificate is still valid.
	deadline := time.Now().Add(5 * time.Second)
	for src.Stats().Failing == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if st := src.Stats(); st.Failing != 1 || st.Valid != 1 {
		t.Fatalf("stats while renewals fail: %+v", st)
	}
	if code, body := get(); code != http.StatusOK {
		t.Fatalf("renewals failing, certificate valid: %d %s, want ready", code, body)
	}
	exp, _ := src.Expiry(id)
	time.Sleep(time.Until(exp) + 50*time.Millisecond)
	code, body := get()
	if code != http.StatusServiceUnavailable || !strings.Contains(body, "none of the 1 local workloads holds a valid certificate") {
		t.Fatalf("every certificate expired: %d %q, want 503 saying why", code, body)
	}
}

// blockedSource is a model source that never syncs: Start returns only
// when its context ends. started is closed when Start is called.
type blockedSource struct {
	registry.Mailbox
	started chan struct{}
}

func (b *blockedSource) Start(ctx context.Context) (*registry.Snapshot, error) {
	close(b.started)
	<-ctx.Done()
	return nil, ctx.Err()
}

func (b *blockedSource) SourceStatus() any { return "syncing" }

// TestReadinessWhileSourceSyncs: the node's endpoints answer while its
// model's source has not synced: readiness 503 saying so, /config_dump
// with the source's status; and the node stops cleanly if it never does.
func TestReadinessWhileSourceSyncs(t *testing.T) {
	free := func() string {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer ln.Close()
		return ln.Addr().String()
	}
	ready, admin := free(), free()
	src := &blockedSource{started: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, Config{Name: "n1", Source: src, ReadinessAddr: ready, AdminAddr: admin, Logger: zerolog.Nop()})
	}()
	select {
	case <-src.started:
	case err := <-done:
		t.Fatalf("Run returned before starting the source: %v", err)
	}
	get := func(url string) (int, string) {
		t.Helper()
		resp, err := http.Get(url)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(body)
	}
	if code, body := get("http://" + ready + "/healthz/ready"); code != http.StatusServiceUnavailable || !strings.Contains(body, "waiting for the mesh model's source") {
		t.Errorf("readiness while the source syncs: %d %q, want 503 saying so", code, body)
	}
	if code, body := get("http://" + admin + "/config_dump"); code != http.StatusOK || !strings.Contains(body, `"syncing"`) {
		t.Errorf("/config_dump while the source syncs: %d %q, want the source's status", code, body)
	}
	if code, body := get("http://" + admin + "/config_dump?format=ztunnel"); code != http.StatusOK {
		t.Errorf("/config_dump?format=ztunnel while the source syncs: %d %q", code, body)
	}
	cancel()
	select {
	case err := <-done:
		if !errors.Is(err, context.Canceled) {
			t.Errorf("Run: %v, want context.Canceled", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after its context ended")
	}
}
