// Package kind brings up a real kind cluster on this machine without a
// container registry or a Docker engine and runs meshtun's shipped
// deploy/kubernetes/ DaemonSet on it.
//
// Everything is built from the Go module proxy and Debian's apt archive and
// cached under ~/.cache/meshtun-test/kind, one directory per part and
// version (a version change builds that part again): kind, containerd,
// runc, crictl, the CNI plugins, the seven Kubernetes binaries, etcd,
// CoreDNS, a debootstrapped Debian base and the node image assembled from
// them (docs/kind.md). The cluster runs on rootful podman on an internal
// podman network, so nothing leaves the machine; a small stand-in for
// kindnetd (WritePodNetwork) gives the nodes their ptp CNI configuration
// and the routes between their pod CIDRs.
package kind
