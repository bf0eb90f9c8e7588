package kube

import (
	"context"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/mesh/identity"
)

// TestCARootBootstrap: with deploy/kubernetes applied and nothing else,
// `meshtun ca serve --kubernetes` (the Deployment's arguments, the
// meshtun-ca service account's RBAC) creates its root into the Secret
// meshtun-ca and publishes the certificate, without the key, in the
// ConfigMap meshtun-ca-root; a restart (a new pod, an empty CA directory)
// keeps that root. The service account can read its own Secret but no
// other, and cannot list secrets.
func TestCARootBootstrap(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "caroot", Nodes: 1})
	cp := controlPlaneT(t, c)
	ctx := context.Background()
	ms := applyDeploy(t, cp)
	if _, err := cp.Admin.CoreV1().Secrets("meshtun-system").Get(ctx, "meshtun-ca", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("Secret meshtun-ca before the CA's first start: %v, want none (the manifests ship no root)", err)
	}
	// Each start has a CA directory of its own (dir/ca, from its
	// config), as each pod has its emptyDir.
	start := func(dir string) *caProc {
		cfgPath := nodeConfig(t, ms, dir, netip.AddrPortFrom(cp.Host.IPv4, caPort))
		return startCA(t, cp, ms, cfgPath, dir)
	}
	first, second := t.TempDir(), t.TempDir()
	ca := start(first)

	sec, err := cp.Admin.CoreV1().Secrets("meshtun-system").Get(ctx, "meshtun-ca", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("the CA created no Secret: %v", err)
	}
	cert := sec.Data[identity.RootCertFile]
	if len(sec.Data[identity.RootKeyFile]) == 0 || len(cert) == 0 {
		t.Fatalf("Secret meshtun-ca holds %d keys, want %s and %s", len(sec.Data), identity.RootKeyFile, identity.RootCertFile)
	}
	cm, err := cp.Admin.CoreV1().ConfigMaps("meshtun-system").Get(ctx, "meshtun-ca-root", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(cm.Data) != 1 || cm.Data[identity.RootCertFile] != string(cert) {
		t.Fatalf("ConfigMap meshtun-ca-root: %v, want only the Secret's root certificate", cm.Data)
	}
	if created := ca.count("no CA root yet: created a self-signed root and stored it in the Secret"); created != 1 {
		t.Errorf("the first start logged %d root creations, want 1", created)
	}

	// The CA's service account: its own Secret, no other.
	tok, err := cp.Admin.CoreV1().ServiceAccounts("meshtun-system").CreateToken(ctx, "meshtun-ca",
		&authv1.TokenRequest{Spec: authv1.TokenRequestSpec{ExpirationSeconds: new(int64(3600))}}, metav1.CreateOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sa, err := kubernetes.NewForConfig(cp.Config(tok.Status.Token))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cp.Admin.CoreV1().Secrets("meshtun-system").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "other"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := sa.CoreV1().Secrets("meshtun-system").Get(ctx, "meshtun-ca", metav1.GetOptions{}); err != nil {
		t.Errorf("the CA's account cannot read its Secret: %v", err)
	}
	for what, err := range map[string]error{
		"get another Secret": func() error {
			_, err := sa.CoreV1().Secrets("meshtun-system").Get(ctx, "other", metav1.GetOptions{})
			return err
		}(),
		"list secrets": func() error {
			_, err := sa.CoreV1().Secrets("meshtun-system").List(ctx, metav1.ListOptions{})
			return err
		}(),
		"delete its Secret": sa.CoreV1().Secrets("meshtun-system").Delete(ctx, "meshtun-ca", metav1.DeleteOptions{}),
		"update another ConfigMap": func() error {
			_, err := sa.CoreV1().ConfigMaps("meshtun-system").Update(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "meshtun-config", Namespace: "meshtun-system"}}, metav1.UpdateOptions{})
			return err
		}(),
		"get a Secret of another namespace": func() error {
			_, err := sa.CoreV1().Secrets("default").Get(ctx, "meshtun-ca", metav1.GetOptions{})
			return err
		}(),
	} {
		if !apierrors.IsForbidden(err) {
			t.Errorf("the CA's account may %s: %v, want forbidden", what, err)
		}
	}

	// A restart with an empty CA directory keeps the root.
	ca.proc.Stop(5 * time.Second)
	ca2 := start(second)
	if n := ca2.count("no CA root yet: created a self-signed root and stored it in the Secret"); n != 0 {
		t.Errorf("the second start created a root again (%d)", n)
	}
	got, err := os.ReadFile(ca2.roots)
	if err != nil {
		t.Fatal(err)
	}
	if string(got) != string(cert) {
		t.Error("after a restart the published root certificate changed")
	}
	key, err := os.ReadFile(filepath.Join(second, "ca", identity.RootKeyFile))
	if err != nil || string(key) != string(sec.Data[identity.RootKeyFile]) {
		t.Errorf("the second CA's directory holds another root key (%v)", err)
	}
}

// count returns how many of the CA's log lines have message msg.
func (c *caProc) count(msg string) int {
	n := 0
	for _, l := range c.lines() {
		if strings.TrimSpace(l.Str("message")) == msg {
			n++
		}
	}
	return n
}
