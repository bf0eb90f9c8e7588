package kube

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"github.com/spiffe/go-spiffe/v2/svid/x509svid"
	"github.com/vishvananda/netlink"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/tun"
)

// waitRedirected waits until the pod carries the redirection annotation
// (want) or not, as meshtun's --redirect-pods sets it.
func waitRedirected(t *testing.T, cs *kubernetes.Clientset, ns, name string, want bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		p, err := cs.CoreV1().Pods(ns).Get(context.Background(), name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if (p.Annotations["ambient.istio.io/redirection"] == "enabled") == want {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("pod %s/%s: redirection annotation %q after 20s, want set=%v", ns, name, p.Annotations["ambient.istio.io/redirection"], want)
		}
		time.Sleep(100 * time.Millisecond) // no watch for one annotation
	}
}

// localDelivery reports whether node n has the rule that delivers port
// 15008 of pod address a to meshtun's listener (tun.LocalDelivery).
func localDelivery(t *testing.T, n *cluster.Node, a netip.Addr) bool {
	t.Helper()
	fam := netlink.FAMILY_V4
	if a.Is6() {
		fam = netlink.FAMILY_V6
	}
	found := false
	err := n.Do(func() error {
		rules, err := netlink.RuleListFiltered(fam, &netlink.Rule{Table: tun.LocalTable}, netlink.RT_FILTER_TABLE)
		for _, r := range rules {
			if r.Dst != nil && r.Dst.IP.Equal(a.AsSlice()) && r.Dport != nil && r.Dport.Start == 15008 {
				found = true
			}
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	return found
}

// accessLog returns m's access log line of the connection from src if it
// appears within 2s (a connection the node did not capture has none).
func accessLog(m *noderun.Process, src netip.AddrPort) (noderun.Line, bool) {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	l, err := m.WaitLogSince(ctx, 0, accessLine(src))
	return l, err == nil
}

// istiodT builds (once, cached) and starts istiod against cp.
func istiodT(t testing.TB, cp *ControlPlane, trusted ...string) *Istiod {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Minute)
	defer cancel()
	start := time.Now()
	bin, err := BuildIstiod(ctx, t.Logf)
	if err != nil {
		t.Fatal(err)
	}
	if d := time.Since(start); d > time.Minute {
		t.Logf("pilot-discovery was built in %s (cold)", d.Round(time.Second))
	}
	sctx, scancel := context.WithTimeout(ctx, 2*time.Minute)
	defer scancel()
	d, err := cp.StartIstiod(sctx, bin, IstiodConfig{TrustedNodeAccounts: trusted})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("istiod log:\n%s", d.LogTail(80))
		}
		d.Stop()
	})
	return d
}

// istiodFiles writes what a meshtun pod in place of ztunnel has mounted,
// for each node: the istio-ca-root-cert ConfigMap istiod puts in every
// namespace, and a projected token of the node's service account with
// audience istio-ca, bound to the node's meshtun pod (which the test
// creates on each node, as the DaemonSet would): istiod's CA lets a
// trusted node account impersonate only the workloads on the node of the
// pod its token is bound to.
func istiodFiles(t testing.TB, cp *ControlPlane, dir string, nodes ...*cluster.Node) (root string, tokens, kubeconfigs []string) {
	t.Helper()
	ctx := context.Background()
	deadline := time.Now().Add(time.Minute)
	for { // istiod's namespace controller writes it; no watch for one object
		cm, err := cp.Admin.CoreV1().ConfigMaps("istio-system").Get(ctx, "istio-ca-root-cert", metav1.GetOptions{})
		if err == nil && cm.Data["root-cert.pem"] != "" {
			root = filepath.Join(dir, "root-cert.pem")
			if err := os.WriteFile(root, []byte(cm.Data["root-cert.pem"]), 0o644); err != nil {
				t.Fatal(err)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("istiod wrote no istio-ca-root-cert ConfigMap into istio-system: %v", err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	for _, n := range nodes {
		pod := &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: "istio-system", Name: "meshtun-" + noderun.NodeName(n), Labels: map[string]string{"app": "meshtun"}},
			Spec: corev1.PodSpec{
				NodeName: noderun.NodeName(n), ServiceAccountName: "ztunnel", HostNetwork: true,
				AutomountServiceAccountToken: new(bool),
				Containers:                   []corev1.Container{{Name: "meshtun", Image: "example.invalid/meshtun:1"}},
			},
		}
		pod, err := cp.Admin.CoreV1().Pods("istio-system").Create(ctx, pod, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		tok, err := cp.Admin.CoreV1().ServiceAccounts("istio-system").CreateToken(ctx, "ztunnel",
			&authv1.TokenRequest{Spec: authv1.TokenRequestSpec{Audiences: []string{"istio-ca"}, ExpirationSeconds: new(int64(3600)),
				BoundObjectRef: &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		token := filepath.Join(dir, "istio-token-"+noderun.NodeName(n))
		if err := os.WriteFile(token, []byte(tok.Status.Token), 0o600); err != nil {
			t.Fatal(err)
		}
		tokens = append(tokens, token)
		// The API server's own token of the account, for
		// --redirect-pods: bound to the pod too, as the kubelet mounts
		// it, so that it names the node (deploy/istio's admission
		// policy lets the account annotate only that node's pods).
		apiTok, err := cp.Admin.CoreV1().ServiceAccounts("istio-system").CreateToken(ctx, "ztunnel",
			&authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: new(int64(3600)),
				BoundObjectRef: &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID}}}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		kubeconfig := filepath.Join(dir, "kubeconfig-"+noderun.NodeName(n))
		if err := os.WriteFile(kubeconfig, cp.Kubeconfig(apiTok.Status.Token), 0o600); err != nil {
			t.Fatal(err)
		}
		kubeconfigs = append(kubeconfigs, kubeconfig)
	}
	return root, tokens, kubeconfigs
}

// istioNodeConfig writes the node settings of deploy/istio's ConfigMap.
func istioNodeConfig(t testing.TB, ms []Manifest, dir string) string {
	t.Helper()
	for _, m := range ms {
		if m.Obj.GetKind() != "ConfigMap" {
			continue
		}
		y, ok, err := unstructured.NestedString(m.Obj.Object, "data", "mesh.yaml")
		if err != nil || !ok {
			t.Fatalf("deploy/istio's ConfigMap has no mesh.yaml: %v", err)
		}
		path := filepath.Join(dir, "mesh.yaml")
		if err := os.WriteFile(path, []byte(y), 0o644); err != nil {
			t.Fatal(err)
		}
		return path
	}
	t.Fatal("deploy/istio has no ConfigMap")
	return ""
}

// peerChain returns the certificate chain the node serving HBONE at addr
// presents, dialled from ns. The handshake is cut short once the chain is
// in (the test has no client certificate).
func peerChain(t *testing.T, ns *cluster.NS, addr netip.AddrPort) []*x509.Certificate {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := ns.Dial(ctx, "tcp", addr.String())
	if err != nil {
		t.Fatalf("dial %s: %v", addr, err)
	}
	defer conn.Close()
	var chain []*x509.Certificate
	got := errors.New("chain received")
	tc := tls.Client(conn, &tls.Config{InsecureSkipVerify: true, NextProtos: []string{"h2"}, MinVersion: tls.VersionTLS13,
		VerifyPeerCertificate: func(raw [][]byte, _ [][]*x509.Certificate) error {
			for _, r := range raw {
				c, err := x509.ParseCertificate(r)
				if err != nil {
					return err
				}
				chain = append(chain, c)
			}
			return got
		}})
	if err := tc.HandshakeContext(ctx); !errors.Is(err, got) {
		t.Fatalf("TLS to %s: %v, want the peer's chain", addr, err)
	}
	return chain
}

// metricsText returns node n's Prometheus metrics.
func metricsText(t testing.TB, n *cluster.Node) string {
	t.Helper()
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: n.Dial}}
	resp, err := hc.Get("http://127.0.0.1:15020/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(body)
}

var authzGVR = schema.GroupVersionResource{Group: "security.istio.io", Version: "v1", Resource: "authorizationpolicies"}

// TestIstiod runs meshtun on two nodes in place of ztunnel, with the mesh
// model from a real istiod (delta xDS) that watches a real API server.
//
// It needs istiod's pilot-discovery, built once into the cache (20 minutes
// or more cold): it runs when MESHTUN_TEST_ISTIOD=1 or when the binary is
// already cached.
func TestIstiod(t *testing.T) {
	if os.Getenv("MESHTUN_TEST_ISTIOD") != "1" {
		if dir, err := CacheDir(); err != nil || !exists(filepath.Join(dir, "bin", "pilot-discovery-"+IstioVersion)) {
			t.Skip("pilot-discovery is not cached; MESHTUN_TEST_ISTIOD=1 builds it (20+ minutes cold)")
		}
	}
	// Node 3 runs no meshtun: it stands for a node of Istio's own HBONE
	// implementation (pkg/hbone), with certificates from istiod.
	c := cluster.NewT(t, cluster.Spec{Name: "istd", Nodes: 3, PodsPerNode: 2})
	cp := controlPlaneT(t, c)
	ctx := context.Background()
	dir := t.TempDir()
	// The nodes run as deploy/istio's account (ztunnel's, which istiod
	// trusts by default) with its RBAC, applied server-side; nothing runs
	// its DaemonSet (no controller manager), the test starts the nodes.
	istiod := istiodT(t, cp, "istio-system/ztunnel")
	istioMs, err := ReadManifests("../../deploy/istio")
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.Apply(ctx, istioMs, false); err != nil {
		t.Fatalf("deploy/istio: %v", err)
	}
	cfgPath := istioNodeConfig(t, istioMs, dir)
	n1, n2, n3 := c.Nodes[0], c.Nodes[1], c.Nodes[2]
	root, tokens, kubeconfigs := istiodFiles(t, cp, dir, n1, n2, n3)
	p11 := n1.Pods[0]
	p21, p22 := n2.Pods[0], n2.Pods[1]
	p31, p32 := n3.Pods[0], n3.Pods[1]
	k := kubelet{t: t, cs: cp.Admin}
	k.namespace("apps", true)
	k.run(p11, "apps", "client", "client", map[string]string{"app": "client", "version": "v1"})
	k.run(p21, "apps", "server", "server", map[string]string{"app": "server"})
	// Node 3's pods are enrolled too; nothing there runs --redirect-pods,
	// so the test marks them redirected, as istio-cni does for ztunnel.
	k.run(p31, "apps", "istio-server", "istio-server", map[string]string{"app": "istio-server"})
	k.run(p32, "apps", "istio-client", "istio-client", map[string]string{"app": "istio-client"})
	for _, name := range []string{"istio-server", "istio-client"} {
		patch := []byte(`{"metadata":{"annotations":{"ambient.istio.io/redirection":"enabled"}}}`)
		if _, err := cp.Admin.CoreV1().Pods("apps").Patch(ctx, name, types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	echo(t, p21, 8080)
	echo(t, p22, 8080)
	echo(t, p31, 8080)

	start := func(n *cluster.Node, token, kubeconfig string) *noderun.Process {
		sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		m, err := noderun.Start(sctx, meshtunBin, n, "--config", cfgPath,
			"--xds-address", istiod.Addr.String(), "--xds-server-name", istiod.ServerName,
			"--xds-root-cert", root, "--xds-token", token,
			"--ca-address", istiod.Addr.String(), "--ca-server-name", istiod.ServerName, "--ca-root-cert", root,
			"--pod-name", "meshtun-"+noderun.NodeName(n), "--pod-namespace", "istio-system",
			"--service-account", "ztunnel", "--instance-ip", n.IPv4.String(), "--cluster-id", "Kubernetes",
			"--redirect-pods", "--kubeconfig", kubeconfig,
			"--log-level", "debug") // the inbound side's debug line of each HBONE request shows its baggage
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Stop(9) })
		return m
	}
	m1, m2 := start(n1, tokens[0], kubeconfigs[0]), start(n2, tokens[1], kubeconfigs[1])
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("node 1 log:\n%s\nnode 2 log:\n%s", m1.Logs(), m2.Logs())
		}
	})

	// until retries fn until it returns a valid connection source; it
	// fails t, the (sub)test it is called from.
	until := func(t *testing.T, what string, fn func() netip.AddrPort) netip.AddrPort {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for {
			if src := fn(); src.IsValid() {
				return src
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: no connection within 30s", what)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	// untilHBONE retries a round trip from p to dst until node 1 logs it
	// as carried over HBONE, and returns that access log line. Until
	// istiod's model has both ends as HBONE, node 1 does not capture the
	// client (no log) or sends to the destination in plaintext.
	untilHBONE := func(t *testing.T, what string, p *cluster.Pod, dst netip.AddrPort) noderun.Line {
		t.Helper()
		var out noderun.Line
		until(t, what, func() netip.AddrPort {
			src := roundTripMaybe(p, dst)
			if !src.IsValid() {
				return src
			}
			var ok bool
			if out, ok = accessLog(m1, src); !ok || out.Str("route") != "hbone" {
				return netip.AddrPort{}
			}
			return src
		})
		return out
	}

	t.Run("mesh TCP across nodes through istiod's model", func(t *testing.T) {
		// Each node marked its own enrolled pod as istio-cni would.
		waitRedirected(t, cp.Admin, "apps", "client", true)
		waitRedirected(t, cp.Admin, "apps", "server", true)
		for _, dst := range []netip.Addr{p21.IPv4, p21.IPv6} {
			out := untilHBONE(t, "hbone to "+dst.String(), p11, netip.AddrPortFrom(dst, 8080))
			wantField(t, out, "src.identity", spiffe("apps", "client"))
			wantField(t, out, "dst.identity", spiffe("apps", "server"))
			in := waitLog(t, m2, 0, "inbound access log", accessLine(netip.MustParseAddrPort(out.Str("src.addr"))))
			wantField(t, in, "direction", "inbound")
			wantField(t, in, "src.identity", spiffe("apps", "client"))
			// One trace id on both nodes; istiod's cluster id on both ends.
			trace := out.Str("trace_id")
			if len(trace) != 32 {
				t.Errorf("outbound trace_id %q, want 32 hex digits", trace)
			}
			wantField(t, in, "trace_id", trace)
			for _, l := range []noderun.Line{out, in} {
				wantField(t, l, "src.cluster", "Kubernetes")
				wantField(t, l, "dst.cluster", "Kubernetes")
			}
			// The baggage as ztunnel's: istiod's canonical revision (v1,
			// from the pod's version label, which WDS alone carries) and
			// cluster, not the pod's name as the service.
			req := waitLog(t, m2, 0, "inbound HBONE request "+trace, func(l noderun.Line) bool {
				return l.Str("message") == "inbound HBONE request" && l.Str("trace_id") == trace
			})
			bag := req.Str("baggage")
			for _, kv := range []string{"k8s.cluster.name=Kubernetes", "k8s.namespace.name=apps", "service.name=client", "service.version=v1"} {
				if !slices.Contains(strings.Split(bag, ","), kv) {
					t.Errorf("baggage received %q has no %s", bag, kv)
				}
			}
			if !regexp.MustCompile(`(^|,)k8s\.(deployment|pod|job|cronjob)\.name=client(,|$)`).MatchString(bag) {
				t.Errorf("baggage received %q names no workload client under k8s.<type>.name", bag)
			}
		}
	})

	t.Run("ztunnel's config_dump shape and metric labels carry istiod's names", func(t *testing.T) {
		// WDS carries no pod labels: the canonical revision ("v1", from
		// the client's version label) can only have come from istiod.
		var dump struct {
			Workloads []struct {
				Name, Namespace, CanonicalName, CanonicalRevision, WorkloadName, Protocol string
			}
			Certificates []struct{ Identity, State string }
		}
		getJSON(t, n1, "http://127.0.0.1:15000/config_dump?format=ztunnel", &dump)
		found := false
		for _, w := range dump.Workloads {
			if w.Namespace == "apps" && w.Name == "client" {
				found = true
				if w.CanonicalName != "client" || w.CanonicalRevision != "v1" || w.WorkloadName != "client" || w.Protocol != "HBONE" {
					t.Errorf("ztunnel config_dump workload apps/client = %+v, want canonical client/v1, workload client, HBONE", w)
				}
			}
		}
		if !found {
			t.Errorf("ztunnel config_dump of node 1 has no workload apps/client: %+v", dump.Workloads)
		}
		if len(dump.Certificates) == 0 || dump.Certificates[0].State != "Available" {
			t.Errorf("ztunnel config_dump certificates = %+v, want node 1's pod's, Available", dump.Certificates)
		}
		body := metricsText(t, n1)
		ok := false
		for _, l := range strings.Split(body, "\n") {
			if strings.HasPrefix(l, "istio_tcp_connections_opened_total{") && strings.Contains(l, `reporter="source"`) &&
				strings.Contains(l, `source_canonical_service="client"`) && strings.Contains(l, `source_canonical_revision="v1"`) &&
				strings.Contains(l, `destination_canonical_service="server"`) &&
				strings.Contains(l, `source_cluster="Kubernetes"`) {
				ok = true
			}
		}
		if !ok {
			t.Errorf("no istio_tcp_connections_opened_total series of node 1 with istiod's canonical services client -> server and cluster:\n%s", body)
		}
		// xDS health: connected, istiod's addresses held, ACKs sent.
		for _, re := range []string{
			`(?m)^meshtun_xds_connected 1$`,
			`(?m)^meshtun_xds_resources\{type_url="type.googleapis.com/istio.workload.Address"\} [1-9][0-9]*$`,
			`(?m)^meshtun_xds_responses_total\{answer="ack",type_url="type.googleapis.com/istio.workload.Address"\} [1-9][0-9]*$`,
			`(?m)^meshtun_xds_last_ack_timestamp_seconds\{type_url="type.googleapis.com/istio.security.Authorization"\} `,
			`(?m)^istio_xds_message_total\{url="type.googleapis.com/istio.workload.Address"\} [1-9][0-9]*$`,
		} {
			if !regexp.MustCompile(re).MatchString(body) {
				t.Errorf("node 1's metrics do not match %s", re)
			}
		}
	})

	t.Run("workload certificates from istiod's CA", func(t *testing.T) {
		rootPEM, err := os.ReadFile(root)
		if err != nil {
			t.Fatal(err)
		}
		roots := x509.NewCertPool()
		if !roots.AppendCertsFromPEM(rootPEM) {
			t.Fatal("no certificate in istio-ca-root-cert")
		}
		// The server pod's node answers HBONE for it with its SVID.
		chain := peerChain(t, n1.NS, netip.AddrPortFrom(p21.IPv4, 15008))
		inter := x509.NewCertPool()
		for _, c := range chain[1:] {
			inter.AddCert(c)
		}
		if _, err := chain[0].Verify(x509.VerifyOptions{Roots: roots, Intermediates: inter,
			KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
			t.Fatalf("the server's certificate (issuer %q) does not chain to istiod's root: %v", chain[0].Issuer, err)
		}
		if len(chain[0].URIs) != 1 || chain[0].URIs[0].String() != spiffe("apps", "server") {
			t.Errorf("the server's certificate names %v, want %s", chain[0].URIs, spiffe("apps", "server"))
		}
		t.Logf("server certificate: issuer %q, valid until %s", chain[0].Issuer, chain[0].NotAfter.Format(time.RFC3339))
	})

	t.Run("Istio's own HBONE (pkg/hbone) and meshtun, both with istiod's certificates", func(t *testing.T) {
		peer := buildInterop(t, "istio-hbone-peer")
		pdir := t.TempDir()
		// Node 3's credential gets its pods' certificates from istiod's
		// CA, a CSR each, as ztunnel (and meshtun) ask for them.
		ca := istiodCA(t, istiod, root, tokens[2], n3)
		creds := func(sa string, issuer interface {
			Issue(context.Context, spiffeid.ID) (*x509svid.SVID, error)
		}, prefix string) []string {
			t.Helper()
			id := spiffeid.RequireFromString(spiffe("apps", sa))
			svid, err := issuer.Issue(ctx, id)
			if err != nil {
				t.Fatalf("certificate for %s: %v", id, err)
			}
			if svid.ID != id {
				t.Fatalf("issued %s, asked for %s", svid.ID, id)
			}
			cert, key := svidFiles(t, pdir, prefix+sa, svid)
			return []string{"--cert", cert, "--key", key, "--root", root}
		}
		serverCreds, clientCreds := creds("istio-server", ca, "istiod-"), creds("istio-client", ca, "istiod-")
		// Istio's server serves HBONE for its pod, as ztunnel would.
		is := startIstioPeer(t, p31.NS, peer, "listening", append([]string{"serve", "--listen", ":15008"}, serverCreds...)...)
		const size = 1<<20 + 7

		t.Run("Istio's dialer to a workload meshtun serves", func(t *testing.T) {
			for _, dst := range []netip.Addr{p21.IPv4, p21.IPv6} {
				mark := m2.Len()
				target := netip.AddrPortFrom(dst, 8080)
				out, p, err := istioDial(t, p32.NS, peer, append([]string{
					"--proxy", netip.AddrPortFrom(dst, 15008).String(), "--target", target.String(),
					"--want-server", spiffe("apps", "server"), "--bytes", strconv.Itoa(size)}, clientCreds...)...)
				if err != nil {
					t.Fatalf("Istio's dialer on node 3 to %s through node 2: %v\n%s", target, err, p.output())
				}
				// Istio's verifier, loaded with istiod's root, read node
				// 2's certificate for the server pod.
				if out.Str("message") != "echoed" || out.Num("received") != size || out.Str("server") != spiffe("apps", "server") {
					t.Errorf("Istio's dialer: %v, want %d bytes echoed by a server verified as %s", out, size, spiffe("apps", "server"))
				}
				l := waitLog(t, m2, mark, "inbound access log of Istio's dialer", func(l noderun.Line) bool {
					return l.Str("log") == "access" && l.Str("message") == "connection complete" &&
						l.Str("direction") == "inbound" && l.Str("dst.addr") == target.String()
				})
				wantField(t, l, "src.identity", spiffe("apps", "istio-client"))
				wantField(t, l, "dst.identity", spiffe("apps", "server"))
				if l.Num("bytes_sent") != size || l.Num("bytes_recv") != size {
					t.Errorf("node 2 relayed %v bytes to the workload and %v back, want %d each way", l["bytes_sent"], l["bytes_recv"], size)
				}
			}
		})

		t.Run("meshtun's outbound to Istio's server", func(t *testing.T) {
			for _, dst := range []netip.Addr{p31.IPv4, p31.IPv6} {
				target := netip.AddrPortFrom(dst, 8080)
				mark := is.len()
				out := untilHBONE(t, "hbone to Istio's server at "+dst.String(), p11, target)
				wantField(t, out, "src.identity", spiffe("apps", "client"))
				wantField(t, out, "dst.identity", spiffe("apps", "istio-server"))
				wantField(t, out, "dst.hbone_addr", netip.AddrPortFrom(dst, 15008).String())
				// Istio's server, trusting istiod's root only, read node 1's
				// certificate for the client pod.
				c, err := is.waitSince(mark, func(l noderun.Line) bool {
					return l.Str("message") == "connect" && l.Str("authority") == target.String()
				})
				if err != nil {
					t.Fatalf("Istio's server saw no CONNECT to %s: %v", target, err)
				}
				if c.Str("peer") != spiffe("apps", "client") || c.Num("tls_version") != tls.VersionTLS13 || c.Str("alpn") != "h2" {
					t.Errorf("Istio's server saw %v, want peer %s over TLS 1.3 and h2", c, spiffe("apps", "client"))
				}
			}
		})

		t.Run("a certificate of another CA is refused", func(t *testing.T) {
			// The same identities in the same trust domain, from a CA
			// istiod's root did not sign.
			rogue, err := identity.OpenCA(identity.CAConfig{Dir: t.TempDir(), TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local")})
			if err != nil {
				t.Fatal(err)
			}
			mark := m2.Len()
			target := netip.AddrPortFrom(p21.IPv4, 8080)
			out, _, err := istioDial(t, p32.NS, peer, append([]string{
				"--proxy", netip.AddrPortFrom(p21.IPv4, 15008).String(), "--target", target.String(),
				"--want-server", spiffe("apps", "server")}, creds("istio-client", rogue, "rogue-")...)...)
			if err == nil {
				t.Fatalf("node 2 let Istio's dialer with another CA's certificate through: %v", out)
			}
			t.Logf("Istio's dialer with another CA's certificate: %s", out.Str("error"))
			waitLog(t, m2, mark, "TLS refusal of Istio's dialer", func(l noderun.Line) bool {
				return l.Str("direction") == "inbound" && l.Str("message") == "connection refused" && strings.HasPrefix(l.Str("error"), "TLS")
			})
			if hasLineSince(m2, mark, func(l noderun.Line) bool {
				return l.Str("message") == "connection complete" && l.Str("direction") == "inbound"
			}) {
				t.Errorf("node 2 delivered a connection after refusing Istio's dialer:\n%s", m2.Logs())
			}

			// Istio's server with another CA's certificate: meshtun's
			// outbound refuses it and nothing reaches its pod.
			is.stop()
			rs := startIstioPeer(t, p31.NS, peer, "listening", append([]string{"serve", "--listen", ":15008"}, creds("istio-server", rogue, "rogue-")...)...)
			mark = m1.Len()
			deadline := time.Now().Add(20 * time.Second)
			for {
				if src := roundTripMaybe(p11, netip.AddrPortFrom(p31.IPv4, 8080)); src.IsValid() {
					t.Fatalf("node 1 reached Istio's server with another CA's certificate (connection from %s)", src)
				}
				// The first attempt may fall on the pooled connection to
				// the stopped server; a fresh one meets the rogue one.
				if hasLineSince(m1, mark, func(l noderun.Line) bool {
					return l.Str("direction") == "outbound" && l.Str("message") == "connection refused" && strings.Contains(l.Str("error"), "certificate")
				}) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("node 1 logged no refusal of the rogue server's certificate:\n%s", m1.Logs())
				}
				time.Sleep(200 * time.Millisecond)
			}
			for _, l := range rs.since(0) {
				if l.Str("message") == "connect" {
					t.Errorf("Istio's server with another CA's certificate got a CONNECT: %v", l)
				}
			}
		})
	})

	t.Run("istiod refuses a node the identity of another node's pod", func(t *testing.T) {
		// Node 1's credential (its token, bound to its meshtun pod) asks
		// istiod's CA directly, as a compromised node might.
		ca := istiodCA(t, istiod, root, tokens[0], n1)
		// Its own pod's identity: issued (so the refusal below is not of
		// the credential itself).
		own := spiffeid.RequireFromString(spiffe("apps", "client"))
		if svid, err := ca.Issue(ctx, own); err != nil {
			t.Fatalf("node 1 asking for %s (its pod's): %v", own, err)
		} else if svid.ID != own {
			t.Fatalf("issued %s, asked for %s", svid.ID, own)
		}
		// The server pod runs on node 2 only.
		other := spiffeid.RequireFromString(spiffe("apps", "server"))
		svid, err := ca.Issue(ctx, other)
		if err == nil {
			t.Fatalf("istiod issued node 1 a certificate for %s, whose only pod runs on node 2", svid.ID)
		}
		// istiod answers Unauthenticated ("request impersonation
		// authentication failure") at this version, PermissionDenied at
		// others; the same credential was just good for its own pod.
		if c := status.Code(err); c != codes.Unauthenticated && c != codes.PermissionDenied {
			t.Errorf("node 1 asking for %s: %v, want istiod's refusal (Unauthenticated or PermissionDenied)", other, err)
		}
		t.Logf("refused: %v", err)
	})

	t.Run("AuthorizationPolicy from the API server denies", func(t *testing.T) {
		pol := &unstructured.Unstructured{Object: map[string]any{
			"apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
			"metadata": map[string]any{"name": "deny-client", "namespace": "apps"},
			"spec": map[string]any{
				"selector": map[string]any{"matchLabels": map[string]any{"app": "server"}},
				"action":   "DENY",
				"rules": []any{map[string]any{"from": []any{map[string]any{"source": map[string]any{
					"principals": []any{"cluster.local/ns/apps/sa/client"},
				}}}}},
			},
		}}
		if err := cp.Apply(ctx, []Manifest{{File: "test", Obj: pol}}, false); err != nil {
			t.Fatal(err)
		}
		deadline := time.Now().Add(30 * time.Second)
		for roundTripMaybe(p11, netip.AddrPortFrom(p21.IPv4, 8080)).IsValid() {
			if time.Now().After(deadline) {
				t.Fatal("the client still reaches the server 30s after the DENY policy was created")
			}
			time.Sleep(200 * time.Millisecond)
		}
		l := waitLog(t, m2, 0, "refusal by the policy", func(l noderun.Line) bool {
			return l.Str("direction") == "inbound" && l.Str("message") == "connection refused" && strings.Contains(l.Str("error"), "apps/deny-client")
		})
		wantField(t, l, "src.identity", spiffe("apps", "client"))
		// istioctl ztunnel-config's own reader and writer take node 2's
		// ztunnel-shaped dump: its workloads, the policy with its rule in
		// ztunnel's nesting, and the certificates' chains.
		out := istioctlZtunnelConfig(t, buildInterop(t, "ztunnel-config"), n2)
		for _, want := range []*regexp.Regexp{
			regexp.MustCompile(`(?m)^apps +server +` + regexp.QuoteMeta(p21.IPv4.String()) + `\S* +\S+ +None +HBONE$`),
			regexp.MustCompile(`(?m)^apps +deny-client +Deny +WorkloadSelector$`),
			regexp.MustCompile(`"principals": \[\s*\{\s*"Exact": "cluster.local/ns/apps/sa/client"`),
			regexp.MustCompile(`(?m)^spiffe://cluster.local/ns/apps/sa/server +Leaf +Available +true `),
		} {
			if !want.MatchString(out) {
				t.Errorf("istioctl ztunnel-config output of node 2 does not match %s:\n%s", want, out)
			}
		}
		dyn, err := dynamic.NewForConfig(cp.AdminConfig)
		if err != nil {
			t.Fatal(err)
		}
		if err := dyn.Resource(authzGVR).Namespace("apps").Delete(ctx, "deny-client", metav1.DeleteOptions{}); err != nil {
			t.Fatal(err)
		}
		until(t, "policy deleted", func() netip.AddrPort { return roundTripMaybe(p11, netip.AddrPortFrom(p21.IPv4, 8080)) })
	})

	t.Run("a pod is captured before it is annotated", func(t *testing.T) {
		// istio-cni's order with ztunnel: the annotation makes istiod
		// tell every peer to send the pod HBONE, so node 2 must take
		// HBONE for the pod (its certificate, the rule that delivers its
		// port 15008 to meshtun) before the annotation exists.
		w, err := cp.Admin.CoreV1().Pods("apps").Watch(ctx, metav1.ListOptions{FieldSelector: "metadata.name=later"})
		if err != nil {
			t.Fatal(err)
		}
		defer w.Stop()
		k.run(p22, "apps", "later", "later", map[string]string{"app": "later"})
		deadline := time.After(30 * time.Second)
	annotated:
		for {
			select {
			case ev, ok := <-w.ResultChan():
				if !ok {
					t.Fatal("the watch of apps/later ended")
				}
				if p, isPod := ev.Object.(*corev1.Pod); isPod && p.Annotations["ambient.istio.io/redirection"] == "enabled" {
					break annotated
				}
			case <-deadline:
				t.Fatal("apps/later not annotated within 30s")
			}
		}
		// At the annotation's event, before istiod can have pushed a
		// model that marks the pod HBONE:
		for _, a := range []netip.Addr{p22.IPv4, p22.IPv6} {
			if !localDelivery(t, n2, a) {
				t.Errorf("apps/later annotated before node 2 delivers %s port 15008 to meshtun", a)
			}
		}
		var dump struct {
			Certificates []struct {
				Identity string `json:"identity"`
			} `json:"certificates"`
		}
		getJSON(t, n2, "http://127.0.0.1:15000/config_dump?format=meshtun", &dump)
		held := false
		for _, c := range dump.Certificates {
			held = held || c.Identity == spiffe("apps", "later")
		}
		if !held {
			t.Errorf("apps/later annotated before node 2 holds its certificate: %+v", dump.Certificates)
		}
	})

	t.Run("services: internalTrafficPolicy Local reaches its node's endpoints only", func(t *testing.T) {
		// internalTrafficPolicy: Local is istiod's load balancing mode
		// STRICT on NODE: apps/later (node 2) is the endpoint for clients
		// of node 2, and clients of node 1 have none (reset, UH).
		local := corev1.ServiceInternalTrafficPolicyLocal
		for _, svc := range []*corev1.Service{
			{ObjectMeta: metav1.ObjectMeta{Name: "local-only"}, Spec: corev1.ServiceSpec{
				Selector: map[string]string{"app": "later"}, InternalTrafficPolicy: &local,
				Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
			}},
			{ObjectMeta: metav1.ObjectMeta{Name: "web"}, Spec: corev1.ServiceSpec{
				Selector: map[string]string{"app": "later"}, IPFamilyPolicy: new(corev1.IPFamilyPolicyRequireDualStack),
				Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
			}},
		} {
			if _, err := cp.Admin.CoreV1().Services("apps").Create(ctx, svc, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		lo, err := cp.Admin.CoreV1().Services("apps").Get(ctx, "local-only", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		vip := netip.AddrPortFrom(netip.MustParseAddr(lo.Spec.ClusterIP), 80)
		// Node 2's client (apps/server) reaches apps/later, on its node.
		until(t, "local-only from node 2", func() netip.AddrPort {
			src := roundTripMaybe(p21, vip)
			if !src.IsValid() {
				return src
			}
			if l, ok := accessLog(m2, src); !ok || l.Str("dst.service") != "local-only.apps.svc.cluster.local" ||
				l.Str("dst.identity") != spiffe("apps", "later") || l.Str("route") != "local" {
				return netip.AddrPort{}
			}
			return src
		})
		// Node 1's client gets a reset, and node 1 says why.
		refusedUH := func(l noderun.Line) bool {
			return l.Str("message") == "connection refused" && l.Str("dst.addr") == vip.String() &&
				l.Str("response_flags") == "UH" && l.Str("dst.service") == "local-only.apps.svc.cluster.local"
		}
		deadline := time.Now().Add(30 * time.Second)
		for !hasLine(m1, refusedUH) {
			if src := roundTripMaybe(p11, vip); src.IsValid() {
				l, _ := accessLog(m1, src)
				t.Fatalf("node 1's client reached the local-only service (node 2's endpoint only): %v", l)
			}
			if time.Now().After(deadline) {
				t.Fatalf("node 1 logged no UH refusal for %s within 30s:\n%s", vip, m1.Logs())
			}
			time.Sleep(200 * time.Millisecond)
		}
		if hasLine(m1, func(l noderun.Line) bool {
			return l.Str("message") == "NACK" && strings.Contains(l.Str("error"), "local-only")
		}) {
			t.Error("node 1 NACKed the local-only service")
		}
		web, err := cp.Admin.CoreV1().Services("apps").Get(ctx, "web", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		for _, ip := range web.Spec.ClusterIPs {
			vip := netip.AddrPortFrom(netip.MustParseAddr(ip), 80)
			// Node 1 reaches the later pod in plaintext until istiod's
			// model, which follows its annotation, has it as HBONE.
			out := untilHBONE(t, "the web service at "+vip.String(), p11, vip)
			wantField(t, out, "dst.service", "web.apps.svc.cluster.local")
			wantField(t, out, "dst.identity", spiffe("apps", "later"))
			ep := p22.IPv4
			if vip.Addr().Is6() {
				ep = p22.IPv6
			}
			wantField(t, out, "dst.hbone_addr", netip.AddrPortFrom(ep, 15008).String())
		}
		// Istio's destination service labels, from istiod's service.
		body := metricsText(t, n1)
		ok := false
		for _, l := range strings.Split(body, "\n") {
			if strings.HasPrefix(l, "istio_tcp_connections_opened_total{") && strings.Contains(l, `reporter="source"`) &&
				strings.Contains(l, `destination_service="web.apps.svc.cluster.local"`) &&
				strings.Contains(l, `destination_service_name="web"`) && strings.Contains(l, `destination_service_namespace="apps"`) &&
				strings.Contains(l, `destination_canonical_service="later"`) {
				ok = true
			}
		}
		if !ok {
			t.Errorf("no istio_tcp_connections_opened_total series of node 1 for the web service (hostname, name web, namespace apps):\n%s", body)
		}
	})

	t.Run("services: trafficDistribution PreferClose picks the client's zone", func(t *testing.T) {
		// istiod gives pods the locality of their Node objects' topology
		// labels: node 1 in zone z1, node 2 in z2, one region.
		for i, n := range []*cluster.Node{n1, n2} {
			node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: noderun.NodeName(n), Labels: map[string]string{
				"topology.kubernetes.io/region": "r1", "topology.kubernetes.io/zone": fmt.Sprintf("z%d", i+1)}}}
			if _, err := cp.Admin.CoreV1().Nodes().Create(ctx, node, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		// Endpoints: apps/near on node 1 (the client's zone) and
		// apps/server on node 2.
		p12 := n1.Pods[1]
		k.run(p12, "apps", "near", "near", map[string]string{"app": "near", "tier": "close"})
		echo(t, p12, 8080)
		waitRedirected(t, cp.Admin, "apps", "near", true)
		patch := []byte(`{"metadata":{"labels":{"tier":"close"}}}`)
		if _, err := cp.Admin.CoreV1().Pods("apps").Patch(ctx, "server", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		cl := &corev1.Service{ObjectMeta: metav1.ObjectMeta{Name: "close"}, Spec: corev1.ServiceSpec{
			Selector: map[string]string{"tier": "close"}, TrafficDistribution: new(corev1.ServiceTrafficDistributionPreferClose),
			Ports: []corev1.ServicePort{{Name: "http", Port: 80, TargetPort: intstr.FromString("http")}},
		}}
		cl, err := cp.Admin.CoreV1().Services("apps").Create(ctx, cl, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		vip := netip.AddrPortFrom(netip.MustParseAddr(cl.Spec.ClusterIP), 80)
		// Until istiod's model has the service, both endpoints and the
		// localities, node 1 may send elsewhere; then 20 connections in a
		// row go to apps/near (any endpoint would send about half to
		// node 2).
		near := func() bool {
			src := roundTripMaybe(p11, vip)
			if !src.IsValid() {
				return false
			}
			l, ok := accessLog(m1, src)
			return ok && l.Str("dst.identity") == spiffe("apps", "near") && l.Str("dst.service") == "close.apps.svc.cluster.local"
		}
		deadline := time.Now().Add(60 * time.Second)
		for run := 0; run < 20; {
			if near() {
				run++
				continue
			}
			run = 0
			if time.Now().After(deadline) {
				t.Fatalf("node 1's client did not reach only apps/near (its zone) through %s within 60s", vip)
			}
			time.Sleep(200 * time.Millisecond)
		}
	})

	t.Run("istiod restarted: the model stays, the node resubscribes", func(t *testing.T) {
		mark := m1.Len()
		istiod.Stop()
		waitLog(t, m1, mark, "stream ended", func(l noderun.Line) bool {
			return strings.Contains(l.Str("message"), "istiod stream ended")
		})
		src := roundTrip(t, p11, netip.AddrPortFrom(p21.IPv4, 8080))
		l := waitLog(t, m1, 0, "connection while istiod is down", accessLine(src))
		wantField(t, l, "route", "hbone")
		mark = m1.Len()
		sctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		defer cancel()
		if err := istiod.Start(sctx); err != nil {
			t.Fatal(err)
		}
		// The node subscribes again and applies istiod's full state.
		waitLog(t, m1, mark, "resubscribed", func(l noderun.Line) bool {
			return l.Str("message") == "applied istiod's update" && l.Str("type") == "type.googleapis.com/istio.workload.Address"
		})
		src = roundTrip(t, p11, netip.AddrPortFrom(p21.IPv4, 8080))
		l = waitLog(t, m1, 0, "connection after the restart", accessLine(src))
		wantField(t, l, "dst.identity", spiffe("apps", "server"))
	})

	t.Run("a pod that opts out loses its annotation, then its capture", func(t *testing.T) {
		patch := []byte(`{"metadata":{"labels":{"istio.io/dataplane-mode":"none"}}}`)
		if _, err := cp.Admin.CoreV1().Pods("apps").Patch(ctx, "later", types.MergePatchType, patch, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		waitRedirected(t, cp.Admin, "apps", "later", false)
		// istiod's model follows the annotation; node 2 stops taking
		// HBONE for the pod, and node 1 reaches it in plaintext.
		deadline := time.Now().Add(30 * time.Second)
		for localDelivery(t, n2, p22.IPv4) || localDelivery(t, n2, p22.IPv6) {
			if time.Now().After(deadline) {
				t.Fatal("node 2 still delivers apps/later's port 15008 to meshtun 30s after it opted out")
			}
			time.Sleep(100 * time.Millisecond) // rules have no event to wait on
		}
		until(t, "plaintext to the opted-out pod", func() netip.AddrPort {
			src := roundTripMaybe(p11, netip.AddrPortFrom(p22.IPv4, 8080))
			if !src.IsValid() {
				return src
			}
			if l, ok := accessLog(m1, src); !ok || l.Str("route") != "passthrough" {
				return netip.AddrPort{}
			}
			return src
		})
	})
}

// istioctlZtunnelConfig fetches node n's /config_dump?format=ztunnel and
// returns what test/interop's ztunnel-config (istioctl ztunnel-config's
// reader and writer) prints for it; the test fails if they refuse it.
func istioctlZtunnelConfig(t *testing.T, bin string, n *cluster.Node) string {
	t.Helper()
	hc := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: n.Dial}}
	resp, err := hc.Get("http://127.0.0.1:15000/config_dump?format=ztunnel")
	if err != nil {
		t.Fatal(err)
	}
	dump, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin)
	cmd.Stdin = bytes.NewReader(dump)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Run(); err != nil {
		t.Fatalf("istioctl's ztunnel-config refused node %s's dump: %v\n%s", n.Name(), err, stderr.String())
	}
	return stdout.String()
}
