// Package xds builds the mesh model from Istio's control plane, istiod,
// the way ztunnel does: a delta xDS stream (Workload Discovery Service)
// over gRPC and TLS to istiod's :15012, authenticated with the node's
// service-account token, subscribed to the types
// type.googleapis.com/istio.workload.Address (workloads and services) and
// type.googleapis.com/istio.security.Authorization (L4 authorization
// policies, among them istiod's translation of PeerAuthentication).
//
// Every response is converted resource by resource, and the source keeps
// istiod's state as istiod last sent it, whatever it NACKs; the model is
// built from that state. A resource meshtun cannot apply (a waypoint it
// cannot reach, another network, an unknown extension…) is NACKed with a
// message naming it and fails closed: a workload of this node that
// meshtun refuses is captured and every connection to or from it denied
// (a workload of another node is left out), and an authorization policy
// it cannot apply (or that has fields it does not know) is replaced by a
// policy that denies every connection in its scope, since leaving it out
// would let in what it denies. Dry-run policies are evaluated and their
// matches logged, not enforced. Resources that do not hold together (a
// ServiceEntry VIP that is a pod's address, a WorkloadEntry on a pod's
// IP, which istiod does send) are resolved one by one by
// registry.Resolve, pods first, then by resource name, and only the
// losing resource is NACKed: a response, a full state in particular, is
// never refused whole. The stream is reopened with backoff when it
// breaks, and the model is kept meanwhile; the first response of each
// type on a new stream is the control plane's full state and replaces
// it.
//
// The result is a registry.Snapshot, delivered like the Kubernetes source
// delivers its own (Start, then Updates), so the proxy does not know where
// its model came from.
package xds

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/anypb"
	"istio.io/istio/pkg/workloadapi"
	"istio.io/istio/pkg/workloadapi/security"

	"github.com/meshtun/meshtun/mesh/metrics"
	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// The resource types of Istio's Workload Discovery Service.
const (
	AddressType       = "type.googleapis.com/istio.workload.Address"
	AuthorizationType = "type.googleapis.com/istio.security.Authorization"
)

// Types are the types the source subscribes to, in the order it does.
var Types = []string{AddressType, AuthorizationType}

// Node is who the node proxy is to istiod: the node ID and metadata
// ztunnel sends, which istiod checks against the token's identity.
type Node struct {
	// PodName, Namespace and ServiceAccount are the node proxy's own pod
	// (the DaemonSet's), its namespace and its service account.
	PodName, Namespace, ServiceAccount string
	// IP is the node proxy pod's address (the node's, with hostNetwork).
	IP netip.Addr
	// NodeName is the Kubernetes node.
	NodeName string
	// ClusterID is istiod's cluster name ("Kubernetes" by default).
	ClusterID string
	// Network is the node's network ("" by default).
	Network string
}

// ID returns the node ID ztunnel sends:
// ztunnel~<ip>~<pod>.<namespace>~<namespace>.svc.<domain suffix>.
func (n Node) ID(domainSuffix string) string {
	return fmt.Sprintf("ztunnel~%s~%s.%s~%s.svc.%s", n.IP, n.PodName, n.Namespace, n.Namespace, domainSuffix)
}

// Config configures a Source.
type Config struct {
	// Address is istiod's xDS address (host:port), as
	// istiod.istio-system.svc:15012.
	Address string
	// ServerName is the name istiod's certificate must carry; the host of
	// Address if empty.
	ServerName string
	// RootCertFile holds the PEM roots that verify istiod (the
	// istio-ca-root-cert ConfigMap, mounted); read on every connection.
	RootCertFile string
	// TokenFile holds the node's projected service-account token (audience
	// istio-ca), sent as "authorization: Bearer"; read on every connection.
	TokenFile string
	// Dial, if set, opens the connection to Address (tests).
	Dial func(ctx context.Context, addr string) (net.Conn, error)
	Node Node
	// TrustDomain, RootNamespace and DomainSuffix are the registry
	// model's (from the node's config file).
	TrustDomain   spiffeid.TrustDomain
	RootNamespace string
	DomainSuffix  string
	// PeerAuth is the mesh-wide default peer-authentication mode (istiod
	// sends STRICT PeerAuthentication as authorization policies).
	PeerAuth registry.PeerAuth
	// Policies are authorization policies from the config file, added to
	// every snapshot.
	Policies []*policy.Policy
	// MaxMessageSize bounds a response from istiod (DefaultMaxMessageSize
	// if zero): a full state comes in one, ~270 bytes per workload.
	MaxMessageSize int
	// MinBackoff and MaxBackoff bound the wait before reconnecting
	// (defaults 500ms and 30s).
	MinBackoff, MaxBackoff time.Duration
	Logger                 zerolog.Logger
}

// DefaultMaxMessageSize is Config.MaxMessageSize's default: 64 MiB,
// a full state of ~240,000 workloads (27 MB for 100,000 measured).
const DefaultMaxMessageSize = 64 << 20

// Status is what the source last did, for /config_dump.
type Status struct {
	// Source is "xds".
	Source string `json:"source"`
	// Address is istiod's.
	Address   string `json:"address"`
	Connected bool   `json:"connected"`
	// Connects counts the streams opened; Disconnects those that ended
	// and the attempts to open one that failed; LastDisconnect says why
	// the last one ended.
	Connects       int    `json:"connects"`
	Disconnects    int    `json:"disconnects"`
	LastDisconnect string `json:"lastDisconnect,omitempty"`
	// Built is when the last snapshot was built; Builds counts them.
	Built  time.Time `json:"built"`
	Builds int       `json:"builds"`
	// ACKs and NACKs count the responses answered; LastNACK is the last
	// NACK's message.
	ACKs     int    `json:"acks"`
	NACKs    int    `json:"nacks"`
	LastNACK string `json:"lastNack,omitempty"`
	// Workloads, Services and Policies count the model's (from istiod).
	Workloads int `json:"workloads"`
	Services  int `json:"services"`
	Policies  int `json:"policies"`
	// Conflicts counts the objects of istiod's state left out or trimmed
	// because they conflict with others (registry.Resolve); Refused the
	// workloads of this node captured and denied because meshtun refuses
	// them.
	Conflicts int `json:"conflicts"`
	Refused   int `json:"refused"`
	// Types is what each subscribed type's responses were, by type URL.
	Types map[string]TypeStatus `json:"types,omitempty"`
}

// TypeStatus is what istiod sent of one resource type, for the xDS
// health metrics (metrics.XDS).
type TypeStatus struct {
	// Responses and Bytes count the responses received and the bytes of
	// their resources (ztunnel's istio_xds_message_total and
	// istio_xds_message_bytes_total).
	Responses uint64 `json:"responses"`
	Bytes     uint64 `json:"bytes"`
	// ACKs and NACKs count the responses answered each way; LastACK and
	// LastNACK are when the last of each was sent.
	ACKs     uint64    `json:"acks"`
	NACKs    uint64    `json:"nacks"`
	LastACK  time.Time `json:"lastAck,omitzero"`
	LastNACK time.Time `json:"lastNack,omitzero"`
	// Resources is how many resources of the type the source holds (as
	// istiod sent them, whether applied or refused).
	Resources int `json:"resources"`
}

// Source follows istiod and builds snapshots of the mesh: a
// registry.Source.
type Source struct {
	registry.Mailbox // Updates: the snapshots built after Start's

	cfg   Config
	log   zerolog.Logger
	conv  converter
	first chan *registry.Snapshot

	mu       sync.Mutex
	st       state
	got      map[string]bool // types received at least once (for Start)
	started  bool            // the first snapshot went to Start
	status   Status
	enrolled map[registry.WorkloadRef]bool     // see Enroll
	probes   map[registry.WorkloadRef][]uint16 // see ProbePorts
	lost     map[string]string                 // resource → its conflict, as last built
	// built is the last snapshot built: the state's workloads are its
	// own where they are unchanged (see build).
	built *registry.Snapshot
}

// New returns a source; Start starts it.
func New(cfg Config) *Source {
	if cfg.RootNamespace == "" {
		cfg.RootNamespace = registry.DefaultRootNamespace
	}
	if cfg.DomainSuffix == "" {
		cfg.DomainSuffix = registry.DefaultDomainSuffix
	}
	if cfg.MaxMessageSize <= 0 {
		cfg.MaxMessageSize = DefaultMaxMessageSize
	}
	if cfg.MinBackoff <= 0 {
		cfg.MinBackoff = 500 * time.Millisecond
	}
	if cfg.MaxBackoff < cfg.MinBackoff {
		cfg.MaxBackoff = max(30*time.Second, cfg.MinBackoff)
	}
	if cfg.ServerName == "" {
		if h, _, err := net.SplitHostPort(cfg.Address); err == nil {
			cfg.ServerName = h
		}
	}
	return &Source{
		cfg: cfg, log: cfg.Logger.With().Str("source", "xds").Logger(),
		conv: converter{
			td: cfg.TrustDomain, network: cfg.Node.Network, root: cfg.RootNamespace, peer: cfg.PeerAuth,
		},
		first:  make(chan *registry.Snapshot, 1),
		st:     state{addrs: map[string]addrEntry{}, authz: map[string]authzEntry{}},
		got:    map[string]bool{},
		status: Status{Source: "xds", Address: cfg.Address},
	}
}

// Start connects to istiod and waits until it has sent every subscribed
// type once (or ctx ends), and returns the first snapshot. From then on,
// until ctx ends, every applied response produces a new snapshot on
// Updates; the source reconnects by itself.
func (s *Source) Start(ctx context.Context) (*registry.Snapshot, error) {
	if s.cfg.TrustDomain.IsZero() {
		return nil, errors.New("xds: no trust domain")
	}
	s.log.Info().Str("address", s.cfg.Address).Str("node", s.cfg.Node.ID(s.cfg.DomainSuffix)).Msg("connecting to istiod (delta xDS)")
	go s.run(ctx)
	select {
	case snap := <-s.first:
		return snap, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("xds: no model from %s: %w", s.cfg.Address, context.Cause(ctx))
	}
}

// Enroll marks workloads of this node (Node.NodeName) in the mesh before
// istiod does. istiod marks a pod HBONE only once its redirection
// annotation is set, and that annotation tells every peer to send it
// HBONE; so the pod must be captured first, as istio-cni has ztunnel take
// a pod before it annotates it. A workload in refs that istiod still
// sends as plaintext (TCP) is in the mesh in this node's snapshots: the
// node captures it, takes inbound HBONE for it and gets its certificate,
// while its peers still reach it in plaintext until istiod tells them
// otherwise. refs replaces the previous set; a new snapshot is published
// if the model has been received. Workloads of other nodes are left as
// istiod sends them.
func (s *Source) Enroll(refs map[registry.WorkloadRef]bool) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if maps.Equal(s.enrolled, refs) {
		return
	}
	s.enrolled = maps.Clone(refs)
	if !s.received() {
		return // Start gets the first model, with the set applied
	}
	snap, _, _, err := s.build(s.st) // apply logged the conflicts
	if err != nil {
		// Resolve leaves nothing Build refuses: a bug.
		s.log.Error().Err(err).Msg("cannot build the mesh model with this node's enrolled pods; keeping the last one")
		return
	}
	s.publish(snap, true)
}

// ProbePorts sets the health-probe ports of workloads of this node (from
// their pods, read from the Kubernetes API by the redirector). istiod's
// workloads carry none, and the kubelet's probes come from the node in
// plaintext: without them, a STRICT pod's probes would be refused and
// the pod would never be ready (ztunnel lets the node's own address
// through for the same reason). ports replaces the previous set; a new
// snapshot is published if the model has been received. Workloads of
// other nodes are left as istiod sends them.
func (s *Source) ProbePorts(ports map[registry.WorkloadRef][]uint16) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if maps.EqualFunc(s.probes, ports, slices.Equal) {
		return
	}
	s.probes = maps.Clone(ports)
	if !s.received() {
		return // Start gets the first model, with the ports applied
	}
	snap, _, _, err := s.build(s.st)
	if err != nil {
		s.log.Error().Err(err).Msg("cannot build the mesh model with this node's probe ports; keeping the last one")
		return
	}
	s.publish(snap, true)
}

// Status returns what the source last did.
func (s *Source) Status() Status {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.status
	st.Types = maps.Clone(st.Types)
	return st
}

// MetricsStats is the source's status as the xDS health metrics read it
// (metrics.XDS).
func (s *Source) MetricsStats() metrics.XDSStats {
	st := s.Status()
	m := metrics.XDSStats{Connected: st.Connected, Connects: uint64(st.Connects), Disconnects: uint64(st.Disconnects),
		Types: make(map[string]metrics.XDSType, len(st.Types))}
	for url, t := range st.Types {
		m.Types[url] = metrics.XDSType{Responses: t.Responses, Bytes: t.Bytes, ACKs: t.ACKs, NACKs: t.NACKs,
			LastACK: t.LastACK, LastNACK: t.LastNACK, Resources: t.Resources}
	}
	return m
}

// count records a response of typeURL whose resources hold n bytes, and
// its answer. s.mu is held.
func (s *Source) count(typeURL string, n int, nack bool, at time.Time) {
	if s.status.Types == nil {
		s.status.Types = make(map[string]TypeStatus, len(Types))
	}
	t := s.status.Types[typeURL]
	t.Responses++
	t.Bytes += uint64(n)
	if nack {
		t.NACKs++
		t.LastNACK = at
	} else {
		t.ACKs++
		t.LastACK = at
	}
	switch typeURL {
	case AddressType:
		t.Resources = len(s.st.addrs)
	case AuthorizationType:
		t.Resources = len(s.st.authz)
	}
	s.status.Types[typeURL] = t
}

var _ registry.Source = (*Source)(nil)

// SourceStatus returns Status (registry.Source).
func (s *Source) SourceStatus() any { return s.Status() }

func (s *Source) run(ctx context.Context) {
	backoff := s.cfg.MinBackoff
	for {
		start := time.Now()
		err := s.stream(ctx)
		if ctx.Err() != nil {
			return
		}
		s.mu.Lock()
		s.status.Connected = false
		s.status.Disconnects++
		s.status.LastDisconnect = err.Error()
		s.mu.Unlock()
		if time.Since(start) > s.cfg.MaxBackoff {
			backoff = s.cfg.MinBackoff // the stream lived: start over
		}
		s.log.Warn().Err(err).Dur("retry_in", backoff).Msg("istiod stream ended; keeping the model and reconnecting")
		select {
		case <-ctx.Done():
			return
		case <-time.After(backoff):
		}
		backoff = min(2*backoff, s.cfg.MaxBackoff)
	}
}

// received reports whether every subscribed type has arrived at least
// once: from then on the model is istiod's. s.mu is held.
func (s *Source) received() bool { return len(s.got) == len(Types) }

// publish delivers a snapshot: to Start the first time every type has
// been received, to Updates after. s.mu is held.
func (s *Source) publish(snap *registry.Snapshot, ready bool) {
	if !ready {
		return
	}
	if !s.started {
		s.started = true
		s.first <- snap
		return
	}
	s.Put(snap)
}

// response is one DeltaDiscoveryResponse's resources.
type response struct {
	typeURL string
	// full: the first response of its type on a stream, which replaces
	// the state of the type.
	full      bool
	resources []*discoveryv3.Resource
	removed   []string
}

// apply applies a response and returns the NACK message ("" for an
// ACK). The state always becomes what istiod sent, whatever is NACKed:
// a resource meshtun refuses is recorded as refused (a local workload is
// then captured and denied, a policy replaced by a deny-all one), and a
// NACK does not hold back the rest of the response, nor later full
// states. The model is built from the whole state; objects that conflict
// (a ServiceEntry VIP that is a pod's address, a WorkloadEntry on a pod's
// IP) are resolved one by one by registry.Resolve, and the NACK names the
// losing resources of this response.
func (s *Source) apply(r response) (nack string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	next := s.st.clone()
	if r.full {
		// The first response of a type on a stream is istiod's whole
		// state of it: what it no longer sends is gone.
		switch r.typeURL {
		case AddressType:
			next.addrs = make(map[string]addrEntry, len(r.resources))
		case AuthorizationType:
			next.authz = make(map[string]authzEntry, len(r.resources))
		}
	}
	var errs []string
	inResponse := make(map[string]bool, len(r.resources))
	for _, res := range r.resources {
		inResponse[res.Name] = true
		if err := s.convert(r.typeURL, res, next); err != nil {
			errs = append(errs, fmt.Sprintf("%s: %v", res.Name, err))
		}
	}
	for _, name := range r.removed {
		switch r.typeURL {
		case AddressType:
			delete(next.addrs, name)
		case AuthorizationType:
			delete(next.authz, name)
		}
	}
	s.st = next
	s.got[r.typeURL] = true
	ready := s.received()

	snap, conflicts, o, err := s.build(next)
	lost := make(map[string]string, len(conflicts))
	for _, c := range conflicts {
		var name string
		switch c.Kind {
		case registry.KindWorkload:
			name = o.workloads[c.Index]
		case registry.KindService:
			name = o.services[c.Index]
		default:
			name = "policy " + c.Name // the config file's or a converted one: cannot conflict
		}
		lost[name] = c.String()
		if inResponse[name] {
			errs = append(errs, fmt.Sprintf("%s: conflicts with another resource: %s", name, c))
		}
		// Logged when it starts (the loser or the winner is new); a
		// conflict that persists is not repeated on every update.
		if s.lost[name] != lost[name] {
			s.log.Warn().Str("resource", name).Str("conflict", lost[name]).Msg("istiod's resources conflict; resolved resource by resource")
		}
	}
	for name := range s.lost {
		if _, still := lost[name]; !still {
			s.log.Info().Str("resource", name).Msg("istiod's resource no longer conflicts")
		}
	}
	s.lost = lost
	s.status.Built = time.Now()
	s.status.Builds++
	s.status.Conflicts = len(conflicts)
	if err != nil {
		// Resolve leaves nothing Build refuses: a bug. The state is
		// istiod's all the same, so the next response builds from it.
		s.log.Error().Err(err).Str("type", r.typeURL).Msg("cannot build the mesh model from istiod's resources; keeping the last one")
		errs = append(errs, fmt.Sprintf("the model does not build: %v", err))
		return nackMessage(errs)
	}
	refused := 0
	for _, w := range snap.Workloads {
		if w.Refused != "" {
			refused++
		}
	}
	s.status.Workloads, s.status.Services = len(snap.Workloads), len(snap.Services)
	s.status.Policies = len(snap.Policies) - len(s.cfg.Policies)
	s.status.Refused = refused
	s.log.Info().Str("type", r.typeURL).Int("resources", len(r.resources)).Int("removed", len(r.removed)).Bool("full", r.full).
		Int("workloads", len(snap.Workloads)).Int("services", len(snap.Services)).Int("rejected", len(errs)).
		Int("conflicts", len(conflicts)).Int("refused_local", refused).Msg("applied istiod's update")
	s.publish(snap, ready)
	if len(errs) > 0 {
		for i, e := range errs {
			if i == maxNACKed {
				s.log.Error().Str("type", r.typeURL).Int("more", len(errs)-i).Msg("rejected: more resources")
				break
			}
			s.log.Error().Str("type", r.typeURL).Msg("rejected: " + e)
		}
		return nackMessage(errs)
	}
	return ""
}

// maxNACKed bounds the rejected resources a NACK message (and the log)
// names one by one: a full state can hold thousands.
const maxNACKed = 100

// nackMessage is a NACK's error_detail message for errs.
func nackMessage(errs []string) string {
	if len(errs) > maxNACKed {
		return "meshtun cannot apply: " + strings.Join(errs[:maxNACKed], "; ") +
			fmt.Sprintf("; and %d more", len(errs)-maxNACKed)
	}
	return "meshtun cannot apply: " + strings.Join(errs, "; ")
}

// build builds the snapshot of a state: its model, with conflicts
// resolved (registry.Resolve), and where each object came from. s.mu is
// held.
//
// The snapshot shares the workloads of the previous one that are
// unchanged (registry.Model.Reuse), and the state then holds the
// snapshot's workloads in place of its own: one copy of each workload
// is kept, and a rebuild copies only those that changed.
func (s *Source) build(st state) (*registry.Snapshot, []registry.Conflict, origin, error) {
	m, o := s.model(st)
	r, conflicts := registry.Resolve(m)
	r.Reuse = s.built
	snap, err := registry.Build(r)
	if err != nil {
		return snap, conflicts, o, err
	}
	s.built = snap
	// Resolve keeps m's workloads in order (dropping some, changing
	// none), and the snapshot has one for each it kept, in order.
	j := 0
	for i, w := range r.Workloads {
		for j < len(m.Workloads) && m.Workloads[j] != w {
			j++
		}
		if j == len(m.Workloads) {
			break // cannot happen (see above)
		}
		if e := st.addrs[o.workloads[j]]; e.w != nil && e.w.w == w {
			e.w.w = snap.Workloads[i] // not a copy model made for this node
		}
	}
	return snap, conflicts, o, err
}

// convert converts one resource into next, or returns why it cannot.
func (s *Source) convert(typeURL string, res *discoveryv3.Resource, next state) error {
	if res.Resource == nil {
		if e, ok := s.st.addrs[res.Name]; ok && typeURL == AddressType {
			next.addrs[res.Name] = e
		}
		if e, ok := s.st.authz[res.Name]; ok && typeURL == AuthorizationType {
			next.authz[res.Name] = e
		}
		return errors.New("resource without a body")
	}
	switch typeURL {
	case AddressType:
		var a workloadapi.Address
		if err := anypb.UnmarshalTo(res.Resource, &a, proto.UnmarshalOptions{}); err != nil {
			// Nothing of it is known: its previous version, if any,
			// stays (also across a full state).
			if e, ok := s.st.addrs[res.Name]; ok {
				next.addrs[res.Name] = e
			}
			return fmt.Errorf("not an istio.workload.Address: %w", err)
		}
		e := addrEntry{}
		switch {
		case a.GetWorkload() != nil:
			e.w, e.err = s.conv.workload(a.GetWorkload())
			if e.err != nil && e.w != nil {
				if w := e.w.w; w.InMesh && w.Node != "" && w.Node == s.cfg.Node.NodeName {
					s.log.Error().Str("resource", res.Name).Str("workload", w.String()).Str("reason", w.Refused).Err(e.err).
						Msg("refusing a workload of this node: it is captured and every connection to or from it is denied until istiod sends a version meshtun can apply")
				}
			}
		case a.GetService() != nil:
			e.s, e.err = s.conv.service(a.GetService())
		default:
			e.err = errors.New("address is neither a workload nor a service")
		}
		next.addrs[res.Name] = e
		return e.err
	case AuthorizationType:
		var a security.Authorization
		if err := anypb.UnmarshalTo(res.Resource, &a, proto.UnmarshalOptions{}); err != nil {
			// Not even its scope is known: the previous version, if
			// any, stays, also across a full state (a deny-all could
			// only guess where to apply).
			err = fmt.Errorf("not an istio.security.Authorization: %w", err)
			if e, ok := s.st.authz[res.Name]; ok {
				e.err = err
				next.authz[res.Name] = e
			}
			return err
		}
		p, err := s.conv.authorization(&a)
		switch {
		case err != nil && a.DryRun:
			// Not enforced anyway: leaving it out denies nothing more.
			next.authz[res.Name] = authzEntry{err: err}
			return fmt.Errorf("%w (a dry-run policy: not evaluated)", err)
		case err != nil:
			// Fail closed: the workloads it would apply to refuse every
			// connection until istiod sends a version meshtun can apply.
			next.authz[res.Name] = authzEntry{p: s.conv.denyAll(&a), err: err}
			return fmt.Errorf("%w (denying every connection in its scope instead)", err)
		}
		next.authz[res.Name] = authzEntry{p: p}
	default:
		return fmt.Errorf("unexpected type %s", typeURL)
	}
	return nil
}
