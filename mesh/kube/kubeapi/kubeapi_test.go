package kubeapi

import (
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"

	authv1 "k8s.io/api/authentication/v1"
	corev1 "k8s.io/api/core/v1"
	discoveryv1 "k8s.io/api/discovery/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/rest"
)

// request is what the fake API server saw.
type request struct {
	method, path, query, contentType, body string
}

// fakeServer answers every request with the JSON of replies[method+" "+path].
func fakeServer(t *testing.T, replies map[string]any) (*Client, func() []request) {
	t.Helper()
	var mu sync.Mutex
	var seen []request
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		mu.Lock()
		seen = append(seen, request{r.Method, r.URL.Path, r.URL.RawQuery, r.Header.Get("Content-Type"), string(b)})
		mu.Unlock()
		key := r.Method + " " + r.URL.Path
		if r.URL.Query().Get("watch") == "true" {
			key = "WATCH " + r.URL.Path
		}
		reply, ok := replies[key]
		if !ok {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusNotFound)
			json.NewEncoder(w).Encode(metav1.Status{TypeMeta: metav1.TypeMeta{Kind: "Status", APIVersion: "v1"},
				Status: metav1.StatusFailure, Reason: metav1.StatusReasonNotFound, Code: http.StatusNotFound})
			return
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(reply)
	}))
	t.Cleanup(srv.Close)
	c, err := New(&rest.Config{Host: srv.URL})
	if err != nil {
		t.Fatal(err)
	}
	return c, func() []request {
		mu.Lock()
		defer mu.Unlock()
		return append([]request(nil), seen...)
	}
}

// TestRequests checks each call's request and the decoding of its reply,
// the API server's paths for the kinds that client-go's typed clients
// used to reach.
func TestRequests(t *testing.T) {
	ctx := context.Background()
	pod := corev1.Pod{TypeMeta: metav1.TypeMeta{Kind: "Pod", APIVersion: "v1"},
		ObjectMeta: metav1.ObjectMeta{Name: "a", Namespace: "ns", UID: "u1"}, Spec: corev1.PodSpec{NodeName: "n1"}}
	c, seen := fakeServer(t, map[string]any{
		"GET /api/v1/namespaces/ns/pods/a": pod,
		"GET /api/v1/pods": corev1.PodList{TypeMeta: metav1.TypeMeta{Kind: "PodList", APIVersion: "v1"},
			Items: []corev1.Pod{pod}},
		"PATCH /api/v1/namespaces/ns/pods/a/status": pod,
		"POST /apis/authentication.k8s.io/v1/tokenreviews": authv1.TokenReview{
			TypeMeta: metav1.TypeMeta{Kind: "TokenReview", APIVersion: "authentication.k8s.io/v1"},
			Status:   authv1.TokenReviewStatus{Authenticated: true, User: authv1.UserInfo{Username: "system:serviceaccount:x:y"}}},
		"GET /apis/security.istio.io/v1": metav1.APIResourceList{GroupVersion: "security.istio.io/v1",
			APIResources: []metav1.APIResource{{Name: "authorizationpolicies"}}},
		"WATCH /api/v1/pods": metav1.WatchEvent{Type: "ADDED", Object: runtime.RawExtension{Object: &pod}},
		"GET /apis/discovery.k8s.io/v1/endpointslices": discoveryv1.EndpointSliceList{
			TypeMeta: metav1.TypeMeta{Kind: "EndpointSliceList", APIVersion: "discovery.k8s.io/v1"},
			Items:    []discoveryv1.EndpointSlice{{ObjectMeta: metav1.ObjectMeta{Name: "s1", Namespace: "ns"}}}},
	})

	p, err := c.GetPod(ctx, "ns", "a")
	if err != nil || p.UID != "u1" || p.Spec.NodeName != "n1" {
		t.Errorf("GetPod = %+v, %v", p, err)
	}
	l, err := c.ListPods(ctx, metav1.ListOptions{FieldSelector: "spec.nodeName=n1"})
	if err != nil || len(l.Items) != 1 || l.Items[0].Name != "a" {
		t.Errorf("ListPods = %+v, %v", l, err)
	}
	if err := c.PatchPodStatus(ctx, "ns", "a", types.MergePatchType, []byte(`{"metadata":{}}`)); err != nil {
		t.Errorf("PatchPodStatus: %v", err)
	}
	tr, err := c.CreateTokenReview(ctx, &authv1.TokenReview{Spec: authv1.TokenReviewSpec{Token: "tok", Audiences: []string{"aud"}}})
	if err != nil || !tr.Status.Authenticated || tr.Status.User.Username != "system:serviceaccount:x:y" {
		t.Errorf("CreateTokenReview = %+v, %v", tr, err)
	}
	rl, err := c.APIResources(ctx, "security.istio.io/v1")
	if err != nil || len(rl.APIResources) != 1 || rl.APIResources[0].Name != "authorizationpolicies" {
		t.Errorf("APIResources = %+v, %v", rl, err)
	}
	if _, err := c.APIResources(ctx, "nothere.example/v1"); err == nil {
		t.Error("APIResources of a group the server does not serve: no error")
	}
	//lint:ignore SA1019 ListWatch returns a cache.ListerWatcher: the test checks that interface's own List and Watch
	obj, err := c.ListWatch("endpointslices", func(o *metav1.ListOptions) { o.LabelSelector = "x=y" }).List(metav1.ListOptions{})
	if sl, ok := obj.(*discoveryv1.EndpointSliceList); err != nil || !ok || len(sl.Items) != 1 || sl.Items[0].Name != "s1" {
		t.Errorf("ListWatch(endpointslices).List = %#v, %v", obj, err)
	}
	ts := int64(7)
	//lint:ignore SA1019 as List above
	w, err := c.ListWatch("pods", nil).Watch(metav1.ListOptions{TimeoutSeconds: &ts})
	if err != nil {
		t.Fatalf("ListWatch(pods).Watch: %v", err)
	}
	if ev := <-w.ResultChan(); ev.Type != watch.Added || ev.Object.(*corev1.Pod).Name != "a" {
		t.Errorf("watch event %+v", ev)
	}
	w.Stop()

	want := []request{
		{method: "GET", path: "/api/v1/namespaces/ns/pods/a"},
		{method: "GET", path: "/api/v1/pods", query: "fieldSelector=spec.nodeName%3Dn1"},
		{method: "PATCH", path: "/api/v1/namespaces/ns/pods/a/status", contentType: "application/merge-patch+json", body: `{"metadata":{}}`},
		{method: "POST", path: "/apis/authentication.k8s.io/v1/tokenreviews", contentType: "application/json"},
		{method: "GET", path: "/apis/security.istio.io/v1"},
		{method: "GET", path: "/apis/nothere.example/v1"},
		{method: "GET", path: "/apis/discovery.k8s.io/v1/endpointslices", query: "labelSelector=x%3Dy"},
		{method: "GET", path: "/api/v1/pods", query: "timeout=7s&timeoutSeconds=7&watch=true"},
	}
	got := seen()
	if len(got) != len(want) {
		t.Fatalf("requests: got %d %+v, want %d", len(got), got, len(want))
	}
	for i, w := range want {
		g := got[i]
		if g.method != w.method || g.path != w.path || g.query != w.query ||
			(w.contentType != "" && g.contentType != w.contentType) || (w.body != "" && g.body != w.body) {
			t.Errorf("request %d: got %+v, want %+v", i, g, w)
		}
	}
	var sent authv1.TokenReview
	if err := json.Unmarshal([]byte(got[3].body), &sent); err != nil || sent.Spec.Token != "tok" ||
		sent.Kind != "TokenReview" || sent.APIVersion != "authentication.k8s.io/v1" {
		t.Errorf("TokenReview sent: %s (%v)", got[3].body, err)
	}
}
