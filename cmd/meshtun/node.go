package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"runtime"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/config"
	"github.com/meshtun/meshtun/mesh/gate"
	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/metrics"
	"github.com/meshtun/meshtun/mesh/node"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
	"github.com/meshtun/meshtun/tun"
)

func runNode(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("node", flag.ContinueOnError)
	var (
		path, name, logLevel string
		credDir, spireSocket string
		caTokenFile, caRoots string
		noIntercept          bool
		uninstall            bool
		hboneNetstack        bool
		hboneSource          string
		drain                time.Duration
		ackDelay             time.Duration
		hsTimeout            time.Duration
		maxHS, maxHSSource   int
		maxPeerConns         int
		procs                int
		useKube              bool
		kubeconfig           string
		xf                   xdsFlags
		cf                   cniFlags
	)
	fs.StringVar(&path, "config", "/etc/meshtun/mesh.yaml", "the mesh config `file` (see docs/config.md)")
	fs.StringVar(&name, "node", os.Getenv("NODE_NAME"), "this node's `name` (default $NODE_NAME): its entry in the config file, and with --kubernetes the spec.nodeName of its pods")
	fs.BoolVar(&useKube, "kubernetes", false, "take the mesh (pods, services) from the Kubernetes API server; the config file gives node settings only (its \"default\" node entry for nodes it does not list)")
	fs.StringVar(&kubeconfig, "kubeconfig", "", "with --kubernetes: the kubeconfig `file`; empty: the in-cluster service account")
	fs.StringVar(&spireSocket, "spire-admin-socket", "", "`path` of the node's SPIRE agent admin socket: take the workloads' certificates from SPIRE's Delegated Identity API instead of `meshtun ca` (see docs/identity.md)")
	fs.StringVar(&credDir, "credentials", "/var/lib/meshtun/node", "`directory` of this node's credential for `meshtun ca` (cert.pem, key.pem, roots.pem; made by `meshtun ca issue-node`)")
	fs.StringVar(&caTokenFile, "ca-token-file", defaultCATokenFile, "with --kubernetes: `file` of the projected service-account token (audience meshtun-ca) sent to `meshtun ca` as the node's credential, re-read for every request (the kubelet rotates it); empty: use --credentials")
	fs.StringVar(&caRoots, "ca-roots", defaultCARoots, "with --kubernetes and --ca-token-file: PEM `file` of the CA roots that verify `meshtun ca` (the meshtun-ca-root ConfigMap)")
	xf.register(fs)
	cf.register(fs)
	fs.BoolVar(&noIntercept, "no-intercept", false, "intercept nothing: every packet goes through the TUN verbatim (for measuring the TUN path alone)")
	fs.BoolVar(&uninstall, "uninstall", false, "remove meshtun from this network namespace (its rules and blocking routes, which a stopped proxy leaves so that captured traffic stays blocked) and exit; refused while a proxy runs")
	fs.BoolVar(&hboneNetstack, "hbone-netstack", false, "terminate inbound HBONE on the netstack through the TUN, not on a kernel socket (the fallback when the kernel cannot; for comparisons)")
	fs.StringVar(&hboneSource, "hbone-source", node.HBONESourceAuto, "the source `address` of outbound HBONE connections: pod (the client pod's, as ztunnel; the node refuses to start if the kernel cannot deliver the replies), node (the node's; the client travels in the forwarded header only), auto (pod where the kernel inbound HBONE path is up, else node with a warning)")
	fs.DurationVar(&hsTimeout, "hbone-handshake-timeout", hbone.DefaultHandshakeTimeout, "inbound HBONE: the `duration` a client has for its TLS handshake and HTTP/2 preface")
	fs.IntVar(&maxHS, "hbone-max-handshakes", hbone.DefaultMaxHandshakes, "inbound HBONE: the `number` of TLS handshakes pending at once, from all sources (beyond: reset; a source holding fewer takes the slot of one holding the most)")
	fs.IntVar(&maxHSSource, "hbone-max-handshakes-per-source", hbone.DefaultMaxHandshakesPerSource, "inbound HBONE: the `number` of TLS handshakes pending at once from one source address")
	fs.IntVar(&maxPeerConns, "hbone-max-conns-per-peer", hbone.DefaultMaxConnsPerPeer, "inbound HBONE: the `number` of connections one peer identity (SPIFFE ID) may hold")
	fs.DurationVar(&ackDelay, "ack-delay", node.DefaultAckDelay, "on connections whose both ends are in the netstack (passthrough, same-node), hold the netstack's pure ACKs back for up to this `duration`, so that a reply sent within it carries the acknowledgment (0: every ACK at once)")
	fs.DurationVar(&drain, "drain-period", node.DefaultDrainPeriod, "on SIGTERM, how long open connections may take to finish")
	fs.StringVar(&logLevel, "log-level", "info", "log `level`: trace, debug, info, warn, error")
	fs.IntVar(&procs, "procs", 0, "`threads` running Go code at once (GOMAXPROCS); 0: half the CPUs the process may use, at least 1 (the GOMAXPROCS environment variable, if set, wins)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if hsTimeout <= 0 || maxHS <= 0 || maxHSSource <= 0 || maxPeerConns <= 0 {
		return fmt.Errorf("-hbone-handshake-timeout %s, -hbone-max-handshakes %d, -hbone-max-handshakes-per-source %d, -hbone-max-conns-per-peer %d: each must be positive", hsTimeout, maxHS, maxHSSource, maxPeerConns)
	}
	if ackDelay < 0 || ackDelay > 100*time.Millisecond {
		return fmt.Errorf("-ack-delay %s: want 0 (off) up to 100ms", ackDelay)
	}
	if procs < 0 {
		return fmt.Errorf("-procs %d: want 0 (automatic) or a positive count", procs)
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	log, err := newLogger(logLevel)
	if err != nil {
		return err
	}
	if uninstall {
		if err := tun.Uninstall(); err != nil {
			return err
		}
		log.Warn().Msg("meshtun uninstalled from this network namespace: its pods' traffic is routed directly, in the clear and unauthorized")
		return nil
	}
	if name == "" {
		return errors.New("-node (or the NODE_NAME environment variable) is required")
	}
	if spireSocket != "" && xf.caAddress != "" {
		return errors.New("--spire-admin-socket and --ca-address are two sources of workload certificates: pick one")
	}
	_, envSet := os.LookupEnv("GOMAXPROCS")
	n := nodeProcs(procs, envSet, runtime.GOMAXPROCS(0))
	runtime.GOMAXPROCS(n)
	log.Info().Int("procs", n).Msg("GOMAXPROCS")
	c, err := config.Load(path)
	if err != nil {
		return err
	}
	for _, w := range c.Warnings {
		log.Warn().Str("config", path).Msg(w)
	}
	useXDS := xf.address != ""
	if useXDS && useKube {
		return errors.New("--xds-address and --kubernetes are two sources of the mesh model: pick one")
	}
	if cf.enabled && !useKube {
		return errors.New("--cni needs --kubernetes: the startup gate decides enrolment from the API server")
	}
	var nc *config.NodeConfig
	if useKube || useXDS {
		nc, err = c.NodeOrDefault(name)
	} else {
		nc, err = c.Node(name)
	}
	if err != nil {
		return err
	}
	var (
		src      registry.Source
		captured func([]*registry.Workload)
		collect  []prometheus.Collector
		cniGate  *gate.Gate
	)
	switch {
	case useKube:
		var cniPods *gatePods
		if cf.enabled {
			cniGate, cniPods = cf.newGate(name, log)
		}
		ks, err := newKube(kubeconfig, name, c, announcedFunc(cniGate), log)
		if err != nil {
			return err
		}
		src = ks
		if cniGate != nil {
			// The plugin goes into the node's CNI chain once the
			// source has synced, as the gate answers from its pods.
			cniPods.Pods = ks
			src = thenStart{ks, func(ctx context.Context) error { return cf.startGate(ctx, cniGate, log) }}
		}
	case useXDS:
		xs, rep, err := newXDS(ctx, xf, kubeconfig, name, c, log)
		if err != nil {
			return err
		}
		src, captured = xs, rep
		collect = append(collect, metrics.XDS(xs.MetricsStats))
	default:
		if kubeconfig != "" {
			return errors.New("--kubeconfig needs --kubernetes (or --xds-address with --redirect-pods)")
		}
		src = config.NewFileSource(c, name, log)
	}
	td := c.TrustDomainID()
	ncfg := node.Config{
		Name:            nc.Name,
		TUN:             tun.Config{Name: nc.TUN.Name, MTU: nc.TUN.MTU, TxQueueLen: nc.TUN.TxQueueLen},
		Source:          src,
		CaptureLinks:    nc.CaptureLinks,
		Captured:        captured,
		CA:              identity.CAConfig{Dir: c.CA.Dir, SVIDTTL: c.CA.SVIDTTL},
		NoIntercept:     noIntercept,
		HBONEOnNetstack: hboneNetstack,
		HBONESource:     hboneSource,
		AckDelay:        ackDelay,

		HBONEHandshakeTimeout:       hsTimeout,
		HBONEMaxHandshakes:          maxHS,
		HBONEMaxHandshakesPerSource: maxHSSource,
		HBONEMaxConnsPerPeer:        maxPeerConns,
		AdminAddr:                   nc.Listen.Admin,
		AdminSocket:                 nc.Listen.AdminSocket,
		ConfigDumpFormat:            nc.Listen.AdminFormat,
		MetricsAddr:                 nc.Listen.Metrics,
		ReadinessAddr:               nc.Listen.Readiness,
		DrainPeriod:                 drain,
		Logger:                      log,
	}
	ncfg.Collectors = collect
	if cniGate != nil {
		ncfg.Captured, ncfg.LinkHint = cniGate.Captured, cniGate.LinkHint
		ncfg.WhileReady = func(ctx context.Context) {
			if err := cniGate.Serve(ctx); err != nil {
				log.Error().Err(err).Msg("CNI startup gate: pods of the mesh cannot start on this node")
			}
		}
	}
	switch {
	case spireSocket != "":
		sp, err := identity.DialSpire(ctx, identity.SpireConfig{AdminSocket: spireSocket, TrustDomain: td, Logger: log})
		if err != nil {
			return err
		}
		defer sp.Close()
		ncfg.Issuer, ncfg.Bundle = sp, sp.Bundle()
		log.Info().Str("spire_admin_socket", spireSocket).Msg("certificates from the SPIRE agent")
	case xf.caAddress != "":
		remote, err := istiodIssuer(xf, td, c.CA.SVIDTTL, log)
		if err != nil {
			return err
		}
		defer remote.Close()
		ncfg.Issuer, ncfg.Bundle = remote, remote.Bundle()
		log.Info().Str("ca", xf.caAddress).Msg("certificates from istiod's CA")
	case c.CA.InsecureSharedDir:
		// node.Run opens ca.dir itself, and says loudly that it does.
	case c.CA.Address == "":
		return fmt.Errorf("%s: ca.address is required: the address of `meshtun ca` (or, for development only, ca.insecureSharedDir: true to have every node hold the root key)", path)
	case useKube && caTokenFile != "":
		remote, err := tokenIssuer(c, td, caTokenFile, caRoots, log)
		if err != nil {
			return err
		}
		defer remote.Close()
		ncfg.Issuer, ncfg.Bundle = remote, remote.Bundle()
		log.Info().Str("ca", c.CA.Address).Str("token_file", caTokenFile).Str("roots", caRoots).Msg("certificates from the certificate service, authenticated by service-account token")
	default:
		remote, err := remoteIssuer(c, td, credDir, log)
		if err != nil {
			return err
		}
		defer remote.Close()
		ncfg.Issuer, ncfg.Bundle = remote, remote.Bundle()
		log.Info().Str("ca", c.CA.Address).Str("credentials", credDir).Msg("certificates from the certificate service")
	}
	err = node.Run(ctx, ncfg)
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// thenStart is a model source that runs then once the source has synced,
// before the node is given its first model.
type thenStart struct {
	registry.Source
	then func(context.Context) error
}

func (t thenStart) Start(ctx context.Context) (*registry.Snapshot, error) {
	snap, err := t.Source.Start(ctx)
	if err != nil {
		return nil, err
	}
	if err := t.then(ctx); err != nil {
		return nil, err
	}
	return snap, nil
}

// nodeProcs returns the GOMAXPROCS of the node: flag if set, else the
// runtime's current value if the GOMAXPROCS environment variable set it,
// else half of the runtime's default (the CPUs the process may use, which
// the runtime already lowers to a cgroup CPU limit), at least 1.
//
// The node's data path is a chain of goroutine hand-offs (TUN reader,
// netstack TCP processor, relay, and back), not computation: every hand-off
// to a goroutine on another P wakes another OS thread, and on a node whose
// cores also run the workloads the proxy serves, those wake-ups are the
// latency. Fewer Ps keep a hand-off on the running thread. Half the CPUs
// leaves the other half to the workloads (whose every request crosses the
// proxy and the workload alike) and still scales with the machine; see
// docs/decisions/2026-11-29-passthrough-latency-gomaxprocs.md for the measurements.
func nodeProcs(flag int, envSet bool, runtimeDefault int) int {
	switch {
	case flag > 0:
		return flag
	case envSet:
		return runtimeDefault
	}
	return max(1, runtimeDefault/2)
}

// remoteIssuer returns the client of `meshtun ca` for this node: it
// authenticates with the node credential in credDir and first trusts the
// roots stored with it.
func remoteIssuer(c *config.Config, td spiffeid.TrustDomain, credDir string, log zerolog.Logger) (*identity.RemoteIssuer, error) {
	cred, err := identity.OpenNodeCredential(credDir)
	if err != nil {
		return nil, fmt.Errorf("%w (make one with `meshtun ca issue-node`)", err)
	}
	roots, err := cred.Roots()
	if err != nil {
		return nil, err
	}
	return identity.DialCA(identity.RemoteConfig{
		Address: c.CA.Address, TrustDomain: td, Bundle: identity.NewTrustBundle(td, roots),
		Credential: cred.Get, TTL: c.CA.SVIDTTL, Logger: log,
	})
}

// Where the DaemonSet of deploy/kubernetes mounts the projected token of
// the CA audience and the meshtun-ca-root ConfigMap.
const (
	defaultCATokenFile = "/var/run/secrets/meshtun-ca/token"
	defaultCARoots     = "/var/run/meshtun/ca-root/" + identity.RootCertFile
)

// tokenIssuer returns the client of `meshtun ca --kubernetes` for this
// node: it sends the projected service-account token in tokenFile as
// "authorization: Bearer" (read again for every request, so a token the
// kubelet rotated is used at once) and first trusts the roots in rootsFile.
func tokenIssuer(c *config.Config, td spiffeid.TrustDomain, tokenFile, rootsFile string, log zerolog.Logger) (*identity.RemoteIssuer, error) {
	data, err := os.ReadFile(rootsFile)
	if err != nil {
		return nil, fmt.Errorf("CA roots: %w", err)
	}
	roots, err := identity.ParseCertsPEM(data)
	if err != nil {
		return nil, fmt.Errorf("CA roots %s: %w", rootsFile, err)
	}
	if len(roots) == 0 {
		return nil, fmt.Errorf("CA roots %s: no certificate", rootsFile)
	}
	token := func() (string, error) { return readToken(tokenFile) }
	if _, err := token(); err != nil {
		return nil, err
	}
	return identity.DialCA(identity.RemoteConfig{
		Address: c.CA.Address, TrustDomain: td, Bundle: identity.NewTrustBundle(td, roots),
		Token: token, TTL: c.CA.SVIDTTL, Logger: log,
	})
}

// readToken reads a bearer token file.
func readToken(path string) (string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return "", fmt.Errorf("CA token: %w", err)
	}
	t := strings.TrimSpace(string(data))
	if t == "" {
		return "", fmt.Errorf("CA token: %s is empty", path)
	}
	return t, nil
}
