// Package kube builds the mesh model from a Kubernetes API server: pods
// become workloads, Services with their EndpointSlices become services, and
// Istio ambient's labels decide which pods are in the mesh. It watches the
// API server with client-go shared informers and delivers a new
// registry.Snapshot after every change, the same snapshot the config file
// builds, so the proxy does not know where its model came from.
//
// Enrollment follows Istio ambient: a pod is in the mesh when its
// namespace is labelled istio.io/dataplane-mode=ambient and the pod is not
// labelled istio.io/dataplane-mode=none. Pods of other namespaces are still
// workloads (known to services and policies, reached in plaintext).
// hostNetwork pods are never workloads: their addresses are the node's.
package kube

import (
	"context"
	"fmt"
	"net/netip"
	"slices"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/dynamic"
	listerscorev1 "k8s.io/client-go/listers/core/v1"
	listersdiscoveryv1 "k8s.io/client-go/listers/discovery/v1"
	"k8s.io/client-go/tools/cache"

	"github.com/meshtun/meshtun/mesh/kube/kubeapi"
	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// Istio ambient's enrollment label and its values.
const (
	DataplaneModeLabel = "istio.io/dataplane-mode"
	ModeAmbient        = "ambient"
	ModeNone           = "none"
)

// API is what the source and the Redirector use of the API server:
// kubeapi.Client on a real one. It is not client-go's clientset, whose
// scheme registers every built-in API group (see package kubeapi).
type API interface {
	// ListWatch lists and watches resource ("pods", "namespaces",
	// "services", "endpointslices") in all namespaces; tweak, if not nil,
	// adjusts every request's options.
	ListWatch(resource string, tweak func(*metav1.ListOptions)) cache.ListerWatcher
	// PatchPodStatus patches a pod through its status subresource (the
	// redirector's annotation; deploy/istio grants only pods/status).
	PatchPodStatus(ctx context.Context, namespace, name string, pt types.PatchType, data []byte) error
	// APIResources returns the resources served in groupVersion.
	APIResources(ctx context.Context, groupVersion string) (*metav1.APIResourceList, error)
}

// Config configures a Source.
type Config struct {
	// Client talks to the API server.
	Client API
	// Dynamic, if set, reads Istio's AuthorizationPolicy and
	// PeerAuthentication (security.istio.io/v1) when their CRDs are
	// installed (as Client's APIResources says); without it the CRDs are
	// not read.
	Dynamic dynamic.Interface
	// Node is this node's name (for status: which pods are local).
	Node string
	// TrustDomain, RootNamespace and DomainSuffix are the registry
	// model's (from the node's config file).
	TrustDomain   spiffeid.TrustDomain
	RootNamespace string
	DomainSuffix  string
	// PeerAuth is the mesh-wide default peer-authentication mode.
	PeerAuth registry.PeerAuth
	// Policies are authorization policies from the config file, added to
	// every snapshot.
	Policies []*policy.Policy
	// Resync is the informers' resync period; 0 means none.
	Resync time.Duration
	// Announced, if set, returns the addresses the CNI startup gate
	// announced for a pod of this node whose sandbox it is creating
	// (gate.Gate.Announced): such a pod is a workload with them, running
	// or pending, before the API server shows its IPs.
	Announced func(namespace, name, uid string) []netip.Addr
	// LocalAddress, if set, reports whether this node's own routes lead
	// address a to a pod's link here (tun.HostLinks): it is asked only
	// when pods of different nodes claim a, and a pod of this node wins
	// the address only if it says yes. Without it, a pod scheduled to
	// this node wins on that alone.
	LocalAddress func(a netip.Addr) bool
	Logger       zerolog.Logger
}

// Source watches the API server and builds snapshots of the mesh: a
// registry.Source.
type Source struct {
	registry.Mailbox // Updates: the snapshots built after Start's

	cfg     Config
	log     zerolog.Logger
	infs    []cache.SharedIndexInformer
	pods    listerscorev1.PodLister
	nss     listerscorev1.NamespaceLister
	svcs    listerscorev1.ServiceLister
	slices  listersdiscoveryv1.EndpointSliceLister
	synced  []cache.InformerSynced
	stopped func() // waits until the informers have stopped
	dirty   chan struct{}
	istio   *istio // nil without Config.Dynamic

	mu     sync.Mutex
	status Status
	last   map[string]string     // pod key → last logged skip reason / "captured"
	claims map[netip.Addr]string // contested address → last logged conflict
}

// Status is what the source last built, for /config_dump.
type Status struct {
	// Source is "kubernetes".
	Source string `json:"source"`
	// Built is when the last snapshot was built; Builds counts them.
	Built  time.Time `json:"built"`
	Builds int       `json:"builds"`
	// LastError is the last build failure (the previous model stays).
	LastError string `json:"lastError,omitempty"`
	// LocalPods are this node's pods: captured, or skipped and why.
	LocalPods []PodStatus `json:"localPods"`
	// Workloads and Services count the model's.
	Workloads int `json:"workloads"`
	Services  int `json:"services"`
}

// PodStatus is one pod of the node.
type PodStatus struct {
	Pod string `json:"pod"`
	// Mesh: the pod is a mesh workload (captured).
	Mesh bool `json:"mesh"`
	// Reason says why a pod is not in the mesh.
	Reason string `json:"reason,omitempty"`
}

// New returns a source; Start starts it.
func New(cfg Config) *Source {
	if cfg.RootNamespace == "" {
		cfg.RootNamespace = registry.DefaultRootNamespace
	}
	s := &Source{
		cfg: cfg, log: cfg.Logger.With().Str("source", "kubernetes").Logger(),
		dirty: make(chan struct{}, 1),
		last:  map[string]string{},
	}
	h := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { s.changed() },
		UpdateFunc: func(any, any) { s.changed() },
		DeleteFunc: func(any) { s.changed() },
	}
	pods := newInformer(cfg.Client.ListWatch("pods", nil), &corev1.Pod{}, cfg.Resync, transformPod)
	nss := newInformer(cfg.Client.ListWatch("namespaces", nil), &corev1.Namespace{}, cfg.Resync, transformNamespace)
	svcs := newInformer(cfg.Client.ListWatch("services", nil), &corev1.Service{}, cfg.Resync, transformService)
	slices := newInformer(cfg.Client.ListWatch("endpointslices", nil), &discoveryv1.EndpointSlice{}, cfg.Resync, transformEndpointSlice)
	s.infs = []cache.SharedIndexInformer{pods, nss, svcs, slices}
	for _, inf := range s.infs {
		inf.AddEventHandler(h)
		s.synced = append(s.synced, inf.HasSynced)
	}
	if cfg.Dynamic != nil {
		s.istio = &istio{dyn: cfg.Dynamic, api: cfg.Client}
	}
	s.pods = listerscorev1.NewPodLister(pods.GetIndexer())
	s.nss = listerscorev1.NewNamespaceLister(nss.GetIndexer())
	s.svcs = listerscorev1.NewServiceLister(svcs.GetIndexer())
	s.slices = listersdiscoveryv1.NewEndpointSliceLister(slices.GetIndexer())
	return s
}

// newInformer is an informer on lw's objects (like obj), indexed by
// namespace as client-go's informer factory indexes them, that caches
// them as transform trims them (transform.go).
func newInformer(lw cache.ListerWatcher, obj runtime.Object, resync time.Duration, transform cache.TransformFunc) cache.SharedIndexInformer {
	inf := cache.NewSharedIndexInformer(lw, obj, resync, cache.Indexers{cache.NamespaceIndex: cache.MetaNamespaceIndexFunc})
	if err := inf.SetTransform(transform); err != nil {
		panic(err) // only once started
	}
	return inf
}

// runInformers runs infs until ctx ends; the returned function waits
// until they have stopped.
func runInformers(ctx context.Context, infs ...cache.SharedIndexInformer) (wait func()) {
	var wg sync.WaitGroup
	for _, inf := range infs {
		wg.Go(func() { inf.RunWithContext(ctx) })
	}
	return wg.Wait
}

func (s *Source) changed() {
	select {
	case s.dirty <- struct{}{}:
	default:
	}
}

// Start starts the informers, waits until their caches hold the API
// server's state (or ctx ends) and returns the first snapshot. From then
// on, until ctx ends, every change produces a new snapshot on Updates;
// changes that arrive while one is built are folded into the next.
func (s *Source) Start(ctx context.Context) (*registry.Snapshot, error) {
	s.stopped = runInformers(ctx, s.infs...)
	s.log.Info().Msg("waiting for the API server's pods, namespaces, services and endpoint slices")
	synced := append(s.synced, s.startIstio(ctx)...)
	if !cache.WaitForCacheSync(ctx.Done(), synced...) {
		return nil, fmt.Errorf("kube: informers did not sync: %w", context.Cause(ctx))
	}
	// The first build sees everything synced so far.
	select {
	case <-s.dirty:
	default:
	}
	snap, err := s.Build()
	if err != nil {
		return nil, err
	}
	go s.run(ctx)
	return snap, nil
}

func (s *Source) run(ctx context.Context) {
	defer s.stopped()
	for {
		select {
		case <-ctx.Done():
			return
		case <-s.dirty:
		}
		snap, err := s.Build()
		if err != nil {
			continue // logged by Build; the last good model stays
		}
		s.Put(snap)
	}
}

// Status returns what the last build saw.
func (s *Source) Status() Status {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := s.status
	st.LocalPods = slices.Clone(st.LocalPods)
	return st
}

var _ registry.Source = (*Source)(nil)

// SourceStatus returns Status (registry.Source).
func (s *Source) SourceStatus() any { return s.Status() }

// Build builds a snapshot from the informers' caches.
func (s *Source) Build() (*registry.Snapshot, error) {
	m, local, claims, err := s.model()
	var snap *registry.Snapshot
	if err == nil {
		// model resolves pods' and services' address conflicts itself,
		// to tell each local pod why it is out; the registry's resolver
		// (the xDS source's) takes whatever else would keep the whole
		// model from building, one object at a time.
		var conflicts []registry.Conflict
		m, conflicts = registry.Resolve(m)
		for _, c := range conflicts {
			s.log.Warn().Str("conflict", c.String()).Msg("left out of the mesh model: it conflicts with another object")
		}
		snap, err = registry.Build(m)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.status.Source = "kubernetes"
	s.status.Built = time.Now()
	s.status.Builds++
	if err != nil {
		s.status.LastError = err.Error()
		s.log.Error().Err(err).Msg("cannot build the mesh model; keeping the last good one")
		return nil, err
	}
	s.status.LastError = ""
	s.status.LocalPods = local
	s.status.Workloads = len(m.Workloads)
	s.status.Services = len(m.Services)
	s.logChanges(local)
	s.logClaims(claims)
	return snap, nil
}

// logChanges logs each local pod whose capture state changed since the
// last build, once.
func (s *Source) logChanges(local []PodStatus) {
	seen := make(map[string]bool, len(local))
	for _, p := range local {
		seen[p.Pod] = true
		state := "captured"
		if !p.Mesh {
			state = p.Reason
		}
		if s.last[p.Pod] == state {
			continue
		}
		s.last[p.Pod] = state
		if p.Mesh {
			s.log.Info().Str("pod", p.Pod).Msg("pod in the mesh")
		} else {
			s.log.Info().Str("pod", p.Pod).Str("reason", p.Reason).Msg("pod not in the mesh")
		}
	}
	for k := range s.last {
		if !seen[k] {
			delete(s.last, k)
			s.log.Info().Str("pod", k).Msg("pod gone from this node")
		}
	}
}

// logClaims logs each address claimed by more than one pod when its
// conflict appears or changes, and when it ends.
func (s *Source) logClaims(claims map[netip.Addr]string) {
	for a, c := range claims {
		if s.claims[a] == c {
			continue
		}
		s.log.Warn().Str("address", a.String()).Str("conflict", c).Msg("pods claim the same address")
	}
	for a := range s.claims {
		if _, still := claims[a]; !still {
			s.log.Info().Str("address", a.String()).Msg("address no longer claimed by more than one pod")
		}
	}
	s.claims = claims
}

// model builds the registry model from the caches, and the status of this
// node's pods.
func (s *Source) model() (registry.Model, []PodStatus, map[netip.Addr]string, error) {
	m := registry.Model{
		TrustDomain: s.cfg.TrustDomain, RootNamespace: s.cfg.RootNamespace,
		DomainSuffix: s.cfg.DomainSuffix,
		Policies:     append(slices.Clone(s.cfg.Policies), s.policies()...),
	}
	pa := s.peerAuthIndex()
	nsList, err := s.nss.List(labels.Everything())
	if err != nil {
		return m, nil, nil, err
	}
	enrolled := make(map[string]bool, len(nsList))
	for _, ns := range nsList {
		enrolled[ns.Name] = ns.Labels[DataplaneModeLabel] == ModeAmbient
	}
	pods, err := s.pods.List(labels.Everything())
	if err != nil {
		return m, nil, nil, err
	}
	// Oldest first: when two pods of one node claim an address (a deleted
	// pod not yet gone and a new one with its IP), the order decides, the
	// same way on every node (resolveClaims).
	sort.Slice(pods, func(i, j int) bool {
		a, b := pods[i], pods[j]
		if !a.CreationTimestamp.Equal(&b.CreationTimestamp) {
			return a.CreationTimestamp.Before(&b.CreationTimestamp)
		}
		return a.Namespace+"/"+a.Name < b.Namespace+"/"+b.Name
	})
	cands := make([]claimant, 0, len(pods))
	for _, p := range pods {
		c := claimant{p: p, key: p.Namespace + "/" + p.Name, local: p.Spec.NodeName == s.cfg.Node && !p.Spec.HostNetwork}
		var announced []netip.Addr
		if s.cfg.Announced != nil && c.local {
			announced = s.cfg.Announced(p.Namespace, p.Name, string(p.UID))
		}
		c.w, c.reason = s.workload(p, enrolled, pa, announced)
		cands = append(cands, c)
	}
	denied, claims := s.resolveClaims(cands)
	var local []PodStatus
	owner := map[netip.Addr]string{}
	byPod := map[registry.WorkloadRef]*registry.Workload{}
	for _, c := range cands {
		p, w := c.p, c.w
		if c.local {
			ps := PodStatus{Pod: c.key, Mesh: w != nil && w.InMesh && w.Refused == "", Reason: c.reason}
			if w != nil && !w.InMesh {
				ps.Reason = notInMeshReason(p, enrolled[p.Namespace])
			}
			local = append(local, ps)
		}
		if w == nil {
			continue
		}
		for _, a := range w.Addresses {
			owner[a] = c.key
		}
		m.Workloads = append(m.Workloads, w)
		if w.Refused == "" {
			byPod[registry.WorkloadRef{Namespace: w.Namespace, Name: w.Name}] = w
		}
	}
	for _, w := range denied {
		owner[w.Addresses[0]] = w.Name
		m.Workloads = append(m.Workloads, w)
	}
	svcs, err := s.svcs.List(labels.Everything())
	if err != nil {
		return m, nil, nil, err
	}
	sort.Slice(svcs, func(i, j int) bool {
		return svcs[i].Namespace+"/"+svcs[i].Name < svcs[j].Namespace+"/"+svcs[j].Name
	})
	vipOwner := map[netip.Addr]string{}
	for _, svc := range svcs {
		rs := s.service(svc, byPod, owner, vipOwner)
		if rs == nil {
			continue
		}
		for _, v := range rs.VIPs {
			vipOwner[v] = svc.Namespace + "/" + svc.Name
		}
		m.Services = append(m.Services, rs)
	}
	return m, local, claims, nil
}

// Enrolled reports whether pod p is enrolled in the ambient mesh by its
// labels, nsEnrolled being whether its namespace is labelled
// istio.io/dataplane-mode=ambient: Istio's rule, the pod's own label
// first (ambient enrolls it in any namespace, none opts it out), then
// the namespace's. The one rule of the Kubernetes source and of the
// redirector under istiod.
func Enrolled(p *corev1.Pod, nsEnrolled bool) bool {
	switch p.Labels[DataplaneModeLabel] {
	case ModeNone:
		return false
	case ModeAmbient:
		return true
	}
	return nsEnrolled
}

// notInMeshReason says why a workload pod is not in the mesh.
func notInMeshReason(p *corev1.Pod, nsEnrolled bool) string {
	if p.Labels[DataplaneModeLabel] == ModeNone {
		return "pod labelled " + DataplaneModeLabel + "=" + ModeNone
	}
	if !nsEnrolled {
		return "neither pod nor namespace labelled " + DataplaneModeLabel + "=" + ModeAmbient
	}
	return "not enrolled"
}

// workload returns the workload of pod p, or nil and why not. announced
// are the addresses the CNI startup gate announced for it: with them a
// pending pod is a workload too (its init containers run captured), with
// them as its addresses while its status has none.
func (s *Source) workload(p *corev1.Pod, enrolled map[string]bool, pa *peerAuthIndex, announced []netip.Addr) (*registry.Workload, string) {
	if p.Spec.HostNetwork {
		return nil, "hostNetwork"
	}
	// Only live pods (the certificate service's rule too, so that it
	// grants what the model holds), and of those the running ones and the
	// pending ones the gate announced: another pending pod has no address
	// to capture yet.
	if live, why := kubeapi.PodLive(p); !live {
		return nil, why
	}
	if p.Status.Phase != corev1.PodRunning && !(p.Status.Phase == corev1.PodPending && len(announced) > 0) {
		return nil, "phase " + string(p.Status.Phase)
	}
	w := &registry.Workload{
		Name: p.Name, Namespace: p.Namespace, ServiceAccount: p.Spec.ServiceAccountName,
		Node: p.Spec.NodeName, Labels: p.Labels,
		InMesh: Enrolled(p, enrolled[p.Namespace]),
		Health: registry.Unhealthy,
	}
	ips := p.Status.PodIPs
	if len(ips) == 0 && p.Status.PodIP != "" {
		ips = []corev1.PodIP{{IP: p.Status.PodIP}}
	}
	if len(ips) == 0 {
		for _, a := range announced {
			ips = append(ips, corev1.PodIP{IP: a.String()})
		}
	}
	for _, ip := range ips {
		a, err := netip.ParseAddr(ip.IP)
		if err != nil {
			s.log.Warn().Str("pod", p.Namespace+"/"+p.Name).Str("ip", ip.IP).Msg("pod IP is not an IP address; ignored")
			continue
		}
		a = a.Unmap()
		if slices.Contains(w.Addresses, a) {
			continue
		}
		w.Addresses = append(w.Addresses, a)
	}
	if len(w.Addresses) == 0 {
		return nil, "no pod IP yet"
	}
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady && c.Status == corev1.ConditionTrue {
			w.Health = registry.Healthy
		}
	}
	w.ProbePorts = probePorts(p)
	pa.apply(w)
	if n, dropped := p.Annotations[labelsDroppedAnnotation]; dropped {
		// Its policies cannot be known: captured (if local) and denied.
		w.Labels = nil
		w.Refused = RefusedLabelsTooLarge
		return w, "labels of " + n + " bytes, over " + strconv.Itoa(MaxPodLabelBytes) + ": refused"
	}
	return w, ""
}

// probePorts returns the ports of the pod's readiness, liveness and
// startup probes (HTTP, TCP and gRPC; named ports resolved by the
// container's ports), which the kubelet reaches from the node.
func probePorts(p *corev1.Pod) []uint16 {
	var out []uint16
	add := func(port uint16) {
		if port != 0 && !slices.Contains(out, port) {
			out = append(out, port)
		}
	}
	for _, c := range slices.Concat(p.Spec.InitContainers, p.Spec.Containers) {
		for _, pr := range []*corev1.Probe{c.ReadinessProbe, c.LivenessProbe, c.StartupProbe} {
			if pr == nil {
				continue
			}
			switch {
			case pr.HTTPGet != nil:
				add(containerPort(c, pr.HTTPGet.Port))
			case pr.TCPSocket != nil:
				add(containerPort(c, pr.TCPSocket.Port))
			case pr.GRPC != nil:
				add(uint16(pr.GRPC.Port))
			}
		}
	}
	slices.Sort(out)
	return out
}

// containerPort resolves a probe's port, by number or by the name of one
// of c's ports; 0 if it names none.
func containerPort(c corev1.Container, port intstr.IntOrString) uint16 {
	if port.Type == intstr.Int {
		return uint16(port.IntVal)
	}
	for _, cp := range c.Ports {
		if cp.Name == port.StrVal {
			return uint16(cp.ContainerPort)
		}
	}
	return 0
}

// service returns the registry service of svc with its ready endpoints
// from its EndpointSlices, or nil for a service the mesh does not handle
// (headless, ExternalName, no cluster IP).
func (s *Source) service(svc *corev1.Service, byPod map[registry.WorkloadRef]*registry.Workload, owner map[netip.Addr]string, vipOwner map[netip.Addr]string) *registry.Service {
	if svc.Spec.Type == corev1.ServiceTypeExternalName {
		return nil
	}
	key := svc.Namespace + "/" + svc.Name
	rs := &registry.Service{
		Name: svc.Name, Namespace: svc.Namespace,
		PreferSameNode: svc.Spec.TrafficDistribution != nil && *svc.Spec.TrafficDistribution == corev1.ServiceTrafficDistributionPreferSameNode,
	}
	if p := svc.Spec.InternalTrafficPolicy; p != nil && *p == corev1.ServiceInternalTrafficPolicyLocal {
		// Only the client's node's endpoints, as kube-proxy and istiod
		// (STRICT on NODE) do; none there, the connection is refused.
		rs.LB = registry.LoadBalancing{Mode: registry.LBStrict, Scopes: []registry.Scope{registry.ScopeNode}}
	}
	ips := svc.Spec.ClusterIPs
	if len(ips) == 0 && svc.Spec.ClusterIP != "" {
		ips = []string{svc.Spec.ClusterIP}
	}
	for _, ip := range ips {
		if ip == corev1.ClusterIPNone {
			return nil
		}
		a, err := netip.ParseAddr(ip)
		if err != nil {
			s.log.Warn().Str("service", key).Str("ip", ip).Msg("cluster IP is not an IP address; ignored")
			continue
		}
		a = a.Unmap()
		if o, ok := owner[a]; ok {
			s.log.Warn().Str("service", key).Str("ip", a.String()).Str("pod", o).Msg("cluster IP is a pod's address; ignored")
			continue
		}
		if o, ok := vipOwner[a]; ok {
			s.log.Warn().Str("service", key).Str("ip", a.String()).Str("other", o).Msg("cluster IP of two services; ignored")
			continue
		}
		rs.VIPs = append(rs.VIPs, a)
	}
	if len(rs.VIPs) == 0 {
		return nil
	}
	slices, err := s.slices.EndpointSlices(svc.Namespace).List(labels.SelectorFromSet(labels.Set{discoveryv1.LabelServiceName: svc.Name}))
	if err != nil {
		return nil
	}
	sort.Slice(slices, func(i, j int) bool { return slices[i].Name < slices[j].Name })
	members := map[registry.WorkloadRef]bool{}
	for _, sp := range svc.Spec.Ports {
		if sp.Protocol != "" && sp.Protocol != corev1.ProtocolTCP {
			continue
		}
		p := registry.ServicePort{Name: sp.Name, Port: uint16(sp.Port), TargetPort: targetPort(sp, slices, key, s.log)}
		if p.Port == 0 {
			continue
		}
		rs.Ports = append(rs.Ports, p)
	}
	for _, sl := range slices {
		for _, ep := range sl.Endpoints {
			if ep.Conditions.Ready != nil && !*ep.Conditions.Ready {
				continue
			}
			if ep.TargetRef == nil || ep.TargetRef.Kind != "Pod" {
				continue // not a pod: the mesh has no workload for it
			}
			ns := ep.TargetRef.Namespace
			if ns == "" {
				ns = svc.Namespace
			}
			ref := registry.WorkloadRef{Namespace: ns, Name: ep.TargetRef.Name}
			if byPod[ref] == nil || members[ref] {
				continue
			}
			members[ref] = true
			rs.Workloads = append(rs.Workloads, ref)
		}
	}
	return rs
}

// targetPort resolves a service port's target: a number as is, a name by
// the EndpointSlices (which carry, per slice, the port the name resolves
// to on its endpoints). 0 means the service port.
//
// TODO: the registry holds one target port per service port; endpoints
// whose pods resolve a name to different numbers get the first slice's.
func targetPort(sp corev1.ServicePort, slices []*discoveryv1.EndpointSlice, svc string, log zerolog.Logger) uint16 {
	if sp.TargetPort.IntVal != 0 {
		return uint16(sp.TargetPort.IntVal)
	}
	if sp.TargetPort.StrVal == "" {
		return 0
	}
	if n, err := strconv.Atoi(sp.TargetPort.StrVal); err == nil {
		return uint16(n)
	}
	var found uint16
	for _, sl := range slices {
		for _, p := range sl.Ports {
			if p.Name == nil || *p.Name != sp.Name || p.Port == nil {
				continue
			}
			n := uint16(*p.Port)
			if found != 0 && n != found {
				log.Warn().Str("service", svc).Str("port", sp.Name).Msg("a named target port resolves to different ports on different endpoints; using the first")
				return found
			}
			found = n
		}
	}
	return found
}
