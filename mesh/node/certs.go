package node

import (
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/registry"
)

// Certificate retries: a local workload whose certificate could not be
// issued (the CA unreachable, or refusing that identity) is blocked for
// mesh connections and its certificate asked for again in the background,
// first after CertRetryMin, then twice as long each time up to
// CertRetryMax. CertAttemptTimeout bounds one attempt.
const (
	CertRetryMin       = time.Second
	CertRetryMax       = 30 * time.Second
	CertAttemptTimeout = 10 * time.Second
)

// BlockedReasonNoCertificate is the reason WorkloadsBlockedMetric, the
// access log and /config_dump give for a local workload that holds no
// certificate: its mesh connections are refused until it has one.
const BlockedReasonNoCertificate = "no-certificate"

// WorkloadsBlockedMetric is the gauge of this node's local mesh workloads
// that are blocked for mesh connections, by reason.
const WorkloadsBlockedMetric = "meshtun_workloads_blocked"

// certSource is the part of identity.Source the certKeeper uses.
type certSource interface {
	Add(context.Context, spiffeid.ID) error
	Expiry(spiffeid.ID) (time.Time, bool)
}

var _ certSource = (*identity.Source)(nil)

// certKeeper gets the local workloads' certificates: a first attempt
// when a workload appears, then retries with backoff in the background
// until the certificate is issued or the workload is gone. The node never
// waits on it to capture: a workload without a certificate is captured
// and blocked (fail closed) meanwhile.
type certKeeper struct {
	src      certSource
	log      zerolog.Logger
	onIssued func() // after a retry got a certificate (outside the locks)
	min, max time.Duration
	attempt  time.Duration

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	syncMu  sync.Mutex // one sync at a time
	mu      sync.Mutex
	pending map[spiffeid.ID]*pendingCert
}

// pendingCert is an identity whose certificate is being retried.
type pendingCert struct {
	cancel    context.CancelFunc
	workloads []string
	attempts  int
	lastErr   string
	next      time.Time
}

func newCertKeeper(ctx context.Context, src certSource, onIssued func(), log zerolog.Logger) *certKeeper {
	ctx, cancel := context.WithCancel(ctx)
	return &certKeeper{
		src: src, log: log, onIssued: onIssued, min: CertRetryMin, max: CertRetryMax, attempt: CertAttemptTimeout,
		ctx: ctx, cancel: cancel, pending: map[spiffeid.ID]*pendingCert{},
	}
}

// stop ends the retries and waits for them.
func (k *certKeeper) stop() {
	k.cancel()
	k.wg.Wait()
}

// sync makes the identities of ws the ones the keeper gets certificates
// for: those neither held nor retried yet get a first attempt now (all at
// once, bounded by ctx and one attempt's timeout), and the retries of
// identities no workload of ws has any more stop. A failed first attempt
// is retried in the background. It never fails: what is missing shows in
// missing(). It returns how many certificates its first attempts issued.
func (k *certKeeper) sync(ctx context.Context, ws []*registry.Workload) (issued int) {
	k.syncMu.Lock()
	defer k.syncMu.Unlock()
	want := map[spiffeid.ID][]string{}
	for _, w := range ws {
		want[w.Identity] = append(want[w.Identity], w.String())
	}
	var fresh []spiffeid.ID
	k.mu.Lock()
	for id, names := range want {
		if p := k.pending[id]; p != nil {
			p.workloads = names
			continue
		}
		if _, held := k.src.Expiry(id); !held {
			fresh = append(fresh, id)
		}
	}
	for id, p := range k.pending {
		if want[id] == nil {
			p.cancel()
			delete(k.pending, id)
		}
	}
	k.mu.Unlock()
	if len(fresh) == 0 {
		return 0
	}
	actx, cancel := context.WithTimeout(ctx, k.attempt)
	errs := make([]error, len(fresh))
	sem := make(chan struct{}, identity.AddParallel)
	var wg sync.WaitGroup
	for i, id := range fresh {
		sem <- struct{}{}
		wg.Go(func() {
			defer func() { <-sem }()
			errs[i] = k.src.Add(actx, id)
		})
	}
	wg.Wait()
	cancel()
	k.mu.Lock()
	defer k.mu.Unlock()
	for i, id := range fresh {
		if errs[i] == nil {
			issued++
			continue
		}
		if k.pending[id] != nil || k.ctx.Err() != nil {
			continue
		}
		pctx, pcancel := context.WithCancel(k.ctx)
		p := &pendingCert{cancel: pcancel, workloads: want[id], attempts: 1, lastErr: errs[i].Error(), next: time.Now().Add(k.min)}
		k.pending[id] = p
		k.log.Error().Err(errs[i]).Str("identity", id.String()).Strs("workloads", p.workloads).Dur("retry_in", k.min).
			Msg("no certificate for a local workload: its mesh connections are refused (outbound reset, inbound HBONE refused) until one is issued; retrying")
		k.wg.Add(1)
		go k.retry(pctx, id, p)
	}
	return issued
}

// retry asks for id's certificate until it is issued or ctx ends, waiting
// k.min after the first failure and twice as long after each further one,
// up to k.max.
func (k *certKeeper) retry(ctx context.Context, id spiffeid.ID, p *pendingCert) {
	defer k.wg.Done()
	delay := k.min
	timer := time.NewTimer(delay)
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-timer.C:
		}
		actx, cancel := context.WithTimeout(ctx, k.attempt)
		err := k.src.Add(actx, id)
		cancel()
		if ctx.Err() != nil {
			return
		}
		k.mu.Lock()
		if err == nil {
			if k.pending[id] == p {
				delete(k.pending, id)
			}
			attempts := p.attempts
			k.mu.Unlock()
			k.log.Info().Str("identity", id.String()).Int("failed_attempts", attempts).
				Msg("certificate issued for a local workload: its mesh connections are no longer blocked")
			if k.onIssued != nil {
				k.onIssued()
			}
			return
		}
		delay = min(delay*2, k.max)
		p.attempts++
		p.lastErr = err.Error()
		p.next = time.Now().Add(delay)
		attempts := p.attempts
		k.mu.Unlock()
		k.log.Warn().Err(err).Str("identity", id.String()).Int("attempt", attempts).Dur("retry_in", delay).
			Msg("certificate for a local workload still not issued; its mesh connections stay blocked")
		timer.Reset(delay)
	}
}

// missingCert is an identity the keeper is retrying, for /config_dump.
type missingCert struct {
	Identity    string    `json:"identity"`
	Workloads   []string  `json:"workloads"`
	Attempts    int       `json:"attempts"`
	LastError   string    `json:"lastError"`
	NextAttempt time.Time `json:"nextAttempt"`
}

// missing returns the identities being retried, sorted.
func (k *certKeeper) missing() []missingCert {
	k.mu.Lock()
	out := make([]missingCert, 0, len(k.pending))
	for id, p := range k.pending {
		out = append(out, missingCert{Identity: id.String(), Workloads: slices.Clone(p.workloads), Attempts: p.attempts, LastError: p.lastErr, NextAttempt: p.next})
	}
	k.mu.Unlock()
	slices.SortFunc(out, func(a, b missingCert) int { return strings.Compare(a.Identity, b.Identity) })
	return out
}

// hasCertificate reports whether the local identity id holds a
// certificate (a workload without one is blocked for mesh connections).
func (n *node) hasCertificate(id spiffeid.ID) bool {
	_, held := n.svids.Expiry(id)
	return held
}

// uncertified returns the local workloads of snap that should hold a
// certificate (not refused) and do not: blocked for mesh connections.
func (n *node) uncertified(snap *registry.Snapshot) []*registry.Workload {
	var out []*registry.Workload
	for _, w := range withCertificates(localWorkloads(snap, n.cfg.Name)) {
		if !n.hasCertificate(w.Identity) {
			out = append(out, w)
		}
	}
	return out
}

// certificateIssued re-reports capture once a retried certificate
// arrived: the workload is now fully captured (Config.Captured).
func (n *node) certificateIssued() {
	n.captureMu.Lock()
	defer n.captureMu.Unlock()
	n.reportCaptured(localWorkloads(n.reg.Load(), n.cfg.Name), n.rulesOK)
}

var blockedDesc = prometheus.NewDesc(WorkloadsBlockedMetric,
	"Local mesh workloads of this node blocked for mesh connections (outbound reset, inbound HBONE refused), by reason.",
	[]string{"reason"}, nil)

// blockedCollector reports WorkloadsBlockedMetric.
type blockedCollector struct{ n *node }

func (blockedCollector) Describe(ch chan<- *prometheus.Desc) { ch <- blockedDesc }

func (c blockedCollector) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(blockedDesc, prometheus.GaugeValue,
		float64(len(c.n.uncertified(c.n.reg.Load()))), BlockedReasonNoCertificate)
}
