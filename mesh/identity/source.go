package identity

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
)

// Issuer issues X509-SVIDs. *CA implements it; a client of an external CA
// (Istio's CA service, SPIRE) can too.
type Issuer interface {
	// Issue returns a new SVID, with a new key, for id.
	Issue(ctx context.Context, id spiffeid.ID) (*x509svid.SVID, error)
}

// DefaultRetryInterval is how long a Source waits after a failed renewal
// before it tries again, when SourceConfig.RetryInterval is zero.
const DefaultRetryInterval = 5 * time.Second

// minRenewDelay bounds how often one identity can be renewed, so that an
// issuer handing out nearly expired certificates cannot make a Source spin.
const minRenewDelay = 50 * time.Millisecond

// SourceConfig configures NewSource.
type SourceConfig struct {
	// Issuer issues the SVIDs of local identities. Required.
	Issuer Issuer
	// Bundle holds the trust bundles peers are verified against. Required.
	Bundle x509bundle.Source
	// TrustDomain is the node's own trust domain. Required.
	TrustDomain spiffeid.TrustDomain
	// RetryInterval is the wait after a failed renewal; DefaultRetryInterval
	// if zero. Retries never wait past half the remaining lifetime.
	RetryInterval time.Duration
	// OnUpdate, if set, is called after every successful issuance (the
	// first one in Add and each renewal), outside the Source's locks.
	OnUpdate func(id spiffeid.ID, svid *x509svid.SVID)
	// Logger receives renewals and renewal failures.
	Logger zerolog.Logger
}

// Source holds the SVIDs of the identities that are local to this node, and
// only those, and renews each at half of its lifetime in the background. TLS
// configurations built by ClientTLS and ServerTLS read the current SVID at
// every handshake, so a renewal takes effect for new connections while open
// connections keep working. A Source is safe for concurrent use.
type Source struct {
	cfg    SourceConfig
	ctx    context.Context
	cancel context.CancelFunc

	mu      sync.Mutex
	entries map[spiffeid.ID]*entry
	wg      sync.WaitGroup

	renewals, renewFailures atomic.Uint64
	failing                 atomic.Int64
}

type entry struct {
	ready  chan struct{} // closed when the first issuance finished
	err    error         // error of the first issuance, set before ready closes
	cancel context.CancelFunc

	mu   sync.RWMutex
	svid *x509svid.SVID
}

func (e *entry) current() *x509svid.SVID {
	e.mu.RLock()
	defer e.mu.RUnlock()
	return e.svid
}

// NewSource returns a Source with no local identities; Add some.
func NewSource(cfg SourceConfig) (*Source, error) {
	switch {
	case cfg.Issuer == nil:
		return nil, errors.New("identity: source needs an issuer")
	case cfg.Bundle == nil:
		return nil, errors.New("identity: source needs a trust bundle")
	case cfg.TrustDomain.IsZero():
		return nil, errors.New("identity: source needs a trust domain")
	}
	if cfg.RetryInterval <= 0 {
		cfg.RetryInterval = DefaultRetryInterval
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Source{cfg: cfg, ctx: ctx, cancel: cancel, entries: make(map[spiffeid.ID]*entry)}, nil
}

// TrustDomain returns the node's trust domain.
func (s *Source) TrustDomain() spiffeid.TrustDomain { return s.cfg.TrustDomain }

// Add makes id local: it issues an SVID for id (waiting for it, bounded by
// ctx) and keeps renewing it until Remove or Close. Adding an identity that
// is already local returns at once.
func (s *Source) Add(ctx context.Context, id spiffeid.ID) error {
	s.mu.Lock()
	if s.ctx.Err() != nil {
		s.mu.Unlock()
		return fmt.Errorf("identity: add %s: source is closed", id)
	}
	e, ok := s.entries[id]
	if ok {
		s.mu.Unlock()
		select {
		case <-e.ready:
			return e.err
		case <-ctx.Done():
			return fmt.Errorf("identity: add %s: %w", id, ctx.Err())
		}
	}
	ectx, cancel := context.WithCancel(s.ctx)
	e = &entry{ready: make(chan struct{}), cancel: cancel}
	s.entries[id] = e
	s.mu.Unlock()

	stop := context.AfterFunc(ctx, cancel)
	svid, err := s.issue(ectx, id)
	if !stop() && err == nil {
		// ctx ended while the SVID was issued and has cancelled ectx, which
		// would stop the renewals: give up as if issuance had failed.
		err = fmt.Errorf("identity: add %s: %w", id, ctx.Err())
	}
	if err != nil {
		cancel()
		s.mu.Lock()
		if s.entries[id] == e {
			delete(s.entries, id)
		}
		s.mu.Unlock()
		e.err = err
		close(e.ready)
		return err
	}
	issuedAt := time.Now()
	e.svid = svid
	close(e.ready)
	s.mu.Lock()
	if s.ctx.Err() != nil {
		s.mu.Unlock()
		return fmt.Errorf("identity: add %s: source is closed", id)
	}
	s.wg.Add(1)
	s.mu.Unlock()
	go s.renew(ectx, id, e, issuedAt)
	s.notify(id, svid)
	return nil
}

// AddParallel is how many identities AddAll asks for at once.
const AddParallel = 16

// AddAll adds ids (see Add), up to AddParallel at a time, so that a node
// with many new workloads waits for a few round trips to the issuer, not
// one per workload. It returns the errors of those that failed; the others
// are added.
func (s *Source) AddAll(ctx context.Context, ids []spiffeid.ID) error {
	errs := make([]error, len(ids))
	sem := make(chan struct{}, AddParallel)
	var wg sync.WaitGroup
	for i, id := range ids {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			errs[i] = s.Add(ctx, id)
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

// Remove forgets id and stops renewing it. Handshakes that need id's SVID
// fail from then on; established connections are not touched.
func (s *Source) Remove(id spiffeid.ID) {
	s.mu.Lock()
	e, ok := s.entries[id]
	delete(s.entries, id)
	s.mu.Unlock()
	if ok {
		e.cancel()
	}
}

// Close stops all renewals and forgets all identities.
func (s *Source) Close() {
	s.mu.Lock()
	s.cancel()
	s.entries = make(map[spiffeid.ID]*entry)
	s.mu.Unlock()
	s.wg.Wait()
}

// IDs returns the local identities, sorted.
func (s *Source) IDs() []spiffeid.ID {
	s.mu.Lock()
	ids := make([]spiffeid.ID, 0, len(s.entries))
	for id := range s.entries {
		ids = append(ids, id)
	}
	s.mu.Unlock()
	slices.SortFunc(ids, func(a, b spiffeid.ID) int { return strings.Compare(a.String(), b.String()) })
	return ids
}

// SVID returns the current SVID of the local identity id.
func (s *Source) SVID(id spiffeid.ID) (*x509svid.SVID, error) {
	s.mu.Lock()
	e, ok := s.entries[id]
	s.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("identity: %s is not a local identity of this node", id)
	}
	select {
	case <-e.ready:
	default:
		return nil, fmt.Errorf("identity: SVID for %s is still being issued", id)
	}
	if e.err != nil {
		return nil, e.err
	}
	return e.current(), nil
}

// Expiry returns when the current SVID of id expires, and false if id is not
// local.
func (s *Source) Expiry(id spiffeid.ID) (time.Time, bool) {
	svid, err := s.SVID(id)
	if err != nil {
		return time.Time{}, false
	}
	return svid.Certificates[0].NotAfter, true
}

// GetX509BundleForTrustDomain returns the trust bundle for td. It implements
// x509bundle.Source.
func (s *Source) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	return s.cfg.Bundle.GetX509BundleForTrustDomain(td)
}

// Workload returns the view of s for one local identity, for ClientTLS. Its
// GetX509SVID returns id's current SVID, or an error once id is removed.
func (s *Source) Workload(id spiffeid.ID) *Workload { return &Workload{src: s, id: id} }

// Workload is a Source seen from one local identity. It implements
// x509svid.Source and x509bundle.Source, that is WorkloadSource.
type Workload struct {
	src *Source
	id  spiffeid.ID
}

// ID returns the identity.
func (w *Workload) ID() spiffeid.ID { return w.id }

// GetX509SVID returns the current SVID of the identity.
func (w *Workload) GetX509SVID() (*x509svid.SVID, error) { return w.src.SVID(w.id) }

// GetX509BundleForTrustDomain returns the trust bundle for td.
func (w *Workload) GetX509BundleForTrustDomain(td spiffeid.TrustDomain) (*x509bundle.Bundle, error) {
	return w.src.GetX509BundleForTrustDomain(td)
}

// issue asks the issuer for an SVID and checks that it is for id and still
// has lifetime left.
func (s *Source) issue(ctx context.Context, id spiffeid.ID) (*x509svid.SVID, error) {
	svid, err := s.cfg.Issuer.Issue(ctx, id)
	if err != nil {
		return nil, fmt.Errorf("identity: issue SVID for %s: %w", id, err)
	}
	if svid == nil || len(svid.Certificates) == 0 {
		return nil, fmt.Errorf("identity: issuer returned no certificate for %s", id)
	}
	if svid.ID != id {
		return nil, fmt.Errorf("identity: asked the issuer for %s, got an SVID for %s", id, svid.ID)
	}
	if exp := svid.Certificates[0].NotAfter; !exp.After(time.Now().Add(minRenewDelay)) {
		return nil, fmt.Errorf("identity: issuer returned an SVID for %s that expires at %s, already past", id, exp.Format(time.RFC3339Nano))
	}
	return svid, nil
}

// renewJitter is the fraction of an SVID's lifetime by which a renewal may
// come early: renewals happen between 40% and 50% of the lifetime, so that
// a node with many workloads issued at the same moment does not send all
// its requests again at the same moment.
const renewJitter = 0.1

// renewDelay returns how long after now an SVID issued at issuedAt and
// expiring at notAfter is renewed: at half of its lifetime, earlier by
// jitter (0 to 1) times renewJitter of the lifetime, never before
// minRenewDelay.
func renewDelay(issuedAt, notAfter, now time.Time, jitter float64) time.Duration {
	life := notAfter.Sub(issuedAt)
	at := issuedAt.Add(life/2 - time.Duration(float64(life)*renewJitter*jitter))
	return max(at.Sub(now), minRenewDelay)
}

// retryDelay returns the wait before retry number failures (1, 2, …) of a
// renewal: base doubled per failure (exponential backoff), but never more
// than half of the lifetime left, so that the last attempts before expiry
// come closer together, and never less than minRenewDelay.
func retryDelay(base time.Duration, failures int, left time.Duration) time.Duration {
	d := base
	for i := 1; i < failures && d < time.Hour; i++ {
		d *= 2
	}
	return max(min(d, left/2), minRenewDelay)
}

// renew keeps e's SVID fresh: it reissues at half of the lifetime (with
// jitter) and retries failures with backoff until ctx ends. The current
// SVID stays in use until it is replaced, also after renewals failed.
func (s *Source) renew(ctx context.Context, id spiffeid.ID, e *entry, issuedAt time.Time) {
	defer s.wg.Done()
	log := s.cfg.Logger.With().Str("identity", id.String()).Logger()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		notAfter := e.current().Certificates[0].NotAfter
		timer.Reset(renewDelay(issuedAt, notAfter, time.Now(), rand.Float64()))
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		for failures := 1; ; failures++ {
			svid, err := s.issue(ctx, id)
			if err == nil {
				e.mu.Lock()
				e.svid = svid
				e.mu.Unlock()
				issuedAt = time.Now()
				if failures > 1 {
					s.failing.Add(-1)
					log.Info().Int("failed_attempts", failures-1).Time("not_after", svid.Certificates[0].NotAfter).Msg("SVID renewed after failures")
				} else {
					log.Debug().Time("not_after", svid.Certificates[0].NotAfter).Msg("renewed SVID")
				}
				s.renewals.Add(1)
				s.notify(id, svid)
				break
			}
			if ctx.Err() != nil {
				if failures > 1 {
					s.failing.Add(-1)
				}
				return
			}
			if failures == 1 {
				s.failing.Add(1)
			}
			s.renewFailures.Add(1)
			left := time.Until(notAfter)
			retry := retryDelay(s.cfg.RetryInterval, failures, left)
			ev := log.Warn()
			if left <= 0 {
				ev = log.Error()
			}
			ev.Err(err).Time("not_after", notAfter).Bool("expired", left <= 0).Int("attempt", failures).
				Dur("retry_in", retry).Msg("SVID renewal failed; the current certificate stays in use until it expires")
			timer.Reset(retry)
			select {
			case <-ctx.Done():
				s.failing.Add(-1)
				return
			case <-timer.C:
			}
		}
	}
}

// Stats are a Source's renewal counters.
type Stats struct {
	// Renewals counts successful renewals; RenewalFailures failed attempts.
	Renewals, RenewalFailures uint64
	// Failing is the number of identities whose renewal is failing now.
	Failing int
	// Valid is the number of local identities holding an unexpired SVID;
	// Total the number of local identities.
	Valid, Total int
}

// Stats returns the renewal counters and how many identities hold a
// valid SVID now.
func (s *Source) Stats() Stats {
	st := Stats{Renewals: s.renewals.Load(), RenewalFailures: s.renewFailures.Load(), Failing: int(s.failing.Load())}
	now := time.Now()
	for _, id := range s.IDs() {
		st.Total++
		if svid, err := s.SVID(id); err == nil && now.Before(svid.Certificates[0].NotAfter) {
			st.Valid++
		}
	}
	return st
}

func (s *Source) notify(id spiffeid.ID, svid *x509svid.SVID) {
	if s.cfg.OnUpdate != nil {
		s.cfg.OnUpdate(id, svid)
	}
}
