package kube

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rs/zerolog"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"

	"github.com/meshtun/meshtun/bench/cluster"
	meshkube "github.com/meshtun/meshtun/mesh/kube"
	"github.com/meshtun/meshtun/mesh/kube/kubeapi"
	"github.com/meshtun/meshtun/mesh/registry"
)

const (
	redirectKey = "ambient.istio.io/redirection"
	// nodeNameExtra is the user extra the API server adds for a token
	// bound to a pod that is scheduled on a node.
	nodeNameExtra = "authentication.kubernetes.io/node-name"
)

// TestIstioRedirectPolicy: deploy/istio's node account (istio-system/
// ztunnel, with rbac.yaml and admission-policy.yaml applied to the real
// API server) can set and remove the redirection annotation of its own
// node's pods through pods/status, the way meshtun's --redirect-pods
// does, and nothing else: no plain pod patch (no image change), no other
// annotation, label, status or value, no pod of another node, no token
// bound to no node.
func TestIstioRedirectPolicy(t *testing.T) {
	c := cluster.NewT(t, cluster.Spec{Name: "krdp", Nodes: 1})
	cp := controlPlaneT(t, c)
	ctx := context.Background()
	admin := cp.Admin
	for _, ns := range []string{"istio-system", "apps"} {
		if _, err := admin.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	ms, err := ReadManifests("../../deploy/istio")
	if err != nil {
		t.Fatal(err)
	}
	if err := cp.Apply(ctx, ms, false); err != nil {
		t.Fatalf("deploy/istio: %v", err)
	}

	// Pods on two nodes (no Node objects: the token still names the node
	// of the pod it is bound to).
	mkPod := func(ns, name, node, sa string, host bool) *corev1.Pod {
		t.Helper()
		p, err := admin.CoreV1().Pods(ns).Create(ctx, &corev1.Pod{
			ObjectMeta: metav1.ObjectMeta{Namespace: ns, Name: name,
				Labels: map[string]string{"app": name}, Annotations: map[string]string{"note": "x"}},
			Spec: corev1.PodSpec{NodeName: node, ServiceAccountName: sa, HostNetwork: host,
				AutomountServiceAccountToken: new(bool),
				Containers:                   []corev1.Container{{Name: "c", Image: "example.invalid/app:1"}}},
		}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		p.Status = corev1.PodStatus{Phase: corev1.PodRunning, PodIP: "198.18.1.10", PodIPs: []corev1.PodIP{{IP: "198.18.1.10"}}}
		if p, err = admin.CoreV1().Pods(ns).UpdateStatus(ctx, p, metav1.UpdateOptions{}); err != nil {
			t.Fatal(err)
		}
		return p
	}
	for _, sa := range []string{"default", "ztunnel"} {
		admin.CoreV1().ServiceAccounts("istio-system").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: sa}}, metav1.CreateOptions{})
	}
	if _, err := admin.CoreV1().ServiceAccounts("apps").Create(ctx, &corev1.ServiceAccount{ObjectMeta: metav1.ObjectMeta{Name: "app"}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	nodePod := mkPod("istio-system", "meshtun-node-a", "node-a", "ztunnel", true)
	mkPod("apps", "a", "node-a", "app", false)
	mkPod("apps", "b", "node-b", "app", false)
	mkPod("apps", "canary", "node-a", "app", false)

	token := func(bound *corev1.Pod) string {
		t.Helper()
		spec := authv1.TokenRequestSpec{ExpirationSeconds: new(int64(3600))}
		if bound != nil {
			spec.BoundObjectRef = &authv1.BoundObjectReference{Kind: "Pod", APIVersion: "v1", Name: bound.Name, UID: bound.UID}
		}
		tok, err := admin.CoreV1().ServiceAccounts("istio-system").CreateToken(ctx, "ztunnel", &authv1.TokenRequest{Spec: spec}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return tok.Status.Token
	}
	client := func(tok string) *kubernetes.Clientset {
		cs, err := kubernetes.NewForConfig(cp.Config(tok))
		if err != nil {
			t.Fatal(err)
		}
		return cs
	}
	node := client(token(nodePod)) // what the kubelet mounts in the DaemonSet's pod
	unbound := client(token(nil))

	// The API server names the node of the pod the token is bound to,
	// and no node for an unbound token: the policy's premise.
	whoami := func(cs *kubernetes.Clientset) []string {
		t.Helper()
		r, err := cs.AuthenticationV1().SelfSubjectReviews().Create(ctx, &authv1.SelfSubjectReview{}, metav1.CreateOptions{})
		if err != nil {
			t.Fatal(err)
		}
		if u := r.Status.UserInfo.Username; u != "system:serviceaccount:istio-system:ztunnel" {
			t.Fatalf("token authenticates as %q", u)
		}
		return r.Status.UserInfo.Extra[nodeNameExtra]
	}
	if got := whoami(node); len(got) != 1 || got[0] != "node-a" {
		t.Fatalf("token bound to pod on node-a: %s = %v, want [node-a]", nodeNameExtra, got)
	}
	if got := whoami(unbound); len(got) != 0 {
		t.Fatalf("unbound token: %s = %v, want none", nodeNameExtra, got)
	}

	patch := func(cs *kubernetes.Clientset, name, body string, sub ...string) error {
		_, err := cs.CoreV1().Pods("apps").Patch(ctx, name, types.MergePatchType, []byte(body), metav1.PatchOptions{}, sub...)
		return err
	}
	setAnn := func(v string) string {
		if v != "null" {
			v = fmt.Sprintf("%q", v)
		}
		return fmt.Sprintf(`{"metadata":{"annotations":{%q:%s}}}`, redirectKey, v)
	}
	get := func(name string) *corev1.Pod {
		t.Helper()
		p, err := admin.CoreV1().Pods("apps").Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return p
	}

	// The policy takes effect when the API server's admission plugin has
	// seen it and its binding; until then a dry run of a label change
	// through pods/status (which RBAC allows) passes.
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := node.CoreV1().Pods("apps").Patch(ctx, "canary", types.MergePatchType, []byte(`{"metadata":{"labels":{"app":"x"}}}`),
			metav1.PatchOptions{DryRun: []string{metav1.DryRunAll}}, "status")
		if apierrors.IsForbidden(err) || apierrors.IsInvalid(err) {
			break
		}
		if time.Now().After(deadline) {
			t.Errorf("the node account may still change a label through pods/status 30s after deploy/istio was applied: %v", err)
			break
		}
		time.Sleep(100 * time.Millisecond) // no signal for an admission plugin's informers
	}

	// refused asserts the change is refused, by message, and leaves the
	// pod as it was.
	refused := func(what string, cs *kubernetes.Clientset, name, body, msg string, sub ...string) {
		t.Helper()
		before := get(name)
		err := patch(cs, name, body, sub...)
		if err == nil {
			t.Errorf("%s: allowed", what)
		} else if !apierrors.IsForbidden(err) && !apierrors.IsInvalid(err) || !strings.Contains(err.Error(), msg) {
			t.Errorf("%s: %v, want forbidden with %q", what, err, msg)
		}
		after := get(name)
		if after.ResourceVersion != before.ResourceVersion {
			t.Errorf("%s: the pod changed (resourceVersion %s -> %s)", what, before.ResourceVersion, after.ResourceVersion)
		}
	}

	// Allowed: the redirector's own patch, set then removed, kept by
	// the API server although sent to pods/status.
	if err := patch(node, "a", setAnn("enabled"), "status"); err != nil {
		t.Fatalf("node-a's account sets the redirection annotation of its pod through pods/status: %v", err)
	}
	if v := get("a").Annotations[redirectKey]; v != "enabled" {
		t.Fatalf("after a pods/status patch the annotation is %q, want enabled: the API server dropped it", v)
	}
	if err := patch(node, "a", setAnn("null"), "status"); err != nil {
		t.Fatalf("node-a's account removes the redirection annotation of its pod: %v", err)
	}
	if v, ok := get("a").Annotations[redirectKey]; ok {
		t.Fatalf("annotation %q still there after its removal", v)
	}

	// The status subresource drops spec changes; the image stays.
	if err := patch(node, "a", `{"spec":{"containers":[{"name":"c","image":"evil.invalid/x:1"}]}}`, "status"); err == nil {
		if img := get("a").Spec.Containers[0].Image; img != "example.invalid/app:1" {
			t.Errorf("the node account changed the image through pods/status: %s", img)
		}
	}
	// meshtun's redirector itself, with the node's token: it annotates
	// the pod the node captured and removes the annotation when the pod
	// leaves the mesh.
	t.Run("redirector", func(t *testing.T) {
		api, err := kubeapi.New(cp.Config(token(nodePod)))
		if err != nil {
			t.Fatal(err)
		}
		rctx, cancel := context.WithCancel(ctx)
		r := meshkube.NewRedirector(api, "node-a", func(map[registry.WorkloadRef]bool) {}, nil, zerolog.New(zerolog.NewTestWriter(t)))
		done := make(chan struct{})
		go func() { r.Run(rctx); close(done) }()
		defer func() { cancel(); <-done }()
		lbl := []byte(`{"metadata":{"labels":{"istio.io/dataplane-mode":"ambient"}}}`)
		if _, err := admin.CoreV1().Namespaces().Patch(ctx, "apps", types.MergePatchType, lbl, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		r.Captured([]registry.WorkloadRef{{Namespace: "apps", Name: "a"}})
		waitRedirected(t, admin, "apps", "a", true)
		lbl = []byte(`{"metadata":{"labels":{"istio.io/dataplane-mode":null}}}`)
		if _, err := admin.CoreV1().Namespaces().Patch(ctx, "apps", types.MergePatchType, lbl, metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
		waitRedirected(t, admin, "apps", "a", false)
	})
	if t.Failed() {
		return
	}

	refused("plain pod patch of the annotation", node, "a", setAnn("enabled"), "forbidden")
	refused("plain pod patch of the image", node, "a", `{"spec":{"containers":[{"name":"c","image":"evil.invalid/x:1"}]}}`, "forbidden")
	refused("another annotation", node, "a", `{"metadata":{"annotations":{"note":"y"}}}`, "only the ambient.istio.io/redirection annotation", "status")
	refused("a new annotation", node, "a", `{"metadata":{"annotations":{"sidecar.istio.io/inject":"true"}}}`, "only the ambient.istio.io/redirection annotation", "status")
	refused("the annotation with another value", node, "a", setAnn("disabled"), `may only be set to "enabled"`, "status")
	refused("a label", node, "a", `{"metadata":{"labels":{"app":"istiod"}}}`, "may not change pod labels", "status")
	refused("a finalizer", node, "a", `{"metadata":{"finalizers":["example.invalid/hold"]}}`, "may not change pod finalizers", "status")
	refused("the status", node, "a", `{"status":{"podIP":"198.18.2.20","podIPs":[{"ip":"198.18.2.20"}]}}`, "may not change pod status", "status")
	refused("another node's pod", node, "b", setAnn("enabled"), "is not on node node-a", "status")
	refused("a token bound to no node", unbound, "a", setAnn("enabled"), "bound to no node", "status")
	if err := node.CoreV1().Pods("apps").Delete(ctx, "a", metav1.DeleteOptions{}); err == nil {
		t.Error("the node account deleted a pod")
	}
}
