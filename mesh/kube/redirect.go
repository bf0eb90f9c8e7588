package kube

import (
	"context"
	"fmt"
	"maps"
	"sort"
	"sync"

	"github.com/rs/zerolog"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"

	"github.com/meshtun/meshtun/mesh/registry"
)

// RedirectionAnnotation is the pod annotation istio-cni sets once it has
// redirected a pod's traffic to the node proxy; istiod tells node proxies
// to reach a workload over HBONE only when its pod has it.
const (
	RedirectionAnnotation = "ambient.istio.io/redirection"
	RedirectionEnabled    = "enabled"
)

// Redirector plays istio-cni's part for meshtun under istiod: it sets
// RedirectionAnnotation on this node's pods that are enrolled in the
// ambient mesh (pod or namespace labelled istio.io/dataplane-mode=ambient,
// pod not opted out, not host-network, with an address: Enrolled) and removes it from
// the ones that leave, so that istiod's model marks exactly them HBONE.
//
// The order is istio-cni's with ztunnel: a pod is captured first, then
// annotated. The annotation tells every peer to send the pod HBONE, so
// the node must take HBONE for it before the annotation exists. The
// redirector hands the enrolled pods to Enroll (the model's source marks
// them in the mesh on this node: the node captures them and gets their
// certificates), and annotates a pod only once the node has reported it
// captured through Captured. A pod that leaves loses its annotation
// first; the node stops capturing it when istiod's model no longer marks
// it HBONE, so that peers have stopped sending it HBONE by then.
type Redirector struct {
	cs     API
	node   string
	enroll func(map[registry.WorkloadRef]bool)
	probes func(map[registry.WorkloadRef][]uint16)
	log    zerolog.Logger
	pods   cache.SharedIndexInformer
	nss    cache.SharedIndexInformer
	dirty  chan struct{}

	mu       sync.Mutex
	captured map[registry.WorkloadRef]bool
}

// NewRedirector returns a redirector for node's pods; Run runs it. enroll
// receives the set of the node's pods that belong in the mesh each time
// it changes (xds.Source.Enroll); probes, if not nil, the health-probe
// ports of the node's pods that have any (xds.Source.ProbePorts: istiod
// sends none); the node reports what it has captured to Captured.
func NewRedirector(cs API, node string, enroll func(map[registry.WorkloadRef]bool), probes func(map[registry.WorkloadRef][]uint16), log zerolog.Logger) *Redirector {
	r := &Redirector{
		cs: cs, node: node, enroll: enroll, probes: probes, log: log.With().Str("component", "redirector").Logger(),
		dirty: make(chan struct{}, 1), captured: map[registry.WorkloadRef]bool{},
	}
	r.pods = newInformer(cs.ListWatch("pods", func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
	}), &corev1.Pod{}, 0, transformPod)
	r.nss = newInformer(cs.ListWatch("namespaces", nil), &corev1.Namespace{}, 0, transformNamespace)
	h := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(any) { r.changed() },
		UpdateFunc: func(any, any) { r.changed() },
		DeleteFunc: func(any) { r.changed() },
	}
	r.pods.AddEventHandler(h)
	r.nss.AddEventHandler(h)
	return r
}

func (r *Redirector) changed() {
	select {
	case r.dirty <- struct{}{}:
	default:
	}
}

// Captured tells the redirector which of the node's workloads the node
// now captures, with their certificates and inbound HBONE in place; it
// replaces the previous report. A pod waiting for its annotation gets it
// once it is in a report.
func (r *Redirector) Captured(refs []registry.WorkloadRef) {
	set := make(map[registry.WorkloadRef]bool, len(refs))
	for _, ref := range refs {
		set[ref] = true
	}
	r.mu.Lock()
	same := maps.Equal(set, r.captured)
	r.captured = set
	r.mu.Unlock()
	if !same {
		r.changed()
	}
}

// Run watches the node's pods and the namespaces and keeps the
// annotations right until ctx ends. A failed patch is logged and retried
// on the next change.
func (r *Redirector) Run(ctx context.Context) {
	defer runInformers(ctx, r.pods, r.nss)()
	if !cache.WaitForCacheSync(ctx.Done(), r.pods.HasSynced, r.nss.HasSynced) {
		return
	}
	for {
		r.reconcile(ctx)
		select {
		case <-ctx.Done():
			return
		case <-r.dirty:
		}
	}
}

// reconcile enrolls the pods that belong in the mesh, annotates those of
// them the node has captured, and removes the annotation from those that
// do not belong.
func (r *Redirector) reconcile(ctx context.Context) {
	enrolled := map[string]bool{}
	for _, o := range r.nss.GetStore().List() {
		ns := o.(*corev1.Namespace)
		enrolled[ns.Name] = ns.Labels[DataplaneModeLabel] == ModeAmbient
	}
	var pods []*corev1.Pod
	for _, o := range r.pods.GetStore().List() {
		pods = append(pods, o.(*corev1.Pod))
	}
	sort.Slice(pods, func(i, j int) bool { return pods[i].Namespace+"/"+pods[i].Name < pods[j].Namespace+"/"+pods[j].Name })
	want := make(map[registry.WorkloadRef]bool)
	for _, p := range pods {
		if Redirected(p, enrolled[p.Namespace]) {
			want[registry.WorkloadRef{Namespace: p.Namespace, Name: p.Name}] = true
		}
	}
	if r.probes != nil {
		ports := map[registry.WorkloadRef][]uint16{}
		for _, p := range pods {
			if ps := probePorts(p); len(ps) > 0 && !p.Spec.HostNetwork {
				ports[registry.WorkloadRef{Namespace: p.Namespace, Name: p.Name}] = ps
			}
		}
		r.probes(ports) // before the enrollment: a STRICT pod's probes pass from its capture on
	}
	r.enroll(want)
	r.mu.Lock()
	captured := r.captured
	r.mu.Unlock()
	for _, p := range pods {
		ref := registry.WorkloadRef{Namespace: p.Namespace, Name: p.Name}
		has := p.Annotations[RedirectionAnnotation] == RedirectionEnabled
		if want[ref] == has || want[ref] && !captured[ref] {
			continue // right, or not captured yet (Captured wakes us)
		}
		val := `"` + RedirectionEnabled + `"`
		if !want[ref] {
			val = "null"
		}
		// Through pods/status, as istio-cni does: the node's account
		// may not patch pods (that could change what they run), and
		// deploy/istio's admission policy lets it change only this
		// annotation of its own node's pods.
		patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%s}}}`, RedirectionAnnotation, val)
		err := r.cs.PatchPodStatus(ctx, p.Namespace, p.Name, types.MergePatchType, []byte(patch))
		if err != nil {
			r.log.Error().Err(err).Str("pod", ref.String()).Bool("redirected", want[ref]).Msg("cannot set the pod's redirection annotation")
			continue
		}
		r.log.Info().Str("pod", ref.String()).Bool("redirected", want[ref]).Msg("pod redirection annotation set")
	}
}

// Redirected reports whether pod p belongs in the ambient mesh (the
// enrollment rules of Source), nsEnrolled being its namespace's label.
func Redirected(p *corev1.Pod, nsEnrolled bool) bool {
	return Enrolled(p, nsEnrolled) && !p.Spec.HostNetwork &&
		p.DeletionTimestamp == nil && p.Status.PodIP != ""
}
