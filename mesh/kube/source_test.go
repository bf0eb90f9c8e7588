package kube

import (
	"context"
	"net/netip"
	"slices"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes/fake"

	"github.com/meshtun/meshtun/mesh/registry"
)

func ns(name string, ambient bool) *corev1.Namespace {
	n := &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{}}}
	if ambient {
		n.Labels[DataplaneModeLabel] = ModeAmbient
	}
	return n
}

func pod(namespace, name, node string, ips ...string) *corev1.Pod {
	p := &corev1.Pod{
		ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name, Labels: map[string]string{"app": name}},
		Spec:       corev1.PodSpec{NodeName: node, ServiceAccountName: name + "-sa"},
		Status: corev1.PodStatus{Phase: corev1.PodRunning,
			Conditions: []corev1.PodCondition{{Type: corev1.PodReady, Status: corev1.ConditionTrue}}},
	}
	for _, ip := range ips {
		p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
	}
	return p
}

func ptr[T any](v T) *T { return &v }

func start(t *testing.T, objs ...runtime.Object) (*Source, *fake.Clientset) {
	t.Helper()
	cs := fake.NewClientset(objs...)
	s := New(Config{Client: fakeAPI{cs}, Node: "n1", TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local"), Logger: zerolog.Nop()})
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	if _, err := s.Start(ctx); err != nil {
		t.Fatal(err)
	}
	return s, cs
}

func TestModel(t *testing.T) {
	opted := pod("mesh", "opted", "n1", "198.18.1.12")
	opted.Labels[DataplaneModeLabel] = ModeNone
	host := pod("mesh", "host", "n1", "198.18.0.11")
	host.Spec.HostNetwork = true
	pending := pod("mesh", "pending", "n1", "198.18.1.14")
	pending.Status.Phase = corev1.PodPending
	notReady := pod("mesh", "notready", "n2", "198.18.2.12")
	notReady.Status.Conditions = nil
	svc := &corev1.Service{
		ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "web"},
		Spec: corev1.ServiceSpec{ClusterIPs: []string{"198.19.0.10", "fd00:6d74:ffff::10"},
			Ports:                 []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
			InternalTrafficPolicy: ptr(corev1.ServiceInternalTrafficPolicyLocal)},
	}
	slice := &discoveryv1.EndpointSlice{
		ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "web-1", Labels: map[string]string{discoveryv1.LabelServiceName: "web"}},
		Ports:      []discoveryv1.EndpointPort{{Name: ptr("http"), Port: ptr(int32(8080))}},
		Endpoints: []discoveryv1.Endpoint{
			{Addresses: []string{"198.18.1.11"}, Conditions: discoveryv1.EndpointConditions{Ready: ptr(true)}, TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: "a"}},
			{Addresses: []string{"198.18.2.12"}, Conditions: discoveryv1.EndpointConditions{Ready: ptr(false)}, TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: "notready"}},
		},
	}
	a := pod("mesh", "a", "n1", "198.18.1.11", "fd00:6d74:1::11")
	a.Spec.Containers = []corev1.Container{{Name: "app",
		Ports:          []corev1.ContainerPort{{Name: "health", ContainerPort: 8081}},
		ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Port: intstr.FromString("health")}}},
		LivenessProbe:  &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(9000)}}},
	}}
	// Labelled ambient itself, in an unlabelled namespace: enrolled (Istio).
	own := pod("plain", "own", "n2", "198.18.2.13")
	own.Labels[DataplaneModeLabel] = ModeAmbient
	s, cs := start(t, ns("mesh", true), ns("plain", false), a, opted, host, pending, notReady,
		pod("plain", "b", "n2", "198.18.2.11"), own, svc, slice)
	snap, err := s.Build()
	if err != nil {
		t.Fatal(err)
	}
	wa := snap.Workload(netip.MustParseAddr("fd00:6d74:1::11"))
	if wa == nil || !wa.InMesh || wa.Identity.String() != "spiffe://cluster.local/ns/mesh/sa/a-sa" || len(wa.Addresses) != 2 {
		t.Fatalf("pod a: %+v", wa)
	}
	if !slices.Equal(wa.ProbePorts, []uint16{8081, 9000}) {
		t.Errorf("pod a probe ports %v, want [8081 9000] (the named readiness port and the liveness port)", wa.ProbePorts)
	}
	if w := snap.Workload(netip.MustParseAddr("198.18.1.12")); w == nil || w.InMesh {
		t.Errorf("opted-out pod: %+v, want a workload outside the mesh", w)
	}
	if w := snap.Workload(netip.MustParseAddr("198.18.2.11")); w == nil || w.InMesh {
		t.Errorf("pod of an unlabelled namespace: %+v, want a workload outside the mesh", w)
	}
	if w := snap.Workload(netip.MustParseAddr("198.18.2.13")); w == nil || !w.InMesh {
		t.Errorf("pod labelled %s=%s in an unlabelled namespace: %+v, want a workload in the mesh", DataplaneModeLabel, ModeAmbient, w)
	}
	for _, ip := range []string{"198.18.0.11", "198.18.1.14"} {
		if w := snap.Workload(netip.MustParseAddr(ip)); w != nil {
			t.Errorf("%s is workload %s; hostNetwork and pending pods are not workloads", ip, w)
		}
	}
	got, port := snap.Service(netip.MustParseAddrPort("[fd00:6d74:ffff::10]:80"))
	if got == nil || port.Target() != 8080 {
		t.Fatalf("service: %v %+v, want web with target port 8080 from the named port", got, port)
	}
	if got.LB.Mode != registry.LBStrict || len(got.LB.Scopes) != 1 || got.LB.Scopes[0] != registry.ScopeNode {
		t.Errorf("internalTrafficPolicy Local: LB %+v, want STRICT on NODE", got.LB)
	}
	eps := got.Endpoints(netip.MustParseAddr("198.19.0.10"))
	if len(eps) != 1 || eps[0].Workload.Name != "a" {
		t.Errorf("endpoints %v, want only the ready pod a", eps)
	}
	st := s.Status()
	want := map[string]string{"mesh/a": "", "mesh/opted": "pod labelled istio.io/dataplane-mode=none", "mesh/pending": "phase Pending"}
	if len(st.LocalPods) != len(want) {
		t.Errorf("local pods %+v, want %v", st.LocalPods, want)
	}
	for _, p := range st.LocalPods {
		if r, ok := want[p.Pod]; !ok || r != p.Reason || p.Mesh != (r == "") {
			t.Errorf("local pod %+v, want reason %q", p, r)
		}
	}

	// A label removed live: the next snapshot has the namespace's pods
	// outside the mesh.
	ctx := context.Background()
	if _, err := cs.CoreV1().Namespaces().Update(ctx, ns("mesh", false), metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case snap = <-s.Updates():
	case <-time.After(10 * time.Second):
		t.Fatal("no snapshot after the namespace changed")
	}
	for snap.Workload(netip.MustParseAddr("198.18.1.11")).InMesh {
		select {
		case snap = <-s.Updates():
		case <-time.After(10 * time.Second):
			t.Fatal("pod a still in the mesh after its namespace lost the label")
		}
	}
}

// A new pod that reuses the address of a pod still being deleted waits
// until the old one is gone; the model stays buildable meanwhile.
func TestAddressReuse(t *testing.T) {
	old := pod("mesh", "old", "n1", "198.18.1.11")
	old.CreationTimestamp = metav1.NewTime(time.Now().Add(-time.Hour))
	newer := pod("mesh", "new", "n1", "198.18.1.11")
	newer.CreationTimestamp = metav1.NewTime(time.Now())
	s, cs := start(t, ns("mesh", true), old, newer)
	snap, err := s.Build()
	if err != nil {
		t.Fatal(err)
	}
	if w := snap.Workload(netip.MustParseAddr("198.18.1.11")); w == nil || w.Name != "old" {
		t.Fatalf("198.18.1.11 is %v, want the older pod", w)
	}
	if err := cs.CoreV1().Pods("mesh").Delete(context.Background(), "old", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	deadline := time.After(10 * time.Second)
	for {
		select {
		case snap = <-s.Updates():
		case <-deadline:
			t.Fatal("the new pod never got its address")
		}
		if w := snap.Workload(netip.MustParseAddr("198.18.1.11")); w != nil && w.Name == "new" {
			return
		}
	}
}

// TestOneBadPodDoesNotBlockTheModel: a pod whose identity cannot be
// written (a service account name the API server would refuse, here
// through a fake one that does not) is left out by the registry's
// resolver; the rest of the mesh is still modelled.
func TestOneBadPodDoesNotBlockTheModel(t *testing.T) {
	bad := pod("mesh", "bad", "n1", "198.18.1.12")
	bad.Spec.ServiceAccountName = "no/slashes"
	s, _ := start(t, ns("mesh", true), pod("mesh", "good", "n1", "198.18.1.11"), bad)
	snap, err := s.Build()
	if err != nil {
		t.Fatal(err)
	}
	if snap.Workload(netip.MustParseAddr("198.18.1.11")) == nil {
		t.Error("the good pod is not in the model")
	}
	if snap.Workload(netip.MustParseAddr("198.18.1.12")) != nil {
		t.Error("the pod without a valid identity is in the model")
	}
}

// TestRemoteClaims (issue 22 item 8a): a kubelet of another node that
// writes a local pod's address into an older pod's status takes nothing
// from it; pods of two other nodes claiming one address get it denied,
// neither identity trusted; with an address this node cannot verify, its
// own pod stays captured but refused.
func TestRemoteClaims(t *testing.T) {
	old := metav1.NewTime(time.Now().Add(-time.Hour))
	victim := pod("mesh", "victim", "n1", "198.18.1.11")
	victim.CreationTimestamp = metav1.Now()
	forger := pod("evil", "forger", "n2", "198.18.2.50", "198.18.1.11")
	forger.CreationTimestamp = old
	other := pod("mesh", "other", "n3", "198.18.3.11")
	other.CreationTimestamp = metav1.Now()
	forger2 := pod("evil", "forger2", "n2", "198.18.3.11")
	forger2.CreationTimestamp = old
	objs := []runtime.Object{ns("mesh", true), ns("evil", true), victim, forger, other, forger2}
	addr := netip.MustParseAddr

	for _, verified := range []bool{true, false} {
		cs := fake.NewClientset(objs...)
		cfg := Config{Client: fakeAPI{cs}, Node: "n1", TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local"), Logger: zerolog.Nop()}
		var asked []netip.Addr
		cfg.LocalAddress = func(a netip.Addr) bool { asked = append(asked, a); return verified }
		s := New(cfg)
		ctx, cancel := context.WithCancel(context.Background())
		snap, err := s.Start(ctx)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(asked, []netip.Addr{addr("198.18.1.11")}) {
			t.Errorf("LocalAddress asked for %v, want only the local pod's contested 198.18.1.11", asked)
		}
		w := snap.Workload(addr("198.18.1.11"))
		switch {
		case w == nil || w.Name != "victim" || w.Node != "n1" || !w.InMesh:
			t.Fatalf("verified=%v: 198.18.1.11 is %+v, want the local pod victim", verified, w)
		case verified && w.Refused != "":
			t.Errorf("the local pod with its verified address is refused: %q", w.Refused)
		case !verified && w.Refused != RefusedAddressConflict:
			t.Errorf("the local pod with an address claimed elsewhere and not verified: refused %q, want %q (captured, denied)", w.Refused, RefusedAddressConflict)
		}
		if w := snap.Workload(addr("198.18.2.50")); w != nil {
			t.Errorf("verified=%v: the forger's own address is workload %v: a forger gains no identity", verified, w)
		}
		d := snap.Workload(addr("198.18.3.11"))
		if d == nil || d.Refused != RefusedAddressConflict || d.Node != "" || !d.InMesh {
			t.Fatalf("verified=%v: 198.18.3.11 (claimed by pods of n2 and n3) is %+v, want a denied address", verified, d)
		}
		for _, id := range []string{"spiffe://cluster.local/ns/mesh/sa/other-sa", "spiffe://cluster.local/ns/evil/sa/forger2-sa"} {
			if d.Identity.String() == id {
				t.Errorf("the denied address has claimant identity %s", id)
			}
		}
		if !d.Protected(80) {
			t.Error("the denied address's port 80 is not protected")
		}
		st := s.Status()
		if len(st.LocalPods) != 1 || st.LocalPods[0].Mesh != verified {
			t.Errorf("verified=%v: local pods %+v", verified, st.LocalPods)
		}
	}
}
