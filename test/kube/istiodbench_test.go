package kube

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
)

// BenchmarkIstiodScale runs meshtun nodes against a real istiod (delta
// xDS) watching a real API server that holds scalePods pods in ambient
// namespaces and scaleServices services (loadScale, as BenchmarkKube),
// and measures the node's memory per workload (issue 24 item 6):
//
//   - a node that runs while the objects are created and follows
//     istiod's incremental pushes: its RSS and live heap (after a forced
//     GC, from the admin socket's pprof) before and after, per workload;
//   - a node started once istiod holds everything: the time from its
//     start to its first model holding every workload and service, the
//     xDS full state's size (istio_xds_message_bytes_total of its first
//     responses), and its RSS and live heap, per workload against the
//     first node's before.
//
// MESHTUN_BENCH_BASE_BIN=<meshtun binary> measures another build (a
// baseline) the same way in the same run, its metrics prefixed "base-".
// With MESHTUN_BENCH_PROFILE_DIR set, the nodes' heap profiles are
// written there (go tool pprof). Not part of `make test`: `make
// bench-istiod` runs it, once. It needs istiod's pilot-discovery, built
// once into the cache (20 minutes or more cold).
func BenchmarkIstiodScale(b *testing.B) {
	ctx := context.Background()
	// Each binary measured gets two nodes: one that follows the load, one
	// started on the full state. MESHTUN_BENCH_BASE_BIN adds a baseline
	// binary (another commit's meshtun), measured in the same run.
	type bin struct{ name, path string }
	bins := []bin{{"", meshtunBin}}
	if base := os.Getenv("MESHTUN_BENCH_BASE_BIN"); base != "" {
		bins = append(bins, bin{"base-", base})
	}
	c := cluster.NewT(b, cluster.Spec{Name: "xbench", Nodes: 2 * len(bins), PodsPerNode: 1})
	cp := controlPlaneT(b, c)
	dir := b.TempDir()
	istiod := istiodT(b, cp, "istio-system/ztunnel")
	istioMs, err := ReadManifests("../../deploy/istio")
	if err != nil {
		b.Fatal(err)
	}
	if err := cp.Apply(ctx, istioMs, false); err != nil {
		b.Fatalf("deploy/istio: %v", err)
	}
	root, tokens, _ := istiodFiles(b, cp, dir, c.Nodes...)
	start := func(bin string, i int) (*noderun.Process, string) {
		n := c.Nodes[i]
		sock := filepath.Join(dir, noderun.NodeName(n)+".sock")
		cfgPath := istioNodeConfigWith(b, istioMs, filepath.Join(dir, noderun.NodeName(n)), sock)
		sctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
		defer cancel()
		m, err := noderun.Start(sctx, bin, n, "--config", cfgPath,
			"--xds-address", istiod.Addr.String(), "--xds-server-name", istiod.ServerName,
			"--xds-root-cert", root, "--xds-token", tokens[i],
			"--ca-address", istiod.Addr.String(), "--ca-server-name", istiod.ServerName, "--ca-root-cert", root,
			"--pod-name", "meshtun-"+noderun.NodeName(n), "--pod-namespace", "istio-system",
			"--service-account", "ztunnel", "--instance-ip", n.IPv4.String(), "--cluster-id", "Kubernetes")
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { m.Stop(9) })
		return m, sock
	}
	type follower struct {
		m         *noderun.Process
		sock      string
		rss, heap int64 // before the load
		base      modelStatus
	}
	var fs []follower
	for i, bn := range bins {
		m, sock := start(bn.path, 2*i)
		fs = append(fs, follower{m: m, sock: sock, base: waitModel(b, c.Nodes[2*i], 0, 0, time.Minute)})
	}
	time.Sleep(5 * time.Second) // let the start's garbage be collected
	for i := range fs {
		fs[i].rss = vmRSS(b, fs[i].m.Pid())
		fs[i].heap = liveHeap(b, fs[i].sock, "")
	}

	b.Run("Scale", func(b *testing.B) {
		t0 := time.Now()
		loadScale(b, cp)
		created := time.Since(t0)
		var st modelStatus
		for i, f := range fs {
			st = waitModel(b, c.Nodes[2*i], f.base.Workloads+scalePods, f.base.Services+scaleServices, 15*time.Minute)
		}
		modelled := time.Since(t0)
		b.Logf("model: %d workloads, %d services; objects created in %s, the following nodes modelled them after %s",
			st.Workloads, st.Services, created.Round(time.Millisecond), modelled.Round(time.Millisecond))
		time.Sleep(10 * time.Second) // settle: GC of the updates' garbage
		per := func(after, before int64) float64 { return float64(after-before) / scalePods }
		for i, bn := range bins {
			f := fs[i]
			rss1 := vmRSS(b, f.m.Pid())
			heap1 := liveHeap(b, f.sock, bn.name+"incremental")
			recv := xdsBytes(b, c.Nodes[2*i])

			t1 := time.Now()
			m2, sock2 := start(bn.path, 2*i+1)
			ready := time.Since(t1)
			sctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
			_, err := m2.WaitLogSince(sctx, 0, func(l noderun.Line) bool {
				return l.Str("message") == "applied istiod's update" &&
					int(l.Num("workloads")) >= st.Workloads && int(l.Num("services")) >= st.Services
			})
			cancel()
			if err != nil {
				b.Fatalf("%snode %d has no model of %d workloads and %d services: %v", bn.name, 2*i+1, st.Workloads, st.Services, err)
			}
			first := time.Since(t1)
			full := xdsBytes(b, c.Nodes[2*i+1])
			time.Sleep(10 * time.Second)
			rss2 := vmRSS(b, m2.Pid())
			heap2 := liveHeap(b, sock2, bn.name+"fullstate")
			m2.Stop(9) // one node at a time on the machine

			b.ReportMetric(float64(f.rss)/1024, bn.name+"rss-before-MiB")
			b.ReportMetric(float64(f.heap)/(1<<20), bn.name+"heap-before-MiB")
			b.ReportMetric(per(rss1, f.rss), bn.name+"incr-rss-KiB/wl")
			b.ReportMetric(per(heap1, f.heap)/1024, bn.name+"incr-heap-KiB/wl")
			b.ReportMetric(per(rss2, f.rss), bn.name+"full-rss-KiB/wl")
			b.ReportMetric(per(heap2, f.heap)/1024, bn.name+"full-heap-KiB/wl")
			b.ReportMetric(float64(full), bn.name+"fullstate-bytes")
			b.ReportMetric(first.Seconds(), bn.name+"first-model-s")
			b.Logf("%snode following the load: RSS %d → %d KiB, live heap %d → %d KiB; %d bytes of Address resources received",
				bn.name, f.rss, rss1, f.heap>>10, heap1>>10, recv)
			b.Logf("%snode started on the full state: RSS %d KiB, live heap %d KiB; xDS full state %d bytes; ready after %s, full model after %s",
				bn.name, rss2, heap2>>10, full, ready.Round(time.Millisecond), first.Round(time.Millisecond))
		}
	})
}

// istioNodeConfigWith writes deploy/istio's node settings into dir with
// the admin socket at sock (pprof).
func istioNodeConfigWith(b testing.TB, ms []Manifest, dir, sock string) string {
	b.Helper()
	if err := os.MkdirAll(dir, 0o755); err != nil {
		b.Fatal(err)
	}
	path := istioNodeConfig(b, ms, dir)
	y, err := os.ReadFile(path)
	if err != nil {
		b.Fatal(err)
	}
	const listen = `listen: {admin: "127.0.0.1:15000",`
	if !strings.Contains(string(y), listen) {
		b.Fatalf("deploy/istio's mesh.yaml has no %q", listen)
	}
	out := strings.Replace(string(y), listen, fmt.Sprintf("listen: {adminSocket: %q, admin: \"127.0.0.1:15000\",", sock), 1)
	if err := os.WriteFile(path, []byte(out), 0o644); err != nil {
		b.Fatal(err)
	}
	return path
}

// liveHeap returns the node's live heap in bytes (HeapAlloc right after
// a forced GC), from its admin socket's pprof; with name and
// MESHTUN_BENCH_PROFILE_DIR set, it writes the heap profile there as
// name.pprof.
func liveHeap(b testing.TB, sock, name string) int64 {
	b.Helper()
	hc := &http.Client{Timeout: time.Minute, Transport: &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", sock)
		}}}
	get := func(url string) []byte {
		resp, err := hc.Get(url)
		if err != nil {
			b.Fatalf("admin socket %s: %v", sock, err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil || resp.StatusCode != http.StatusOK {
			b.Fatalf("admin socket %s: %s: %v %s", sock, url, err, resp.Status)
		}
		return body
	}
	if out := os.Getenv("MESHTUN_BENCH_PROFILE_DIR"); out != "" && name != "" {
		if err := os.WriteFile(filepath.Join(out, name+".pprof"), get("http://node/debug/pprof/heap?gc=1"), 0o644); err != nil {
			b.Fatal(err)
		}
	}
	sc := bufio.NewScanner(strings.NewReader(string(get("http://node/debug/pprof/heap?gc=1&debug=1"))))
	sc.Buffer(nil, 16<<20)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "# HeapAlloc = "); ok {
			n, err := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
			if err != nil {
				b.Fatalf("HeapAlloc %q: %v", v, err)
			}
			return n
		}
	}
	b.Fatalf("admin socket %s: no HeapAlloc in the heap profile", sock)
	return 0
}

// xdsBytes returns the bytes of Address resources node n received from
// istiod (istio_xds_message_bytes_total).
func xdsBytes(b testing.TB, n *cluster.Node) int64 {
	b.Helper()
	for _, l := range strings.Split(metricsText(b, n), "\n") {
		if strings.HasPrefix(l, "istio_xds_message_bytes_total{") && strings.Contains(l, "istio.workload.Address") {
			f := strings.Fields(l)
			v, err := strconv.ParseFloat(f[len(f)-1], 64)
			if err != nil {
				b.Fatalf("metric line %q: %v", l, err)
			}
			return int64(v)
		}
	}
	b.Fatalf("node %s has no istio_xds_message_bytes_total of Address resources", noderun.NodeName(n))
	return 0
}
