package proxy

import (
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/metrics"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
)

// record is what a node reports about one connection: the access-log line
// (with ztunnel's field names) and Istio's TCP metrics. Every path fills
// one in and ends it with refused or done.
type record struct {
	p                 *Proxy
	start             time.Time
	src, dst          netip.AddrPort
	srcW, dstW        *registry.Workload
	srcID             string // verified or local source identity, "" if none
	direction, route  string
	hboneAddr, target string
	// service is the destination service's hostname (dst.service, the
	// forwarded host; UnknownService for an inbound host the mesh does not
	// know), svc the service itself when the model has it.
	service   string
	svc       *registry.Service
	secure    bool     // mutual TLS (HBONE) or in-proxy with identities
	reporters []string // "source" and/or "destination"
	// trace is the connection's W3C trace context: the one an inbound
	// HBONE request carried, else a new one (sent on outbound HBONE). Its
	// trace id is in the access log of both nodes.
	trace hbone.TraceParent
	// derived is the source as the peer's baggage describes it, for an
	// inbound connection whose source workload the model does not know
	// (ztunnel's derived source); nil otherwise.
	derived *derivedPeer

	sentCtrs, recvCtrs []prometheus.Counter // per reporter, set by opened
	// exempt, if set, ends the classifier's exemption of the upstream
	// kernel connection (Config.Exempt); called once its socket is closed.
	exempt func()
}

// release ends the upstream connection's exemption, if it has one.
func (r *record) release() {
	if r.exempt != nil {
		r.exempt()
	}
}

// newRecord starts the record of a connection from src to dst.
func (p *Proxy) newRecord(src, dst netip.AddrPort, srcW, dstW *registry.Workload, direction, route string) *record {
	r := &record{p: p, start: time.Now(), src: src, dst: dst, srcW: srcW, dstW: dstW, direction: direction, route: route,
		trace: hbone.NewTraceParent()}
	if srcW != nil && srcW.InMesh && direction == "outbound" {
		r.srcID = srcW.Identity.String()
	}
	switch route {
	case "hbone", "waypoint":
		r.secure = true
		if direction == "outbound" {
			r.reporters = []string{"source"}
		} else {
			r.reporters = []string{"destination"}
		}
	case "local":
		// Both ends are this node's: it reports for both.
		r.secure = true
		r.reporters = []string{"source", "destination"}
	case "plaintext":
		r.reporters = []string{"destination"}
	default:
		r.reporters = []string{"source"}
	}
	return r
}

// via sets the endpoint chosen for a service VIP, and the service (nil if
// the destination was no service).
func (r *record) via(target netip.AddrPort, svc *registry.Service) *record {
	if target != r.dst {
		r.target = target.String()
	}
	r.svc = svc
	if svc != nil {
		r.service = svc.Hostname
	}
	return r
}

func (r *record) event(ev *zerolog.Event) *zerolog.Event {
	ev.Str("src.addr", r.src.String()).Str("dst.addr", r.dst.String()).
		Str("direction", r.direction).Str("route", r.route).Str("trace_id", r.trace.TraceIDString())
	workloadFields(ev, "src", r.srcW)
	if r.srcW == nil && r.derived != nil {
		r.derived.fields(ev)
	}
	workloadFields(ev, "dst", r.dstW)
	if r.srcID != "" {
		ev.Str("src.identity", r.srcID)
	}
	if r.hboneAddr != "" {
		ev.Str("dst.hbone_addr", r.hboneAddr)
	}
	if r.target != "" {
		ev.Str("dst.target", r.target)
	}
	if r.service != "" {
		ev.Str("dst.service", r.service)
	}
	return ev
}

func workloadFields(ev *zerolog.Event, side string, w *registry.Workload) {
	if w == nil {
		return
	}
	ev.Str(side+".workload", w.Name).Str(side+".namespace", w.Namespace)
	if w.Cluster != "" {
		ev.Str(side+".cluster", w.Cluster)
	}
	if w.InMesh && side == "dst" {
		ev.Str("dst.identity", w.Identity.String())
	}
}

func (r *record) labels(reporter, flags string) metrics.Conn {
	c := metrics.Conn{Reporter: reporter, ResponseFlags: flags, SecurityPolicy: "none"}
	if r.svc != nil {
		c.DstService = metrics.Service{Hostname: r.svc.Hostname, Name: r.svc.Name, Namespace: r.svc.Namespace}
	} else {
		c.DstService.Hostname = r.service
	}
	if r.secure {
		c.SecurityPolicy = "mutual_tls"
	}
	c.Src, c.Dst = peer(r.srcW), peer(r.dstW)
	if r.srcW == nil && r.derived != nil {
		c.Src = r.derived.peer
	}
	c.Src.Principal = r.srcID
	if w := r.dstW; w == nil || !w.InMesh {
		c.Dst.Principal = ""
	}
	return c
}

// peer is a workload's metric labels, with istiod's names when the model
// has them.
func peer(w *registry.Workload) metrics.Peer {
	if w == nil {
		return metrics.Peer{}
	}
	svc, rev := w.Canonical()
	return metrics.Peer{Workload: w.Workload(), Namespace: w.Namespace, Principal: w.Identity.String(),
		CanonicalService: svc, CanonicalRevision: rev, Cluster: w.Cluster,
		Region: w.Locality.Region, Zone: w.Locality.Zone}
}

// refused reports a connection refused before it opened.
func (r *record) refused(err error) { r.refusedLog(err, true, 0) }

// refusedLog counts the refusal and, if log, logs it, with how many lines
// were held back before it (suppressed) if any.
func (r *record) refusedLog(err error, log bool, suppressed uint64) {
	flags := responseFlags(err)
	for _, rep := range r.reporters {
		c := r.labels(rep, flags)
		r.p.cfg.Metrics.Refused(&c)
	}
	if !log || r.p.quiet.Load() {
		return
	}
	e := r.event(r.p.access.Info()).Str("error", connectError(err)).Str("response_flags", flags).
		Dur("duration", time.Since(r.start))
	if suppressed > 0 {
		e = e.Uint64("suppressed", suppressed)
	}
	e.Msg("connection refused")
}

// refusedEarly is refused for a connection refused before any request
// (a failed TLS handshake, the wrong address): anyone can cause those, as
// fast as they can connect, so their access-log lines are limited to
// hbone.DefaultLogRate a second (the next line let through says how many
// were held back); the metrics count them all.
func (r *record) refusedEarly(err error) {
	ok, n := r.p.earlyLog.Allow()
	r.refusedLog(err, ok, n)
}

// opened counts the connection as open: its upstream is connected.
func (r *record) opened() {
	for _, rep := range r.reporters {
		c := r.labels(rep, "-")
		r.p.cfg.Metrics.Opened(&c)
		if sent, recv := r.p.cfg.Metrics.Bytes(&c); sent != nil {
			r.sentCtrs = append(r.sentCtrs, sent)
			r.recvCtrs = append(r.recvCtrs, recv)
		}
	}
}

// sent counts n bytes sent by the client; received, n received by it.
// The relay calls them as data moves.
func (r *record) sent(n int) {
	for _, c := range r.sentCtrs {
		c.Add(float64(n))
	}
}

func (r *record) received(n int) {
	for _, c := range r.recvCtrs {
		c.Add(float64(n))
	}
}

// done reports a finished connection. Bytes are counted from the client's
// point of view: sent by it, received by it.
func (r *record) done(sent, recv int64, reset bool) {
	for _, rep := range r.reporters {
		c := r.labels(rep, "-")
		r.p.cfg.Metrics.Closed(&c)
	}
	if r.p.quiet.Load() {
		return
	}
	ev := r.event(r.p.access.Info())
	if reset {
		ev.Str("error", "connection reset")
	}
	ev.Int64("bytes_sent", sent).Int64("bytes_recv", recv).
		Dur("duration", time.Since(r.start)).Msg("connection complete")
}

// responseFlags maps a refusal to Istio's response flag.
func responseFlags(err error) string {
	var de *deniedError
	var tf *tlsFailure
	switch {
	case errors.As(err, &de), errors.Is(err, hbone.ErrDenied), errors.As(err, new(*refusedWorkloadError)):
		return "DENY"
	case errors.As(err, &tf):
		return "TLS_FAILURE"
	case errors.Is(err, errNoEndpoint), errors.As(err, new(*registry.WaypointError)):
		return "UH"
	case errors.As(err, new(*unresolvedError)):
		return "DF"
	case errors.Is(err, errDraining):
		return "DRAIN"
	}
	return "CONNECT"
}

// refusedWorkloadError denies a connection of a workload the control
// plane put in the mesh with a feature meshtun refuses (registry's
// Workload.Refused): captured so that it is not left open, and denied.
type refusedWorkloadError struct{ w *registry.Workload }

func (e *refusedWorkloadError) Error() string {
	return fmt.Sprintf("workload %s is refused by meshtun (%s): every connection from it and to it is denied", e.w, e.w.Refused)
}

// noCertificateError refuses a mesh connection of a local workload that
// holds no certificate yet (the CA unreachable, or refusing it): blocked,
// fail closed, until the node gets one.
type noCertificateError struct{ w *registry.Workload }

func (e *noCertificateError) Error() string {
	return fmt.Sprintf("workload %s has no certificate (identity %s not issued yet): its mesh connections are refused until it has one", e.w, e.w.Identity)
}

// unresolvedError refuses a connection to a service whose chosen
// endpoint has no address, only a DNS name (an Istio ServiceEntry with
// resolution DNS), that could not be resolved to an address meshtun may
// send to: passing the connection on to the VIP instead could reach a
// mesh destination in plaintext.
type unresolvedError struct {
	svc *registry.Service
	w   *registry.Workload
	err error // why it could not be resolved
}

func (e *unresolvedError) Error() string {
	why := "not resolved"
	if e.err != nil {
		why = e.err.Error()
	}
	return fmt.Sprintf("service %s (%s): endpoint %s is known by its DNS name %q (a ServiceEntry with resolution DNS): %s; connection refused", e.svc, e.svc.Hostname, e.w, e.w.Hostname, why)
}

func (e *unresolvedError) Unwrap() error { return e.err }

var (
	errNoEndpoint = errors.New("no healthy endpoint for the service")
	errDraining   = errors.New("node proxy is draining: no new connections")
)
