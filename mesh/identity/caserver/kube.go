package caserver

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/spiffe/go-spiffe/v2/spiffeid"
	"google.golang.org/grpc/metadata"

	"github.com/meshtun/meshtun/mesh/identity"
)

// TokenReviewer validates a bearer token the way the Kubernetes API server's
// TokenReview does. The real one posts an authentication.k8s.io/v1
// TokenReview; tests use a fake.
type TokenReviewer interface {
	Review(ctx context.Context, token string, audiences []string) (*TokenReview, error)
}

// TokenReview is the status of a TokenReview.
type TokenReview struct {
	Authenticated bool
	// Username is system:serviceaccount:<namespace>:<name> for a
	// service-account token.
	Username string
	// Audiences the token is valid for, of those asked.
	Audiences []string
	// Extra holds authentication.kubernetes.io/pod-name and pod-uid for a
	// token bound to a pod.
	Extra map[string][]string
	// Error is the API server's reason when not authenticated.
	Error string
}

// Pod is what the authorizer needs to know about a pod.
type Pod struct {
	Namespace, Name, UID, ServiceAccount, Node string
	// Running: the pod is live by kubeapi.PodLive (scheduled and not
	// finished, terminating included), the rule the node's model uses.
	Running bool
}

// Pods reads pods from the API server.
type Pods interface {
	// Get returns the pod, or an error if it does not exist.
	Get(ctx context.Context, namespace, name string) (*Pod, error)
	// OnNode returns the pods scheduled on node.
	OnNode(ctx context.Context, node string) ([]Pod, error)
}

// Extra keys of a TokenReview for a pod-bound service-account token.
const (
	ExtraPodName = "authentication.kubernetes.io/pod-name"
	ExtraPodUID  = "authentication.kubernetes.io/pod-uid"
	// ExtraNodeName is set by API servers that embed the node of the pod
	// in the token (ServiceAccountTokenPodNodeInfo, Kubernetes 1.30+).
	ExtraNodeName = "authentication.kubernetes.io/node-name"
)

// KubeMode authenticates node proxies by their projected service-account
// token (authorization: Bearer, reviewed with audience Audience), accepts
// only the service accounts in NodeAccounts, finds the caller's node from
// the pod the token is bound to, and grants an identity only if a running
// pod with that namespace and service account is on that node.
type KubeMode struct {
	TrustDomain spiffeid.TrustDomain
	Reviewer    TokenReviewer
	Pods        Pods
	// Audience the tokens must be for.
	Audience string
	// NodeAccounts are the "<namespace>/<service account>" of node proxies.
	NodeAccounts []string
	// ReviewTTL is how long a successful TokenReview is reused
	// (DefaultReviewTTL if zero); ReviewCacheSize bounds the reviews kept
	// (DefaultReviewCacheSize if zero). Failures are not reused.
	ReviewTTL       time.Duration
	ReviewCacheSize int

	cacheOnce sync.Once
	cache     *reviewCache
}

// maxTokenLen bounds a bearer token: a projected service-account token is
// about 1 KiB; a longer one is refused without a TokenReview.
const maxTokenLen = 8 << 10

// Authenticate implements Authenticator.
func (k *KubeMode) Authenticate(ctx context.Context) (Caller, error) {
	md, _ := metadata.FromIncomingContext(ctx)
	var token string
	for _, v := range md.Get("authorization") {
		if t, ok := strings.CutPrefix(v, "Bearer "); ok {
			token = strings.TrimSpace(t)
		}
	}
	if token == "" {
		return Caller{}, ErrNoCredential
	}
	if len(token) > maxTokenLen {
		return Caller{}, fmt.Errorf("bearer token of %d bytes; at most %d", len(token), maxTokenLen)
	}
	r, err := k.reviews().review(ctx, k.Reviewer, token, []string{k.Audience})
	if err != nil {
		return Caller{}, fmt.Errorf("token review failed: %v", err)
	}
	if !r.Authenticated {
		return Caller{}, fmt.Errorf("token not authenticated: %s", r.Error)
	}
	if !slices.Contains(r.Audiences, k.Audience) {
		return Caller{}, fmt.Errorf("token of %s is not for audience %q", r.Username, k.Audience)
	}
	rest, ok := strings.CutPrefix(r.Username, "system:serviceaccount:")
	ns, sa, ok2 := strings.Cut(rest, ":")
	if !ok || !ok2 {
		return Caller{}, fmt.Errorf("token of %s is not a service-account token", r.Username)
	}
	who := fmt.Sprintf("service account %s/%s", ns, sa)
	if !slices.Contains(k.NodeAccounts, ns+"/"+sa) {
		return Caller{}, fmt.Errorf("%s is not a node account (allowed: %s)", who, strings.Join(k.NodeAccounts, ", "))
	}
	podName := first(r.Extra[ExtraPodName])
	if podName == "" {
		return Caller{}, fmt.Errorf("token of %s is not bound to a pod (use a projected token)", who)
	}
	pod, err := k.Pods.Get(ctx, ns, podName)
	if err != nil {
		return Caller{}, fmt.Errorf("%s: pod %s/%s of the token: %v", who, ns, podName, err)
	}
	if uid := first(r.Extra[ExtraPodUID]); uid != "" && uid != pod.UID {
		return Caller{}, fmt.Errorf("%s: pod %s/%s of the token is gone (uid %s, now %s)", who, ns, podName, uid, pod.UID)
	}
	if pod.Node == "" {
		return Caller{}, fmt.Errorf("%s: pod %s/%s is not scheduled on a node", who, ns, podName)
	}
	if n := first(r.Extra[ExtraNodeName]); n != "" && n != pod.Node {
		return Caller{}, fmt.Errorf("%s: token names node %s, but pod %s/%s is on node %s", who, n, ns, podName, pod.Node)
	}
	return Caller{Node: pod.Node, Who: fmt.Sprintf("%s (pod %s/%s)", who, ns, podName)}, nil
}

// reviews returns the TokenReview cache, made on first use.
func (k *KubeMode) reviews() *reviewCache {
	k.cacheOnce.Do(func() { k.cache = newReviewCache(k.ReviewTTL, k.ReviewCacheSize) })
	return k.cache
}

func first(s []string) string {
	if len(s) == 0 {
		return ""
	}
	return s[0]
}

// Authorize implements Authorizer.
func (k *KubeMode) Authorize(ctx context.Context, caller Caller, id spiffeid.ID) error {
	if !id.MemberOf(k.TrustDomain) {
		return fmt.Errorf("node %s may not have %s: not of trust domain %s", caller.Node, id, k.TrustDomain)
	}
	ns, sa, err := identity.ParseWorkloadID(id)
	if err != nil {
		return fmt.Errorf("node %s may not have %s: %v", caller.Node, id, err)
	}
	pods, err := k.Pods.OnNode(ctx, caller.Node)
	if err != nil {
		return fmt.Errorf("node %s: list its pods: %v", caller.Node, err)
	}
	for _, p := range pods {
		if p.Running && p.Namespace == ns && p.ServiceAccount == sa {
			return nil
		}
	}
	return fmt.Errorf("node %s may not have %s: no running pod of namespace %s with service account %s is on node %s", caller.Node, id, ns, sa, caller.Node)
}

// DefaultAudience is the audience of the projected service-account tokens
// node proxies present to `meshtun ca --kubernetes`.
const DefaultAudience = "meshtun-ca"
