// Package node assembles a meshtun node proxy: the TUN device and its
// routing, the classifier, the netstack, the workload identities and the
// proxy, started in that order and torn down in reverse.
package node

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/bundle/x509bundle"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/metrics"
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
	// Source is where the mesh model comes from (the config file,
	// Kubernetes, istiod): Run starts it once its HTTP endpoints are up
	// (readiness answers 503 until the source has synced and capture is
	// installed) and follows its updates until it drains. Each local mesh
	// workload is captured on the links its model names
	// (Workload.CaptureLinks) or, unless the snapshot says the links are
	// known, on the one its route leads to.
	Source registry.Source
	// CaptureLinks are node-side links captured whatever the model says
	// (the node's captureLinks in the config file): a packet from one of
	// them whose source is no local workload's address on it is dropped.
	CaptureLinks []string
	// Issuer issues the local workloads' SVIDs (a RemoteIssuer: the keys
	// stay on the node, the root key does not come here) and Bundle holds
	// the roots peers are verified against. If Issuer is nil, the node
	// opens the built-in CA of CA.Dir itself: development only, since every
	// node then holds the root key and can mint any identity.
	Issuer identity.Issuer
	Bundle x509bundle.Source
	// CA is the built-in certificate authority, used only if Issuer is nil.
	// Its TrustDomain is the model's.
	CA identity.CAConfig
	// Collectors are added to the node's metrics (the model source's own,
	// as the xDS health metrics).
	Collectors []prometheus.Collector
	// Captured, if set, is told after every change of capture which
	// local mesh workloads are captured: certificate held, host link
	// known or found, capture and inbound HBONE rules in place. With
	// istiod as the source, a pod is annotated for redirection only once
	// it is (kube.Redirector.Captured); the CNI startup gate answers a
	// pod's ADD once its announced addresses are (gate.Gate.Captured).
	Captured func([]*registry.Workload)
	// LinkHint, if set, names the host link of a local workload's address
	// when the model does not know its link and no route to it is found
	// (the CNI startup gate's announced link).
	LinkHint func(netip.Addr) (string, bool)
	// WhileReady, if set, runs from the moment the node is ready (capture
	// installed) until it starts to drain, when its context ends: the CNI
	// startup gate's server, which must not answer before the node can
	// capture nor after it stops doing so.
	WhileReady func(context.Context)
	// NoIntercept leaves every packet verbatim: the TUN is in the path but
	// no flow is proxied. For measuring the TUN path alone.
	NoIntercept bool
	// HBONEOnNetstack terminates inbound HBONE on the netstack, through
	// the TUN, as when the kernel cannot deliver a pod's port 15008 to a
	// node socket (the fallback; for tests and comparisons).
	HBONEOnNetstack bool
	// HBONESource is where outbound HBONE connections are dialled from:
	// HBONESourceAuto (the default, when empty), HBONESourcePod or
	// HBONESourceNode. The client pod's address needs the kernel inbound
	// HBONE path (its replies are delivered the same way).
	HBONESource string
	// HBONEHandshakeTimeout, HBONEMaxHandshakes,
	// HBONEMaxHandshakesPerSource and HBONEMaxConnsPerPeer bound inbound
	// HBONE (hbone.ServerConfig's HandshakeTimeout, MaxHandshakes,
	// MaxHandshakesPerSource, MaxConnsPerPeer), on the kernel socket and
	// the netstack alike; zero: the hbone package's defaults.
	HBONEHandshakeTimeout                                                 time.Duration
	HBONEMaxHandshakes, HBONEMaxHandshakesPerSource, HBONEMaxConnsPerPeer int
	// AckDelay holds the netstack's pure ACKs on connections whose both
	// ends it is back for up to this long, for a reply to carry the
	// acknowledgment (stack.Config.AckDelay); 0 writes every ACK at once.
	// The binary's default is DefaultAckDelay.
	AckDelay time.Duration
	// AdminAddr is where the read-only admin HTTP server listens
	// (/config_dump, GET /logging); empty disables it. Keep it on
	// loopback. The rest is on AdminSocket.
	AdminAddr string
	// AdminSocket is the path of the admin Unix socket (root only), which
	// serves the endpoints that change the node or profile it; empty
	// disables them.
	AdminSocket string
	// ConfigDumpFormat is the shape /config_dump has without ?format=:
	// "meshtun" (the default, when empty) or "ztunnel" (ztunnel's JSON,
	// for tools that read ztunnel's admin endpoint).
	ConfigDumpFormat string
	// MetricsAddr serves /metrics (Prometheus); ReadinessAddr serves
	// /healthz/ready. Empty disables them.
	MetricsAddr, ReadinessAddr string
	// DrainPeriod is how long open connections may take to finish after
	// the node is told to stop; DefaultDrainPeriod if zero.
	DrainPeriod time.Duration
	Logger      zerolog.Logger
}

// ReadyMessage is the log message Run writes once traffic is captured.
const ReadyMessage = "node ready"

// SyncingMessage is the log message Run writes when it starts the model's
// source; ModelUpdatedMessage the one written once each later model is
// in force (capture, certificates and open connections updated).
const (
	SyncingMessage      = "waiting for the mesh model's source"
	ModelUpdatedMessage = "mesh model updated"
)

// NoInterceptWarning is the warning Run logs when Config.NoIntercept is
// set: the node is in the path but protects nothing.
const NoInterceptWarning = "--no-intercept: NOTHING IS ENFORCED: no mTLS, no authorization, no STRICT peer authentication; every packet passes the TUN verbatim (for measuring the TUN path only)"

// localWorkloads returns the mesh workloads of node name: the ones it
// captures, refused ones included (captured to be denied).
func localWorkloads(s *registry.Snapshot, name string) []*registry.Workload {
	var out []*registry.Workload
	for _, w := range s.Workloads {
		if w.CapturedBy(name) {
			out = append(out, w)
		}
	}
	return out
}

// withCertificates returns the workloads of locals that get a
// certificate: all but the refused ones, which nothing may reach or
// leave.
func withCertificates(locals []*registry.Workload) []*registry.Workload {
	out := make([]*registry.Workload, 0, len(locals))
	for _, w := range locals {
		if w.Refused == "" {
			out = append(out, w)
		}
	}
	return out
}

// DefaultDrainPeriod is how long a stopping node lets open connections
// finish when Config.DrainPeriod is zero.
const DefaultDrainPeriod = 30 * time.Second

// DefaultAckDelay is meshtun node's --ack-delay: how long the netstack
// holds a pure ACK on a connection whose both ends it is, for the reply to
// carry it (docs/decisions/2026-12-01-levers-round-two.md).
const DefaultAckDelay = time.Millisecond

// Run runs the node proxy until ctx is done, then drains it (new
// connections are refused, open ones get up to DrainPeriod to finish),
// removes everything it installed, and returns ctx's error.
func Run(ctx context.Context, cfg Config) (err error) {
	log := cfg.Logger
	if cfg.Source == nil {
		return errors.New("node: no source of the mesh model")
	}
	if cfg.DrainPeriod == 0 {
		cfg.DrainPeriod = DefaultDrainPeriod
	}
	// Connections live in runCtx, which ends only after the drain: the
	// signal that stops the node must not cut them.
	runCtx, stopRun := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRun()
	// Until the source has synced the registry holds an empty model,
	// which only /config_dump reads.
	n := &node{cfg: cfg, log: log, reg: registry.New(&registry.Snapshot{}), metrics: metrics.New()}
	// meshtun's own kernel sockets whose packets cross the TUN (the rules
	// capture every packet to a local mesh pod, the node's included) and
	// go out verbatim: its listeners and its connections from the node to
	// a local workload. No socket mark: any process with CAP_NET_RAW could
	// set one.
	var nodeAddrs *tun.LocalAddrs
	n.exempt = classify.NewExempt(func(a netip.Addr) bool { return nodeAddrs != nil && nodeAddrs.Contains(a) })

	// HTTP endpoints first, so that readiness reports "not ready" while
	// the rest starts.
	stopHTTP, err := n.serveHTTP(runCtx)
	if err != nil {
		return err
	}
	defer stopHTTP()

	// The model: the source runs until ctx ends (its updates stop when
	// the drain begins).
	log.Info().Msg(SyncingMessage)
	mesh, err := cfg.Source.Start(ctx)
	if err != nil {
		return fmt.Errorf("node: the mesh model's source: %w", err)
	}
	n.reg.Store(mesh)
	n.synced.Store(true)
	td := mesh.TrustDomain
	locals := localWorkloads(mesh, cfg.Name)
	if len(locals) == 0 {
		log.Warn().Str("node", cfg.Name).Msg("no mesh workloads on this node yet; the mesh model's source may add some")
	}

	// The identity source next; the certificates themselves are asked
	// for only once capture is installed (below): a CA that is down, or
	// refuses an identity, must never leave the pods uncaptured.
	issuer, bundle := cfg.Issuer, cfg.Bundle
	if issuer == nil {
		cfg.CA.TrustDomain = td
		cfg.CA.Logger = log
		log.Warn().Str("ca_dir", cfg.CA.Dir).Msg("INSECURE (development only): this node holds the CA root key and issues its own certificates; a compromised node can mint any identity of the trust domain. Use `meshtun ca` (ca.address) instead.")
		ca, err := identity.OpenCA(cfg.CA)
		if err != nil {
			return err
		}
		issuer, bundle = ca, ca.Bundle()
	}
	n.svids, err = identity.NewSource(identity.SourceConfig{
		Issuer: issuer, Bundle: bundle, TrustDomain: td, Logger: log,
	})
	if err != nil {
		return err
	}
	defer n.svids.Close()
	n.certs = newCertKeeper(runCtx, n.svids, n.certificateIssued, log)
	defer n.certs.stop()

	// The HBONE dials go to pods of other nodes, which no rule of this
	// node captures; from the node's address, or from the client pod's
	// (podDialer) while n.podSource says so.
	switch cfg.HBONESource {
	case "":
		cfg.HBONESource = HBONESourceAuto
		n.cfg.HBONESource = HBONESourceAuto
	case HBONESourceAuto, HBONESourcePod, HBONESourceNode:
	default:
		return fmt.Errorf("node: HBONE source %q: want %s, %s or %s", cfg.HBONESource, HBONESourceAuto, HBONESourcePod, HBONESourceNode)
	}
	if cfg.HBONESource == HBONESourcePod && (cfg.HBONEOnNetstack || cfg.NoIntercept) {
		return fmt.Errorf("node: outbound HBONE from the pod's address (HBONE source %q) needs inbound HBONE on the kernel socket", cfg.HBONESource)
	}
	dialer := &net.Dialer{}
	pd := &podDialer{ports: HBONEClientPorts, state: &n.podSource}
	n.hc, err = hbone.NewClient(hbone.ClientConfig{
		Dial:     dialer.DialContext,
		DialFrom: pd.dial,
		TLS: func(src, dst spiffeid.ID) (*tls.Config, error) {
			return identity.ClientTLS(n.svids.Workload(src), dst), nil
		},
		Logger: log,
	})
	if err != nil {
		return err
	}
	defer n.hc.Close()

	cfg.TUN.Logger = log
	dev, err := tun.Open(cfg.TUN)
	if err != nil {
		return err
	}
	// The spoof sink: a second TUN that policy routing sends a capture
	// link's packets with a foreign source to; its reader counts them and
	// drops them.
	sinkDev, err := tun.Open(tun.Config{Name: SinkName(dev.Name()), MTU: 65535, NoOffload: true, Logger: log})
	if err != nil {
		dev.Close()
		return err
	}
	n.sink = &spoofSink{dev: sinkDev, log: log}
	go n.sink.run()
	links, _ := n.captureLinks(mesh, locals)
	v4, v6 := families(locals, links)
	sys, err := tun.SetSysctls(tun.SysctlConfig{TUN: dev.Name(), IPv4: v4, IPv6: v6, Logger: log})
	if err != nil {
		sinkDev.Close()
		dev.Close()
		return err
	}
	// Teardown runs in reverse: the routes through the TUNs first, so the
	// blocking routes behind them take over at once (the rules stay: the
	// captured traffic is refused, not routed in the clear, until a new
	// meshtun starts or "meshtun node --uninstall" removes them); then the
	// devices, which ends the stack's reader; then the stack and the
	// sysctls.
	var routes *tun.Routing
	defer func() {
		if routes != nil {
			if rerr := routes.Close(); rerr != nil {
				log.Error().Err(rerr).Msg("remove the routes through the TUN")
			}
		}
		if cerr := dev.Close(); cerr != nil {
			log.Warn().Err(cerr).Msg("close TUN")
		}
		if cerr := sinkDev.Close(); cerr != nil {
			log.Warn().Err(cerr).Msg("close the spoof sink")
		}
		if n.hl != nil {
			n.hl.close()
		}
		if n.st != nil {
			n.st.Close()
		}
		if rerr := sys.Restore(); rerr != nil {
			log.Error().Err(rerr).Msg("restore sysctls")
		}
	}()

	// The node's own addresses: a connection from one of them was opened
	// by the node itself (the kernel drops packets from elsewhere that
	// claim them).
	nodeAddrs, err = tun.WatchLocalAddrs(runCtx, log)
	if err != nil {
		return err
	}
	n.cls = classify.New(classify.Config{Policy: interceptPolicy(n.reg, cfg, nodeAddrs.Contains, log), Exempt: n.exempt})
	go n.cls.Run(runCtx, 5*time.Second)

	// In order: the netstack (built, not yet reading the TUN), the proxy
	// that dials through it and builds the HBONE server, then the
	// netstack started with the proxy as its TCP handler.
	n.st, err = stack.New(stack.Config{
		Device:     dev,
		Classifier: n.cls,
		AckDelay:   cfg.AckDelay,
		Logger:     log,
	})
	if err != nil {
		return err
	}
	n.px, err = proxy.New(runCtx, proxy.Config{
		Node: cfg.Name, Registry: n.reg, HBONE: n.hc, Metrics: n.metrics, FromNode: nodeAddrs.Contains,
		Certified: n.hasCertificate, Exempt: n.exempt, Netstack: n.st,
		HBONEFromPod: n.hboneFromPod,
		Inbound: hbone.ServerConfig{
			TLS: identity.ServerTLS(n.svids, td, func(local netip.Addr) (spiffeid.ID, bool) {
				w := n.reg.Load().Workload(local)
				if !w.CapturedBy(cfg.Name) || w.Refused != "" || !n.hasCertificate(w.Identity) {
					return spiffeid.ID{}, false
				}
				return w.Identity, true
			}),
			HandshakeTimeout:       cfg.HBONEHandshakeTimeout,
			MaxHandshakes:          cfg.HBONEMaxHandshakes,
			MaxHandshakesPerSource: cfg.HBONEMaxHandshakesPerSource,
			MaxConnsPerPeer:        cfg.HBONEMaxConnsPerPeer,
			Logger:                 log,
		},
		Logger: log, AccessLog: log.With().Str("log", "access").Logger(),
	})
	if err != nil {
		return err
	}
	n.hs = n.px.Server()
	if err := n.st.Start(n.px.HandleTCP); err != nil {
		return err
	}
	n.hl = &hboneListeners{st: n.st, serve: n.px.ServeNetstackHBONE, log: log, open: map[netip.Addr]*stack.Listener{}}
	n.hl.sync(locals)
	if err := n.metrics.Register(metrics.DataPlane(n.dataPlaneStats)); err != nil {
		return fmt.Errorf("node: metrics: %w", err)
	}
	if err := n.metrics.Register(refusedCollector{n.reg, cfg.Name}); err != nil {
		return fmt.Errorf("node: metrics: %w", err)
	}
	if err := n.metrics.Register(blockedCollector{n}); err != nil {
		return fmt.Errorf("node: metrics: %w", err)
	}
	for _, c := range cfg.Collectors {
		if err := n.metrics.Register(c); err != nil {
			return fmt.Errorf("node: metrics: %w", err)
		}
	}

	routes, err = tun.InstallRouting(dev, sinkDev, tun.RoutingConfig{
		CaptureLinks: links,
		PodPrefixes:  podPrefixes(locals),
	})
	if err != nil {
		return err
	}
	n.routes = routes
	// Inbound HBONE on a kernel socket; its rules go before the routes
	// through the TUN (defers run in reverse), and then port 15008 of the
	// pods meets the blocking routes like every other port.
	hboneOn := "netstack"
	if !cfg.HBONEOnNetstack && !cfg.NoIntercept {
		if n.local = n.kernelHBONE(runCtx, locals); n.local != nil {
			hboneOn = "kernel"
			if !n.local.Replies().IsZero() {
				n.podSource.Store(podSourceOn)
			}
			defer func() {
				// The pooled outbound connections from the pods'
				// addresses end first, while their packets and
				// replies still pass (the peers see a FIN, not a
				// connection left open until their keepalive).
				n.hc.Close()
				if lerr := n.local.Close(); lerr != nil {
					log.Error().Err(lerr).Msg("remove HBONE local delivery")
				}
				if rerr := routes.SetLocalDelivery(0, tun.PortRange{}); rerr != nil {
					log.Error().Err(rerr).Msg("remove the local-delivery listener's exemption from the spoof rules")
				}
			}()
		}
	}

	hboneSource := "node"
	switch {
	case n.podSource.Load() == podSourceOn:
		hboneSource = "pod"
	case cfg.HBONESource == HBONESourcePod:
		return errors.New("node: outbound HBONE from the pod's address is required (HBONE source pod) and the kernel cannot deliver its replies (see the warning above)")
	case cfg.HBONESource == HBONESourceAuto && !cfg.NoIntercept:
		log.Warn().Msg("outbound HBONE leaves from the node's address (the kernel inbound HBONE path is off): a ztunnel peer evaluates the clients' source-IP rules on the node's address")
	}

	// Certificates last, once everything is captured: a workload whose
	// certificate is not issued (the CA unreachable, or refusing it) stays
	// captured and blocked for mesh connections, and its certificate is
	// retried in the background; the node never stops for it.
	n.certs.sync(ctx, withCertificates(locals))

	// HBONE for the pods is taken on the kernel socket or, failing that,
	// on the netstack: they are captured either way.
	n.captureMu.Lock()
	n.rulesOK = true
	n.reportCaptured(locals, true)
	n.captureMu.Unlock()
	go n.follow(runCtx, cfg.Source.Updates())

	n.ready.Store(true)
	readyCtx, stopReady := context.WithCancel(runCtx)
	var whileReady sync.WaitGroup
	if cfg.WhileReady != nil {
		whileReady.Go(func() { cfg.WhileReady(readyCtx) })
	}
	defer whileReady.Wait()
	defer stopReady()
	var linkNames []string
	for _, l := range links {
		linkNames = append(linkNames, l.Name)
	}
	log.Info().Str("node", cfg.Name).Str("tun", dev.Name()).Int("mtu", dev.MTU()).
		Strs("capture_links", linkNames).Str("hbone_inbound", hboneOn).Str("hbone_source", hboneSource).
		Int("workloads", len(locals)).Int("workloads_without_certificate", len(n.uncertified(mesh))).
		Str("trust_domain", td.String()).
		Msg(ReadyMessage)
	<-ctx.Done()

	// Drain: not ready, GOAWAY to HBONE clients, new connections refused,
	// open ones given DrainPeriod to finish.
	n.ready.Store(false)
	stopReady()
	whileReady.Wait()
	n.px.StopNew()
	log.Info().Int("open", n.px.Open()).Dur("drain_period", cfg.DrainPeriod).Msg("draining")
	dctx, cancel := context.WithTimeout(runCtx, cfg.DrainPeriod)
	n.hs.Drain(dctx)
	reset := n.px.Drain(dctx)
	cancel()
	log.Info().Int("reset", reset).Msg("drained; shutting down")
	return ctx.Err()
}

// node is a running node proxy's state, shared by its HTTP endpoints and
// the update loop.
type node struct {
	cfg     Config
	log     zerolog.Logger
	reg     *registry.Registry
	metrics *metrics.Metrics
	svids   *identity.Source
	hc      *hbone.Client
	hs      *hbone.Server
	cls     *classify.Classifier
	exempt  *classify.Exempt
	st      *stack.Stack
	px      *proxy.Proxy
	hl      *hboneListeners

	captureMu    sync.Mutex      // capture updates (the update loop; certificates issued)
	bridgeWarned bool            // a route led to a bridge CNI; said so once
	noRoute      map[string]bool // local workloads without a link known or routed, logged once
	rulesOK      bool            // the last capture update installed its rules (captureMu)
	certs        *certKeeper
	routes       *tun.Routing
	local        *tun.LocalDelivery // nil: inbound HBONE on the netstack
	podSource    atomic.Int32       // podSourceOff, On, Failed: outbound HBONE's source address
	sink         *spoofSink
	ready        atomic.Bool
	synced       atomic.Bool       // the source delivered its first model
	httpAddrs    map[string]string // bound addresses of serveHTTP, by endpoint
}

// podPrefixes returns the host prefixes of the workloads' addresses.
func podPrefixes(ws []*registry.Workload) []netip.Prefix {
	var pods []netip.Prefix
	for _, w := range ws {
		for _, a := range w.Addresses {
			pods = append(pods, netip.PrefixFrom(a, a.BitLen()))
		}
	}
	return pods
}

// dataPlaneStats reads the packet path's counters for a scrape.
func (n *node) dataPlaneStats() metrics.DataPlaneStats {
	cs := n.cls.Stats()
	ss := n.st.Stats()
	ps := n.hc.Stats()
	d := metrics.DataPlaneStats{
		Packets: map[[2]string]uint64{}, Bytes: map[[2]string]uint64{}, Outbound: cs.Outbound,
		Flows: cs.Flows, FlowsInserted: cs.FlowsInserted, FlowsExpired: cs.FlowsExpired,
		FlowsHalfOpen: cs.HalfOpen, UnknownIntercepted: cs.UnknownIntercepted,
		TCPRetransmits: ss.TCPRetransmits, ForwarderDrops: ss.ForwarderDrops + ss.PendingDrops,
		VerbatimWriteErrors: ss.VerbatimWriteErrors, UDPCoalesced: ss.UDPCoalesced, AcksElided: ss.AcksElided, AcksDelayed: ss.AcksDelayed,
		HBONEConns: ps.Conns, HBONEStreams: ps.Streams, HBONEServerConns: n.hs.OpenConns(),
		Drops: map[string]uint64{},
		PacketDrops: map[string]uint64{
			"spoofed-source": n.sink.dropped.Load(),
		},
		CertExpiry:   map[string]time.Time{},
		HBONEInbound: map[string]uint64{},
	}
	d.HBONEInbound["kernel"], d.HBONEInbound["netstack"] = n.px.HBONEAccepted()
	d.HBONERefused = n.hs.Refused()
	d.HBONEHandshakes, _ = n.hs.PendingHandshakes()
	for p := range cs.VerbatimPackets {
		proto := classify.Proto(p).String()
		d.Packets[[2]string{"verbatim", proto}] = cs.VerbatimPackets[p]
		d.Bytes[[2]string{"verbatim", proto}] = cs.VerbatimBytes[p]
		d.Packets[[2]string{"intercept", proto}] = cs.InterceptedPackets[p]
		d.Bytes[[2]string{"intercept", proto}] = cs.InterceptedBytes[p]
	}
	for r, v := range cs.DropsByReason {
		if v > 0 {
			d.Drops[classify.DropReason(r).String()] = v
		}
	}
	for _, id := range n.svids.IDs() {
		if t, ok := n.svids.Expiry(id); ok {
			d.CertExpiry[id.String()] = t
		}
	}
	is := n.svids.Stats()
	d.CertRenewals, d.CertRenewalFailures, d.CertsFailing, d.CertsValid = is.Renewals, is.RenewalFailures, is.Failing, is.Valid
	return d
}

// interceptPolicy is the classifier's policy: proxy.CapturePolicy, or nil
// (and a loud warning) with NoIntercept.
func interceptPolicy(reg *registry.Registry, cfg Config, fromNode func(netip.Addr) bool, log zerolog.Logger) classify.Policy {
	if cfg.NoIntercept {
		log.Warn().Str("node", cfg.Name).Msg(NoInterceptWarning)
		return nil
	}
	return proxy.CapturePolicy(reg, cfg.Name, fromNode)
}

// hboneListeners keeps a netstack listener on port 15008 of every local
// mesh workload: inbound HBONE is accepted there, with SYN cookies when a
// SYN flood fills the listener's backlog, instead of through the TCP
// forwarder (which holds every pending handshake, for up to two minutes).
type hboneListeners struct {
	st    *stack.Stack
	serve func(*stack.Conn)
	log   zerolog.Logger
	mu    sync.Mutex
	open  map[netip.Addr]*stack.Listener
}

// sync opens listeners for the addresses of ws that have none and closes
// those of addresses no longer among them. A listener that fails to open
// is logged; HBONE to that address then goes through the forwarder.
func (h *hboneListeners) sync(ws []*registry.Workload) {
	h.mu.Lock()
	defer h.mu.Unlock()
	want := map[netip.Addr]bool{}
	for _, w := range ws {
		for _, a := range w.Addresses {
			want[a] = true
			if h.open[a] != nil {
				continue
			}
			l, err := h.st.Listen(netip.AddrPortFrom(a, hbone.Port), h.serve)
			if err != nil {
				h.log.Error().Err(err).Str("workload", w.String()).Msg("HBONE listener; inbound HBONE goes through the forwarder, without SYN cookies")
				continue
			}
			h.open[a] = l
		}
	}
	for a, l := range h.open {
		if !want[a] {
			l.Close()
			delete(h.open, a)
		}
	}
}

// close closes every listener.
func (h *hboneListeners) close() {
	h.sync(nil)
}

// svidSet is the part of identity.Source that syncSVIDs uses.
type svidSet interface {
	IDs() []spiffeid.ID
	Remove(spiffeid.ID)
}

// syncSVIDs removes from src the identities no workload of want has any
// more (their keys are not kept, renewed or served); issuing the new ones
// is the certKeeper's. It returns how many it removed.
func syncSVIDs(src svidSet, want []*registry.Workload, log zerolog.Logger) int {
	keep := make(map[spiffeid.ID]bool, len(want))
	for _, w := range want {
		keep[w.Identity] = true
	}
	removed := 0
	for _, id := range src.IDs() {
		if !keep[id] {
			src.Remove(id)
			removed++
			log.Info().Str("identity", id.String()).Msg("no local workload has this identity any more; its certificate is removed")
		}
	}
	return removed
}

// install makes snap the current model: the snapshot first, then old
// certificates go; then capture follows the node's workloads: pods added to this node are captured from now on, rules added
// before old ones go; then the certificates of new local workloads are
// asked for (capture never waits on the CA: a new workload is blocked for
// mesh connections until its certificate arrives, retried in the
// background if it does not); last the open connections are
// re-authorized. It returns how many connections were closed and
// certificates removed, and whether every local workload's host link was
// found.
func (n *node) install(ctx context.Context, snap *registry.Snapshot) (closed, removed int, complete bool) {
	locals := localWorkloads(snap, n.cfg.Name)
	certified := withCertificates(locals)
	n.reg.Store(snap)
	n.hl.sync(locals)
	removed = syncSVIDs(n.svids, certified, n.log)
	n.captureMu.Lock()
	var all []tun.CaptureLink
	all, complete = n.captureLinks(snap, locals)
	ok := true
	if err := n.routes.Update(all, podPrefixes(locals)); err != nil {
		n.log.Error().Err(err).Msg("update capture rules")
		ok = false
	} else if n.local != nil {
		if err := n.local.Update(podAddrs(locals)); err != nil {
			n.log.Error().Err(err).Msg("update HBONE local-delivery rules")
			ok = false
		}
	}
	n.rulesOK = ok
	n.reportCaptured(locals, ok)
	n.captureMu.Unlock()
	if n.certs.sync(ctx, certified) > 0 {
		n.certificateIssued()
	}
	return n.px.Reauthorize(), removed, complete
}

// reportCaptured tells Config.Captured which of locals are captured:
// rulesOK (the capture and local-delivery rules were installed), the
// workload's certificate held and its link known or found. Called with
// captureMu held.
func (n *node) reportCaptured(locals []*registry.Workload, rulesOK bool) {
	if n.cfg.Captured == nil {
		return
	}
	var ws []*registry.Workload
	for _, w := range locals {
		if !rulesOK || n.noRoute[w.String()] {
			continue
		}
		if _, held := n.svids.Expiry(w.Identity); !held {
			continue
		}
		ws = append(ws, w)
	}
	n.cfg.Captured(ws)
}

// captureLinks returns the links to capture, each with the addresses of
// the local mesh workloads whose packets arrive on it: Config.CaptureLinks,
// the links the model names (Workload.CaptureLinks) and, unless the
// snapshot's LinksKnown, the host-side links of the other workloads
// found from their routes; and whether every workload had one. A bridge
// CNI is reported once: its pods' links are not captured (that would
// capture every pod on the bridge).
func (n *node) captureLinks(snap *registry.Snapshot, locals []*registry.Workload) ([]tun.CaptureLink, bool) {
	var out []tun.CaptureLink
	index := map[string]int{}
	add := func(name string, srcs []netip.Addr) {
		i, ok := index[name]
		if !ok {
			i = len(out)
			index[name] = i
			out = append(out, tun.CaptureLink{Name: name})
		}
		out[i].Sources = append(out[i].Sources, srcs...)
	}
	for _, l := range n.cfg.CaptureLinks {
		add(l, nil)
	}
	var unlinked []*registry.Workload
	for _, w := range locals {
		for _, l := range w.CaptureLinks {
			add(l, w.Addresses)
		}
		if len(w.CaptureLinks) == 0 && !snap.LinksKnown {
			unlinked = append(unlinked, w)
		}
	}
	if len(unlinked) == 0 {
		n.noRoute = nil
		return out, true
	}
	locals = unlinked
	var addrs []netip.Addr
	for _, w := range locals {
		addrs = append(addrs, w.Addresses...)
	}
	found, err := tun.HostLinks(addrs)
	if err != nil {
		n.log.Error().Err(err).Msg("find the pods' host links")
		return out, false
	}
	complete := true
	missing := map[string]bool{}
	for _, w := range locals {
		var link *tun.HostLink
		for _, a := range w.Addresses {
			if hl, ok := found[a.Unmap()]; ok {
				link = &hl
				break
			}
		}
		if link == nil && n.cfg.LinkHint != nil {
			for _, a := range w.Addresses {
				if name, ok := n.cfg.LinkHint(a.Unmap()); ok && tun.RoutedLink(name) {
					link = &tun.HostLink{Name: name}
					break
				}
			}
		}
		switch {
		case link == nil:
			complete = false
			missing[w.String()] = true
			if !n.noRoute[w.String()] {
				n.log.Warn().Str("workload", w.String()).Msg("no route to the pod on this node yet: its outbound traffic is not captured until one appears")
			}
		case link.Bridge:
			if !n.bridgeWarned {
				n.bridgeWarned = true
				n.log.Error().Str("workload", w.String()).Str("bridge", link.Name).Str("route", link.Route.String()).
					Msg("bridge CNI detected: pods on one Linux bridge reach each other without the node routing them, " +
						"so meshtun cannot capture them by link; traffic from other nodes to the pods is still captured, " +
						"traffic the pods send is not. Use a routed CNI (kindnet, Calico, Cilium in routing mode)")
			}
		default:
			add(link.Name, w.Addresses)
		}
	}
	n.noRoute = missing
	return out, complete
}

// follow applies each model from updates, the source's: the one update
// loop. While a local workload has no host route yet, capture is retried
// every second.
func (n *node) follow(ctx context.Context, updates <-chan *registry.Snapshot) {
	var retry <-chan time.Time
	for {
		var snap *registry.Snapshot
		retried := false
		select {
		case <-ctx.Done():
			return
		case snap = <-updates:
		case <-retry:
			snap, retried = n.reg.Load(), true
		}
		closed, removed, complete := n.install(ctx, snap)
		retry = nil
		if !complete {
			retry = time.After(time.Second)
		}
		if !retried {
			n.log.Info().Int("workloads", len(snap.Workloads)).Int("services", len(snap.Services)).
				Int("policies", len(snap.Policies)).Int("local", len(localWorkloads(snap, n.cfg.Name))).
				Int("certificates_removed", removed).Int("connections_closed", closed).Msg(ModelUpdatedMessage)
		}
	}
}

// families says which IP families the node's captured pods use: their
// addresses and their links' sources. A node without pods yet uses none,
// so forwarding it cannot turn on only warns (tun.SetSysctls).
func families(locals []*registry.Workload, links []tun.CaptureLink) (v4, v6 bool) {
	see := func(a netip.Addr) {
		if a.Unmap().Is4() {
			v4 = true
		} else {
			v6 = true
		}
	}
	for _, w := range locals {
		for _, a := range w.Addresses {
			see(a)
		}
	}
	for _, l := range links {
		for _, a := range l.Sources {
			see(a)
		}
	}
	return v4, v6
}
