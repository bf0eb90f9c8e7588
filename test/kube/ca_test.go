package kube

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	appsv1 "k8s.io/api/apps/v1"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	sigsyaml "sigs.k8s.io/yaml"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/bench/noderun"
	"github.com/meshtun/meshtun/mesh/identity"
)

// caPort is the port of `meshtun ca` in the control plane's namespace.
const caPort = 15012

// caAudience is the audience of the nodes' tokens (deploy/kubernetes).
const caAudience = "meshtun-ca"

// caProc is `meshtun ca serve --kubernetes` running in the control plane's
// namespace, as the meshtun-ca service account of deploy/kubernetes.
type caProc struct {
	proc  *cluster.Proc
	log   string
	addr  netip.AddrPort
	roots string // root-cert.pem the nodes trust
}

// startCA runs `meshtun ca serve --kubernetes` with the Deployment's
// arguments, with a kubeconfig of the meshtun-ca service account (the
// shipped RBAC), on cfgPath: on the first start it creates the root into
// the Secret meshtun-ca and publishes the certificate in the ConfigMap
// meshtun-ca-root, which is written to dir for the nodes (as the
// DaemonSet mounts it).
func startCA(t testing.TB, cp *ControlPlane, ms []Manifest, cfgPath, dir string) *caProc {
	t.Helper()
	ctx := context.Background()
	shipped := shippedCAArgs(t, ms)
	root := filepath.Join(dir, "ca-root")
	if err := os.MkdirAll(root, 0o755); err != nil {
		t.Fatal(err)
	}
	tok, err := cp.Admin.CoreV1().ServiceAccounts("meshtun-system").CreateToken(ctx, "meshtun-ca",
		&authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: new(int64(3600))}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	kc := filepath.Join(dir, "ca-kubeconfig")
	if err := os.WriteFile(kc, cp.Kubeconfig(tok.Status.Token), 0o600); err != nil {
		t.Fatal(err)
	}
	c := &caProc{log: filepath.Join(dir, "ca.log"), addr: netip.AddrPortFrom(cp.Host.IPv4, caPort),
		roots: filepath.Join(root, "root-cert.pem")}
	f, err := os.Create(c.log)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	// The Deployment's own arguments, with the files moved to dir.
	var args []string
	for _, a := range shipped {
		switch {
		case strings.HasPrefix(a, "--config="):
			a = "--config=" + cfgPath
		}
		args = append(args, a)
	}
	args = append(args, "--kubeconfig", kc, "--listen", c.addr.String())
	cmd := cp.Host.Command(ctx, meshtunBin, args...)
	cmd.Stdout, cmd.Stderr = f, f
	if c.proc, err = cp.Host.Start(cmd); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		c.proc.Stop(5 * time.Second)
		if t.Failed() {
			data, _ := os.ReadFile(c.log)
			t.Logf("meshtun ca log:\n%s", data)
		}
	})
	c.wait(t, 0, "ready", func(l noderun.Line) bool { return l.Str("message") == "certificate service ready" })
	cm, err := cp.Admin.CoreV1().ConfigMaps("meshtun-system").Get(ctx, "meshtun-ca-root", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the CA published no root certificate: %v", err)
	}
	if err := os.WriteFile(c.roots, []byte(cm.Data[identity.RootCertFile]), 0o644); err != nil {
		t.Fatal(err)
	}
	return c
}

// shippedCAArgs checks the shape of deploy/kubernetes' CA and node
// workloads (the CA key only in the CA's pod, the nodes' projected token of
// the CA audience where `meshtun node` looks by default) and returns the
// arguments of the CA's container.
func shippedCAArgs(t testing.TB, ms []Manifest) []string {
	t.Helper()
	var ca *appsv1.Deployment
	var ds *appsv1.DaemonSet
	for _, m := range ms {
		data, _ := sigsyaml.Marshal(m.Obj.Object)
		switch {
		case m.Obj.GetKind() == "Deployment" && m.Obj.GetName() == "meshtun-ca":
			ca = new(appsv1.Deployment)
			if err := sigsyaml.Unmarshal(data, ca); err != nil {
				t.Fatal(err)
			}
		case m.Obj.GetKind() == "DaemonSet":
			ds = new(appsv1.DaemonSet)
			if err := sigsyaml.Unmarshal(data, ds); err != nil {
				t.Fatal(err)
			}
		}
	}
	if ca == nil || ds == nil {
		t.Fatal("deploy/kubernetes lacks the meshtun-ca Deployment or the node DaemonSet")
	}
	if sa := ca.Spec.Template.Spec.ServiceAccountName; sa != "meshtun-ca" {
		t.Errorf("the CA runs as service account %q, want meshtun-ca (its RBAC)", sa)
	}
	var token, roots bool
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.Secret != nil {
			t.Errorf("the node DaemonSet mounts Secret %s: no node may hold a CA key", v.Secret.SecretName)
		}
		if v.Projected != nil {
			for _, src := range v.Projected.Sources {
				if st := src.ServiceAccountToken; st != nil && st.Audience == caAudience && v.Name == "ca-token" && st.Path == "token" {
					token = true
				}
			}
		}
		if v.ConfigMap != nil && v.ConfigMap.Name == "meshtun-ca-root" && v.Name == "ca-root" {
			roots = true
		}
	}
	mounts := map[string]string{}
	for _, m := range ds.Spec.Template.Spec.Containers[0].VolumeMounts {
		mounts[m.Name] = m.MountPath
	}
	// meshtun node's defaults (--ca-token-file, --ca-roots).
	if !token || mounts["ca-token"] != "/var/run/secrets/meshtun-ca" {
		t.Errorf("the node DaemonSet has no projected token of audience %s at /var/run/secrets/meshtun-ca/token", caAudience)
	}
	if !roots || mounts["ca-root"] != "/var/run/meshtun/ca-root" {
		t.Errorf("the node DaemonSet has no meshtun-ca-root ConfigMap at /var/run/meshtun/ca-root")
	}
	args := ca.Spec.Template.Spec.Containers[0].Args
	if len(args) < 3 || args[0] != "ca" || args[1] != "serve" || !slices.Contains(args, "--kubernetes") {
		t.Fatalf("the CA's container args %q are not `ca serve --kubernetes ...`", args)
	}
	return args
}

// lines returns the CA's log lines.
func (c *caProc) lines() []noderun.Line {
	data, _ := os.ReadFile(c.log)
	var ls []noderun.Line
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		var l noderun.Line
		if json.Unmarshal(sc.Bytes(), &l) == nil {
			ls = append(ls, l)
		}
	}
	return ls
}

// wait waits up to 20 s for a log line from mark on that matches pred.
func (c *caProc) wait(t testing.TB, mark int, what string, pred func(noderun.Line) bool) noderun.Line {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		ls := c.lines()
		for _, l := range ls[min(mark, len(ls)):] {
			if pred(l) {
				return l
			}
		}
		select {
		case <-c.proc.Done():
			data, _ := os.ReadFile(c.log)
			t.Fatalf("meshtun ca exited waiting for %s:\n%s", what, data)
		default:
		}
		if time.Now().After(deadline) {
			data, _ := os.ReadFile(c.log)
			t.Fatalf("meshtun ca: no log line for %s:\n%s", what, data)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// dial opens a connection to the CA from the control plane's namespace.
func (c *caProc) dial(cp *ControlPlane) func(ctx context.Context, addr string) (net.Conn, error) {
	return func(ctx context.Context, addr string) (net.Conn, error) { return cp.Host.Dial(ctx, "tcp", addr) }
}

// nodeToken plays the kubelet's projected token for the node proxy on n:
// it creates the proxy's pod (service account meshtun of meshtun-system,
// scheduled on n) and a token of audience meshtun-ca bound to it, in a
// file of dir.
func nodeToken(t testing.TB, cp *ControlPlane, n *cluster.Node, dir string) string {
	t.Helper()
	name := "meshtun-" + noderun.NodeName(n)
	return boundToken(t, cp, "meshtun-system", name, "meshtun", noderun.NodeName(n), filepath.Join(dir, name+".token"))
}

// boundToken creates pod ns/name with service account sa on node (unless
// it exists) and writes a token of audience meshtun-ca bound to it to path.
func boundToken(t testing.TB, cp *ControlPlane, ns, name, sa, node, path string) string {
	t.Helper()
	ctx := context.Background()
	pod, err := cp.Admin.CoreV1().Pods(ns).Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		pod, err = cp.Admin.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name},
			Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: sa, AutomountServiceAccountToken: new(bool), HostNetwork: true,
				Containers: []corev1.Container{{Name: "meshtun", Image: "example.invalid/meshtun:1"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
	}
	tok, err := cp.Admin.CoreV1().ServiceAccounts(ns).CreateToken(ctx, sa, &authv1.TokenRequest{Spec: authv1.TokenRequestSpec{
		Audiences: []string{caAudience}, ExpirationSeconds: new(int64(3600)),
		BoundObjectRef: &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: pod.Name, UID: pod.UID},
	}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(tok.Status.Token), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// askCA asks the CA for a certificate for id with the token in tokenFile,
// as a node proxy does.
func askCA(t *testing.T, cp *ControlPlane, c *caProc, tokenFile, id string) error {
	t.Helper()
	data, err := os.ReadFile(c.roots)
	if err != nil {
		t.Fatal(err)
	}
	roots, err := identity.ParseCertsPEM(data)
	if err != nil {
		t.Fatal(err)
	}
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	r, err := identity.DialCA(identity.RemoteConfig{
		Address: c.addr.String(), TrustDomain: td, Bundle: identity.NewTrustBundle(td, roots),
		Token: func() (string, error) {
			b, err := os.ReadFile(tokenFile)
			return string(b), err
		},
		Dial: c.dial(cp),
	})
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err = r.Issue(ctx, spiffeid.RequireFromString(id))
	return err
}
