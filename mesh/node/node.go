// Package node assembles a meshtun node proxy: the TUN device and its
// routing, the classifier, the netstack, the workload identities and the
// proxy, started in that order and torn down in reverse.
package node

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/config"
	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/proxy"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/stack"
	"github.com/meshtun/meshtun/stack/classify"
	"github.com/meshtun/meshtun/tun"
)

// Config is what a node proxy needs to know about its node and the mesh.
type Config struct {
	// Name is this node's name: workloads whose Node equals it are local.
	Name string
	TUN  tun.Config
	// CaptureLinks are the node-side links of the captured pods.
	CaptureLinks []string
	// Uplinks are the node's links towards other nodes.
	Uplinks []string
	// Mesh is the initial model of the mesh.
	Mesh *registry.Snapshot
	// CA is the built-in certificate authority that issues the local
	// workloads' SVIDs. Its TrustDomain must be Mesh's.
	CA identity.CAConfig
	// ConfigPath, if set, is watched: a valid change replaces the mesh
	// model (workloads, services, policies) without dropping established
	// connections; node settings in it take effect at the next start.
	ConfigPath string
	// NoIntercept leaves every packet verbatim: the TUN is in the path but
	// no flow is proxied. For measuring the TUN path alone.
	NoIntercept bool
	// AdminAddr is where the admin HTTP server listens (pprof under
	// /debug/pprof/); empty disables it. Keep it on loopback.
	AdminAddr string
	Logger    zerolog.Logger
}

// ReadyMessage is the log message Run writes once traffic is captured.
const ReadyMessage = "node ready"

// localWorkloads returns the mesh workloads of node name.
func localWorkloads(s *registry.Snapshot, name string) []*registry.Workload {
	var out []*registry.Workload
	for _, w := range s.Workloads {
		if w.InMesh && w.Node == name {
			out = append(out, w)
		}
	}
	return out
}

// Run runs the node proxy until ctx is done, then removes everything it
// installed. It returns ctx's error after a clean shutdown.
func Run(ctx context.Context, cfg Config) (err error) {
	log := cfg.Logger
	if cfg.Mesh == nil {
		return errors.New("node: no mesh model")
	}
	locals := localWorkloads(cfg.Mesh, cfg.Name)
	if len(locals) == 0 {
		return fmt.Errorf("node %q: no mesh workloads on this node", cfg.Name)
	}
	reg := registry.New(cfg.Mesh)

	// Identities first: nothing is captured before the local workloads
	// have their certificates.
	cfg.CA.TrustDomain = cfg.Mesh.TrustDomain
	cfg.CA.Logger = log
	ca, err := identity.OpenCA(cfg.CA)
	if err != nil {
		return err
	}
	svids, err := identity.NewSource(identity.SourceConfig{
		Issuer: ca, Bundle: ca.Bundle(), TrustDomain: cfg.Mesh.TrustDomain, Logger: log,
	})
	if err != nil {
		return err
	}
	defer svids.Close()
	for _, w := range locals {
		if err := svids.Add(ctx, w.Identity); err != nil {
			return fmt.Errorf("node: certificate for %s: %w", w, err)
		}
	}

	hc, err := hbone.NewClient(hbone.ClientConfig{
		TLS: func(src, dst spiffeid.ID) (*tls.Config, error) {
			return identity.ClientTLS(svids.Workload(src), dst), nil
		},
		Logger: log,
	})
	if err != nil {
		return err
	}
	defer hc.Close()

	dev, err := tun.Open(cfg.TUN)
	if err != nil {
		return err
	}
	sys, err := tun.SetSysctls(dev.Name())
	if err != nil {
		dev.Close()
		return err
	}
	// Teardown runs in reverse: routing first, so traffic flows directly
	// again at once; then the device, which ends the stack's reader; then
	// the stack and the sysctls.
	var (
		st     *stack.Stack
		routes *tun.Routing
	)
	defer func() {
		if routes != nil {
			if rerr := routes.Close(); rerr != nil {
				log.Error().Err(rerr).Msg("remove routing")
			}
		}
		if cerr := dev.Close(); cerr != nil {
			log.Warn().Err(cerr).Msg("close TUN")
		}
		if st != nil {
			st.Close()
		}
		if rerr := sys.Restore(); rerr != nil {
			log.Error().Err(rerr).Msg("restore sysctls")
		}
	}()

	var policy classify.Policy = capturePolicy(reg, cfg.Name)
	if cfg.NoIntercept {
		policy = nil
	}
	cls := classify.New(classify.Config{Policy: policy})
	sweepCtx, stopSweep := context.WithCancel(ctx)
	defer stopSweep()
	go cls.Run(sweepCtx, 5*time.Second)

	px, err := proxy.New(ctx, proxy.Config{Node: cfg.Name, Registry: reg, HBONE: hc, Logger: log})
	if err != nil {
		return err
	}
	hs, err := hbone.NewServer(hbone.ServerConfig{
		TLS: identity.ServerTLS(svids, cfg.Mesh.TrustDomain, func(local netip.Addr) (spiffeid.ID, bool) {
			w := reg.Load().Workload(local)
			if w == nil || !w.InMesh || w.Node != cfg.Name {
				return spiffeid.ID{}, false
			}
			return w.Identity, true
		}),
		Handler: px.InboundHandler(),
		Logger:  log,
	})
	if err != nil {
		return err
	}
	px.SetServer(hs)
	st, err = stack.New(stack.Config{
		Device:     dev,
		Classifier: cls,
		HandleTCP:  px.HandleTCP,
		Logger:     log,
	})
	if err != nil {
		return err
	}
	px.SetDialer(st)

	var pods []netip.Prefix
	for _, w := range locals {
		for _, a := range w.Addresses {
			pods = append(pods, netip.PrefixFrom(a, a.BitLen()))
		}
	}
	routes, err = tun.InstallRouting(dev, tun.RoutingConfig{
		CaptureLinks: cfg.CaptureLinks,
		PodPrefixes:  pods,
	})
	if err != nil {
		return err
	}

	if cfg.AdminAddr != "" {
		stopAdmin, err := serveAdmin(ctx, cfg.AdminAddr, log)
		if err != nil {
			return err
		}
		defer stopAdmin()
	}

	if cfg.ConfigPath != "" {
		go watchConfig(ctx, cfg.ConfigPath, reg, px, log)
	}

	log.Info().Str("node", cfg.Name).Str("tun", dev.Name()).Int("mtu", dev.MTU()).
		Strs("capture_links", cfg.CaptureLinks).Strs("uplinks", cfg.Uplinks).
		Int("workloads", len(locals)).Str("trust_domain", cfg.Mesh.TrustDomain.String()).
		Msg(ReadyMessage)
	<-ctx.Done()
	log.Info().Msg("shutting down")
	return ctx.Err()
}

// capturePolicy selects the SYNs the netstack takes: connections opened by
// a local mesh workload (outbound), HBONE to a local mesh workload
// (inbound), and plaintext to a local mesh workload that STRICT mode or an
// authorization policy protects (to be authorized, or refused). Everything
// else stays verbatim: plaintext to an unprotected PERMISSIVE workload
// reaches it directly.
func capturePolicy(reg *registry.Registry, node string) classify.Policy {
	return classify.PolicyFunc(func(src, dst netip.AddrPort) bool {
		s := reg.Load()
		if w := s.Workload(src.Addr()); w != nil && w.InMesh && w.Node == node {
			return true
		}
		if w := s.Workload(dst.Addr()); w != nil && w.InMesh && w.Node == node {
			if dst.Port() == hbone.Port {
				return true
			}
			deny, allow, strict := w.Policies()
			return strict || len(deny) > 0 || len(allow) > 0
		}
		return false
	})
}

// watchConfig replaces the mesh model whenever the config file changes to
// a valid one, and has the proxy re-authorize its open connections. An
// invalid file keeps the last good model.
func watchConfig(ctx context.Context, path string, reg *registry.Registry, px *proxy.Proxy, log zerolog.Logger) {
	first := true
	err := config.Watch(ctx, path, func(c *config.Config) {
		if first { // Watch delivers the current file once it watches
			first = false
			return
		}
		snap, err := c.Snapshot()
		if err != nil {
			log.Error().Err(err).Str("config", path).Msg("config reload failed; keeping the last good model")
			return
		}
		for _, w := range c.Warnings {
			log.Warn().Str("config", path).Msg(w)
		}
		reg.Store(snap)
		closed := px.Reauthorize()
		log.Info().Str("config", path).Int("workloads", len(snap.Workloads)).Int("services", len(snap.Services)).
			Int("policies", len(snap.Policies)).Int("connections_closed", closed).Msg("config reloaded")
	}, func(err error) {
		log.Error().Err(err).Str("config", path).Msg("config reload failed; keeping the last good model")
	})
	if err != nil && !errors.Is(err, context.Canceled) {
		log.Error().Err(err).Str("config", path).Msg("config watch stopped")
	}
}
