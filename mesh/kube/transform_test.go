package kube

import (
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	kruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/client-go/kubernetes/fake"
)

// fatPod is a pod as the API server sends it, with what the model does
// not read: managedFields, env, volumes, a tenant's large annotation.
func fatPod() *corev1.Pod {
	p := pod("mesh", "fat", "n1", "198.18.1.11", "fd00:6d74:1::11")
	p.UID = "u-1"
	p.Annotations = map[string]string{"tenant/blob": strings.Repeat("x", 200<<10), RedirectionAnnotation: RedirectionEnabled}
	p.ManagedFields = []metav1.ManagedFieldsEntry{{Manager: "kubectl", FieldsV1: metav1.NewFieldsV1(`{"f:spec":{}}`)}}
	p.OwnerReferences = []metav1.OwnerReference{{Kind: "ReplicaSet", Name: "fat-1"}}
	var env []corev1.EnvVar
	for i := range 100 {
		env = append(env, corev1.EnvVar{Name: "V" + strings.Repeat("x", i), Value: strings.Repeat("y", 100)})
	}
	p.Spec.Containers = []corev1.Container{
		{Name: "app", Image: "example.invalid/app:1", Env: env, Command: []string{"/bin/app", "--flag"},
			Ports:          []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}, {Name: "health", ContainerPort: 8081}, {Name: "other", ContainerPort: 9999}},
			ReadinessProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{HTTPGet: &corev1.HTTPGetAction{Port: intstr.FromString("health"), Path: "/ready", Host: "h"}}, PeriodSeconds: 3},
			LivenessProbe:  &corev1.Probe{ProbeHandler: corev1.ProbeHandler{TCPSocket: &corev1.TCPSocketAction{Port: intstr.FromInt32(9000)}}},
			StartupProbe:   &corev1.Probe{ProbeHandler: corev1.ProbeHandler{Exec: &corev1.ExecAction{Command: []string{"true"}}}}},
		{Name: "sidecar", Image: "example.invalid/side:1", Env: env},
	}
	p.Spec.InitContainers = []corev1.Container{{Name: "init", Image: "example.invalid/init:1",
		StartupProbe: &corev1.Probe{ProbeHandler: corev1.ProbeHandler{GRPC: &corev1.GRPCAction{Port: 7000}}}}}
	p.Spec.Volumes = []corev1.Volume{{Name: "v", VolumeSource: corev1.VolumeSource{EmptyDir: &corev1.EmptyDirVolumeSource{}}}}
	p.Status.ContainerStatuses = []corev1.ContainerStatus{{Name: "app", Image: "example.invalid/app:1", ImageID: strings.Repeat("sha", 30)}}
	p.Status.Conditions = append(p.Status.Conditions, corev1.PodCondition{Type: corev1.PodScheduled, Status: corev1.ConditionTrue, Message: strings.Repeat("m", 1000)})
	return p
}

// TestTransformPod: the cached pod keeps what the model, the gate and the
// redirector read, and nothing else: the same workload, probe ports,
// enrollment and redirection; a few hundred bytes instead of the
// tenant's 200 KiB.
func TestTransformPod(t *testing.T) {
	in := fatPod()
	orig := in.DeepCopy()
	size := func(v any) int { b, _ := json.Marshal(v); return len(b) }
	before := size(in)
	obj, err := transformPod(in)
	if err != nil {
		t.Fatal(err)
	}
	p := obj.(*corev1.Pod)
	after := size(p)
	t.Logf("pod: %d bytes as sent, %d cached", before, after)
	if after > 1024 {
		t.Errorf("cached pod is %d bytes, want ≤ 1 KiB: %s", after, must(json.Marshal(p)))
	}
	if p.Name != orig.Name || p.Namespace != orig.Namespace || p.UID != orig.UID || p.Spec.NodeName != "n1" ||
		p.Spec.ServiceAccountName != orig.Spec.ServiceAccountName || p.Status.Phase != corev1.PodRunning ||
		!slices.Equal(p.Status.PodIPs, orig.Status.PodIPs) || p.Labels["app"] != "fat" {
		t.Errorf("cached pod lost what the model reads: %s", must(json.Marshal(p)))
	}
	if got, want := probePorts(p), probePorts(orig); !slices.Equal(got, want) || !slices.Equal(want, []uint16{7000, 8081, 9000}) {
		t.Errorf("probe ports %v from the cache, %v from the pod; want [7000 8081 9000]", got, want)
	}
	if p.Annotations[RedirectionAnnotation] != RedirectionEnabled || len(p.Annotations) != 1 {
		t.Errorf("annotations %v, want only the redirection annotation", p.Annotations)
	}
	if len(p.Status.Conditions) != 1 || p.Status.Conditions[0].Type != corev1.PodReady {
		t.Errorf("conditions %v, want only Ready", p.Status.Conditions)
	}
	// Idempotent: the cached pod transformed again is the same.
	again, _ := transformPod(p.DeepCopy())
	if a, b := must(json.Marshal(again)), must(json.Marshal(p)); string(a) != string(b) {
		t.Errorf("transform is not idempotent:\n%s\n%s", a, b)
	}
}

// TestTransformLabelsBounded: a pod whose labels exceed MaxPodLabelBytes
// is cached without them, and refused (its policies cannot be known),
// the enrollment label kept; its neighbour is unaffected; the
// transform's marker cannot come from the API server.
func TestTransformLabelsBounded(t *testing.T) {
	big := pod("mesh", "big", "n1", "198.18.1.12")
	for i := range 200 {
		big.Labels["k"+strings.Repeat("x", 40)+string(rune('a'+i%26))+strings.Repeat("z", i/26)] = strings.Repeat("v", 60)
	}
	big.Labels[DataplaneModeLabel] = ModeAmbient
	// The marker cannot come from the API server: its key is not a
	// valid annotation key (apimachinery's validation, which the API
	// server applies to every object's annotations).
	if errs := validation.IsQualifiedName(labelsDroppedAnnotation); len(errs) == 0 {
		t.Errorf("%s is a valid annotation key: a tenant could set it", labelsDroppedAnnotation)
	}
	s, _ := start(t, ns("plain", false), big, pod("plain", "ok", "n1", "198.18.1.11"))
	snap, err := s.Build()
	if err != nil {
		t.Fatal(err)
	}
	w := snap.Workload(netip.MustParseAddr("198.18.1.12"))
	if w == nil || w.Refused != RefusedLabelsTooLarge || !w.InMesh || len(w.Labels) != 0 {
		t.Fatalf("pod with %d bytes of labels: %+v, want a refused mesh workload (enrolled by its kept label) without labels", labelBytes(big.Labels), w)
	}
	if w := snap.Workload(netip.MustParseAddr("198.18.1.11")); w == nil || w.Refused != "" {
		t.Errorf("control: %+v", w)
	}
	cached, err := s.pods.Pods("mesh").Get("big")
	if err != nil {
		t.Fatal(err)
	}
	if len(cached.Labels) != 1 {
		t.Errorf("cached labels %v, want only %s", cached.Labels, DataplaneModeLabel)
	}
}

// TestTransformOthers: services, EndpointSlices, namespaces and Istio
// resources are cached without their labels, annotations and
// managedFields, keeping what the model reads.
func TestTransformOthers(t *testing.T) {
	blob := map[string]string{"tenant/blob": strings.Repeat("x", 10<<10)}
	mf := []metav1.ManagedFieldsEntry{{Manager: "kubectl", FieldsV1: metav1.NewFieldsV1(strings.Repeat(" ", 1000))}}
	svc := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "web", Annotations: blob, Labels: blob, ManagedFields: mf},
		Spec: corev1.ServiceSpec{ClusterIPs: []string{"198.19.0.10"}, Selector: blob,
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}}}}
	sl := &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Namespace: "mesh", Name: "web-1", Annotations: blob, ManagedFields: mf,
		Labels: map[string]string{discoveryv1.LabelServiceName: "web", "tenant/blob": blob["tenant/blob"]}},
		Ports: []discoveryv1.EndpointPort{{Name: ptr("http"), Port: ptr(int32(8080))}},
		Endpoints: []discoveryv1.Endpoint{{Addresses: []string{"198.18.1.11"}, Hostname: ptr(blob["tenant/blob"]),
			Conditions: discoveryv1.EndpointConditions{Ready: ptr(true)}, TargetRef: &corev1.ObjectReference{Kind: "Pod", Name: "a", UID: "u"}}}}
	n := ns("mesh", true)
	n.Annotations, n.ManagedFields = blob, mf
	n.Labels["tenant/blob"] = blob["tenant/blob"]
	pa := &unstructured.Unstructured{Object: map[string]any{
		"apiVersion": "security.istio.io/v1", "kind": "PeerAuthentication",
		"metadata": map[string]any{"name": "strict", "namespace": "mesh", "annotations": map[string]any{"tenant/blob": blob["tenant/blob"]}, "managedFields": []any{"x"}},
		"spec":     map[string]any{"mtls": map[string]any{"mode": "STRICT"}},
		"status":   map[string]any{"x": blob["tenant/blob"]},
	}}
	for _, c := range []struct {
		obj any
		tf  func(any) (any, error)
	}{{svc, transformService}, {sl, transformEndpointSlice}, {n, transformNamespace}, {pa, transformIstio}} {
		out, err := c.tf(c.obj)
		if err != nil {
			t.Fatal(err)
		}
		b := must(json.Marshal(out))
		if len(b) > 600 || strings.Contains(string(b), "tenant") || strings.Contains(string(b), "kubectl") {
			t.Errorf("%T cached as %d bytes: %s", c.obj, len(b), b)
		}
	}
	s, _ := start(t, n, svc, sl, pod("mesh", "a", "n1", "198.18.1.11"))
	snap, err := s.Build()
	if err != nil {
		t.Fatal(err)
	}
	got, port := snap.Service(netip.MustParseAddrPort("198.19.0.10:80"))
	if got == nil || port.Target() != 8080 || len(got.Endpoints(netip.MustParseAddr("198.19.0.10"))) != 1 {
		t.Errorf("service from the trimmed caches: %+v %+v", got, port)
	}
	if w := snap.Workload(netip.MustParseAddr("198.18.1.11")); w == nil || !w.InMesh {
		t.Errorf("pod a in an ambient namespace from the trimmed caches: %+v", w)
	}
}

func must(b []byte, err error) []byte {
	if err != nil {
		panic(err)
	}
	return b
}

// BenchmarkPodCache measures the heap that 10,000 cached pods take, as
// the API server sends them and as transformPod trims them, for two
// shapes: test/kube's benchmark pod (one container, created and its
// status written: two managedFields entries) and fatPod's (a
// production-like pod, 200 KiB of a tenant's annotation). Reported as
// B/pod: `go test -run '^$' -bench PodCache ./mesh/kube/`.
func BenchmarkPodCache(b *testing.B) {
	small := func(i int) *corev1.Pod {
		p := pod("scale-00", fmt.Sprintf("p-%05d", i), "fake-01", fmt.Sprintf("198.18.%d.%d", 200+i/250, 1+i%250), fmt.Sprintf("fd00:6d74:%d::%d", 200+i/250, 1+i%250))
		p.UID = types.UID(fmt.Sprintf("0b6f3c1e-5d2a-4a8e-9f1c-%012d", i))
		p.ResourceVersion = strconv.Itoa(100000 + i)
		p.Spec.Containers = []corev1.Container{{Name: "app", Image: "example.invalid/app:1",
			Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}, TerminationMessagePath: "/dev/termination-log",
			TerminationMessagePolicy: "File", ImagePullPolicy: "IfNotPresent"}}
		p.Spec.RestartPolicy, p.Spec.DNSPolicy, p.Spec.SchedulerName = "Always", "ClusterFirst", "default-scheduler"
		p.ManagedFields = []metav1.ManagedFieldsEntry{
			{Manager: "kube.test", Operation: "Update", APIVersion: "v1", FieldsType: "FieldsV1",
				FieldsV1: metav1.NewFieldsV1(`{"f:metadata":{"f:labels":{".":{},"f:app":{}}},"f:spec":{"f:automountServiceAccountToken":{},"f:containers":{"k:{\"name\":\"app\"}":{".":{},"f:image":{},"f:imagePullPolicy":{},"f:name":{},"f:ports":{".":{},"k:{\"containerPort\":8080,\"protocol\":\"TCP\"}":{".":{},"f:containerPort":{},"f:name":{},"f:protocol":{}}},"f:resources":{},"f:terminationMessagePath":{},"f:terminationMessagePolicy":{}}},"f:dnsPolicy":{},"f:enableServiceLinks":{},"f:nodeName":{},"f:restartPolicy":{},"f:schedulerName":{},"f:securityContext":{},"f:serviceAccount":{},"f:serviceAccountName":{},"f:terminationGracePeriodSeconds":{}}}`)},
			{Manager: "kube.test", Operation: "Update", APIVersion: "v1", FieldsType: "FieldsV1", Subresource: "status",
				FieldsV1: metav1.NewFieldsV1(`{"f:status":{"f:conditions":{"k:{\"type\":\"Ready\"}":{".":{},"f:lastProbeTime":{},"f:lastTransitionTime":{},"f:status":{},"f:type":{}}},"f:hostIP":{},"f:phase":{},"f:podIP":{},"f:podIPs":{".":{},"k:{\"ip\":\"198.18.200.1\"}":{".":{},"f:ip":{}},"k:{\"ip\":\"fd00:6d74:200::1\"}":{".":{},"f:ip":{}}},"f:startTime":{}}}`)},
		}
		return p
	}
	fat := func(i int) *corev1.Pod {
		p := fatPod()
		p.Name = fmt.Sprintf("fat-%05d", i)
		p.Annotations["tenant/blob"] = strings.Repeat("x", 2<<10)
		return p
	}
	for _, shape := range []struct {
		name string
		make func(int) *corev1.Pod
	}{{"bench", small}, {"fat", fat}} {
		for _, trim := range []bool{false, true} {
			b.Run(fmt.Sprintf("%s/transform=%v", shape.name, trim), func(b *testing.B) {
				const n = 10000
				for range b.N {
					// Decoded from JSON, as the client decodes them: no
					// sharing between pods.
					raw := make([][]byte, n)
					for i := range n {
						raw[i] = must(json.Marshal(shape.make(i)))
					}
					runtime.GC()
					var m0, m1 runtime.MemStats
					runtime.ReadMemStats(&m0)
					cache := make([]any, n)
					for i := range n {
						p := &corev1.Pod{}
						if err := json.Unmarshal(raw[i], p); err != nil {
							b.Fatal(err)
						}
						cache[i] = p
						if trim {
							cache[i], _ = transformPod(p)
						}
					}
					runtime.GC()
					runtime.ReadMemStats(&m1)
					b.ReportMetric(float64(m1.HeapAlloc-m0.HeapAlloc)/n, "B/pod")
					runtime.KeepAlive(cache)
					runtime.KeepAlive(raw)
				}
			})
		}
	}
}

// BenchmarkSourceHeap measures the live heap a Source adds with 10,000
// pods (test/kube's benchmark shape) and 2,000 services with an
// EndpointSlice each: its trimmed caches and the snapshot built from
// them. Reported as B/pod (everything divided by the pods):
// `go test -run '^$' -bench SourceHeap ./mesh/kube/`.
func BenchmarkSourceHeap(b *testing.B) {
	const pods, svcs = 10000, 2000
	for range b.N {
		objs := []kruntime.Object{}
		for i := range 10 {
			objs = append(objs, ns(fmt.Sprintf("scale-%02d", i), true))
		}
		for i := range pods {
			p := pod(fmt.Sprintf("scale-%02d", i*10/pods), fmt.Sprintf("p-%05d", i), fmt.Sprintf("fake-%02d", i%50),
				fmt.Sprintf("198.18.%d.%d", 200+i/250, 1+i%250), fmt.Sprintf("fd00:6d74:%d::%d", 200+i/250, 1+i%250))
			p.Labels = map[string]string{"app": fmt.Sprintf("svc-%04d", i/(pods/svcs))}
			p.UID = types.UID(fmt.Sprintf("0b6f3c1e-5d2a-4a8e-9f1c-%012d", i))
			p.Spec.Containers = []corev1.Container{{Name: "app", Image: "example.invalid/app:1",
				Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}}}
			objs = append(objs, p)
		}
		for j := range svcs {
			namespace, name := fmt.Sprintf("scale-%02d", j*10/svcs), fmt.Sprintf("svc-%04d", j)
			objs = append(objs, &corev1.Service{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name},
				Spec: corev1.ServiceSpec{ClusterIPs: []string{fmt.Sprintf("198.19.%d.%d", j/250, 1+j%250)}, Selector: map[string]string{"app": name},
					Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}}})
			var eps []discoveryv1.Endpoint
			for i := j * pods / svcs; i < (j+1)*pods/svcs; i++ {
				eps = append(eps, discoveryv1.Endpoint{Addresses: []string{fmt.Sprintf("198.18.%d.%d", 200+i/250, 1+i%250)},
					Conditions: discoveryv1.EndpointConditions{Ready: ptr(true)},
					TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: namespace, Name: fmt.Sprintf("p-%05d", i)}})
			}
			objs = append(objs, &discoveryv1.EndpointSlice{ObjectMeta: metav1.ObjectMeta{Namespace: namespace, Name: name + "-v4",
				Labels: map[string]string{discoveryv1.LabelServiceName: name}}, AddressType: discoveryv1.AddressTypeIPv4,
				Ports: []discoveryv1.EndpointPort{{Name: ptr("http"), Port: ptr(int32(8080))}}, Endpoints: eps})
		}
		cs := fake.NewClientset(objs...)
		runtime.GC()
		var m0, m1 runtime.MemStats
		runtime.ReadMemStats(&m0)
		s := New(Config{Client: fakeAPI{cs}, Node: "n1", TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local"), Logger: zerolog.Nop()})
		ctx, cancel := context.WithCancel(context.Background())
		snap, err := s.Start(ctx)
		if err != nil {
			b.Fatal(err)
		}
		if len(snap.Workloads) != pods {
			b.Fatalf("%d workloads, want %d", len(snap.Workloads), pods)
		}
		runtime.GC()
		runtime.ReadMemStats(&m1)
		b.ReportMetric(float64(m1.HeapAlloc-m0.HeapAlloc)/pods, "B/pod")
		runtime.KeepAlive(snap)
		runtime.KeepAlive(s)
		runtime.KeepAlive(cs)
		cancel()
	}
}
