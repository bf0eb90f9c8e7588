package kube

import (
	"strconv"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/client-go/tools/cache"
)

// The informers cache every pod, service, namespace and EndpointSlice of
// the cluster. Whole objects cost ~24 KiB a pod (managedFields, env,
// volumes, annotations…), and tenants can inflate them at will (large
// annotations on pods that never run). The transforms below keep exactly
// what the model, the CNI gate and the redirector read, and bound what a
// tenant controls of that.

// MaxPodLabelBytes bounds the labels of a pod the caches keep (the sum of
// keys and values). A pod with more is kept without them and refused
// (RefusedLabelsTooLarge): its labels decide which policies apply to it,
// and a workload with part of them could escape a DENY policy.
const MaxPodLabelBytes = 8 << 10

// RefusedLabelsTooLarge is the registry.Workload.Refused reason of a pod
// whose labels exceed MaxPodLabelBytes.
const RefusedLabelsTooLarge = "labels_too_large"

// labelsDroppedAnnotation marks, in the cache only, a pod whose labels
// were dropped (its value: their size). It is not a valid annotation key
// (the colon), so the API server never sends it: only the transform sets
// it, and keeps it when it sees its own output again.
const labelsDroppedAnnotation = "meshtun:labels-dropped"

// stripMeta keeps what the caches key, order and version by.
func stripMeta(m *metav1.ObjectMeta) {
	*m = metav1.ObjectMeta{
		Name: m.Name, Namespace: m.Namespace, UID: m.UID, ResourceVersion: m.ResourceVersion,
		CreationTimestamp: m.CreationTimestamp, DeletionTimestamp: m.DeletionTimestamp,
		Labels: m.Labels, Annotations: m.Annotations,
	}
}

// transformPod is the pods' informer transform: name, namespace, uid,
// creation and deletion times, labels (bounded), the redirection
// annotation, nodeName, serviceAccountName, hostNetwork, phase, podIP(s),
// the Ready condition, and of the containers only their probes' ports
// (and the named container ports these refer to).
func transformPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil // a tombstone (DeletedFinalStateUnknown): as is
	}
	ann := map[string]string(nil)
	if p.Annotations[RedirectionAnnotation] == RedirectionEnabled {
		ann = map[string]string{RedirectionAnnotation: RedirectionEnabled}
	}
	if v, ok := p.Annotations[labelsDroppedAnnotation]; ok {
		// Already transformed (a transform must be idempotent).
		if ann == nil {
			ann = map[string]string{}
		}
		ann[labelsDroppedAnnotation] = v
	}
	if n := labelBytes(p.Labels); n > MaxPodLabelBytes {
		keep := map[string]string{}
		if v, ok := p.Labels[DataplaneModeLabel]; ok {
			keep[DataplaneModeLabel] = v
		}
		p.Labels = keep
		if ann == nil {
			ann = map[string]string{}
		}
		ann[labelsDroppedAnnotation] = strconv.Itoa(n)
	}
	p.Annotations = ann
	stripMeta(&p.ObjectMeta)
	p.Spec = corev1.PodSpec{
		NodeName: p.Spec.NodeName, ServiceAccountName: p.Spec.ServiceAccountName, HostNetwork: p.Spec.HostNetwork,
		InitContainers: probeContainers(p.Spec.InitContainers), Containers: probeContainers(p.Spec.Containers),
	}
	var conds []corev1.PodCondition
	for _, c := range p.Status.Conditions {
		if c.Type == corev1.PodReady {
			conds = []corev1.PodCondition{{Type: c.Type, Status: c.Status}}
		}
	}
	p.Status = corev1.PodStatus{Phase: p.Status.Phase, PodIP: p.Status.PodIP, PodIPs: p.Status.PodIPs, Conditions: conds}
	return p, nil
}

// labelBytes is the size of labels' keys and values.
func labelBytes(l map[string]string) int {
	n := 0
	for k, v := range l {
		n += len(k) + len(v)
	}
	return n
}

// probeContainers keeps of cs the containers with a probe, and of those
// only the probes' ports and the container ports they name (probePorts).
func probeContainers(cs []corev1.Container) []corev1.Container {
	var out []corev1.Container
	for _, c := range cs {
		var keep corev1.Container
		for _, pr := range []*corev1.Probe{c.ReadinessProbe, c.LivenessProbe, c.StartupProbe} {
			if pr == nil {
				continue
			}
			var h corev1.ProbeHandler
			switch {
			case pr.HTTPGet != nil:
				h.HTTPGet = &corev1.HTTPGetAction{Port: pr.HTTPGet.Port}
				keep.Ports = appendNamedPort(keep.Ports, c, pr.HTTPGet.Port.StrVal)
			case pr.TCPSocket != nil:
				h.TCPSocket = &corev1.TCPSocketAction{Port: pr.TCPSocket.Port}
				keep.Ports = appendNamedPort(keep.Ports, c, pr.TCPSocket.Port.StrVal)
			case pr.GRPC != nil:
				h.GRPC = &corev1.GRPCAction{Port: pr.GRPC.Port}
			default:
				continue
			}
			np := &corev1.Probe{ProbeHandler: h}
			switch pr {
			case c.ReadinessProbe:
				keep.ReadinessProbe = np
			case c.LivenessProbe:
				keep.LivenessProbe = np
			default:
				keep.StartupProbe = np
			}
		}
		if keep.ReadinessProbe != nil || keep.LivenessProbe != nil || keep.StartupProbe != nil {
			out = append(out, keep)
		}
	}
	return out
}

// appendNamedPort appends c's port named name, if any (and name is not
// empty), with only its name and number.
func appendNamedPort(ports []corev1.ContainerPort, c corev1.Container, name string) []corev1.ContainerPort {
	if name == "" {
		return ports
	}
	for _, cp := range c.Ports {
		if cp.Name == name {
			return append(ports, corev1.ContainerPort{Name: cp.Name, ContainerPort: cp.ContainerPort})
		}
	}
	return ports
}

// transformNamespace keeps a namespace's name and its enrollment label.
func transformNamespace(obj any) (any, error) {
	ns, ok := obj.(*corev1.Namespace)
	if !ok {
		return obj, nil
	}
	var l map[string]string
	if v, ok := ns.Labels[DataplaneModeLabel]; ok {
		l = map[string]string{DataplaneModeLabel: v}
	}
	ns.Labels, ns.Annotations = l, nil
	stripMeta(&ns.ObjectMeta)
	ns.Spec, ns.Status = corev1.NamespaceSpec{}, corev1.NamespaceStatus{}
	return ns, nil
}

// transformService keeps what Source.service reads: type, cluster IPs,
// traffic distribution, internal traffic policy and ports.
func transformService(obj any) (any, error) {
	svc, ok := obj.(*corev1.Service)
	if !ok {
		return obj, nil
	}
	svc.Labels, svc.Annotations = nil, nil
	stripMeta(&svc.ObjectMeta)
	ports := make([]corev1.ServicePort, len(svc.Spec.Ports))
	for i, p := range svc.Spec.Ports {
		ports[i] = corev1.ServicePort{Name: p.Name, Protocol: p.Protocol, Port: p.Port, TargetPort: p.TargetPort}
	}
	svc.Spec = corev1.ServiceSpec{
		Type: svc.Spec.Type, ClusterIP: svc.Spec.ClusterIP, ClusterIPs: svc.Spec.ClusterIPs,
		TrafficDistribution: svc.Spec.TrafficDistribution, InternalTrafficPolicy: svc.Spec.InternalTrafficPolicy,
		Ports: ports,
	}
	svc.Status = corev1.ServiceStatus{}
	return svc, nil
}

// transformEndpointSlice keeps the service-name label (the lister selects
// by it), the ports and, of each endpoint, its readiness and its pod.
func transformEndpointSlice(obj any) (any, error) {
	sl, ok := obj.(*discoveryv1.EndpointSlice)
	if !ok {
		return obj, nil
	}
	var l map[string]string
	if v, ok := sl.Labels[discoveryv1.LabelServiceName]; ok {
		l = map[string]string{discoveryv1.LabelServiceName: v}
	}
	sl.Labels, sl.Annotations = l, nil
	stripMeta(&sl.ObjectMeta)
	for i, ep := range sl.Endpoints {
		e := discoveryv1.Endpoint{Conditions: discoveryv1.EndpointConditions{Ready: ep.Conditions.Ready}}
		if r := ep.TargetRef; r != nil {
			e.TargetRef = &corev1.ObjectReference{Kind: r.Kind, Namespace: r.Namespace, Name: r.Name}
		}
		sl.Endpoints[i] = e
	}
	ports := make([]discoveryv1.EndpointPort, len(sl.Ports))
	for i, p := range sl.Ports {
		ports[i] = discoveryv1.EndpointPort{Name: p.Name, Port: p.Port}
	}
	sl.Ports = ports
	return sl, nil
}

// transformIstio keeps of an Istio resource (AuthorizationPolicy,
// PeerAuthentication) its metadata's name, namespace, uid, version and
// creation time, the istio.io/dry-run annotation, and its spec: no
// managedFields, labels, other annotations or status.
func transformIstio(obj any) (any, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return obj, nil
	}
	md, _ := u.Object["metadata"].(map[string]any)
	keep := map[string]any{}
	for _, k := range []string{"name", "namespace", "uid", "resourceVersion", "creationTimestamp", "deletionTimestamp"} {
		if v, ok := md[k]; ok {
			keep[k] = v
		}
	}
	out := map[string]any{"metadata": keep}
	for _, k := range []string{"apiVersion", "kind", "spec"} {
		if v, ok := u.Object[k]; ok {
			out[k] = v
		}
	}
	if ann, _ := md["annotations"].(map[string]any); ann != nil {
		if v, ok := ann[DryRunAnnotation]; ok {
			keep["annotations"] = map[string]any{DryRunAnnotation: v}
		}
	}
	u.Object = out
	return u, nil
}

var (
	_ cache.TransformFunc = transformPod
	_ cache.TransformFunc = transformNamespace
	_ cache.TransformFunc = transformService
	_ cache.TransformFunc = transformEndpointSlice
	_ cache.TransformFunc = transformIstio
)
