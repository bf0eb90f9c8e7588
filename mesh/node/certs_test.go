package node

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"net/netip"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/registry"
)

// flakyCA refuses every request until up is set, then issues; it records
// when each request came.
type flakyCA struct {
	ca *identity.CA
	mu sync.Mutex
	up bool
	at []time.Time
}

func (f *flakyCA) Issue(ctx context.Context, id spiffeid.ID) (*x509svid.SVID, error) {
	f.mu.Lock()
	f.at = append(f.at, time.Now())
	up := f.up
	f.mu.Unlock()
	if !up {
		return nil, errors.New("certificate service unreachable")
	}
	return f.ca.Issue(ctx, id)
}

func (f *flakyCA) setUp() {
	f.mu.Lock()
	f.up = true
	f.mu.Unlock()
}

func (f *flakyCA) attempts() []time.Time {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]time.Time(nil), f.at...)
}

// TestCertificateRetriedWithBackoff: a local workload whose certificate
// the CA does not issue leaves the node running: the workload is reported
// blocked (metric, readiness, /config_dump), its certificate is asked for
// again with a doubling wait up to the cap, and once the CA issues it the
// workload is unblocked and reported captured.
func TestCertificateRetriedWithBackoff(t *testing.T) {
	ca, err := identity.OpenCA(identity.CAConfig{Dir: t.TempDir(), TrustDomain: testTD})
	if err != nil {
		t.Fatal(err)
	}
	flaky := &flakyCA{ca: ca}
	src, err := identity.NewSource(identity.SourceConfig{Issuer: flaky, Bundle: ca.Bundle(), TrustDomain: testTD})
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	w := &registry.Workload{Name: "a", Namespace: "default", ServiceAccount: "a", Node: "n1", InMesh: true,
		Addresses: []netip.Addr{netip.MustParseAddr("198.18.1.11")}}
	snap, err := registry.Build(registry.Model{TrustDomain: testTD, Workloads: []*registry.Workload{w}})
	if err != nil {
		t.Fatal(err)
	}
	w = snap.Workloads[0]
	captured := make(chan []*registry.Workload, 16)
	n := &node{cfg: Config{Name: "n1", Captured: func(ws []*registry.Workload) { captured <- ws }},
		reg: registry.New(snap), svids: src, log: zerolog.Nop(), rulesOK: true}
	n.ready.Store(true)
	n.certs = newCertKeeper(context.Background(), src, n.certificateIssued, zerolog.Nop())
	n.certs.min, n.certs.max = 20*time.Millisecond, 80*time.Millisecond
	defer n.certs.stop()

	if issued := n.certs.sync(context.Background(), []*registry.Workload{w}); issued != 0 {
		t.Fatalf("issued %d with the CA down", issued)
	}
	if n.hasCertificate(w.Identity) {
		t.Fatal("certificate held with the CA down")
	}
	if v := gauge(t, blockedCollector{n}); v != 1 {
		t.Errorf("%s = %v, want 1", WorkloadsBlockedMetric, v)
	}
	rec := httptest.NewRecorder()
	n.readiness(rec, httptest.NewRequest(http.MethodGet, "/healthz/ready", nil))
	if rec.Code != http.StatusServiceUnavailable || !strings.Contains(rec.Body.String(), "default/a") || !strings.Contains(rec.Body.String(), BlockedReasonNoCertificate) {
		t.Errorf("readiness %d %q, want 503 naming default/a and %s", rec.Code, rec.Body.String(), BlockedReasonNoCertificate)
	}
	rec = httptest.NewRecorder()
	n.configDump(rec, httptest.NewRequest(http.MethodGet, "/config_dump", nil))
	if body := rec.Body.String(); !strings.Contains(body, `"blocked": "no-certificate"`) || !strings.Contains(body, `"lastError": "identity: issue SVID for `+w.Identity.String()) {
		t.Errorf("/config_dump does not show the missing certificate:\n%s", body)
	}

	// Seven attempts: the first, then waits of 20, 40, 80, 80, 80, 80 ms.
	deadline := time.Now().Add(10 * time.Second)
	for len(flaky.attempts()) < 7 && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	at := flaky.attempts()
	if len(at) < 7 {
		t.Fatalf("%d attempts in 10 s", len(at))
	}
	for i, want := range []time.Duration{20, 40, 80, 80, 80, 80} {
		want *= time.Millisecond
		if got := at[i+1].Sub(at[i]); got < want || got > want+60*time.Millisecond {
			t.Errorf("wait before attempt %d: %v, want %v", i+2, got, want)
		}
	}
	flaky.setUp()
	select {
	case refs := <-captured:
		if len(refs) != 1 || refs[0].Name != "a" {
			t.Errorf("captured %v after the certificate came, want default/a", refs)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the certificate never came once the CA was up")
	}
	if !n.hasCertificate(w.Identity) || len(n.certs.missing()) != 0 {
		t.Errorf("after issuance: held %v, missing %v", n.hasCertificate(w.Identity), n.certs.missing())
	}
	if v := gauge(t, blockedCollector{n}); v != 0 {
		t.Errorf("%s = %v after issuance, want 0", WorkloadsBlockedMetric, v)
	}
	rec = httptest.NewRecorder()
	n.readiness(rec, httptest.NewRequest(http.MethodGet, "/healthz/ready", nil))
	if rec.Code != http.StatusOK {
		t.Errorf("readiness after issuance: %d %q", rec.Code, rec.Body.String())
	}
	// A workload that leaves stops its retries.
	n.certs.sync(context.Background(), nil)
	if m := n.certs.missing(); len(m) != 0 {
		t.Errorf("missing %v with no workload", m)
	}
}

// gauge reads the one gauge c collects.
func gauge(t *testing.T, c prometheus.Collector) float64 {
	t.Helper()
	ch := make(chan prometheus.Metric, 4)
	c.Collect(ch)
	close(ch)
	var d dto.Metric
	if err := (<-ch).Write(&d); err != nil {
		t.Fatal(err)
	}
	return d.GetGauge().GetValue()
}
