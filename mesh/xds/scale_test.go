package xds

import (
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"testing"
	"time"

	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/protobuf/types/known/anypb"
	"istio.io/istio/pkg/workloadapi"
)

// scaleState returns Address resources shaped as istiod sends them for
// pods (dual-stack, of a Deployment, each the endpoint of one service)
// and services (one VIP, one port): nw workloads over 10 namespaces and
// 50 nodes, ns services of nw/ns workloads each, as test/kube's
// BenchmarkIstiodScale creates them.
func scaleState(tb testing.TB, nw, ns int) (workloads, services []*discoveryv3.Resource) {
	tb.Helper()
	per := nw / ns
	res := func(name string, a *workloadapi.Address) *discoveryv3.Resource {
		body, err := anypb.New(a)
		if err != nil {
			tb.Fatal(err)
		}
		return &discoveryv3.Resource{Name: name, Version: "2026-12-04T19:00:00Z/17", Resource: body}
	}
	nsOf := func(i int) string { return fmt.Sprintf("scale-%02d", i*10/nw) }
	for i := range nw {
		namespace, name := nsOf(i), fmt.Sprintf("p-%05d", i)
		sub, host := 200+i/250, 1+i%250
		v4 := netip.AddrFrom4([4]byte{198, 18, byte(sub), byte(host)})
		v6 := netip.MustParseAddr(fmt.Sprintf("fd00:6d74:%d::%d", sub, host))
		svcName := fmt.Sprintf("svc-%04d", i/per)
		uid := "Kubernetes//Pod/" + namespace + "/" + name
		workloads = append(workloads, res(uid, &workloadapi.Address{Type: &workloadapi.Address_Workload{Workload: &workloadapi.Workload{
			Uid: uid, Name: name, Namespace: namespace, ServiceAccount: "app", Node: fmt.Sprintf("fake-%02d", i%50),
			Addresses:     [][]byte{v4.AsSlice(), v6.AsSlice()},
			CanonicalName: svcName, CanonicalRevision: "latest", WorkloadName: svcName, WorkloadType: workloadapi.WorkloadType_DEPLOYMENT,
			ClusterId: "Kubernetes", TrustDomain: "cluster.local", Status: workloadapi.WorkloadStatus_HEALTHY,
			Services: map[string]*workloadapi.PortList{
				namespace + "/" + svcName + "." + namespace + ".svc.cluster.local": {Ports: []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}}},
			},
		}}}))
	}
	for j := range ns {
		namespace, name := nsOf(j*per), fmt.Sprintf("svc-%04d", j)
		host := name + "." + namespace + ".svc.cluster.local"
		vip := netip.AddrFrom4([4]byte{198, 19, byte(j >> 8), byte(j)})
		services = append(services, res(namespace+"/"+host, &workloadapi.Address{Type: &workloadapi.Address_Service{Service: &workloadapi.Service{
			Name: name, Namespace: namespace, Hostname: host,
			Addresses: []*workloadapi.NetworkAddress{{Address: vip.AsSlice()}},
			Ports:     []*workloadapi.Port{{ServicePort: 80, TargetPort: 8080}},
		}}}))
	}
	return workloads, services
}

func scaleSource() *Source {
	return New(Config{
		Address:     "istiod.istio-system.svc:15012",
		Node:        Node{PodName: "meshtun-abcde", Namespace: "istio-system", ServiceAccount: "ztunnel", IP: netip.MustParseAddr("198.18.0.2"), NodeName: "n1", ClusterID: "Kubernetes"},
		TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local"),
		Logger:      zerolog.Nop(),
	})
}

func liveHeap() uint64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&ms)
	return ms.HeapAlloc
}

// writeHeap writes a heap profile to $MESHTUN_XDS_HEAP_DIR/name.pprof if
// that is set.
func writeHeap(tb testing.TB, name string) {
	dir := os.Getenv("MESHTUN_XDS_HEAP_DIR")
	if dir == "" {
		return
	}
	f, err := os.Create(filepath.Join(dir, name+".pprof"))
	if err != nil {
		tb.Fatal(err)
	}
	defer f.Close()
	if err := pprof.WriteHeapProfile(f); err != nil {
		tb.Fatal(err)
	}
}

func totalAlloc() uint64 {
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return ms.TotalAlloc
}

const (
	scaleWorkloads = 10000
	scaleServices  = 2000
)

// BenchmarkSourceScale measures, in-process, what the source holds for
// 10,000 workloads and 2,000 services as istiod sends them: the live heap
// per workload once a full state is applied (the source's state and the
// snapshot a node keeps), and the garbage and time per workload when the
// same state arrives as pushes of 50 resources (as while pods start).
func BenchmarkSourceScale(b *testing.B) {
	if os.Getenv("MESHTUN_XDS_HEAP_DIR") != "" {
		runtime.MemProfileRate = 4096
	}
	for range b.N {
		src := scaleSource()
		h0 := liveHeap()
		ws, ss := scaleState(b, scaleWorkloads, scaleServices)
		all := append(append([]*discoveryv3.Resource{}, ss...), ws...)
		src.apply(response{typeURL: AuthorizationType, full: true})
		t0 := time.Now()
		src.apply(response{typeURL: AddressType, full: true, resources: all})
		full := time.Since(t0)
		snap := <-src.first
		all, ws, ss = nil, nil, nil
		h1 := liveHeap()
		writeHeap(b, "full")
		if len(snap.Workloads) != scaleWorkloads || len(snap.Services) != scaleServices {
			b.Fatalf("model of %d workloads and %d services, want %d and %d", len(snap.Workloads), len(snap.Services), scaleWorkloads, scaleServices)
		}
		runtime.KeepAlive(snap)
		runtime.KeepAlive(src)
		b.ReportMetric(float64(h1-h0)/scaleWorkloads, "full-heap-B/wl")
		b.ReportMetric(full.Seconds()*1000, "full-ms")

		// The same state pushed in pieces, services first.
		src = scaleSource()
		snap = nil
		h2 := liveHeap()
		ws, ss = scaleState(b, scaleWorkloads, scaleServices)
		src.apply(response{typeURL: AuthorizationType, full: true})
		src.apply(response{typeURL: AddressType, full: true, resources: ss})
		<-src.first
		a0 := totalAlloc()
		t0 = time.Now()
		const batch = 50
		for i := 0; i < len(ws); i += batch {
			src.apply(response{typeURL: AddressType, resources: ws[i:min(i+batch, len(ws))]})
		}
		incr := time.Since(t0)
		garbage := totalAlloc() - a0
		ws, ss = nil, nil
		h3 := liveHeap()
		writeHeap(b, "incr")
		last := <-src.Updates()
		if len(last.Workloads) != scaleWorkloads {
			b.Fatalf("model of %d workloads after the pushes, want %d", len(last.Workloads), scaleWorkloads)
		}
		b.ReportMetric(float64(h3-h2)/scaleWorkloads, "incr-heap-B/wl")
		b.ReportMetric(float64(garbage)/scaleWorkloads/(scaleWorkloads/batch), "incr-alloc-B/wl/push")
		b.ReportMetric(incr.Seconds()*1000/(scaleWorkloads/batch), "push-ms")
	}
}
