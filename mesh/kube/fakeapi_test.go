package kube

import (
	"context"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/cache"
)

// fakeAPI is the API of client-go's fake clientset, for the unit tests.
type fakeAPI struct{ cs *fake.Clientset }

func (f fakeAPI) ListWatch(resource string, tweak func(*metav1.ListOptions)) cache.ListerWatcher {
	list := map[string]func(context.Context, metav1.ListOptions) (runtime.Object, error){
		"pods": func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return f.cs.CoreV1().Pods("").List(ctx, o)
		},
		"namespaces": func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return f.cs.CoreV1().Namespaces().List(ctx, o)
		},
		"services": func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return f.cs.CoreV1().Services("").List(ctx, o)
		},
		"endpointslices": func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			return f.cs.DiscoveryV1().EndpointSlices("").List(ctx, o)
		},
	}[resource]
	watchF := map[string]func(context.Context, metav1.ListOptions) (watch.Interface, error){
		"pods": func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return f.cs.CoreV1().Pods("").Watch(ctx, o)
		},
		"namespaces": func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return f.cs.CoreV1().Namespaces().Watch(ctx, o)
		},
		"services": func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return f.cs.CoreV1().Services("").Watch(ctx, o)
		},
		"endpointslices": func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			return f.cs.DiscoveryV1().EndpointSlices("").Watch(ctx, o)
		},
	}[resource]
	if list == nil {
		panic("fakeAPI: no resource " + resource)
	}
	if tweak == nil {
		tweak = func(*metav1.ListOptions) {}
	}
	return cache.ToListWatcherWithWatchListSemantics(&cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			tweak(&o)
			return list(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			tweak(&o)
			return watchF(ctx, o)
		},
	}, f.cs)
}

func (f fakeAPI) PatchPod(ctx context.Context, namespace, name string, pt types.PatchType, data []byte) error {
	_, err := f.cs.CoreV1().Pods(namespace).Patch(ctx, name, pt, data, metav1.PatchOptions{})
	return err
}

func (f fakeAPI) APIResources(_ context.Context, groupVersion string) (*metav1.APIResourceList, error) {
	return f.cs.Discovery().ServerResourcesForGroupVersion(groupVersion)
}
