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

type (
	listFunc  func(context.Context, metav1.ListOptions) (runtime.Object, error)
	watchFunc func(context.Context, metav1.ListOptions) (watch.Interface, error)
)

// listOf turns a typed client's List into a listFunc.
func listOf[T runtime.Object](l func(context.Context, metav1.ListOptions) (T, error)) listFunc {
	return func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) { return l(ctx, o) }
}

func (f fakeAPI) ListWatch(resource string, tweak func(*metav1.ListOptions)) cache.ListerWatcher {
	var list listFunc
	var watchF watchFunc
	switch resource {
	case "pods":
		c := f.cs.CoreV1().Pods("")
		list, watchF = listOf(c.List), c.Watch
	case "namespaces":
		c := f.cs.CoreV1().Namespaces()
		list, watchF = listOf(c.List), c.Watch
	case "services":
		c := f.cs.CoreV1().Services("")
		list, watchF = listOf(c.List), c.Watch
	case "endpointslices":
		c := f.cs.DiscoveryV1().EndpointSlices("")
		list, watchF = listOf(c.List), c.Watch
	default:
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

func (f fakeAPI) PatchPodStatus(ctx context.Context, namespace, name string, pt types.PatchType, data []byte) error {
	_, err := f.cs.CoreV1().Pods(namespace).Patch(ctx, name, pt, data, metav1.PatchOptions{}, "status")
	return err
}

func (f fakeAPI) APIResources(_ context.Context, groupVersion string) (*metav1.APIResourceList, error) {
	return f.cs.Discovery().ServerResourcesForGroupVersion(groupVersion)
}
