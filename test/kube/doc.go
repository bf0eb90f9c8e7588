// Package kube runs meshtun against a real Kubernetes API server: it
// builds kube-apiserver and etcd from the Go module proxy once into a
// cache (Build), starts them inside a test cluster's sealed namespaces
// (StartControlPlane), and its tests play kubelet and CNI for `meshtun
// node --kubernetes` processes running with the RBAC of deploy/kubernetes.
//
// It is a module of its own so that the control plane's module graph
// (k8s.io/kubernetes, etcd) stays out of the product's go.mod; `make test`
// runs it.
package kube
