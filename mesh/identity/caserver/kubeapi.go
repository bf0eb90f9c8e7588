package caserver

import (
	"context"
	"fmt"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"

	"github.com/meshtun/meshtun/mesh/kube/kubeapi"
)

// KubeAPI is the TokenReviewer and Pods of KubeMode on a real API server:
// an authentication.k8s.io/v1 TokenReview per request, and pod reads (get,
// and list by spec.nodeName). Its service account needs create on
// tokenreviews and get, list on pods (deploy/kubernetes/ca.yaml).
type KubeAPI struct {
	Client KubeClient
}

// KubeClient is what KubeAPI calls on the API server: kubeapi.Client
// (not client-go's clientset, whose scheme registers every built-in API
// group; see package kubeapi).
type KubeClient interface {
	CreateTokenReview(ctx context.Context, tr *authv1.TokenReview) (*authv1.TokenReview, error)
	GetPod(ctx context.Context, namespace, name string) (*corev1.Pod, error)
	ListPods(ctx context.Context, opts metav1.ListOptions) (*corev1.PodList, error)
}

// Review implements TokenReviewer.
func (k KubeAPI) Review(ctx context.Context, token string, audiences []string) (*TokenReview, error) {
	tr, err := k.Client.CreateTokenReview(ctx, &authv1.TokenReview{
		Spec: authv1.TokenReviewSpec{Token: token, Audiences: audiences},
	})
	if err != nil {
		return nil, err
	}
	r := &TokenReview{
		Authenticated: tr.Status.Authenticated,
		Username:      tr.Status.User.Username,
		Audiences:     tr.Status.Audiences,
		Error:         tr.Status.Error,
		Extra:         map[string][]string{},
	}
	for k, v := range tr.Status.User.Extra {
		r.Extra[k] = v
	}
	return r, nil
}

// Get implements Pods.
func (k KubeAPI) Get(ctx context.Context, namespace, name string) (*Pod, error) {
	p, err := k.Client.GetPod(ctx, namespace, name)
	if err != nil {
		return nil, err
	}
	pod := podOf(p)
	return &pod, nil
}

// OnNode implements Pods.
func (k KubeAPI) OnNode(ctx context.Context, node string) ([]Pod, error) {
	if node == "" {
		return nil, fmt.Errorf("no node")
	}
	l, err := k.Client.ListPods(ctx, metav1.ListOptions{
		FieldSelector: fields.OneTermEqualSelector("spec.nodeName", node).String(),
	})
	if err != nil {
		return nil, err
	}
	pods := make([]Pod, 0, len(l.Items))
	for i := range l.Items {
		pods = append(pods, podOf(&l.Items[i]))
	}
	return pods, nil
}

func podOf(p *corev1.Pod) Pod {
	live, _ := kubeapi.PodLive(p)
	return Pod{
		Namespace: p.Namespace, Name: p.Name, UID: string(p.UID),
		ServiceAccount: p.Spec.ServiceAccountName, Node: p.Spec.NodeName,
		Running: live,
	}
}
