package kind_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"
)

// speedYAML: an iperf3 and probe server on the first worker, a client on
// the second, in a namespace that is in the mesh ({{LABELS}} ambient) or
// not, or on the nodes' own network (hostNetwork) for kind's network
// without pods.
const speedYAML = `apiVersion: v1
kind: Namespace
metadata:
  name: {{NS}}
  labels: {{LABELS}}
---
apiVersion: v1
kind: Pod
metadata: {name: server, namespace: {{NS}}}
spec:
  hostNetwork: {{HOSTNET}}
  nodeSelector: {kubernetes.io/hostname: {{W1}}}
  terminationGracePeriodSeconds: 1
  containers:
    - {name: iperf3, image: meshtun-toolbox:dev, imagePullPolicy: Never, command: [iperf3, -s, -p, "5301"]}
    - {name: probe, image: meshtun-probe:dev, imagePullPolicy: Never, args: [serve, -tcp, ":18080", -http, ":18081"]}
---
apiVersion: v1
kind: Pod
metadata: {name: client, namespace: {{NS}}}
spec:
  hostNetwork: {{HOSTNET}}
  nodeSelector: {kubernetes.io/hostname: {{W2}}}
  terminationGracePeriodSeconds: 1
  containers:
    - {name: tools, image: meshtun-toolbox:dev, imagePullPolicy: Never, command: [sleep, infinity]}
    - {name: probe, image: meshtun-probe:dev, imagePullPolicy: Never, args: [sleep]}
`

// speedRow is one line of the table.
type speedRow struct {
	name                  string
	fwdGbps, revGbps      float64
	rr, crr               benchResult
	proxyCPUPerGB         float64 // meshtun CPU-s on both nodes per GB sent, forward run
	serverRSS, clientRSS  float64
	serverCPUPct, cliCPUP float64
}

type benchResult struct {
	N      int     `json:"n"`
	PerSec float64 `json:"perSec"`
	P50us  int64   `json:"p50us"`
	P99us  int64   `json:"p99us"`
}

// BenchmarkSpeedTable measures pod → pod across the two workers in one
// run, on kind's node network (hostNetwork), between pods outside the
// mesh and between mesh pods: iperf3 one stream each way (10 s), 1-byte
// request/response on one connection (p50/p99, 5 s) and a new connection
// per exchange (rate, p50/p99, 5 s), and for the mesh the node proxies'
// CPU per GB. It logs the table docs/kind.md shows and reports the mesh's
// ratios to pods outside the mesh, measured in the same run. One pass is
// the measurement (b.N is not used):
//
//	cd test/kind && go test -count=1 -timeout 60m -run '^$' -bench SpeedTable -benchtime 1x ./
func BenchmarkSpeedTable(b *testing.B) {
	t := testing.TB(b)
	ctx := context.Background()
	w1, w2 := cl.Name+"-worker", cl.Name+"-worker2"
	var rows []speedRow
	for _, v := range []struct {
		name, labels string
		hostNet      bool
	}{
		{"kind node network (hostNetwork)", "{}", true},
		{"pod → pod, no mesh", "{}", false},
		{"pod → pod, mesh (HBONE)", "{istio.io/dataplane-mode: ambient}", false},
	} {
		ns := "speed-" + randHex(3)
		sharedNamespaces = append(sharedNamespaces, ns)
		y := strings.NewReplacer("{{NS}}", ns, "{{LABELS}}", v.labels, "{{HOSTNET}}", fmt.Sprint(v.hostNet), "{{W1}}", w1, "{{W2}}", w2).Replace(speedYAML)
		if _, err := cl.KubectlIn(ctx, y, "apply", "-f", "-"); err != nil {
			t.Fatal(err)
		}
		if _, err := cl.Kubectl(ctx, "-n", ns, "wait", "--for=condition=Ready", "pod", "--all", "--timeout=5m"); err != nil {
			t.Fatal(err)
		}
		out, err := cl.Kubectl(ctx, "-n", ns, "get", "pod", "server", "-o", "jsonpath={.status.podIP}")
		if err != nil {
			t.Fatal(err)
		}
		srv := strings.TrimSpace(string(out))
		tb := &toolbox{ns: ns}
		// The first exchange also waits until the client is captured (the
		// gate makes that immediate for new pods).
		for deadline := time.Now().Add(time.Minute); ; {
			_, err := probeExec(ctx, ns, 20*time.Second, "send", "-to", srv+":18080", "-msg", "warm-up")
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: %v", v.name, err)
			}
			time.Sleep(time.Second) // the server may still be starting
		}
		row := speedRow{name: v.name}
		var fwd iperfResult
		use := sampleProxies(t, []string{w1, w2}, 0, func() {
			fwd = tb.iperf(t, "client", "-c", srv, "-p", "5301", "-t", "10", "-J")
		})
		row.fwdGbps = fwd.End.SumReceived.BitsPerSecond / 1e9
		gb := float64(fwd.End.SumReceived.Bytes) / 1e9
		row.proxyCPUPerGB = (use[0].cpuSeconds() + use[1].cpuSeconds()) / gb
		row.serverRSS, row.clientRSS = use[0].rssMiB, use[1].rssMiB
		row.serverCPUPct, row.cliCPUP = use[0].cpuPct(), use[1].cpuPct()
		rev := tb.iperf(t, "client", "-c", srv, "-p", "5301", "-t", "10", "-R", "-J")
		row.revGbps = rev.End.SumReceived.BitsPerSecond / 1e9
		for _, m := range []struct {
			mode string
			r    *benchResult
		}{{"rr", &row.rr}, {"crr", &row.crr}} {
			out, err := probeExec(ctx, ns, time.Minute, "bench", "-to", srv+":18080", "-mode", m.mode, "-for", "5s")
			if err != nil {
				t.Fatal(err)
			}
			if err := json.Unmarshal([]byte(out), m.r); err != nil {
				t.Fatalf("probe bench %s: %q: %v", m.mode, out, err)
			}
		}
		rows = append(rows, row)
		t.Logf("%s: %+v", v.name, row)
		cl.Kubectl(ctx, "delete", "namespace", ns, "--wait=false")
	}
	var tbl strings.Builder
	fmt.Fprintf(&tbl, "\n| path | throughput → | throughput ← | RR p50 | RR p99 | RR/s | connect+RR/s | CRR p50 | CRR p99 | meshtun CPU-s per GB (both nodes) |\n|---|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		fmt.Fprintf(&tbl, "| %s | %.2f Gbit/s | %.2f Gbit/s | %d µs | %d µs | %.0f | %.0f | %d µs | %d µs | %.2f |\n",
			r.name, r.fwdGbps, r.revGbps, r.rr.P50us, r.rr.P99us, r.rr.PerSec, r.crr.PerSec, r.crr.P50us, r.crr.P99us, r.proxyCPUPerGB)
	}
	if len(rows) == 3 {
		p, m := rows[1], rows[2]
		b.ReportMetric(m.fwdGbps/p.fwdGbps, "mesh/plain-throughput")
		b.ReportMetric(float64(m.rr.P50us)/float64(p.rr.P50us), "mesh/plain-rr-p50")
		b.ReportMetric(m.crr.PerSec/p.crr.PerSec, "mesh/plain-crr-rate")
		fmt.Fprintf(&tbl, "\nmesh / no mesh: throughput → %.2f, ← %.2f; RR p50 %.2f; connect rate %.2f\n",
			m.fwdGbps/p.fwdGbps, m.revGbps/p.revGbps, float64(m.rr.P50us)/float64(p.rr.P50us), m.crr.PerSec/p.crr.PerSec)
	}
	t.Log(tbl.String())
}

// probeExec runs /probe with args in the client pod's probe container
// (the pod's first container is the toolbox).
func probeExec(ctx context.Context, ns string, timeout time.Duration, args ...string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	out, err := cl.Kubectl(ctx, append([]string{"-n", ns, "exec", "client", "-c", "probe", "--", "/probe"}, args...)...)
	if err != nil {
		return string(out), fmt.Errorf("/probe %s in %s/client: %w", strings.Join(args, " "), ns, err)
	}
	return string(out), nil
}
