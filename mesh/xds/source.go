// Package xds builds the mesh model from Istio's control plane, istiod,
// the way ztunnel does: a delta xDS stream (Workload Discovery Service)
// over gRPC and TLS to istiod's :15012, authenticated with the node's
// service-account token, subscribed to the types
// type.googleapis.com/istio.workload.Address (workloads and services) and
// type.googleapis.com/istio.security.Authorization (L4 authorization
// policies, among them istiod's translation of PeerAuthentication).
//
// Every response is converted resource by resource: what meshtun can
// honour is applied and ACKed; a resource it cannot apply (a waypoint it
// would bypass, another network, an unknown extension…) is NACKed with a
// message naming it, its previous version (if any) stays, and the rest of
// the response still applies. An authorization policy it cannot apply is
// the exception: it is replaced by a policy that denies every connection
// in its scope (fail closed), since leaving it out would let in what it
// denies. A response whose resources together do not
// make a valid model (two workloads on one address) is NACKed whole and
// the last good model stays. The stream is reopened with backoff when it
// breaks, and the model is kept meanwhile; the first response of each type
// on a new stream is the control plane's full state and replaces it.
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
	// MinBackoff and MaxBackoff bound the wait before reconnecting
	// (defaults 500ms and 30s).
	MinBackoff, MaxBackoff time.Duration
	Logger                 zerolog.Logger
}

// Status is what the source last did, for /config_dump.
type Status struct {
	// Source is "xds".
	Source string `json:"source"`
	// Address is istiod's.
	Address   string `json:"address"`
	Connected bool   `json:"connected"`
	// Connects counts the streams opened; LastDisconnect says why the
	// last one ended.
	Connects       int    `json:"connects"`
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
}

// Source follows istiod and builds snapshots of the mesh.
type Source struct {
	cfg     Config
	log     zerolog.Logger
	conv    converter
	updates chan *registry.Snapshot
	first   chan *registry.Snapshot

	mu       sync.Mutex
	st       state
	got      map[string]bool // types received at least once (for Start)
	started  bool            // the first snapshot went to Start
	status   Status
	enrolled map[registry.WorkloadRef]bool // see Enroll
}

// New returns a source; Start starts it.
func New(cfg Config) *Source {
	if cfg.RootNamespace == "" {
		cfg.RootNamespace = registry.DefaultRootNamespace
	}
	if cfg.DomainSuffix == "" {
		cfg.DomainSuffix = registry.DefaultDomainSuffix
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
		updates: make(chan *registry.Snapshot, 1),
		first:   make(chan *registry.Snapshot, 1),
		st:      state{addrs: map[string]addrEntry{}, authz: map[string]authzEntry{}},
		got:     map[string]bool{},
		status:  Status{Source: "xds", Address: cfg.Address},
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
	snap, err := registry.Build(s.model(s.st))
	if err != nil {
		// The same resources built before: only InMesh changed.
		s.log.Error().Err(err).Msg("cannot build the mesh model with this node's enrolled pods; keeping the last one")
		return
	}
	s.publish(snap, true)
}

// Updates delivers the snapshots built after Start's. Only the newest
// matters: an unread one is replaced.
func (s *Source) Updates() <-chan *registry.Snapshot { return s.updates }

// Status returns what the source last did.
func (s *Source) Status() Status {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.status
}

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
	select { // replace an unread snapshot
	case <-s.updates:
	default:
	}
	s.updates <- snap
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

// apply applies a response: it converts each resource, builds the model
// with the ones that convert, and returns the NACK message ("" for an
// ACK). The state changes only if the model builds.
func (s *Source) apply(r response) (nack string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	next := s.st.clone()
	var errs []string
	if r.full {
		switch r.typeURL {
		case AddressType:
			// Resources that fail below keep their last good version;
			// the ones the control plane no longer sends are gone.
			keep := next.addrs
			next.addrs = map[string]addrEntry{}
			for _, res := range r.resources {
				if e, ok := keep[res.Name]; ok {
					next.addrs[res.Name] = e
				}
			}
		case AuthorizationType:
			keep := next.authz
			next.authz = map[string]authzEntry{}
			for _, res := range r.resources {
				if e, ok := keep[res.Name]; ok {
					next.authz[res.Name] = e
				}
			}
		}
	}
	for _, res := range r.resources {
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
	m := s.model(next)
	snap, err := registry.Build(m)
	s.status.Built = time.Now()
	s.status.Builds++
	if err != nil {
		msg := fmt.Sprintf("the model does not build, keeping the last good one: %v", err)
		s.log.Error().Err(err).Str("type", r.typeURL).Msg("cannot build the mesh model from istiod's resources; keeping the last good one")
		return msg
	}
	s.st = next
	s.got[r.typeURL] = true
	ready := s.received()
	s.status.Workloads, s.status.Services = len(m.Workloads), len(m.Services)
	s.status.Policies = len(m.Policies) - len(s.cfg.Policies)
	s.log.Info().Str("type", r.typeURL).Int("resources", len(r.resources)).Int("removed", len(r.removed)).Bool("full", r.full).
		Int("workloads", len(m.Workloads)).Int("services", len(m.Services)).Int("rejected", len(errs)).Msg("applied istiod's update")
	s.publish(snap, ready)
	if len(errs) > 0 {
		for _, e := range errs {
			s.log.Error().Str("type", r.typeURL).Msg("rejected: " + e)
		}
		return "meshtun cannot apply: " + strings.Join(errs, "; ")
	}
	return ""
}

// convert converts one resource into next, or returns why it cannot.
func (s *Source) convert(typeURL string, res *discoveryv3.Resource, next state) error {
	if res.Resource == nil {
		return errors.New("resource without a body")
	}
	switch typeURL {
	case AddressType:
		var a workloadapi.Address
		if err := anypb.UnmarshalTo(res.Resource, &a, proto.UnmarshalOptions{}); err != nil {
			return fmt.Errorf("not an istio.workload.Address: %w", err)
		}
		e := addrEntry{version: res.Version}
		switch {
		case a.GetWorkload() != nil:
			w, err := s.conv.workload(a.GetWorkload())
			if err != nil {
				return err
			}
			e.w = w
		case a.GetService() != nil:
			svc, err := s.conv.service(a.GetService())
			if err != nil {
				return err
			}
			e.s = svc
		default:
			return errors.New("address is neither a workload nor a service")
		}
		next.addrs[res.Name] = e
	case AuthorizationType:
		var a security.Authorization
		if err := anypb.UnmarshalTo(res.Resource, &a, proto.UnmarshalOptions{}); err != nil {
			return fmt.Errorf("not an istio.security.Authorization: %w", err)
		}
		p, err := s.conv.authorization(&a)
		if err != nil {
			// Fail closed: the workloads it would apply to refuse every
			// connection until istiod sends a version meshtun can apply.
			next.authz[res.Name] = authzEntry{version: res.Version, p: s.conv.denyAll(&a)}
			return fmt.Errorf("%w (denying every connection in its scope instead)", err)
		}
		next.authz[res.Name] = authzEntry{version: res.Version, p: p}
	default:
		return fmt.Errorf("unexpected type %s", typeURL)
	}
	return nil
}
