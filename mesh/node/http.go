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
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// serveHTTP starts the node's HTTP endpoints (admin, metrics, readiness)
// on their configured addresses and returns a function that stops them.
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
	for _, ep := range []struct {
		name, addr string
		handler    http.Handler
	}{
		{"admin", n.cfg.AdminAddr, n.adminMux()},
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
		srv := &http.Server{Handler: ep.handler, ReadHeaderTimeout: 10 * time.Second}
		servers = append(servers, srv)
		go func() {
			if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
				n.log.Error().Err(err).Str("addr", ep.addr).Msg(ep.name + " server stopped")
			}
		}()
		n.log.Debug().Str("addr", ln.Addr().String()).Msg(ep.name + " server listening")
	}
	return stop, nil
}

// readiness answers /healthz/ready: 200 once the TUN is up, routing
// installed, the registry loaded and the local certificates issued; 503
// before that, while draining, and when no local workload holds a valid
// certificate any more (renewals failed until every one expired). Failing
// renewals alone do not make the node unready: it keeps serving with the
// certificates it has (see the meshtun_certificates_* metrics).
func (n *node) readiness(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/healthz/ready" {
		http.NotFound(w, r)
		return
	}
	if !n.ready.Load() {
		http.Error(w, "not ready", http.StatusServiceUnavailable)
		return
	}
	if st := n.svids.Stats(); st.Total > 0 && st.Valid == 0 {
		http.Error(w, fmt.Sprintf("not ready: none of the %d local workloads holds a valid certificate (%d renewals failing)", st.Total, st.Failing), http.StatusServiceUnavailable)
		return
	}
	w.Write([]byte("ready\n"))
}

func (n *node) adminMux() *http.ServeMux {
	mux := http.NewServeMux()
	mux.HandleFunc("/config_dump", n.configDump)
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
}

type serviceDump struct {
	Name      string                 `json:"name"`
	Namespace string                 `json:"namespace"`
	Hostname  string                 `json:"hostname"`
	VIPs      []netip.Addr           `json:"vips"`
	Ports     []registry.ServicePort `json:"ports"`
	Endpoints []string               `json:"endpoints"`
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
		for port, m := range wl.PortPeerAuth {
			if wd.PortPeerAuthentication == nil {
				wd.PortPeerAuthentication = make(map[uint16]string, len(wl.PortPeerAuth))
			}
			wd.PortPeerAuthentication[port] = m.String()
		}
		if wl.InMesh {
			wd.Identity = wl.Identity.String()
		}
		d.Workloads = append(d.Workloads, wd)
	}
	for _, s := range snap.Services {
		sd := serviceDump{Name: s.Name, Namespace: s.Namespace, Hostname: s.Hostname, VIPs: s.VIPs, Ports: s.Ports, Endpoints: []string{}}
		for _, vip := range s.VIPs {
			for _, ep := range s.Endpoints(vip) {
				sd.Endpoints = append(sd.Endpoints, ep.Workload.String()+"@"+ep.Addr.String())
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
	if n.px != nil {
		d.Connections = n.px.Open()
	}
	if n.cfg.Status != nil {
		d.Source = n.cfg.Status()
	}
	if n.cls != nil {
		d.Flows = n.cls.Len()
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(d)
}

// logging reads (GET) or sets (POST, PUT) the log levels:
// ?level=trace|debug|info|warn|error sets the node's level, and
// ?access=on|off turns the access log on or off.
func (n *node) logging(w http.ResponseWriter, r *http.Request) {
	switch r.Method {
	case http.MethodGet:
	case http.MethodPost, http.MethodPut:
		q := r.URL.Query()
		if v := q.Get("level"); v != "" {
			lvl, err := zerolog.ParseLevel(v)
			if err != nil || v == "" {
				http.Error(w, fmt.Sprintf("level %q: want trace, debug, info, warn or error", v), http.StatusBadRequest)
				return
			}
			zerolog.SetGlobalLevel(lvl)
			n.log.Warn().Str("level", lvl.String()).Msg("log level changed")
		}
		if v := q.Get("access"); v != "" {
			switch v {
			case "on", "off":
				n.px.SetAccessLog(v == "on")
			default:
				http.Error(w, fmt.Sprintf("access %q: want on or off", v), http.StatusBadRequest)
				return
			}
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
