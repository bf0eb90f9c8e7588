package kube

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"

	"github.com/meshtun/meshtun/mesh/registry"
)

// TestRedirectorAnnotatesOnlyCaptured: the redirector enrolls a pod at
// once but annotates it only after the node has reported it captured (the
// annotation sends peers' HBONE to it), and removes the annotation of a
// pod that leaves even while the node still captures it.
func TestRedirectorAnnotatesOnlyCaptured(t *testing.T) {
	p := pod("apps", "web", "n1", "198.18.1.10")
	p.Status.PodIP = "198.18.1.10"
	cs := fake.NewClientset(ns("apps", true), p)
	web := registry.WorkloadRef{Namespace: "apps", Name: "web"}
	// enroll hands each pass's set to the test and waits for it: the
	// test knows where the redirector is.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	sets := make(chan map[registry.WorkloadRef]bool)
	proceed := make(chan struct{})
	enroll := func(s map[registry.WorkloadRef]bool) {
		select {
		case sets <- s:
		case <-ctx.Done():
			return
		}
		select { // a failed assertion cancels ctx: Run must end
		case <-proceed:
		case <-ctx.Done():
		}
	}
	r := NewRedirector(fakeAPI{cs}, "n1", enroll, nil, zerolog.New(zerolog.NewTestWriter(t)))
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	pass := func(what string) map[registry.WorkloadRef]bool {
		t.Helper()
		select {
		case s := <-sets:
			return s
		case <-time.After(10 * time.Second):
			t.Fatalf("no reconcile pass: %s", what)
			return nil
		}
	}
	annotated := func() bool {
		t.Helper()
		got, err := cs.CoreV1().Pods("apps").Get(ctx, "web", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return got.Annotations[RedirectionAnnotation] == RedirectionEnabled
	}
	// The redirector's patches, as the API server reports them.
	w, err := cs.CoreV1().Pods("apps").Watch(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	waitAnnotated := func(want bool, what string) {
		t.Helper()
		timeout := time.After(10 * time.Second)
		for {
			select {
			case ev := <-w.ResultChan():
				if p, ok := ev.Object.(*corev1.Pod); ok && p.Name == "web" &&
					(p.Annotations[RedirectionAnnotation] == RedirectionEnabled) == want {
					return
				}
			case <-timeout:
				t.Fatalf("%s: annotation set=%v not seen within 10s", what, want)
			}
		}
	}

	if s := pass("first"); !s[web] {
		t.Fatalf("enrolled %v, want apps/web", s)
	}
	proceed <- struct{}{}
	// Another node's pod captured: a second pass, after the first ended.
	r.Captured([]registry.WorkloadRef{{Namespace: "apps", Name: "other"}})
	pass("after an unrelated report")
	if annotated() {
		t.Fatal("annotated before the node reported it captured")
	}
	proceed <- struct{}{}

	r.Captured([]registry.WorkloadRef{web})
	pass("after the capture report")
	proceed <- struct{}{}
	waitAnnotated(true, "after the node reported it captured")

	// The pod opts out: the annotation goes while it is still captured.
	patch := []byte(`{"metadata":{"labels":{"` + DataplaneModeLabel + `":"` + ModeNone + `"}}}`)
	if _, err := cs.CoreV1().Pods("apps").Patch(ctx, "web", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	for {
		s := pass("after the opt-out")
		proceed <- struct{}{}
		if !s[web] {
			break
		}
	}
	waitAnnotated(false, "after the pod opted out")

	// Every write of the redirector went through pods/status: the node's
	// account has no patch on pods (deploy/istio).
	n := 0
	for _, a := range cs.Actions() {
		if pa, ok := a.(k8stesting.PatchAction); ok && pa.GetResource().Resource == "pods" && pa.GetName() == "web" &&
			!strings.Contains(string(pa.GetPatch()), DataplaneModeLabel) {
			n++
			if pa.GetSubresource() != "status" {
				t.Errorf("the redirector patched pod apps/web through %q, want the status subresource: %s", pa.GetSubresource(), pa.GetPatch())
			}
		}
	}
	if n < 2 { // a pass on a cache not yet updated may repeat one
		t.Errorf("%d redirector patches of apps/web, want at least 2 (set, remove)", n)
	}
}

// TestRedirectedPodLabel: the redirector's enrollment is Istio's: a pod
// labelled istio.io/dataplane-mode=ambient is enrolled in an unlabelled
// namespace, one labelled none is not in an enrolled one.
func TestRedirectedPodLabel(t *testing.T) {
	for _, c := range []struct {
		podLabel        string
		nsAmbient, want bool
	}{
		{"", true, true}, {"", false, false},
		{ModeAmbient, false, true}, {ModeAmbient, true, true},
		{ModeNone, true, false}, {ModeNone, false, false},
	} {
		p := pod("apps", "web", "n1", "198.18.1.10")
		p.Status.PodIP = "198.18.1.10"
		if c.podLabel != "" {
			p.Labels[DataplaneModeLabel] = c.podLabel
		}
		if got := Redirected(p, c.nsAmbient); got != c.want {
			t.Errorf("pod label %q, namespace enrolled %v: Redirected = %v, want %v", c.podLabel, c.nsAmbient, got, c.want)
		}
	}
}

// TestRedirectorProbePorts: under istiod, whose workloads carry no probe
// ports, the redirector hands the node's pods' probe ports (from the
// Kubernetes API) to the model, so that the kubelet's probes of a STRICT
// pod pass; host-network pods and pods without probes are left out.
func TestRedirectorProbePorts(t *testing.T) {
	web := pod("apps", "web", "n1", "198.18.1.10")
	web.Spec.Containers = []corev1.Container{{Name: "app",
		Ports:          []corev1.ContainerPort{{Name: "health", ContainerPort: 8081}},
		ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Port: intstr.FromString("health")}}},
		StartupProbe:   &corev1.Probe{ProbeHandler: corev1.ProbeHandler{GRPC: &corev1.GRPCAction{Port: 9090}}},
	}}
	host := pod("apps", "host", "n1", "198.18.0.1")
	host.Spec.HostNetwork = true
	host.Spec.Containers = web.Spec.Containers
	cs := fake.NewClientset(ns("apps", false), web, host, pod("apps", "plain", "n1", "198.18.1.11"))
	got := make(chan map[registry.WorkloadRef][]uint16, 16)
	ctx, cancel := context.WithCancel(context.Background())
	r := NewRedirector(fakeAPI{cs}, "n1", func(map[registry.WorkloadRef]bool) {},
		func(m map[registry.WorkloadRef][]uint16) { got <- m }, zerolog.New(zerolog.NewTestWriter(t)))
	done := make(chan struct{})
	go func() { r.Run(ctx); close(done) }()
	defer func() { cancel(); <-done }()
	select {
	case m := <-got:
		want := map[registry.WorkloadRef][]uint16{{Namespace: "apps", Name: "web"}: {8081, 9090}}
		if len(m) != len(want) || !slices.Equal(m[registry.WorkloadRef{Namespace: "apps", Name: "web"}], want[registry.WorkloadRef{Namespace: "apps", Name: "web"}]) {
			t.Errorf("probe ports %v, want %v", m, want)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the redirector reported no probe ports")
	}
}
