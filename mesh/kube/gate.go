package kube

import (
	"net/netip"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/labels"

	"github.com/meshtun/meshtun/mesh/gate"
)

// The Source is the CNI startup gate's view of the API server
// (gate.Pods): the gate decides enrolment from the same caches and rules
// as the model.
var _ gate.Pods = (*Source)(nil)

// Pod returns the cached pod namespace/name, if the caches hold it and
// its namespace.
func (s *Source) Pod(namespace, name string) (gate.Pod, bool) {
	p, err := s.pods.Pods(namespace).Get(name)
	if err != nil {
		return gate.Pod{}, false
	}
	ns, err := s.nss.Get(namespace)
	if err != nil {
		return gate.Pod{}, false
	}
	nsEnrolled := ns.Labels[DataplaneModeLabel] == ModeAmbient
	out := gate.Pod{
		UID: string(p.UID), Node: p.Spec.NodeName,
		InMesh:  nsEnrolled && p.Labels[DataplaneModeLabel] != ModeNone && !p.Spec.HostNetwork,
		Ended:   p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed,
		Running: p.Status.Phase == corev1.PodRunning,
	}
	if !out.InMesh {
		out.Reason = notInMeshReason(p, nsEnrolled)
		if p.Spec.HostNetwork {
			out.Reason = "hostNetwork"
		}
	}
	ips := p.Status.PodIPs
	if len(ips) == 0 && p.Status.PodIP != "" {
		ips = []corev1.PodIP{{IP: p.Status.PodIP}}
	}
	for _, ip := range ips {
		if a, err := netip.ParseAddr(ip.IP); err == nil {
			out.Addresses = append(out.Addresses, a.Unmap())
		}
	}
	return out, true
}

// Rebuild builds a new snapshot soon (an announcement of the gate came or
// went).
func (s *Source) Rebuild() { s.changed() }

// Exempt returns the cached namespaces that are not enrolled: none of
// their pods is in the mesh.
func (s *Source) Exempt() []string {
	nss, err := s.nss.List(labels.Everything())
	if err != nil {
		return nil
	}
	var out []string
	for _, ns := range nss {
		if ns.Labels[DataplaneModeLabel] != ModeAmbient {
			out = append(out, ns.Name)
		}
	}
	return out
}
