package identity

import (
	"context"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

type update struct {
	id   spiffeid.ID
	svid *x509svid.SVID
	at   time.Time
}

// newTestSource returns a Source over issuer whose updates arrive on the
// returned channel.
func newTestSource(t *testing.T, issuer Issuer, ca *CA) (*Source, <-chan update) {
	t.Helper()
	updates := make(chan update, 16)
	src, err := NewSource(SourceConfig{
		Issuer:        issuer,
		Bundle:        ca.Bundle(),
		TrustDomain:   ca.TrustDomain(),
		RetryInterval: 100 * time.Millisecond,
		OnUpdate: func(id spiffeid.ID, svid *x509svid.SVID) {
			updates <- update{id, svid, time.Now()}
		},
		Logger: testLogger(t),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(src.Close)
	return src, updates
}

func nextUpdate(t *testing.T, updates <-chan update, timeout time.Duration) update {
	t.Helper()
	select {
	case u := <-updates:
		return u
	case <-time.After(timeout):
		t.Fatalf("no SVID update within %s", timeout)
		return update{}
	}
}

func TestSourceHoldsOnlyLocalIdentities(t *testing.T) {
	ca := openCA(t, t.TempDir(), testTD, time.Hour)
	src, updates := newTestSource(t, ca, ca)
	a, b := mustID(t, testTD, "ns", "a"), mustID(t, testTD, "ns", "b")
	ctx := context.Background()
	if err := src.Add(ctx, b); err != nil {
		t.Fatal(err)
	}
	if err := src.Add(ctx, a); err != nil {
		t.Fatal(err)
	}
	if err := src.Add(ctx, a); err != nil { // idempotent
		t.Fatal(err)
	}
	if u := nextUpdate(t, updates, time.Second); u.id != b {
		t.Errorf("first update for %s, want %s", u.id, b)
	}
	if u := nextUpdate(t, updates, time.Second); u.id != a {
		t.Errorf("second update for %s, want %s", u.id, a)
	}
	select {
	case u := <-updates:
		t.Errorf("adding %s twice issued a second SVID (update %s)", a, u.id)
	default:
	}
	if ids := src.IDs(); len(ids) != 2 || ids[0] != a || ids[1] != b {
		t.Errorf("IDs() = %v, want [%s %s]", ids, a, b)
	}
	svid, err := src.SVID(a)
	if err != nil || svid.ID != a {
		t.Fatalf("SVID(%s) = %v, %v", a, svid, err)
	}
	exp, ok := src.Expiry(a)
	if !ok || !exp.Equal(svid.Certificates[0].NotAfter) {
		t.Errorf("Expiry(%s) = %s, %t; want %s", a, exp, ok, svid.Certificates[0].NotAfter)
	}

	notLocal := mustID(t, testTD, "ns", "c")
	if _, err := src.SVID(notLocal); err == nil || !strings.Contains(err.Error(), "not a local identity") {
		t.Errorf("SVID of a non-local identity: %v", err)
	}
	if _, ok := src.Expiry(notLocal); ok {
		t.Error("Expiry of a non-local identity reported")
	}
	if _, err := src.Workload(notLocal).GetX509SVID(); err == nil {
		t.Error("Workload view of a non-local identity returned an SVID")
	}

	src.Remove(a)
	if _, err := src.SVID(a); err == nil {
		t.Errorf("SVID(%s) after Remove: no error", a)
	}
	if _, err := src.Workload(a).GetX509SVID(); err == nil {
		t.Error("Workload view still returns an SVID after Remove")
	}
	if ids := src.IDs(); len(ids) != 1 || ids[0] != b {
		t.Errorf("IDs() after Remove = %v", ids)
	}

	foreign := mustID(t, spiffeid.RequireTrustDomainFromString("other.example"), "ns", "a")
	if err := src.Add(ctx, foreign); err == nil || !strings.Contains(err.Error(), "other.example") {
		t.Errorf("Add of a foreign identity: %v", err)
	}
	if ids := src.IDs(); len(ids) != 1 {
		t.Errorf("failed Add left an entry: %v", ids)
	}
}

func TestSourceRenewsAtHalfLife(t *testing.T) {
	// Certificate times have one-second resolution: with 4 s the renewal
	// comes at least 1.6 s (half-life less jitter) after the first issue,
	// so its NotAfter is a later second. (With 2 s a renewal 0.8 s later
	// could land in the same second, and the expiry check below failed
	// about once in a loaded run.)
	const ttl = 4 * time.Second
	ca := openCA(t, t.TempDir(), testTD, ttl)
	src, updates := newTestSource(t, ca, ca)
	id := mustID(t, testTD, "ns", "short")
	if err := src.Add(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	first := nextUpdate(t, updates, time.Second)
	second := nextUpdate(t, updates, 3*ttl)
	if second.id != id {
		t.Fatalf("renewal for %s, want %s", second.id, id)
	}
	// Certificate times have one-second resolution, so the real lifetime is
	// what NotAfter says, not ttl.
	elapsed := second.at.Sub(first.at)
	life := first.svid.Certificates[0].NotAfter.Sub(first.at)
	half := life / 2
	early := time.Duration(float64(life) * renewJitter)
	if elapsed < half-early-100*time.Millisecond || elapsed > half+300*time.Millisecond {
		t.Errorf("renewed %s after the first issue, want between %s and %s (half of the remaining lifetime, up to %s early)", elapsed, half-early, half, early)
	}
	if second.svid.Certificates[0].SerialNumber.Cmp(first.svid.Certificates[0].SerialNumber) == 0 {
		t.Error("renewal kept the old certificate")
	}
	cur, err := src.SVID(id)
	if err != nil {
		t.Fatal(err)
	}
	if cur.Certificates[0].SerialNumber.Cmp(second.svid.Certificates[0].SerialNumber) != 0 {
		t.Error("SVID() does not return the renewed certificate")
	}
	exp, _ := src.Expiry(id)
	if !exp.After(first.svid.Certificates[0].NotAfter) {
		t.Errorf("expiry %s did not move past the first SVID's %s", exp, first.svid.Certificates[0].NotAfter)
	}
	// After Remove nothing renews id any more: the next renewal was due
	// about ttl/2 after the second issue.
	src.Remove(id)
	select {
	case u := <-updates:
		t.Errorf("SVID of %s renewed after Remove", u.id)
	case <-time.After(ttl * 7 / 10):
	}
}

// flakyIssuer fails the calls whose number is in fail (1-based).
type flakyIssuer struct {
	ca    *CA
	calls atomic.Int32
	mu    sync.Mutex
	fail  map[int32]bool
}

func (f *flakyIssuer) Issue(ctx context.Context, id spiffeid.ID) (*x509svid.SVID, error) {
	n := f.calls.Add(1)
	f.mu.Lock()
	fail := f.fail[n]
	f.mu.Unlock()
	if fail {
		return nil, errors.New("CA unavailable")
	}
	return f.ca.Issue(ctx, id)
}

func TestSourceRetriesFailedRenewal(t *testing.T) {
	ca := openCA(t, t.TempDir(), testTD, 2*time.Second)
	issuer := &flakyIssuer{ca: ca, fail: map[int32]bool{2: true, 3: true}}
	src, updates := newTestSource(t, issuer, ca)
	id := mustID(t, testTD, "ns", "retry")
	if err := src.Add(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	first := nextUpdate(t, updates, time.Second)
	second := nextUpdate(t, updates, 4*time.Second)
	if n := issuer.calls.Load(); n < 4 {
		t.Errorf("issuer called %d times, want the two failures retried", n)
	}
	if !second.svid.Certificates[0].NotAfter.After(first.svid.Certificates[0].NotAfter) {
		t.Error("retry did not renew the SVID")
	}
}

func TestSourceAddFailure(t *testing.T) {
	ca := openCA(t, t.TempDir(), testTD, time.Hour)
	issuer := &flakyIssuer{ca: ca, fail: map[int32]bool{1: true}}
	src, _ := newTestSource(t, issuer, ca)
	id := mustID(t, testTD, "ns", "x")
	err := src.Add(context.Background(), id)
	if err == nil || !strings.Contains(err.Error(), "CA unavailable") || !strings.Contains(err.Error(), id.String()) {
		t.Fatalf("Add with a failing issuer: %v", err)
	}
	if _, err := src.SVID(id); err == nil {
		t.Error("failed Add left an SVID")
	}
	if err := src.Add(context.Background(), id); err != nil {
		t.Fatalf("Add after the issuer recovered: %v", err)
	}

	// An issuer handing out expired certificates is refused.
	past, err := OpenCA(CAConfig{Dir: t.TempDir(), TrustDomain: testTD, SVIDTTL: time.Hour,
		Now: func() time.Time { return time.Now().Add(-2 * time.Hour) }})
	if err != nil {
		t.Fatal(err)
	}
	src2, _ := newTestSource(t, past, past)
	if err := src2.Add(context.Background(), id); err == nil || !strings.Contains(err.Error(), "already past") {
		t.Errorf("Add with an issuer of expired SVIDs: %v", err)
	}

	src.Close()
	if err := src.Add(context.Background(), mustID(t, testTD, "ns", "late")); err == nil {
		t.Error("Add after Close succeeded")
	}
}

func TestRenewScheduling(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	notAfter := t0.Add(time.Hour)
	for _, c := range []struct {
		now    time.Time
		jitter float64
		want   time.Duration
	}{
		{t0, 0, 30 * time.Minute},                       // half-life
		{t0, 1, 24 * time.Minute},                       // at most 10% of the lifetime early
		{t0, 0.5, 27 * time.Minute},                     // in between
		{t0.Add(10 * time.Minute), 0, 20 * time.Minute}, // measured from issuance, not from now
		{t0.Add(50 * time.Minute), 0, minRenewDelay},    // overdue: at once, but not in a spin
		{t0.Add(-time.Minute), 0, 31 * time.Minute},     // clock behind the issuance
	} {
		if got := renewDelay(t0, notAfter, c.now, c.jitter); got != c.want {
			t.Errorf("renewDelay(now %s, jitter %v) = %s, want %s", c.now.Sub(t0), c.jitter, got, c.want)
		}
	}
	for _, c := range []struct {
		failures int
		left     time.Duration
		want     time.Duration
	}{
		{1, time.Hour, 5 * time.Second},
		{2, time.Hour, 10 * time.Second},
		{4, time.Hour, 40 * time.Second},
		{40, time.Hour, 30 * time.Minute}, // capped at half of what is left
		{3, 10 * time.Second, 5 * time.Second},
		{1, 0, minRenewDelay}, // expired: keep trying, not spinning
		{1, -time.Hour, minRenewDelay},
	} {
		if got := retryDelay(5*time.Second, c.failures, c.left); got != c.want {
			t.Errorf("retryDelay(5s, %d, %s) = %s, want %s", c.failures, c.left, got, c.want)
		}
	}
}

func TestSourceStatsCountFailingRenewals(t *testing.T) {
	ca := openCA(t, t.TempDir(), testTD, 2*time.Second)
	issuer := &flakyIssuer{ca: ca, fail: map[int32]bool{}}
	for i := int32(2); i < 100; i++ {
		issuer.fail[i] = true
	}
	src, _ := newTestSource(t, issuer, ca)
	id := mustID(t, testTD, "ns", "stats")
	if err := src.Add(context.Background(), id); err != nil {
		t.Fatal(err)
	}
	if st := src.Stats(); st.Valid != 1 || st.Total != 1 || st.Failing != 0 {
		t.Fatalf("after issuance: %+v, want 1 valid of 1, none failing", st)
	}
	deadline := time.Now().Add(5 * time.Second)
	for src.Stats().Failing == 0 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	st := src.Stats()
	if st.Failing != 1 || st.RenewalFailures == 0 || st.Valid != 1 {
		t.Fatalf("while the issuer fails: %+v, want 1 failing, failures counted, the old SVID still valid", st)
	}
	exp, _ := src.Expiry(id)
	time.Sleep(time.Until(exp) + 100*time.Millisecond)
	if st := src.Stats(); st.Valid != 0 || st.Total != 1 {
		t.Fatalf("after expiry: %+v, want 0 valid of 1", st)
	}
}
