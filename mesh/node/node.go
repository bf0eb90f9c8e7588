// Package node assembles a meshtun node proxy: the TUN device and its
// routing, the classifier, the netstack, the workload identities and the
// proxy, started in that order and torn down in reverse.
package node

import (
	"context"
	"crypto/sha256"
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

	"github.com/meshtun/meshtun/mesh/config"
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
	// CaptureLinks are the node-side links of the captured pods, each
	// with the addresses its pods may send from ([CaptureLinks]).
	CaptureLinks []tun.CaptureLink
	// Mesh is the initial model of the mesh.
	Mesh *registry.Snapshot
	// Issuer issues the local workloads' SVIDs (a RemoteIssuer: the keys
	// stay on the node, the root key does not come here) and Bundle holds
	// the roots peers are verified against. If Issuer is nil, the node
	// opens the built-in CA of CA.Dir itself: development only, since every
	// node then holds the root key and can mint any identity.
	Issuer identity.Issuer
	Bundle x509bundle.Source
	// CA is the built-in certificate authority, used only if Issuer is nil.
	// Its TrustDomain must be Mesh's.
	CA identity.CAConfig
	// ConfigPath, if set, is watched: a valid change replaces the mesh
	// model (workloads, services, policies) without dropping established
	// connections; node settings in it take effect at the next start, and
	// a change of trust domain is refused until then.
	ConfigPath string
	// ConfigSum is the config.Config.Sum of the file Mesh was built from:
	// the watcher applies a content that differs from it. Zero applies the
	// first content the watcher reads.
	ConfigSum [sha256.Size]byte
	// Updates, if set, delivers new models of the mesh (from the
	// Kubernetes API server); each replaces the current one as a valid
	// config reload does.
	Updates <-chan *registry.Snapshot
	// CaptureByRoute: each local mesh workload's host-side link is found
	// from the node's route to its address (routed CNIs: kindnet, Calico,
	// Cilium in routing mode) and captured with the workload's addresses
	// as its sources, in addition to CaptureLinks.
	CaptureByRoute bool
	// Status, if set, is shown as "source" on /config_dump: what the model's
	// source last saw.
	Status func() any
	// Collectors are added to the node's metrics (the model source's own,
	// as the xDS health metrics).
	Collectors []prometheus.Collector
	// Captured, if set, is told after every change of capture which
	// local mesh workloads are captured: certificate held, host link
	// found, capture and inbound HBONE rules in place. With istiod as the
	// source, a pod is annotated for redirection only once it is
	// (kube.Redirector.Captured).
	Captured func([]registry.WorkloadRef)
	// CapturedWorkloads, if set, is told the same as Captured, with the
	// workloads (and so their addresses): the CNI startup gate answers a
	// pod's ADD once its announced addresses are captured.
	CapturedWorkloads func([]*registry.Workload)
	// LinkHint, if set, names the host link of a local workload's address
	// when CaptureByRoute finds no route to it (the CNI startup gate's
	// announced link).
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

// NoInterceptWarning is the warning Run logs when Config.NoIntercept is
// set: the node is in the path but protects nothing.
const NoInterceptWarning = "--no-intercept: NOTHING IS ENFORCED: no mTLS, no authorization, no STRICT peer authentication; every packet passes the TUN verbatim (for measuring the TUN path only)"

// localWorkloads returns the mesh workloads of node name: the ones it
// captures, refused ones included (captured to be denied).
func localWorkloads(s *registry.Snapshot, name string) []*registry.Workload {
	var out []*registry.Workload
	for _, w := range s.Workloads {
		if w.InMesh && w.Node == name {
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
// carry it (docs/ARCHITECTURE.md, "The bare ACK").
const DefaultAckDelay = time.Millisecond

// Run runs the node proxy until ctx is done, then drains it (new
// connections are refused, open ones get up to DrainPeriod to finish),
// removes everything it installed, and returns ctx's error.
func Run(ctx context.Context, cfg Config) (err error) {
	log := cfg.Logger
	if cfg.Mesh == nil {
		return errors.New("node: no mesh model")
	}
	locals := localWorkloads(cfg.Mesh, cfg.Name)
	if len(locals) == 0 {
		log.Warn().Str("node", cfg.Name).Msg("no mesh workloads on this node yet; the config file may add some")
	}
	if cfg.DrainPeriod == 0 {
		cfg.DrainPeriod = DefaultDrainPeriod
	}
	// Connections live in runCtx, which ends only after the drain: the
	// signal that stops the node must not cut them.
	runCtx, stopRun := context.WithCancel(context.WithoutCancel(ctx))
	defer stopRun()
	n := &node{cfg: cfg, log: log, reg: registry.New(cfg.Mesh), metrics: metrics.New()}
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

	// The identity source next; the certificates themselves are asked
	// for only once capture is installed (below): a CA that is down, or
	// refuses an identity, must never leave the pods uncaptured.
	issuer, bundle := cfg.Issuer, cfg.Bundle
	if issuer == nil {
		cfg.CA.TrustDomain = cfg.Mesh.TrustDomain
		cfg.CA.Logger = log
		log.Warn().Str("ca_dir", cfg.CA.Dir).Msg("INSECURE (development only): this node holds the CA root key and issues its own certificates; a compromised node can mint any identity of the trust domain. Use `meshtun ca` (ca.address) instead.")
		ca, err := identity.OpenCA(cfg.CA)
		if err != nil {
			return err
		}
		issuer, bundle = ca, ca.Bundle()
	}
	n.svids, err = identity.NewSource(identity.SourceConfig{
		Issuer: issuer, Bundle: bundle, TrustDomain: cfg.Mesh.TrustDomain, Logger: log,
	})
	if err != nil {
		return err
	}
	defer n.svids.Close()
	n.certs = newCertKeeper(runCtx, n.svids, n.certificateIssued, log)
	defer n.certs.stop()

	// The HBONE dials go to pods of other nodes, which no rule of this
	// node captures.
	dialer := &net.Dialer{}
	n.hc, err = hbone.NewClient(hbone.ClientConfig{
		Dial: dialer.DialContext,
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
	links, _ := n.captureLinks(cfg.CaptureLinks, locals)
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

	n.px, err = proxy.New(runCtx, proxy.Config{
		Node: cfg.Name, Registry: n.reg, HBONE: n.hc, Metrics: n.metrics, FromNode: nodeAddrs.Contains,
		Certified: n.hasCertificate, Exempt: n.exempt,
		Logger: log, AccessLog: log.With().Str("log", "access").Logger(),
	})
	if err != nil {
		return err
	}
	n.hs, err = hbone.NewServer(hbone.ServerConfig{
		TLS: identity.ServerTLS(n.svids, cfg.Mesh.TrustDomain, func(local netip.Addr) (spiffeid.ID, bool) {
			w := n.reg.Load().Workload(local)
			if w == nil || !w.InMesh || w.Node != cfg.Name || w.Refused != "" || !n.hasCertificate(w.Identity) {
				return spiffeid.ID{}, false
			}
			return w.Identity, true
		}),
		Handler:                n.px.InboundHandler(),
		OnRefusedConn:          n.px.TLSFailure,
		HandshakeTimeout:       cfg.HBONEHandshakeTimeout,
		MaxHandshakes:          cfg.HBONEMaxHandshakes,
		MaxHandshakesPerSource: cfg.HBONEMaxHandshakesPerSource,
		MaxConnsPerPeer:        cfg.HBONEMaxConnsPerPeer,
		Logger:                 log,
	})
	if err != nil {
		return err
	}
	n.px.SetServer(n.hs)
	n.st, err = stack.New(stack.Config{
		Device:     dev,
		Classifier: n.cls,
		HandleTCP:  n.px.HandleTCP,
		AckDelay:   cfg.AckDelay,
		Logger:     log,
	})
	if err != nil {
		return err
	}
	n.px.SetDialer(n.st)
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
			defer func() {
				if lerr := n.local.Close(); lerr != nil {
					log.Error().Err(lerr).Msg("remove HBONE local delivery")
				}
				if rerr := routes.SetLocalDelivery(0); rerr != nil {
					log.Error().Err(rerr).Msg("remove the local-delivery listener's exemption from the spoof rules")
				}
			}()
		}
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
	if cfg.ConfigPath != "" {
		go watchConfig(runCtx, cfg.ConfigPath, n, log)
	}
	if cfg.Updates != nil {
		go n.follow(runCtx, cfg.Updates)
	}

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
		Strs("capture_links", linkNames).Str("hbone_inbound", hboneOn).
		Int("workloads", len(locals)).Int("workloads_without_certificate", len(n.uncertified(cfg.Mesh))).
		Str("trust_domain", cfg.Mesh.TrustDomain.String()).
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
// the config watcher.
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

	captureMu    sync.Mutex      // capture updates, from the config watcher or the source
	bridgeWarned bool            // CaptureByRoute found a bridge CNI; said so once
	noRoute      map[string]bool // CaptureByRoute: local workloads without a host route, logged once
	rulesOK      bool            // the last capture update installed its rules (captureMu)
	certs        *certKeeper
	routes       *tun.Routing
	local        *tun.LocalDelivery // nil: inbound HBONE on the netstack
	sink         *spoofSink
	ready        atomic.Bool
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

// interceptPolicy is the classifier's policy: capturePolicy, or nil (and a
// loud warning) with NoIntercept.
func interceptPolicy(reg *registry.Registry, cfg Config, fromNode func(netip.Addr) bool, log zerolog.Logger) classify.Policy {
	if cfg.NoIntercept {
		log.Warn().Str("node", cfg.Name).Msg(NoInterceptWarning)
		return nil
	}
	return capturePolicy(reg, cfg.Name, fromNode)
}

// capturePolicy selects the SYNs the netstack takes: connections opened by
// a local mesh workload (outbound), HBONE to a local mesh workload
// (inbound), plaintext from a mesh workload to a local one (its own node
// should have tunnelled it), and plaintext to a local mesh workload that
// STRICT mode or an authorization policy protects (to be authorized, or
// refused), also from the node itself (fromNode: a source address of the
// node's own), except to the workload's probe ports. Everything else stays
// verbatim: plaintext to an unprotected PERMISSIVE workload reaches it
// directly, and so do the node's probes.
//
// The classifier also asks it, for a segment of no known flow, about both
// orientations of the connection, and keeps the segment from going out
// verbatim when both say yes. So it says yes both ways between two mesh
// workloads, whose traffic must never be verbatim, and no for the node's
// probes, whose replies must stay verbatim.
func capturePolicy(reg *registry.Registry, node string, fromNode func(netip.Addr) bool) classify.Policy {
	return classify.PolicyFunc(func(src, dst netip.AddrPort) bool {
		s := reg.Load()
		sw := s.Workload(src.Addr())
		if sw != nil && sw.InMesh && sw.Node == node {
			return true
		}
		if w := s.Workload(dst.Addr()); w != nil && w.InMesh && w.Node == node {
			if dst.Port() == hbone.Port || sw != nil && sw.InMesh {
				return true
			}
			if w.ProbePort(dst.Port()) && fromNode(src.Addr()) {
				return false
			}
			return w.Protected(dst.Port())
		}
		return false
	})
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

// watchConfig replaces the mesh model whenever the config file changes to
// a valid one, and has the proxy re-authorize its open connections. An
// invalid file keeps the last good model.
func watchConfig(ctx context.Context, path string, n *node, log zerolog.Logger) {
	r := &reloader{
		path: path, inForce: n.cfg.ConfigSum, td: n.cfg.Mesh.TrustDomain, log: log,
		apply: func(c *config.Config, snap *registry.Snapshot) { n.apply(ctx, c, snap) },
	}
	err := config.Watch(ctx, path, r.onChange, r.onError)
	if err != nil && !errors.Is(err, context.Canceled) {
		log.Error().Err(err).Str("config", path).Msg("config watch stopped")
	}
}

// reloader decides which configs the watcher delivers are applied: one
// whose content differs from the config in force, that builds, and that
// keeps the trust domain. It compares content, not the order of
// deliveries, so that a change made between the start-up load and the
// watch is applied, and a valid change after an invalid one too.
type reloader struct {
	path string
	// inForce is the Sum of the config whose model is in force; the zero
	// value (none known) matches no config.
	inForce [sha256.Size]byte
	// td is the trust domain of the running node: the CA, the SVIDs and
	// the TLS verification are built for it.
	td    spiffeid.TrustDomain
	apply func(*config.Config, *registry.Snapshot)
	log   zerolog.Logger
}

func (r *reloader) onChange(c *config.Config) {
	if c.Sum() == r.inForce {
		r.log.Debug().Str("config", r.path).Msg("config unchanged from the one in force")
		return
	}
	snap, err := c.Snapshot()
	if err != nil {
		r.log.Error().Err(err).Str("config", r.path).Msg("config reload failed; keeping the last good model")
		return
	}
	if snap.TrustDomain != r.td {
		r.log.Error().Str("config", r.path).Str("trust_domain", snap.TrustDomain.String()).Str("in_force", r.td.String()).
			Msgf("config reload refused: the trust domain changed from %s to %s, which needs a restart of the node; keeping the last good model", r.td, snap.TrustDomain)
		return
	}
	for _, w := range c.Warnings {
		r.log.Warn().Str("config", r.path).Msg(w)
	}
	r.apply(c, snap)
	r.inForce = c.Sum()
}

func (r *reloader) onError(err error) {
	r.log.Error().Err(err).Str("config", r.path).Msg("config reload failed; keeping the last good model")
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

// apply installs a new mesh model from a reloaded config.
func (n *node) apply(ctx context.Context, c *config.Config, snap *registry.Snapshot) {
	path := c.Path
	links, err := CaptureLinks(c, n.cfg.Name)
	if err != nil {
		n.log.Error().Err(err).Str("config", path).Msg("config reload: this node is gone from the file; capture unchanged")
	}
	closed, removed, _ := n.install(ctx, snap, links, err == nil)
	n.log.Info().Str("config", path).Int("workloads", len(snap.Workloads)).Int("services", len(snap.Services)).
		Int("policies", len(snap.Policies)).Int("certificates_removed", removed).Int("connections_closed", closed).Msg("config reloaded")
}

// install makes snap the current model: the snapshot first, then old
// certificates go; then (if updateCapture) capture follows the node's
// workloads: pods added to this node are captured from now on, rules added
// before old ones go; then the certificates of new local workloads are
// asked for (capture never waits on the CA: a new workload is blocked for
// mesh connections until its certificate arrives, retried in the
// background if it does not); last the open connections are
// re-authorized. It returns how many connections were closed and
// certificates removed, and whether every local workload's host link was
// found (with CaptureByRoute).
func (n *node) install(ctx context.Context, snap *registry.Snapshot, links []tun.CaptureLink, updateCapture bool) (closed, removed int, complete bool) {
	locals := localWorkloads(snap, n.cfg.Name)
	certified := withCertificates(locals)
	n.reg.Store(snap)
	n.hl.sync(locals)
	removed = syncSVIDs(n.svids, certified, n.log)
	complete = true
	if updateCapture {
		n.captureMu.Lock()
		var all []tun.CaptureLink
		all, complete = n.captureLinks(links, locals)
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
	}
	if n.certs.sync(ctx, certified) > 0 && updateCapture {
		n.certificateIssued()
	}
	return n.px.Reauthorize(), removed, complete
}

// reportCaptured tells Config.Captured which of locals are captured:
// rulesOK (the capture and local-delivery rules were installed), the
// workload's certificate held and, with CaptureByRoute, its host link
// found. Called with captureMu held, or before the node follows updates.
func (n *node) reportCaptured(locals []*registry.Workload, rulesOK bool) {
	if n.cfg.Captured == nil && n.cfg.CapturedWorkloads == nil {
		return
	}
	var refs []registry.WorkloadRef
	var ws []*registry.Workload
	for _, w := range locals {
		if !rulesOK || n.noRoute[w.String()] {
			continue
		}
		if _, held := n.svids.Expiry(w.Identity); !held {
			continue
		}
		refs = append(refs, registry.WorkloadRef{Namespace: w.Namespace, Name: w.Name})
		ws = append(ws, w)
	}
	if n.cfg.Captured != nil {
		n.cfg.Captured(refs)
	}
	if n.cfg.CapturedWorkloads != nil {
		n.cfg.CapturedWorkloads(ws)
	}
}

// captureLinks returns links plus, with CaptureByRoute, the host-side
// links of the local mesh workloads found from their routes, each with
// its workloads' addresses as sources, and whether every workload had one.
// A bridge CNI is reported once: its pods' links are not captured (that
// would capture every pod on the bridge).
func (n *node) captureLinks(links []tun.CaptureLink, locals []*registry.Workload) ([]tun.CaptureLink, bool) {
	if !n.cfg.CaptureByRoute {
		return links, true
	}
	var addrs []netip.Addr
	for _, w := range locals {
		addrs = append(addrs, w.Addresses...)
	}
	found, err := tun.HostLinks(addrs)
	if err != nil {
		n.log.Error().Err(err).Msg("find the pods' host links")
		return links, false
	}
	out := append([]tun.CaptureLink(nil), links...)
	index := map[string]int{}
	for i, l := range out {
		index[l.Name] = i
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
			i, ok := index[link.Name]
			if !ok {
				i = len(out)
				index[link.Name] = i
				out = append(out, tun.CaptureLink{Name: link.Name})
			}
			out[i].Sources = append(out[i].Sources, w.Addresses...)
		}
	}
	n.noRoute = missing
	return out, complete
}

// follow applies each model from updates (the Kubernetes source). While a
// local workload has no host route yet, capture is retried every second.
func (n *node) follow(ctx context.Context, updates <-chan *registry.Snapshot) {
	var retry <-chan time.Time
	for {
		var snap *registry.Snapshot
		select {
		case <-ctx.Done():
			return
		case snap = <-updates:
		case <-retry:
			snap = n.reg.Load()
		}
		closed, _, complete := n.install(ctx, snap, n.cfg.CaptureLinks, true)
		retry = nil
		if !complete {
			retry = time.After(time.Second)
		}
		n.log.Debug().Int("workloads", len(snap.Workloads)).Int("services", len(snap.Services)).
			Int("local", len(localWorkloads(snap, n.cfg.Name))).Int("connections_closed", closed).Msg("mesh model updated")
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
