package kube

import (
	"context"
	"encoding/json"
	"errors"
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

// DryRunAnnotation marks an AuthorizationPolicy that is evaluated and
// logged but not enforced ("true"), as Istio defines it.
const DryRunAnnotation = "istio.io/dry-run"

// policies returns the AuthorizationPolicies as the policy engine's
// policies, converted by policy.FromIstio (as the config file's and
// istiod's: the same warnings and ambient rules). A policy that does not
// decode is replaced by an ALLOW policy without rules for the same
// selector (policy.AllowNothing): its workloads allow nothing until it is
// fixed (fail closed), and the error is logged.
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

// parsePolicy decodes one AuthorizationPolicy object and converts it with
// policy.FromIstio, logging its warnings.
func (s *Source) parsePolicy(u *unstructured.Unstructured) []*policy.Policy {
	name := "AuthorizationPolicy " + u.GetNamespace() + "/" + u.GetName()
	spec, _, _ := unstructured.NestedFieldNoCopy(u.Object, "spec")
	if spec == nil {
		spec = map[string]any{}
	}
	data, err := json.Marshal(spec)
	var in policy.Istio
	if err == nil {
		in, err = decodeAuthorizationPolicy(u.GetNamespace(), u.GetName(), data)
	}
	if v, ok := u.GetAnnotations()[DryRunAnnotation]; ok && err == nil {
		// As istiod reads it (strconv.ParseBool); a value that is not a
		// boolean leaves the policy enforced, the side that cannot let
		// in what it denies.
		dry, perr := strconv.ParseBool(v)
		if perr != nil {
			s.log.Warn().Str("policy", name).Str("annotation", DryRunAnnotation).Str("value", v).
				Msg("annotation is not a boolean; the policy is enforced")
		}
		in.DryRun = dry
	}
	if err == nil {
		p, probs := policy.FromIstio(in)
		var errs []error
		for _, pr := range probs {
			if pr.Warning {
				s.log.Warn().Str("policy", name).Msg(pr.Error())
			} else {
				errs = append(errs, pr)
			}
		}
		switch {
		case len(errs) > 0:
			err = errors.Join(errs...)
		case p == nil:
			return nil // ignored (CUSTOM, a waypoint's): the warning says why
		default:
			return []*policy.Policy{p}
		}
	}
	s.log.Error().Err(err).Str("policy", name).
		Msg("policy not understood; its workloads allow nothing until it is fixed")
	sel, _, _ := unstructured.NestedStringMap(u.Object, "spec", "selector", "matchLabels")
	// A selector that is not a map of strings is nil here: the closed
	// policy then covers the whole namespace.
	if p := policy.AllowNothing(u.GetName(), u.GetNamespace(), sel); p != nil {
		return []*policy.Policy{p}
	}
	return nil
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
