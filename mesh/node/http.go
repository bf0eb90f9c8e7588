package node

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/pprof"
	"net/netip"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// serveHTTP starts the node's HTTP endpoints (admin, metrics, readiness)
// on their configured addresses, and the admin socket, and returns a
// function that stops them. The TCP admin address serves the read-only
// endpoints; the admin socket (root only) serves them all, including the
// ones that change the node (POST /logging) or read its memory (pprof).
func (n *node) serveHTTP(ctx context.Context) (stop func(), err error) {
	var servers []*http.Server
	var exempts []func()
	stop = func() {
		sctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
		defer cancel()
		for _, s := range servers {
			s.Shutdown(sctx)
		}
		for _, release := range exempts {
			release()
		}
	}
	n.httpAddrs = map[string]string{}
	serve := func(name string, ln net.Listener, h http.Handler) {
		srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second, ConnContext: withPeer}
		servers = append(servers, srv)
		n.httpAddrs[name] = ln.Addr().String()
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				n.log.Error().Err(err).Str("addr", ln.Addr().String()).Msg(name + " server stopped")
			}
		}()
		n.log.Debug().Str("addr", ln.Addr().String()).Msg(name + " server listening")
	}
	for _, ep := range []struct {
		name, addr string
		handler    http.Handler
	}{
		{"admin", n.cfg.AdminAddr, n.adminMux(false)},
		{"metrics", n.cfg.MetricsAddr, promhttp.HandlerFor(n.metrics.Registry, promhttp.HandlerOpts{})},
		{"readiness", n.cfg.ReadinessAddr, http.HandlerFunc(n.readiness)},
	} {
		if ep.addr == "" {
			continue
		}
		var lc net.ListenConfig
		ln, err := lc.Listen(ctx, "tcp", ep.addr)
		if err != nil {
			stop()
			return nil, fmt.Errorf("node: %s listener on %s: %w", ep.name, ep.addr, err)
		}
		// Its replies to a local pod cross the TUN (the node's traffic to
		// the pods is captured): exempt, by the address and port it holds.
		exempts = append(exempts, n.exempt.AddListener(ln.Addr().(*net.TCPAddr).AddrPort()))
		serve(ep.name, ln, ep.handler)
	}
	if n.cfg.AdminSocket != "" {
		// Without it the node runs on: what it would serve is off (closed),
		// the mesh is not.
		if ln, err := listenAdminSocket(n.cfg.AdminSocket, n.log); err != nil {
			n.log.Error().Err(err).Msg("no admin socket: changing the log levels and pprof are unavailable")
		} else {
			serve("admin socket", ln, n.adminMux(true))
			n.log.Info().Str("socket", n.cfg.AdminSocket).Msg("admin socket (root only) serves POST /logging and /debug/pprof/")
		}
	}
	return stop, nil
}

// readiness answers /healthz/ready: 200 once the TUN is up, routing
// installed, the registry loaded and the local certificates issued; 503
// before that, while draining, while a local workload has no certificate
// (blocked for mesh connections: the CA unreachable or refusing it; the
// body names them), and when no local workload holds a valid certificate
// any more (renewals failed until every one expired). Failing renewals
// alone do not make the node unready: it keeps serving with the
// certificates it has (see the meshtun_certificates_* metrics).
func (n *node) readiness(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/healthz/ready" {
		http.NotFound(w, r)
		return
	}
	if !n.ready.Load() {
		msg := "not ready"
		if !n.synced.Load() {
			msg = "not ready: waiting for the mesh model's source (see /config_dump)"
		}
		http.Error(w, msg, http.StatusServiceUnavailable)
		return
	}
	var missing []*registry.Workload
	if n.reg != nil {
		missing = n.uncertified(n.reg.Load())
	}
	if len(missing) > 0 {
		const shown = 5
		var names []string
		for _, w := range missing[:min(len(missing), shown)] {
			names = append(names, w.String())
		}
		more := ""
		if len(missing) > shown {
			more = fmt.Sprintf(" and %d more", len(missing)-shown)
		}
		http.Error(w, fmt.Sprintf("not ready: %d local workloads have no certificate (%s), their mesh connections are blocked: %s%s (see /config_dump)",
			len(missing), BlockedReasonNoCertificate, strings.Join(names, ", "), more), http.StatusServiceUnavailable)
		return
	}
	if st := n.svids.Stats(); st.Total > 0 && st.Valid == 0 {
		http.Error(w, fmt.Sprintf("not ready: none of the %d local workloads holds a valid certificate (%d renewals failing)", st.Total, st.Failing), http.StatusServiceUnavailable)
		return
	}
	w.Write([]byte("ready\n"))
}

// adminMux is the admin endpoints: on TCP (privileged false) the
// read-only ones, /config_dump (istioctl ztunnel-config reads it, as
// ztunnel serves it on 15000) and GET /logging; on the admin socket also
// POST /logging and /debug/pprof/ (profiles and traces show memory and
// requests; cmdline shows the arguments).
func (n *node) adminMux(privileged bool) *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("/config_dump", n.configDump)
	if !privileged {
		mux.HandleFunc("/logging", n.readOnlyLogging)
		return mux
	}
	mux.HandleFunc("/logging", n.logging)
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", pprof.Cmdline)
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	return mux
}

// configDump is the JSON of /config_dump.
type configDump struct {
	Node         string            `json:"node"`
	TrustDomain  string            `json:"trustDomain"`
	Ready        bool              `json:"ready"`
	Workloads    []workloadDump    `json:"workloads"`
	Services     []serviceDump     `json:"services"`
	Policies     []*policy.Policy  `json:"policies"`
	Certificates []certificateDump `json:"certificates"`
	Connections  int               `json:"openConnections"`
	Source       any               `json:"source,omitempty"`
	Flows        int               `json:"flows"`
	// MissingCertificates are the local identities whose certificate is
	// being retried (their workloads blocked for mesh connections).
	MissingCertificates []missingCert `json:"missingCertificates"`
}

type workloadDump struct {
	Name               string            `json:"name"`
	Namespace          string            `json:"namespace"`
	ServiceAccount     string            `json:"serviceAccount"`
	Node               string            `json:"node"`
	Addresses          []netip.Addr      `json:"addresses"`
	Labels             map[string]string `json:"labels,omitempty"`
	InMesh             bool              `json:"mesh"`
	PeerAuthentication string            `json:"peerAuthentication"`
	// PortPeerAuthentication is the port-level modes, port → mode.
	PortPeerAuthentication map[uint16]string `json:"portPeerAuthentication,omitempty"`
	ProbePorts             []uint16          `json:"probePorts,omitempty"`
	Identity               string            `json:"identity,omitempty"`
	// Refused says why meshtun refuses the workload (captured, every
	// connection denied), if it does.
	Refused string `json:"refused,omitempty"`
	// Waypoint is the workload's waypoint ("address:port" or
	// "namespace/hostname:port"), if it has one.
	Waypoint string `json:"waypoint,omitempty"`
	// Blocked says why a local workload's mesh connections are refused
	// for now (BlockedReasonNoCertificate), if they are.
	Blocked string `json:"blocked,omitempty"`
}

type serviceDump struct {
	Name      string                 `json:"name"`
	Namespace string                 `json:"namespace"`
	Hostname  string                 `json:"hostname"`
	VIPs      []netip.Addr           `json:"vips"`
	CIDRs     []netip.Prefix         `json:"vipRanges,omitempty"`
	Ports     []registry.ServicePort `json:"ports"`
	Endpoints []string               `json:"endpoints"`
	// Waypoint is the service's waypoint, if it has one; its weighted
	// waypoints are "<waypoint> weight <n>".
	Waypoint          string   `json:"waypoint,omitempty"`
	WeightedWaypoints []string `json:"weightedWaypoints,omitempty"`
}

type certificateDump struct {
	Identity string    `json:"identity"`
	Expiry   time.Time `json:"expiry"`
}

// configDump answers /config_dump: meshtun's shape, or ztunnel's with
// ?format=ztunnel (see ztunnel_dump.go). Config.ConfigDumpFormat picks the
// shape served without the parameter, so that tools that fetch ztunnel's
// /config_dump as it is read meshtun's unchanged.
func (n *node) configDump(w http.ResponseWriter, r *http.Request) {
	format := r.URL.Query().Get("format")
	if format == "" {
		format = n.cfg.ConfigDumpFormat
	}
	switch format {
	case "ztunnel":
		n.writeZtunnelDump(w)
		return
	case "", "meshtun":
	default:
		http.Error(w, fmt.Sprintf("format %q: want meshtun or ztunnel", format), http.StatusBadRequest)
		return
	}
	snap := n.reg.Load()
	d := configDump{Node: n.cfg.Name, TrustDomain: snap.TrustDomain.String(), Ready: n.ready.Load(),
		Policies: snap.Policies, Workloads: []workloadDump{}, Services: []serviceDump{}, Certificates: []certificateDump{}}
	for _, wl := range snap.Workloads {
		wd := workloadDump{Name: wl.Name, Namespace: wl.Namespace, ServiceAccount: wl.ServiceAccount, Node: wl.Node,
			Addresses: wl.Addresses, Labels: wl.Labels, InMesh: wl.InMesh, PeerAuthentication: wl.PeerAuth.String(),
			ProbePorts: wl.ProbePorts, Refused: wl.Refused}
		if wl.Waypoint != nil {
			wd.Waypoint = wl.Waypoint.String()
		}
		for port, m := range wl.PortPeerAuth {
			if wd.PortPeerAuthentication == nil {
				wd.PortPeerAuthentication = make(map[uint16]string, len(wl.PortPeerAuth))
			}
			wd.PortPeerAuthentication[port] = m.String()
		}
		if wl.InMesh {
			wd.Identity = wl.Identity.String()
			if n.svids != nil && wl.Node == n.cfg.Name && wl.Refused == "" && !n.hasCertificate(wl.Identity) {
				wd.Blocked = BlockedReasonNoCertificate
			}
		}
		d.Workloads = append(d.Workloads, wd)
	}
	for _, s := range snap.Services {
		sd := serviceDump{Name: s.Name, Namespace: s.Namespace, Hostname: s.Hostname, VIPs: s.VIPs, CIDRs: s.CIDRs, Ports: s.Ports, Endpoints: []string{}}
		if s.Waypoint != nil {
			sd.Waypoint = s.Waypoint.String()
		}
		for i := range s.WeightedWaypoints {
			ww := &s.WeightedWaypoints[i]
			sd.WeightedWaypoints = append(sd.WeightedWaypoints, fmt.Sprintf("%s weight %d", &ww.Waypoint, ww.Weight))
		}
		for _, vip := range s.Families() {
			for _, ep := range s.Endpoints(vip) {
				at := ep.Addr.String()
				if ep.Unresolved() {
					at = ep.Workload.Hostname + " (unresolved)"
				}
				sd.Endpoints = append(sd.Endpoints, ep.Workload.String()+"@"+at)
			}
		}
		d.Services = append(d.Services, sd)
	}
	if n.svids != nil {
		for _, id := range n.svids.IDs() {
			if t, ok := n.svids.Expiry(id); ok {
				d.Certificates = append(d.Certificates, certificateDump{Identity: id.String(), Expiry: t})
			}
		}
	}
	d.MissingCertificates = []missingCert{}
	if n.certs != nil {
		d.MissingCertificates = n.certs.missing()
	}
	if n.px != nil {
		d.Connections = n.px.Open()
	}
	if n.cfg.Source != nil {
		d.Source = n.cfg.Source.SourceStatus()
	}
	if n.cls != nil {
		d.Flows = n.cls.Len()
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(d)
}

// readOnlyLogging is /logging on the TCP admin address: GET reads the
// levels; changing them is refused with where to do it.
func (n *node) readOnlyLogging(w http.ResponseWriter, r *http.Request) {
	// A POST that changes nothing (`istioctl ztunnel-config log` without
	// --level sends POST /logging?level=) is a read.
	q := r.URL.Query()
	noChange := (r.Method == http.MethodPost || r.Method == http.MethodPut) && q.Get("level") == "" && q.Get("access") == ""
	if r.Method != http.MethodGet && !noChange {
		msg := "the log levels are changed on the admin socket only (root): meshtun admin -X POST '/logging?level=…'"
		if n.cfg.AdminSocket != "" {
			msg += " (socket " + n.cfg.AdminSocket + ")"
		} else {
			msg += "; this node has none (listen.adminSocket is empty)"
		}
		http.Error(w, msg, http.StatusForbidden)
		return
	}
	n.logging(w, r)
}

// LogLevelChangedMessage is logged (level warn, whatever the log level)
// before a POST /logging applies.
const LogLevelChangedMessage = "log settings changed"

func clipQuery(s string) string {
	if len(s) > 64 {
		return s[:64] + "…"
	}
	return s
}

// parseLogLevels reads ?level= in meshtun's form (one level) and in
// ztunnel's, which istioctl ztunnel-config log sends: comma-separated
// items, each a level for every logger or <logger>:<level> (or =). meshtun
// has one level and the access log, so the only logger it takes is
// "access": its records are at info, as ztunnel's are, so access at
// trace, debug or info turns the access log on and at warn, error or off
// turns it off (access is then "on" or "off", else ""). A level for the
// node as a whole is trace, debug, info, warn or error (set true); "off"
// is refused there: the node's own warnings stay on record.
func parseLogLevels(arg string) (lvl zerolog.Level, set bool, access string, err error) {
	if arg == "" {
		return zerolog.NoLevel, false, "", nil
	}
	items := strings.Split(arg, ",")
	if len(items) > 8 {
		return zerolog.NoLevel, false, "", fmt.Errorf("level %q: at most 8 items", clipQuery(arg))
	}
	for _, it := range items {
		target, level, scoped := strings.Cut(it, ":")
		if !scoped {
			target, level, scoped = strings.Cut(it, "=")
		}
		if !scoped {
			target, level = "", it
		}
		switch level { // ztunnel's names istioctl may pass through
		case "warning":
			level = "warn"
		case "critical":
			level = "error"
		}
		switch target {
		case "":
			l, perr := zerolog.ParseLevel(level)
			if perr != nil || l < zerolog.TraceLevel || l > zerolog.ErrorLevel || level == "" {
				return zerolog.NoLevel, false, "", fmt.Errorf("level %q: want trace, debug, info, warn or error (or access:<level>)", clipQuery(it))
			}
			lvl, set = l, true
		case "access":
			switch level {
			case "trace", "debug", "info":
				access = "on"
			case "warn", "error", "off":
				access = "off"
			default:
				return zerolog.NoLevel, false, "", fmt.Errorf("level %q: want access:trace|debug|info (on) or access:warn|error|off (off)", clipQuery(it))
			}
		default:
			return zerolog.NoLevel, false, "", fmt.Errorf("level %q: logger %q unknown: meshtun has one level for the node and the access log (access:<level>)", clipQuery(it), clipQuery(target))
		}
	}
	if !set {
		lvl = zerolog.NoLevel
	}
	return lvl, set, access, nil
}

// logging reads (GET) or sets (POST, PUT) the log levels:
// ?level=trace|debug|info|warn|error sets the node's level, and
// ?access=on|off turns the access log on or off; ?level= also takes
// ztunnel's form (parseLogLevels).
func (n *node) logging(w http.ResponseWriter, r *http.Request) {
	switch r.Method {
	case http.MethodGet:
	case http.MethodPost, http.MethodPut:
		q := r.URL.Query()
		lvlArg, accessArg := q.Get("level"), q.Get("access")
		lvl, lvlSet, levelAccess, err := parseLogLevels(lvlArg)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		switch accessArg {
		case "", "on", "off":
		default:
			http.Error(w, fmt.Sprintf("access %q: want on or off", clipQuery(accessArg)), http.StatusBadRequest)
			return
		}
		if levelAccess != "" {
			if accessArg != "" && accessArg != levelAccess {
				http.Error(w, fmt.Sprintf("level %q and access %q disagree about the access log", clipQuery(lvlArg), accessArg), http.StatusBadRequest)
				return
			}
			accessArg = levelAccess
		}
		if !lvlSet {
			lvlArg = ""
		}
		if accessArg != "" && n.px == nil {
			http.Error(w, "no proxy running: the access log cannot be changed", http.StatusServiceUnavailable)
			return
		}
		if lvlArg == "" && accessArg == "" {
			break
		}
		// Logged before it applies, and whatever the level: a change that
		// silences the log is itself on record (with who made it).
		ev := n.log.WithLevel(zerolog.NoLevel).Str(zerolog.LevelFieldName, zerolog.WarnLevel.String()).
			Str("was_level", zerolog.GlobalLevel().String())
		if lvlArg != "" {
			ev = ev.Str("new_level", lvl.String())
		}
		if accessArg != "" {
			ev = ev.Str("access_log", accessArg)
		}
		if p, ok := peerOf(r.Context()); ok {
			ev = ev.Uint32("by_uid", p.Uid).Int32("by_pid", p.Pid)
		}
		ev.Msg(LogLevelChangedMessage)
		if lvlArg != "" {
			zerolog.SetGlobalLevel(lvl)
		}
		if accessArg != "" {
			n.px.SetAccessLog(accessArg == "on")
		}
	default:
		http.Error(w, "GET to read, POST ?level=…&access=on|off to set", http.StatusMethodNotAllowed)
		return
	}
	access := "off"
	if n.px != nil && n.px.AccessLog() {
		access = "on"
	}
	w.Header().Set("Content-Type", "application/json")
	json.NewEncoder(w).Encode(map[string]string{"level": zerolog.GlobalLevel().String(), "access": access})
}
