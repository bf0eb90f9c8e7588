package kube

import (
	"context"
	"net/netip"
	"testing"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshtun/meshtun/mesh/identity/caserver"
)

// podsAPI is caserver.KubeClient over a fixed set of pods.
type podsAPI struct{ pods []*corev1.Pod }

func (podsAPI) CreateTokenReview(context.Context, *authv1.TokenReview) (*authv1.TokenReview, error) {
	panic("not used")
}

func (a podsAPI) GetPod(_ context.Context, namespace, name string) (*corev1.Pod, error) {
	for _, p := range a.pods {
		if p.Namespace == namespace && p.Name == name {
			return p, nil
		}
	}
	return nil, context.Canceled
}

func (a podsAPI) ListPods(context.Context, metav1.ListOptions) (*corev1.PodList, error) {
	l := &corev1.PodList{}
	for _, p := range a.pods {
		l.Items = append(l.Items, *p)
	}
	return l, nil
}

// TestSourceAndCAAgreeOnLivePods: every local pod the node's model puts
// in the mesh is one `meshtun ca --kubernetes` grants the node a
// certificate for (kubeapi.PodLive, one rule for both), a terminating pod
// (still Running, deletionTimestamp set) above all: before, the model kept
// it and the CA refused it, and the node's start failed on it for good.
// Finished pods are in neither.
func TestSourceAndCAAgreeOnLivePods(t *testing.T) {
	terminating := pod("mesh", "terminating", "n1", "198.18.1.11")
	terminating.DeletionTimestamp = &metav1.Time{Time: time.Now()}
	terminating.Spec.ServiceAccountName = "terminating-sa"
	done := pod("mesh", "done", "n1", "198.18.1.12")
	done.Status.Phase = corev1.PodSucceeded
	failed := pod("mesh", "failed", "n1", "198.18.1.13")
	failed.Status.Phase = corev1.PodFailed
	running := pod("mesh", "running", "n1", "198.18.1.14")
	pods := []*corev1.Pod{terminating, done, failed, running}

	s, _ := start(t, ns("mesh", true), terminating, done, failed, running)
	snap, err := s.Build()
	if err != nil {
		t.Fatal(err)
	}
	td := spiffeid.RequireTrustDomainFromString("cluster.local")
	ca := &caserver.KubeMode{TrustDomain: td, Pods: caserver.KubeAPI{Client: podsAPI{pods}}}
	inModel := map[string]bool{}
	for _, p := range pods {
		w := snap.Workload(netip.MustParseAddr(p.Status.PodIPs[0].IP))
		inMesh := w != nil && w.InMesh && w.Node == "n1"
		inModel[p.Name] = inMesh
		// The CA's answer for the pod's own service account alone (one
		// pod per account here).
		cp, err := caserver.KubeAPI{Client: podsAPI{[]*corev1.Pod{p}}}.Get(context.Background(), p.Namespace, p.Name)
		if err != nil {
			t.Fatal(err)
		}
		if inMesh && !cp.Running {
			t.Errorf("pod %s: in the node's mesh model, yet not live for the CA", p.Name)
		}
		if !inMesh && cp.Running && p.Status.Phase == corev1.PodRunning {
			t.Errorf("pod %s: live for the CA, yet left out of the node's model", p.Name)
		}
		if inMesh {
			if err := ca.Authorize(context.Background(), caserver.Caller{Node: "n1"}, w.Identity); err != nil {
				t.Errorf("pod %s is in the node's model, but the CA refuses its identity: %v", p.Name, err)
			}
		}
	}
	for name, want := range map[string]bool{"terminating": true, "running": true, "done": false, "failed": false} {
		if inModel[name] != want {
			t.Errorf("pod %s in the model: %v, want %v", name, inModel[name], want)
		}
	}
}
