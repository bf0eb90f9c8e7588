package kube

import (
	"context"
	"fmt"
	"sort"

	"github.com/rs/zerolog"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/tools/cache"
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
// ambient mesh (namespace labelled istio.io/dataplane-mode=ambient, pod
// not opted out, not host-network, with an address) and removes it from
// the ones that leave, so that istiod's model marks exactly them HBONE.
// meshtun captures a pod when istiod's model says so: a pod it has
// annotated is captured once istiod has seen the annotation.
type Redirector struct {
	cs    API
	node  string
	log   zerolog.Logger
	pods  cache.SharedIndexInformer
	nss   cache.SharedIndexInformer
	dirty chan struct{}
}

// NewRedirector returns a redirector for node's pods; Run runs it.
func NewRedirector(cs API, node string, log zerolog.Logger) *Redirector {
	r := &Redirector{cs: cs, node: node, log: log.With().Str("component", "redirector").Logger(), dirty: make(chan struct{}, 1)}
	r.pods = newInformer(cs.ListWatch("pods", func(o *metav1.ListOptions) {
		o.FieldSelector = fields.OneTermEqualSelector("spec.nodeName", node).String()
	}), &corev1.Pod{}, 0)
	r.nss = newInformer(cs.ListWatch("namespaces", nil), &corev1.Namespace{}, 0)
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

// reconcile annotates the pods that should have the annotation and do
// not, and removes it from those that should not have it.
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
	for _, p := range pods {
		want := Redirected(p, enrolled[p.Namespace])
		has := p.Annotations[RedirectionAnnotation] == RedirectionEnabled
		if want == has {
			continue
		}
		val := `"` + RedirectionEnabled + `"`
		if !want {
			val = "null"
		}
		patch := fmt.Sprintf(`{"metadata":{"annotations":{%q:%s}}}`, RedirectionAnnotation, val)
		err := r.cs.PatchPod(ctx, p.Namespace, p.Name, types.MergePatchType, []byte(patch))
		key := p.Namespace + "/" + p.Name
		if err != nil {
			r.log.Error().Err(err).Str("pod", key).Bool("redirected", want).Msg("cannot set the pod's redirection annotation")
			continue
		}
		r.log.Info().Str("pod", key).Bool("redirected", want).Msg("pod redirection annotation set")
	}
}

// Redirected reports whether pod p belongs in the ambient mesh (the
// enrollment rules of Source), nsEnrolled being its namespace's label.
func Redirected(p *corev1.Pod, nsEnrolled bool) bool {
	return nsEnrolled && !p.Spec.HostNetwork && p.Labels[DataplaneModeLabel] != ModeNone &&
		p.DeletionTimestamp == nil && p.Status.PodIP != ""
}
