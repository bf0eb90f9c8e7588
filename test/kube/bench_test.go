package kube

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
)

// Scale of the API server's contents for the benchmarks (issue 12): pods
// spread over scaleNamespaces ambient namespaces and scaleFakeNodes nodes
// that do not exist (no veths: the measured node only models them), each
// service selecting scalePodsPerSvc of them.
const (
	scalePods       = 10000
	scaleServices   = 2000
	scalePodsPerSvc = scalePods / scaleServices
	scaleNamespaces = 10
	scaleFakeNodes  = 50
	scaleWorkers    = 32 // concurrent creates
	// latencyChanges is the number of timed changes of each latency
	// benchmark.
	latencyChanges = 200
)

// scaleAddrs returns the addresses of fake pod i: 198.18.200.0 and up
// (clear of the cluster's nodes and pods, 198.18.0-89.x, and of the
// service range 198.19.0.0/16), and the IPv6 twin of the plan.
func scaleAddrs(i int) (netip.Addr, netip.Addr) {
	sub, host := 200+i/250, 1+i%250
	return netip.AddrFrom4([4]byte{198, 18, byte(sub), byte(host)}),
		netip.MustParseAddr(fmt.Sprintf("fd00:6d74:%d::%d", sub, host))
}

// BenchmarkKube runs meshtun node --kubernetes against a real API server
// holding scalePods pods and scaleServices services (with their
// EndpointSlices) and measures the node: its memory (NodeModelScale), the
// time from a local pod's status patch to its capture rule
// (CaptureLatency), and from an AuthorizationPolicy's creation to a
// connection being refused (PolicyLatency). Not part of `make test`:
// `make bench-kube` runs it, once.
func BenchmarkKube(b *testing.B) {
	ctx := context.Background()
	// Node 1's pods: 1 client, 2 server, 3… the pods whose capture is timed.
	c := cluster.NewT(b, cluster.Spec{Name: "kbench", Nodes: 1, PodsPerNode: 6})
	cp := controlPlaneT(b, c)
	ms := applyDeploy(b, cp)
	dir := b.TempDir()
	cfgPath := nodeConfig(b, ms, dir, netip.AddrPortFrom(cp.Host.IPv4, caPort))
	ca := startCA(b, cp, ms, cfgPath, dir)
	installIstioCRDs(b, cp)

	kubeconfig := nodeKubeconfig(b, cp, dir)
	n := c.Nodes[0]
	client, server, capPods := n.Pods[0], n.Pods[1], n.Pods[2:]
	k := kubelet{t: b, cs: cp.Admin}
	k.namespace("bench", true)
	k.run(client, "bench", "client", "client", map[string]string{"app": "client"})
	k.run(server, "bench", "server", "server", map[string]string{"app": "server"})
	echo(b, server, 8080)

	sctx, cancel := context.WithTimeout(ctx, time.Minute)
	m, err := noderun.Start(sctx, meshtunBin, n, "--kubernetes", "--kubeconfig", kubeconfig, "--config", cfgPath,
		"--ca-token-file", nodeToken(b, cp, n, dir), "--ca-roots", ca.roots)
	cancel()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { m.Stop(9) })
	waitLog(b, m, 0, "server captured", podLog("bench/server", "pod in the mesh"))
	waitLog(b, m, 0, "client captured", podLog("bench/client", "pod in the mesh"))
	roundTrip(b, client, netip.AddrPortFrom(server.IPv4, 8080))
	base := waitModel(b, n, 0, 0, time.Minute)
	time.Sleep(5 * time.Second) // let the start's garbage be collected
	rssBefore := vmRSS(b, m.Pid())

	b.Run("NodeModelScale", func(b *testing.B) {
		start := time.Now()
		loadScale(b, cp)
		created := time.Since(start)
		st := waitModel(b, n, base.Workloads+scalePods, base.Services+scaleServices, 5*time.Minute)
		modelled := time.Since(start)
		time.Sleep(10 * time.Second) // settle: GC of the list's garbage
		rss := vmRSS(b, m.Pid())
		b.ReportMetric(float64(rssBefore)/1024, "rss-before-MiB")
		b.ReportMetric(float64(rss)/1024, "rss-MiB")
		b.ReportMetric(float64(rss-rssBefore)/scalePods, "KiB/pod")
		b.ReportMetric(created.Seconds(), "create-s")
		b.ReportMetric(modelled.Seconds(), "modelled-s")
		b.Logf("model: %d workloads, %d services; RSS %d KiB before, %d KiB after; objects created in %s, modelled after %s",
			st.Workloads, st.Services, rssBefore, rss, created.Round(time.Millisecond), modelled.Round(time.Millisecond))
	})

	b.Run("CaptureLatency", func(b *testing.B) {
		// lat: patch to rule; modelLat: patch to the node's "pod in the
		// mesh" log line (the model built; the rest is installing it).
		var lat, modelLat []time.Duration
		for i := range latencyChanges {
			p := capPods[i%len(capPods)]
			prefix := netip.PrefixFrom(p.IPv4, 32).String()
			name := "cap-" + strconv.Itoa(i)
			pod := &corev1.Pod{
				ObjectMeta: metav1.ObjectMeta{Namespace: "bench", Name: name},
				Spec: corev1.PodSpec{NodeName: noderun.NodeName(n), ServiceAccountName: "client",
					AutomountServiceAccountToken: new(bool),
					Containers:                   []corev1.Container{{Name: "app", Image: "example.invalid/app:1"}}},
			}
			pod, err := cp.Admin.CoreV1().Pods("bench").Create(ctx, pod, metav1.CreateOptions{})
			if err != nil {
				b.Fatal(err)
			}
			if ruleFor(b, n, prefix) {
				b.Fatalf("capture rule for %s before pod %s runs", prefix, name)
			}
			pod.Status = runningStatus(p.IPv4, p.IPv6, n.IPv4)
			mark := m.Len()
			inMesh := podLog("bench/"+name, "pod in the mesh")
			var modelled time.Duration
			t0 := time.Now()
			if _, err := cp.Admin.CoreV1().Pods("bench").UpdateStatus(ctx, pod, metav1.UpdateOptions{}); err != nil {
				b.Fatal(err)
			}
			for !ruleFor(b, n, prefix) {
				if modelled == 0 && slices.ContainsFunc(m.Lines()[mark:], inMesh) {
					modelled = time.Since(t0)
				}
				if time.Since(t0) > 30*time.Second {
					b.Fatalf("no capture rule for %s 30s after pod %s runs", prefix, name)
				}
				time.Sleep(2 * time.Millisecond)
			}
			lat = append(lat, time.Since(t0))
			if modelled == 0 { // logged while the last netlink dump ran
				modelled = lat[len(lat)-1]
			}
			modelLat = append(modelLat, modelled)
			if err := cp.Admin.CoreV1().Pods("bench").Delete(ctx, name, metav1.DeleteOptions{GracePeriodSeconds: new(int64(0))}); err != nil {
				b.Fatal(err)
			}
			waitRule(b, n, prefix, false)
		}
		reportLatency(b, lat, "")
		reportLatency(b, modelLat, "model-")
	})

	b.Run("PolicyLatency", func(b *testing.B) {
		dst := netip.AddrPortFrom(server.IPv4, 8080)
		apr := dynamic.NewForConfigOrDie(cp.AdminConfig).Resource(schema.GroupVersionResource{
			Group: "security.istio.io", Version: "v1", Resource: "authorizationpolicies"}).Namespace("bench")
		var lat []time.Duration
		for i := range latencyChanges {
			name := "deny-" + strconv.Itoa(i)
			deny := &unstructured.Unstructured{Object: map[string]any{
				"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
				"metadata": map[string]any{"name": name, "namespace": "bench"},
				"spec": map[string]any{
					"selector": map[string]any{"matchLabels": map[string]any{"app": "server"}},
					"action":   "DENY",
					"rules": []any{map[string]any{"from": []any{map[string]any{"source": map[string]any{
						"principals": []any{"cluster.local/ns/bench/sa/client"}}}}}},
				},
			}}
			if !roundTripMaybe(client, dst).IsValid() {
				b.Fatalf("client → server refused before policy %s", name)
			}
			t0 := time.Now()
			if _, err := apr.Create(ctx, deny, metav1.CreateOptions{}); err != nil {
				b.Fatal(err)
			}
			for roundTripMaybe(client, dst).IsValid() {
				if time.Since(t0) > 30*time.Second {
					b.Fatalf("client → server still allowed 30s after DENY policy %s", name)
				}
				time.Sleep(2 * time.Millisecond)
			}
			lat = append(lat, time.Since(t0))
			if err := apr.Delete(ctx, name, metav1.DeleteOptions{}); err != nil {
				b.Fatal(err)
			}
			deadline := time.Now().Add(30 * time.Second)
			for !roundTripMaybe(client, dst).IsValid() {
				if time.Now().After(deadline) {
					b.Fatalf("client → server still refused 30s after policy %s was deleted", name)
				}
				time.Sleep(5 * time.Millisecond)
			}
		}
		reportLatency(b, lat, "")
	})
}

// runningStatus is the status the kubelet reports for a running, ready pod.
func runningStatus(ip4, ip6, host netip.Addr) corev1.PodStatus {
	now := metav1.Now()
	return corev1.PodStatus{
		Phase: corev1.PodRunning, PodIP: ip4.String(),
		PodIPs:    []corev1.PodIP{{IP: ip4.String()}, {IP: ip6.String()}},
		HostIP:    host.String(),
		StartTime: &now,
		Conditions: []corev1.PodCondition{
			{Type: corev1.PodReady, Status: corev1.ConditionTrue, LastTransitionTime: now},
		},
	}
}

// reportLatency reports the median and 99th percentile of lat, in ms, as
// metrics named with prefix.
func reportLatency(b *testing.B, lat []time.Duration, prefix string) {
	slices.Sort(lat)
	q := func(p float64) float64 {
		return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))]) / float64(time.Millisecond)
	}
	b.ReportMetric(q(0.50), prefix+"p50-ms")
	b.ReportMetric(q(0.99), prefix+"p99-ms")
	if prefix == "" {
		b.ReportMetric(float64(lat[len(lat)-1])/float64(time.Millisecond), "max-ms")
		b.ReportMetric(float64(len(lat)), "changes")
	}
}

// modelStatus is the part of the node's /config_dump the benchmark reads.
type modelStatus struct {
	Workloads int `json:"workloads"`
	Services  int `json:"services"`
}

// waitModel waits until node n's model holds at least workloads workloads
// and services services (its /config_dump says; there is no other signal).
func waitModel(b testing.TB, n *cluster.Node, workloads, services int, timeout time.Duration) modelStatus {
	b.Helper()
	deadline := time.Now().Add(timeout)
	hc := &http.Client{Timeout: time.Minute, Transport: &http.Transport{DialContext: n.Dial}}
	for {
		// The dump of a large model is slow to serve on a busy machine:
		// a failed read is retried until the deadline.
		var dump struct{ Source modelStatus }
		resp, err := hc.Get("http://127.0.0.1:15000/config_dump?format=meshtun")
		if err == nil {
			err = json.NewDecoder(resp.Body).Decode(&dump)
			resp.Body.Close()
		}
		st := dump.Source
		if err == nil && st.Workloads >= workloads && st.Services >= services {
			return st
		}
		if time.Now().After(deadline) {
			b.Fatalf("model has %d workloads and %d services after %s, want %d and %d (last read: %v)", st.Workloads, st.Services, timeout, workloads, services, err)
		}
		time.Sleep(500 * time.Millisecond)
	}
}

// vmRSS returns the resident set size of process pid, in KiB.
func vmRSS(b testing.TB, pid int) int64 {
	b.Helper()
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		b.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "VmRSS:"); ok {
			kib, err := strconv.ParseInt(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")), 10, 64)
			if err != nil {
				b.Fatalf("VmRSS of %d: %q: %v", pid, v, err)
			}
			return kib
		}
	}
	b.Fatalf("no VmRSS in /proc/%d/status", pid)
	return 0
}

// loadScale creates the scale's namespaces, pods (created, then their
// status set to Running with their addresses, as the kubelet would),
// services and EndpointSlices (as the endpoint-slice controller would),
// scaleWorkers at a time, without waiting for anything but the API
// server's answers.
func loadScale(b testing.TB, cp *ControlPlane) {
	b.Helper()
	ctx := context.Background()
	cfg := *cp.AdminConfig
	cfg.QPS = -1 // no client-side rate limit
	// A busy machine (CI, parallel runs) can take the API server longer
	// than the admin client's 30 s to answer one create.
	cfg.Timeout = 3 * time.Minute
	cs, err := kubernetes.NewForConfig(&cfg)
	if err != nil {
		b.Fatal(err)
	}
	nsOf := func(pod int) string { return fmt.Sprintf("scale-%02d", pod*scaleNamespaces/scalePods) }
	for i := range scaleNamespaces {
		ns := fmt.Sprintf("scale-%02d", i)
		if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{
			Name: ns, Labels: map[string]string{"istio.io/dataplane-mode": "ambient"}}}, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
		if _, err := cs.CoreV1().ServiceAccounts(ns).Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "app"}}, metav1.CreateOptions{}); err != nil {
			b.Fatal(err)
		}
	}
	parallel(b, scalePods, func(i int) error {
		ns := nsOf(i)
		ip4, ip6 := scaleAddrs(i)
		node := i % scaleFakeNodes
		name := fmt.Sprintf("p-%05d", i)
		pod, err := cs.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name,
				Labels: map[string]string{"app": fmt.Sprintf("svc-%04d", i/scalePodsPerSvc)}},
			Spec: corev1.PodSpec{NodeName: fmt.Sprintf("fake-%02d", node), ServiceAccountName: "app",
				AutomountServiceAccountToken: new(bool),
				Containers: []corev1.Container{{Name: "app", Image: "example.invalid/app:1",
					Ports: []corev1.ContainerPort{{Name: "http", ContainerPort: 8080}}}}},
		}, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) { // a retry (parallel) of a create that timed out
			pod, err = cs.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
		}
		if err != nil {
			return err
		}
		// A fake node's address: where its pods' traffic would go.
		pod.Status = runningStatus(ip4, ip6, netip.AddrFrom4([4]byte{198, 18, 250, byte(1 + node)}))
		_, err = cs.CoreV1().Pods(ns).UpdateStatus(ctx, pod, metav1.UpdateOptions{})
		return err
	})
	parallel(b, scaleServices, func(j int) error {
		ns := nsOf(j * scalePodsPerSvc)
		name := fmt.Sprintf("svc-%04d", j)
		if _, err := cs.CoreV1().Services(ns).Create(ctx, &corev1.Service{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec: corev1.ServiceSpec{Selector: map[string]string{"app": name},
				Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromInt32(8080)}}},
		}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
			return err
		}
		var eps []discoveryv1.Endpoint
		for i := j * scalePodsPerSvc; i < (j+1)*scalePodsPerSvc; i++ {
			ip4, _ := scaleAddrs(i)
			eps = append(eps, discoveryv1.Endpoint{Addresses: []string{ip4.String()},
				Conditions: discoveryv1.EndpointConditions{Ready: new(true)},
				TargetRef:  &corev1.ObjectReference{Kind: "Pod", Namespace: ns, Name: fmt.Sprintf("p-%05d", i)}})
		}
		_, err := cs.DiscoveryV1().EndpointSlices(ns).Create(ctx, &discoveryv1.EndpointSlice{
			ObjectMeta:  metav1.ObjectMeta{Namespace: ns, Name: name + "-v4", Labels: map[string]string{discoveryv1.LabelServiceName: name}},
			AddressType: discoveryv1.AddressTypeIPv4,
			Ports:       []discoveryv1.EndpointPort{{Name: new("http"), Port: new(int32(8080))}},
			Endpoints:   eps,
		}, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			return nil
		}
		return err
	})
}

// parallel runs fn(0…n-1), scaleWorkers at a time, and fails b with the
// first error. fn is retried (up to 5 times) when the API server answers
// that it timed out or is overloaded, as it does on a busy machine: fn
// must take an object that its timed-out attempt created anyway.
func parallel(b testing.TB, n int, fn func(int) error) {
	b.Helper()
	retried := func(i int) error {
		var err error
		for range 5 {
			if err = fn(i); err == nil || !(apierrors.IsTimeout(err) || apierrors.IsServerTimeout(err) || apierrors.IsTooManyRequests(err)) {
				return err
			}
		}
		return err
	}
	parallelOnce(b, n, retried)
}

func parallelOnce(b testing.TB, n int, fn func(int) error) {
	b.Helper()
	next := make(chan int)
	var wg sync.WaitGroup
	var once sync.Once
	var first error
	for range scaleWorkers {
		wg.Go(func() {
			for i := range next {
				if err := fn(i); err != nil {
					once.Do(func() { first = fmt.Errorf("object %d: %w", i, err) })
				}
			}
		})
	}
	for i := range n {
		next <- i
	}
	close(next)
	wg.Wait()
	if first != nil {
		b.Fatal(first)
	}
}
