package identity

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	delegated "github.com/spiffe/spire-api-sdk/proto/spire/api/agent/delegatedidentity/v1"
	"github.com/spiffe/spire-api-sdk/proto/spire/api/types"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

// SpireConfig configures DialSpire.
type SpireConfig struct {
	// AdminSocket is the path of the SPIRE agent's admin socket, which
	// serves the Delegated Identity API. The agent authorizes this process
	// by its own SPIFFE ID (the agent's authorized_delegates).
	AdminSocket string
	// TrustDomain is the mesh's trust domain.
	TrustDomain spiffeid.TrustDomain
	// Timeout bounds the wait for an SVID or the first bundle; 10 s if zero.
	Timeout time.Duration
	Logger  zerolog.Logger
}

// SpireIssuer is an Issuer that gets the SVIDs of the node's workloads from
// the node's SPIRE agent through its Delegated Identity API: it subscribes
// with the selectors of the workload's namespace and service account
// (k8s:ns:<ns>, k8s:sa:<sa>) and takes the SVID of the identity asked for.
// The agent (not the node) makes the keys, and grants only what the
// registration entries parented to it allow. The trust bundle follows the
// agent's bundle subscription.
type SpireIssuer struct {
	cfg    SpireConfig
	conn   *grpc.ClientConn
	client delegated.DelegatedIdentityClient
	bundle *TrustBundle
	cancel context.CancelFunc
	wg     sync.WaitGroup
	// lastErr is the last error of the bundle subscription.
	lastErr atomic.Pointer[error]
}

// DialSpire connects to the agent and waits for its first trust bundle.
func DialSpire(ctx context.Context, cfg SpireConfig) (*SpireIssuer, error) {
	if cfg.AdminSocket == "" || cfg.TrustDomain.IsZero() {
		return nil, errors.New("identity: SPIRE source needs the agent's admin socket and the trust domain")
	}
	if cfg.Timeout <= 0 {
		cfg.Timeout = 10 * time.Second
	}
	conn, err := grpc.NewClient("passthrough:///spire-agent-admin",
		grpc.WithTransportCredentials(insecure.NewCredentials()), // a local unix socket; the agent checks our process
		grpc.WithContextDialer(func(ctx context.Context, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", cfg.AdminSocket)
		}))
	if err != nil {
		return nil, fmt.Errorf("identity: SPIRE agent %s: %w", cfg.AdminSocket, err)
	}
	s := &SpireIssuer{cfg: cfg, conn: conn, client: delegated.NewDelegatedIdentityClient(conn),
		bundle: NewTrustBundle(cfg.TrustDomain, nil)}
	bctx, cancel := context.WithCancel(context.Background())
	s.cancel = cancel
	first := make(chan error, 1)
	s.wg.Go(func() { s.followBundles(bctx, first) })
	wctx, wcancel := context.WithTimeout(ctx, cfg.Timeout)
	defer wcancel()
	select {
	case err := <-first:
		if err != nil {
			s.Close()
			return nil, err
		}
	case <-wctx.Done():
		var last error = wctx.Err()
		if e := s.lastErr.Load(); e != nil {
			last = *e
		}
		s.Close()
		return nil, fmt.Errorf("identity: SPIRE agent %s: no trust bundle within %s: %w", cfg.AdminSocket, cfg.Timeout, last)
	}
	return s, nil
}

// Bundle returns the trust bundle, kept current from the agent.
func (s *SpireIssuer) Bundle() *TrustBundle { return s.bundle }

// Close ends the subscriptions and the connection.
func (s *SpireIssuer) Close() error {
	s.cancel()
	err := s.conn.Close()
	s.wg.Wait()
	return err
}

// followBundles keeps the bundle of the trust domain current; it reports
// the first one on first, and resubscribes until ctx ends.
func (s *SpireIssuer) followBundles(ctx context.Context, first chan<- error) {
	reported := false
	report := func(err error) {
		if !reported {
			reported = true
			first <- err
		}
	}
	for ctx.Err() == nil {
		stream, err := s.client.SubscribeToX509Bundles(ctx, &delegated.SubscribeToX509BundlesRequest{})
		for err == nil {
			var resp *delegated.SubscribeToX509BundlesResponse
			if resp, err = stream.Recv(); err != nil {
				break
			}
			raw, ok := resp.GetCaCertificates()[s.cfg.TrustDomain.IDString()]
			if !ok {
				err = fmt.Errorf("identity: SPIRE agent sent no bundle for %s", s.cfg.TrustDomain)
				break
			}
			var roots []*x509.Certificate
			if roots, err = x509.ParseCertificates(raw); err != nil {
				break
			}
			if s.bundle.Set(roots) {
				s.cfg.Logger.Info().Int("roots", len(roots)).Msg("trust bundle updated from the SPIRE agent")
			}
			report(nil)
		}
		if ctx.Err() != nil {
			return
		}
		// The agent may not serve this process yet (it is starting, or has
		// not synced the node proxy's entry): retry; DialSpire gives up
		// after its timeout with the last error.
		s.lastErr.Store(&err)
		s.cfg.Logger.Warn().Err(err).Msg("SPIRE bundle subscription failed or ended; resubscribing")
		select {
		case <-ctx.Done():
			return
		case <-time.After(time.Second):
		}
	}
}

// Issue returns the agent's current SVID for the workload identity id.
func (s *SpireIssuer) Issue(ctx context.Context, id spiffeid.ID) (*x509svid.SVID, error) {
	ns, sa, err := ParseWorkloadID(id)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, s.cfg.Timeout)
	defer cancel()
	stream, err := s.client.SubscribeToX509SVIDs(ctx, &delegated.SubscribeToX509SVIDsRequest{
		Selectors: []*types.Selector{{Type: "k8s", Value: "ns:" + ns}, {Type: "k8s", Value: "sa:" + sa}},
	})
	if err != nil {
		return nil, fmt.Errorf("SPIRE agent: subscribe for %s: %w", id, err)
	}
	for {
		resp, err := stream.Recv()
		if err != nil {
			return nil, fmt.Errorf("SPIRE agent: no SVID for %s (no registration entry for k8s:ns:%s, k8s:sa:%s on this node's agent?): %w", id, ns, sa, err)
		}
		for _, sv := range resp.GetX509Svids() {
			x := sv.GetX509Svid()
			td, err := spiffeid.TrustDomainFromString(x.GetId().GetTrustDomain())
			if err != nil {
				continue
			}
			if got, err := spiffeid.FromPath(td, x.GetId().GetPath()); err != nil || got != id {
				continue
			}
			var raw []byte
			for _, c := range x.GetCertChain() {
				raw = append(raw, c...)
			}
			return x509svid.ParseRaw(raw, sv.GetX509SvidKey())
		}
	}
}
