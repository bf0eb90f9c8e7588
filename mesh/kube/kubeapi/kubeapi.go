// Package kubeapi is meshtun's client of the Kubernetes API server: the
// few kinds it reads and writes (pods, namespaces, services, endpoint
// slices, token reviews, API discovery of one group), over client-go's
// REST client with a scheme of its own that holds only those kinds.
//
// client-go's generated clientset, informer factory, discovery client and
// the typed clients all go through k8s.io/client-go/kubernetes/scheme,
// whose init registers every built-in API group (56 packages of types):
// in meshtun that was 4 MiB of the binary's text resident in every node at
// start, half of the init allocations and a sixth of the binary, for kinds
// it never touches. See
// docs/decisions/2026-12-01-binary-size-rss.md.
package kubeapi

import (
	"context"
	"encoding/json"
	"fmt"
	"sync"
	"time"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
)

// Client talks to the API server for the kinds of this package's scheme.
type Client struct {
	core, discovery, auth *rest.RESTClient
}

// codecs are the serializers of a scheme that holds the kinds the client
// decodes, built on first use rather than at init: a node that does not
// talk to an API server does not pay for it.
var codecs = sync.OnceValue(func() serializer.CodecFactory {
	s := runtime.NewScheme()
	for _, add := range []func(*runtime.Scheme) error{corev1.AddToScheme, discoveryv1.AddToScheme, authv1.AddToScheme} {
		if err := add(s); err != nil {
			panic(fmt.Sprintf("kubeapi: scheme: %v", err))
		}
	}
	return serializer.NewCodecFactory(s)
})

// New returns a client for the API server rc describes.
func New(rc *rest.Config) (*Client, error) {
	hc, err := rest.HTTPClientFor(rc)
	if err != nil {
		return nil, fmt.Errorf("kubernetes: %w", err)
	}
	mk := func(gv schema.GroupVersion, apiPath string) (*rest.RESTClient, error) {
		c := rest.CopyConfig(rc)
		c.GroupVersion = &gv
		c.APIPath = apiPath
		c.NegotiatedSerializer = codecs().WithoutConversion()
		if c.UserAgent == "" {
			c.UserAgent = rest.DefaultKubernetesUserAgent()
		}
		r, err := rest.RESTClientForConfigAndClient(c, hc)
		if err != nil {
			return nil, fmt.Errorf("kubernetes: %w", err)
		}
		return r, nil
	}
	var c Client
	if c.core, err = mk(corev1.SchemeGroupVersion, "/api"); err != nil {
		return nil, err
	}
	if c.discovery, err = mk(discoveryv1.SchemeGroupVersion, "/apis"); err != nil {
		return nil, err
	}
	if c.auth, err = mk(authv1.SchemeGroupVersion, "/apis"); err != nil {
		return nil, err
	}
	return &c, nil
}

// ListWatch returns the list and watch of resource ("pods", "namespaces",
// "services" or "endpointslices") in all namespaces, tweak (if not nil)
// adjusting every request's options, for an informer. As client-go's
// typed clients do, a watch also ends on the client's side when the
// options' TimeoutSeconds have passed, should the server not end it.
func (c *Client) ListWatch(resource string, tweak func(*metav1.ListOptions)) cache.ListerWatcher {
	rc := c.core
	if resource == "endpointslices" {
		rc = c.discovery
	}
	if tweak == nil {
		tweak = func(*metav1.ListOptions) {}
	}
	return &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			tweak(&o)
			return rc.Get().Resource(resource).VersionedParams(&o, metav1.ParameterCodec).Do(ctx).Get()
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			tweak(&o)
			o.Watch = true
			var timeout time.Duration
			if o.TimeoutSeconds != nil {
				timeout = time.Duration(*o.TimeoutSeconds) * time.Second
			}
			return rc.Get().Resource(resource).VersionedParams(&o, metav1.ParameterCodec).Timeout(timeout).Watch(ctx)
		},
	}
}

// PatchPodStatus patches a pod through its status subresource: the API
// server keeps changes to the status and the metadata (labels,
// annotations) and drops those to the spec. RBAC grants it as
// pods/status, which cannot change what a pod runs.
func (c *Client) PatchPodStatus(ctx context.Context, namespace, name string, pt types.PatchType, data []byte) error {
	return c.core.Patch(pt).Namespace(namespace).Resource("pods").Name(name).SubResource("status").
		VersionedParams(&metav1.PatchOptions{}, metav1.ParameterCodec).Body(data).Do(ctx).Error()
}

// GetPod reads a pod.
func (c *Client) GetPod(ctx context.Context, namespace, name string) (*corev1.Pod, error) {
	p := &corev1.Pod{}
	err := c.core.Get().Namespace(namespace).Resource("pods").Name(name).
		VersionedParams(&metav1.GetOptions{}, metav1.ParameterCodec).Do(ctx).Into(p)
	return p, err
}

// ListPods lists pods of all namespaces.
func (c *Client) ListPods(ctx context.Context, opts metav1.ListOptions) (*corev1.PodList, error) {
	l := &corev1.PodList{}
	err := c.core.Get().Resource("pods").VersionedParams(&opts, metav1.ParameterCodec).Do(ctx).Into(l)
	return l, err
}

// CreateTokenReview creates an authentication.k8s.io/v1 TokenReview and
// returns it with the API server's status.
func (c *Client) CreateTokenReview(ctx context.Context, tr *authv1.TokenReview) (*authv1.TokenReview, error) {
	out := &authv1.TokenReview{}
	err := c.auth.Post().Resource("tokenreviews").
		VersionedParams(&metav1.CreateOptions{}, metav1.ParameterCodec).Body(tr).Do(ctx).Into(out)
	return out, err
}

// APIResources returns the resources the API server serves in
// groupVersion ("group/version"), as discovery's
// ServerResourcesForGroupVersion does.
func (c *Client) APIResources(ctx context.Context, groupVersion string) (*metav1.APIResourceList, error) {
	b, err := c.core.Get().AbsPath("/apis", groupVersion).Do(ctx).Raw()
	if err != nil {
		return nil, err
	}
	l := &metav1.APIResourceList{}
	if err := json.Unmarshal(b, l); err != nil {
		return nil, fmt.Errorf("kubernetes: discovery of %s: %w", groupVersion, err)
	}
	if l.GroupVersion == "" {
		l.GroupVersion = groupVersion
	}
	return l, nil
}

// GetSecret reads a Secret.
func (c *Client) GetSecret(ctx context.Context, namespace, name string) (*corev1.Secret, error) {
	s := &corev1.Secret{}
	err := c.core.Get().Namespace(namespace).Resource("secrets").Name(name).
		VersionedParams(&metav1.GetOptions{}, metav1.ParameterCodec).Do(ctx).Into(s)
	return s, err
}

// CreateSecret creates a Secret (in its own namespace).
func (c *Client) CreateSecret(ctx context.Context, s *corev1.Secret) (*corev1.Secret, error) {
	out := &corev1.Secret{}
	err := c.core.Post().Namespace(s.Namespace).Resource("secrets").
		VersionedParams(&metav1.CreateOptions{}, metav1.ParameterCodec).Body(s).Do(ctx).Into(out)
	return out, err
}

// GetConfigMap reads a ConfigMap.
func (c *Client) GetConfigMap(ctx context.Context, namespace, name string) (*corev1.ConfigMap, error) {
	cm := &corev1.ConfigMap{}
	err := c.core.Get().Namespace(namespace).Resource("configmaps").Name(name).
		VersionedParams(&metav1.GetOptions{}, metav1.ParameterCodec).Do(ctx).Into(cm)
	return cm, err
}

// CreateConfigMap creates a ConfigMap (in its own namespace).
func (c *Client) CreateConfigMap(ctx context.Context, cm *corev1.ConfigMap) (*corev1.ConfigMap, error) {
	out := &corev1.ConfigMap{}
	err := c.core.Post().Namespace(cm.Namespace).Resource("configmaps").
		VersionedParams(&metav1.CreateOptions{}, metav1.ParameterCodec).Body(cm).Do(ctx).Into(out)
	return out, err
}

// UpdateConfigMap replaces a ConfigMap; its resourceVersion makes a
// concurrent change a conflict.
func (c *Client) UpdateConfigMap(ctx context.Context, cm *corev1.ConfigMap) (*corev1.ConfigMap, error) {
	out := &corev1.ConfigMap{}
	err := c.core.Put().Namespace(cm.Namespace).Resource("configmaps").Name(cm.Name).
		VersionedParams(&metav1.UpdateOptions{}, metav1.ParameterCodec).Body(cm).Do(ctx).Into(out)
	return out, err
}

// PodLive is the one rule of which pods are live for the mesh, shared by
// the node's model (mesh/kube) and the certificate service's node
// authorization (mesh/identity/caserver), so that the two never disagree:
// a pod the node keeps in the mesh is one the CA grants a certificate for.
// A pod is live from its scheduling until it finishes (phase Pending or
// Running), graceful termination included: a terminating pod still runs,
// and dropping it from the mesh then would leave its last connections
// uncaptured (plaintext, no policy). It returns why not, if not.
func PodLive(p *corev1.Pod) (bool, string) {
	switch p.Status.Phase {
	case corev1.PodPending, corev1.PodRunning:
		return true, ""
	case "":
		return false, "no phase yet"
	}
	return false, "phase " + string(p.Status.Phase)
}
