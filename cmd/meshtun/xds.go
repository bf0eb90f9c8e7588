package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net"
	"net/netip"
	"os"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/config"
	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/kube"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/mesh/xds"
)

// xdsFlags are the flags of the istiod (xDS) source. Their defaults come
// from the environment variables ztunnel's DaemonSet sets, so meshtun can
// take its place with the same pod spec.
type xdsFlags struct {
	address, serverName, rootCert, token  string
	podName, podNamespace, serviceAccount string
	instanceIP, clusterID, network        string
	redirectPods                          bool
	// istiod's CA
	caAddress, caServerName, caRootCert string
}

func envOr(k, def string) string {
	if v, ok := os.LookupEnv(k); ok && v != "" {
		return v
	}
	return def
}

func (f *xdsFlags) register(fs *flag.FlagSet) {
	fs.StringVar(&f.address, "xds-address", os.Getenv("XDS_ADDRESS"), "take the mesh (workloads, services, policies) from istiod's delta xDS at `host:port` (as istiod.istio-system.svc:15012; default $XDS_ADDRESS) instead of the config file")
	fs.StringVar(&f.serverName, "xds-server-name", "", "the name istiod's certificate must carry; default the host of --xds-address")
	fs.StringVar(&f.rootCert, "xds-root-cert", envOr("XDS_ROOT_CA", "/var/run/secrets/istio/root-cert.pem"), "PEM `file` of the roots that verify istiod (the istio-ca-root-cert ConfigMap, mounted; default $XDS_ROOT_CA)")
	fs.StringVar(&f.token, "xds-token", "/var/run/secrets/tokens/istio-token", "`file` of the node's service-account token (audience istio-ca), sent to istiod as a bearer token (xDS and, with --ca-address, the CA)")
	fs.StringVar(&f.caAddress, "ca-address", os.Getenv("CA_ADDRESS"), "take the workloads' certificates from istiod's CA (IstioCertificateService) at `host:port` (as istiod.istio-system.svc:15012; default $CA_ADDRESS) instead of `meshtun ca`; authenticated with --xds-token, the node's service account must be in istiod's CA_TRUSTED_NODE_ACCOUNTS")
	fs.StringVar(&f.caServerName, "ca-server-name", "", "the name istiod's certificate must carry at --ca-address; default the host of --ca-address")
	fs.StringVar(&f.caRootCert, "ca-root-cert", envOr("CA_ROOT_CA", "/var/run/secrets/istio/root-cert.pem"), "PEM `file` of istiod's root: verifies istiod at --ca-address and is the mesh's first trust bundle (default $CA_ROOT_CA)")
	fs.StringVar(&f.podName, "pod-name", os.Getenv("POD_NAME"), "with --xds-address: this node proxy's pod `name` (default $POD_NAME)")
	fs.StringVar(&f.podNamespace, "pod-namespace", os.Getenv("POD_NAMESPACE"), "with --xds-address: its `namespace` (default $POD_NAMESPACE)")
	fs.StringVar(&f.serviceAccount, "service-account", os.Getenv("SERVICE_ACCOUNT"), "with --xds-address: its service `account` (default $SERVICE_ACCOUNT)")
	fs.StringVar(&f.instanceIP, "instance-ip", os.Getenv("INSTANCE_IP"), "with --xds-address: its pod `address` (default $INSTANCE_IP)")
	fs.StringVar(&f.clusterID, "cluster-id", envOr("CLUSTER_ID", "Kubernetes"), "with --xds-address: istiod's cluster `name` (default $CLUSTER_ID or Kubernetes)")
	fs.BoolVar(&f.redirectPods, "redirect-pods", false, "with --xds-address: play istio-cni's part, annotating this node's enrolled pods ambient.istio.io/redirection=enabled so that istiod reaches them over HBONE (needs get, list, watch on pods and namespaces and patch on pods; --kubeconfig or the in-cluster account)")
	fs.StringVar(&f.network, "network", os.Getenv("NETWORK"), "with --xds-address: this node's Istio `network` (default $NETWORK, empty)")
}

// newXDS returns the source of the mesh model that follows istiod (the
// node starts it) and, with --redirect-pods, what the node tells of the
// pods it has captured (node.Config.Captured; nil without), whose
// redirector runs until ctx ends.
func newXDS(ctx context.Context, f xdsFlags, kubeconfig, nodeName string, c *config.Config, log zerolog.Logger) (*xds.Source, func([]*registry.Workload), error) {
	for _, r := range []struct{ v, flag string }{
		{f.podName, "--pod-name (or POD_NAME)"}, {f.podNamespace, "--pod-namespace (or POD_NAMESPACE)"},
		{f.serviceAccount, "--service-account (or SERVICE_ACCOUNT)"}, {f.instanceIP, "--instance-ip (or INSTANCE_IP)"},
	} {
		if r.v == "" {
			return nil, nil, fmt.Errorf("--xds-address needs %s: istiod checks who the node proxy is", r.flag)
		}
	}
	if kubeconfig != "" && !f.redirectPods {
		return nil, nil, errors.New("--kubeconfig with --xds-address is for --redirect-pods: the model comes from istiod")
	}
	ip, err := netip.ParseAddr(f.instanceIP)
	if err != nil {
		return nil, nil, fmt.Errorf("--instance-ip %q: %w", f.instanceIP, err)
	}
	if len(c.Workloads) > 0 || len(c.Services) > 0 {
		log.Warn().Str("config", c.Path).Msg("with --xds-address the workloads and services of the config file are ignored: istiod's are the mesh")
	}
	src := xds.New(xds.Config{
		Address: f.address, ServerName: f.serverName, RootCertFile: f.rootCert, TokenFile: f.token,
		Node: xds.Node{
			PodName: f.podName, Namespace: f.podNamespace, ServiceAccount: f.serviceAccount,
			IP: ip, NodeName: nodeName, ClusterID: f.clusterID, Network: f.network,
		},
		TrustDomain: c.TrustDomainID(), RootNamespace: c.RootNamespace, DomainSuffix: c.ClusterDomain,
		PeerAuth: c.DefaultPeerAuth(), Policies: c.Policies(), Logger: log,
	})
	var captured func([]*registry.Workload)
	if f.redirectPods {
		cs, err := kubeClient(kubeconfig, nodeName)
		if err != nil {
			return nil, nil, err
		}
		klogToZerolog(log)
		// Before the model: istiod marks the pods HBONE only once they
		// carry the annotation, which the redirector sets once the node
		// has captured them (the source marks them in the mesh here
		// meanwhile).
		r := kube.NewRedirector(cs, nodeName, src.Enroll, src.ProbePorts, log)
		captured = func(ws []*registry.Workload) {
			refs := make([]registry.WorkloadRef, len(ws))
			for i, w := range ws {
				refs[i] = registry.WorkloadRef{Namespace: w.Namespace, Name: w.Name}
			}
			r.Captured(refs)
		}
		go r.Run(ctx)
	}
	return src, captured, nil
}

// istiodIssuer returns the client of istiod's CA: TLS verified by
// istiod's root and name, the node's projected token as bearer, the
// cluster ID as istiod's agents send it. The root file is also the first
// trust bundle of the mesh; istiod's responses keep it current.
func istiodIssuer(f xdsFlags, td spiffeid.TrustDomain, ttl time.Duration, log zerolog.Logger) (*identity.RemoteIssuer, error) {
	name := f.caServerName
	if name == "" {
		h, _, err := net.SplitHostPort(f.caAddress)
		if err != nil {
			return nil, fmt.Errorf("--ca-address %q: %w", f.caAddress, err)
		}
		name = h
	}
	pemRoots, err := os.ReadFile(f.caRootCert)
	if err != nil {
		return nil, fmt.Errorf("--ca-root-cert: %w", err)
	}
	roots, err := identity.ParseCertsPEM(pemRoots)
	if err != nil {
		return nil, fmt.Errorf("--ca-root-cert %s: %w", f.caRootCert, err)
	}
	if _, err := os.Stat(f.token); err != nil {
		return nil, fmt.Errorf("--xds-token (the node's token for istiod's CA): %w", err)
	}
	return identity.DialCA(identity.RemoteConfig{
		Address: f.caAddress, ServerName: name, TrustDomain: td, Bundle: identity.NewTrustBundle(td, roots),
		Token: identity.TokenFile(f.token), ClusterID: f.clusterID, TTL: ttl, Logger: log,
	})
}
