package kube

import (
	"context"
	"encoding/json"
	"sort"
	"strconv"
	"sync"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/cache"

	"github.com/meshtun/meshtun/mesh/config"
	"github.com/meshtun/meshtun/mesh/policy"
	"github.com/meshtun/meshtun/mesh/registry"
)

// Istio's security API, read when its CRDs are installed.
var (
	IstioSecurity         = schema.GroupVersion{Group: "security.istio.io", Version: "v1"}
	AuthorizationPolicies = IstioSecurity.WithResource("authorizationpolicies")
	PeerAuthentications   = IstioSecurity.WithResource("peerauthentications")
)

// istioPollInterval is how often the source looks for Istio's CRDs while
// they are not installed.
const istioPollInterval = 10 * time.Second

// istio holds the informers on Istio's policy CRDs, once they exist.
type istio struct {
	dyn dynamic.Interface
	api API

	mu     sync.Mutex
	aps    cache.GenericLister // nil until the CRDs are found
	pas    cache.GenericLister
	parsed map[types.UID]parsedPolicy // by UID, valid for one resourceVersion
}

type parsedPolicy struct {
	version  string
	policies []*policy.Policy
}

// installed reports whether the API server serves both Istio resources.
func (is *istio) installed(ctx context.Context) bool {
	rl, err := is.api.APIResources(ctx, IstioSecurity.String())
	if err != nil || rl == nil {
		return false
	}
	n := 0
	for _, r := range rl.APIResources {
		if r.Name == AuthorizationPolicies.Resource || r.Name == PeerAuthentications.Resource {
			n++
		}
	}
	return n == 2
}

// startIstio starts the informers on Istio's CRDs if they are installed
// and returns their HasSynced (the first snapshot waits for them: a policy
// that exists must be enforced from the start). Otherwise it logs once and
// looks for them every istioPollInterval in the background, starting the
// informers when they appear.
func (s *Source) startIstio(ctx context.Context) []cache.InformerSynced {
	is := s.istio
	if is == nil {
		return nil
	}
	if is.installed(ctx) {
		return s.watchIstio(ctx)
	}
	s.log.Info().Str("group", IstioSecurity.String()).
		Msg("Istio's AuthorizationPolicy and PeerAuthentication CRDs are not installed; watching for them to appear")
	go func() {
		t := time.NewTicker(istioPollInterval)
		defer t.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-t.C:
			}
			if is.installed(ctx) {
				s.log.Info().Str("group", IstioSecurity.String()).Msg("Istio's policy CRDs appeared; watching them")
				s.watchIstio(ctx)
				return
			}
		}
	}()
	return nil
}

func (s *Source) watchIstio(ctx context.Context) []cache.InformerSynced {
	is := s.istio
	ap, pa := is.informer(AuthorizationPolicies, s.cfg.Resync), is.informer(PeerAuthentications, s.cfg.Resync)
	h := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { s.changed() },
		UpdateFunc: func(any, any) { s.changed() },
		DeleteFunc: func(any) { s.changed() },
	}
	ap.AddEventHandler(h)
	pa.AddEventHandler(h)
	is.mu.Lock()
	is.aps = cache.NewGenericLister(ap.GetIndexer(), AuthorizationPolicies.GroupResource())
	is.pas = cache.NewGenericLister(pa.GetIndexer(), PeerAuthentications.GroupResource())
	is.mu.Unlock()
	runInformers(ctx, ap, pa)
	return []cache.InformerSynced{ap.HasSynced, pa.HasSynced}
}

// informer is an informer on resource in all namespaces, through the
// dynamic client (as client-go's dynamic informer factory builds it).
func (is *istio) informer(resource schema.GroupVersionResource, resync time.Duration) cache.SharedIndexInformer {
	r := is.dyn.Resource(resource).Namespace(metav1.NamespaceAll)
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return r.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return r.Watch(ctx, o)
		},
	}
	// The wrapper tells the reflector whether the client can stream the
	// initial list (WatchList): the fake one of the tests cannot.
	return newInformer(cache.ToListWatcherWithWatchListSemantics(lw, is.dyn), &unstructured.Unstructured{}, resync, transformIstio)
}

// policies returns the AuthorizationPolicies as the policy engine's
// policies, through the config file's own decoding (the same fields,
// warnings and ambient rules). A policy that does not decode is replaced
// by an ALLOW policy without rules for the same selector: its workloads
// allow nothing until it is fixed (fail closed), and the error is logged.
func (s *Source) policies() []*policy.Policy {
	is := s.istio
	if is == nil {
		return nil
	}
	is.mu.Lock()
	defer is.mu.Unlock()
	if is.aps == nil {
		return nil
	}
	objs, err := is.aps.List(labels.Everything())
	if err != nil {
		return nil
	}
	sort.Slice(objs, func(i, j int) bool { return key(objs[i]) < key(objs[j]) })
	next := make(map[types.UID]parsedPolicy, len(objs))
	var out []*policy.Policy
	for _, o := range objs {
		u, ok := o.(*unstructured.Unstructured)
		if !ok {
			continue
		}
		pp, ok := is.parsed[u.GetUID()]
		if !ok || pp.version != u.GetResourceVersion() {
			pp = parsedPolicy{version: u.GetResourceVersion(), policies: s.parsePolicy(u)}
		}
		next[u.GetUID()] = pp
		out = append(out, pp.policies...)
	}
	is.parsed = next
	return out
}

func key(o any) string {
	if u, ok := o.(*unstructured.Unstructured); ok {
		return u.GetNamespace() + "/" + u.GetName()
	}
	return ""
}

// parsePolicy decodes one AuthorizationPolicy object.
func (s *Source) parsePolicy(u *unstructured.Unstructured) []*policy.Policy {
	name := "AuthorizationPolicy " + u.GetNamespace() + "/" + u.GetName()
	spec, _, _ := unstructured.NestedMap(u.Object, "spec")
	ap := map[string]any{}
	for k, v := range spec {
		ap[k] = v
	}
	ap["name"], ap["namespace"] = u.GetName(), u.GetNamespace()
	c, err := s.parseConfig(name, map[string]any{"authorizationPolicies": []any{ap}})
	if err == nil {
		for _, w := range c.Warnings {
			s.log.Warn().Str("policy", name).Msg(w)
		}
		return c.Policies()
	}
	s.log.Error().Err(err).Str("policy", name).
		Msg("policy not understood; its workloads allow nothing until it is fixed")
	closed := map[string]any{"name": u.GetName(), "namespace": u.GetNamespace(), "action": "ALLOW"}
	if sel, ok := spec["selector"]; ok {
		closed["selector"] = sel
	}
	c, err = s.parseConfig(name, map[string]any{"authorizationPolicies": []any{closed}})
	if err != nil { // the selector itself is bad: deny the whole namespace
		delete(closed, "selector")
		if c, err = s.parseConfig(name, map[string]any{"authorizationPolicies": []any{closed}}); err != nil {
			return nil
		}
	}
	return c.Policies()
}

func (s *Source) parseConfig(name string, doc map[string]any) (*config.Config, error) {
	doc["trustDomain"] = s.cfg.TrustDomain.String()
	doc["rootNamespace"] = s.cfg.RootNamespace
	data, err := json.Marshal(doc)
	if err != nil {
		return nil, err
	}
	return config.Parse(name, data)
}

// peerAuth is the peer-authentication mode of one workload, resolved as
// Istio does: the workload's own (selector) policy, else its namespace's,
// else the mesh-wide one (root namespace, no selector), else the default;
// UNSET inherits; DISABLE is PERMISSIVE for an L4 proxy. Port-level modes
// come from the selecting policy.
type peerAuthIndex struct {
	mesh, defMode string
	ns            map[string]string
	sel           []paSel
}

type paSel struct {
	namespace string
	selector  map[string]string
	mode      string
	ports     map[uint16]string
}

func (s *Source) peerAuthIndex() *peerAuthIndex {
	idx := &peerAuthIndex{defMode: s.cfg.PeerAuth.String(), ns: map[string]string{}}
	is := s.istio
	if is == nil {
		return idx
	}
	is.mu.Lock()
	lister := is.pas
	is.mu.Unlock()
	if lister == nil {
		return idx
	}
	objs, err := lister.List(labels.Everything())
	if err != nil {
		return idx
	}
	// Oldest first, as Istio resolves conflicts.
	sort.Slice(objs, func(i, j int) bool {
		a, b := objs[i].(*unstructured.Unstructured), objs[j].(*unstructured.Unstructured)
		ta, tb := a.GetCreationTimestamp(), b.GetCreationTimestamp()
		if !ta.Equal(&tb) {
			return ta.Before(&tb)
		}
		return key(a) < key(b)
	})
	for _, o := range objs {
		u, ok := o.(*unstructured.Unstructured)
		if !ok {
			continue
		}
		mode, _, _ := unstructured.NestedString(u.Object, "spec", "mtls", "mode")
		sel, hasSel, _ := unstructured.NestedStringMap(u.Object, "spec", "selector", "matchLabels")
		switch {
		case hasSel && len(sel) > 0:
			if u.GetNamespace() == s.cfg.RootNamespace {
				continue // applies to nothing, as in Istio
			}
			e := paSel{namespace: u.GetNamespace(), selector: sel, mode: mode}
			ports, _, _ := unstructured.NestedMap(u.Object, "spec", "portLevelMtls")
			for k, v := range ports {
				p, err := strconv.ParseUint(k, 10, 16)
				m, _ := v.(map[string]any)
				pm, _ := m["mode"].(string)
				if err != nil || p == 0 || pm == "" || pm == "UNSET" {
					continue
				}
				if e.ports == nil {
					e.ports = map[uint16]string{}
				}
				e.ports[uint16(p)] = pm
			}
			idx.sel = append(idx.sel, e)
		case u.GetNamespace() == s.cfg.RootNamespace:
			if idx.mesh == "" {
				idx.mesh = mode
			}
		default:
			if _, dup := idx.ns[u.GetNamespace()]; !dup {
				idx.ns[u.GetNamespace()] = mode
			}
		}
	}
	return idx
}

// apply sets w's PeerAuth and PortPeerAuth.
func (idx *peerAuthIndex) apply(w *registry.Workload) {
	mode := idx.defMode
	if idx.mesh != "" && idx.mesh != "UNSET" {
		mode = idx.mesh
	}
	if m := idx.ns[w.Namespace]; m != "" && m != "UNSET" {
		mode = m
	}
	for _, e := range idx.sel {
		if e.namespace != w.Namespace || !policy.SelectorMatches(e.selector, w.Labels) {
			continue
		}
		if e.mode != "" && e.mode != "UNSET" {
			mode = e.mode
		}
		for p, m := range e.ports {
			if w.PortPeerAuth == nil {
				w.PortPeerAuth = map[uint16]registry.PeerAuth{}
			}
			w.PortPeerAuth[p] = modeOf(m)
		}
		break // the oldest selecting policy decides
	}
	w.PeerAuth = modeOf(mode)
}

func modeOf(m string) registry.PeerAuth {
	if m == "STRICT" {
		return registry.Strict
	}
	return registry.Permissive
}
