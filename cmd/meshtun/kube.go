package main

import (
	"bytes"
	"flag"
	"fmt"
	"io"
	"net/netip"
	"strings"
	"sync"

	"github.com/rs/zerolog"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/klog/v2"

	"github.com/meshtun/meshtun/mesh/config"
	"github.com/meshtun/meshtun/mesh/kube"
	"github.com/meshtun/meshtun/mesh/kube/kubeapi"
	"github.com/meshtun/meshtun/tun"
)

// newKube returns the source of the mesh model that follows the API server
// (in-cluster, or kubeconfig if set); the node starts it.
func newKube(kubeconfig, nodeName string, c *config.Config, announced func(ns, name, uid string) []netip.Addr, log zerolog.Logger) (*kube.Source, error) {
	klogToZerolog(log)
	rc, err := restConfig(kubeconfig, nodeName)
	if err != nil {
		return nil, err
	}
	cs, err := kubeapi.New(rc)
	if err != nil {
		return nil, err
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return nil, fmt.Errorf("kubernetes: %w", err)
	}
	if len(c.Workloads) > 0 || len(c.Services) > 0 {
		log.Warn().Str("config", c.Path).Msg("with --kubernetes the workloads and services of the config file are ignored: the API server's pods and services are the mesh")
	}
	src := kube.New(kube.Config{
		Client: cs, Dynamic: dyn, Node: nodeName,
		TrustDomain: c.TrustDomainID(), RootNamespace: c.RootNamespace, DomainSuffix: c.ClusterDomain,
		PeerAuth: c.DefaultPeerAuth(), Policies: c.Policies(), Announced: announced,
		LocalAddress: podLinkHere(log), Logger: log,
	})
	log.Info().Str("server", rc.Host).Str("node", nodeName).Msg("kubernetes: connecting")
	return src, nil
}

// podLinkHere returns kube.Config.LocalAddress: an address is this
// node's pod's when the node's routes lead it to a pod link here (a host
// route to a link that is not the uplink, or a bridge CNI's bridge), as
// capture finds it (tun.HostLinks). Asked only when pods of different
// nodes claim the address.
func podLinkHere(log zerolog.Logger) func(netip.Addr) bool {
	return func(a netip.Addr) bool {
		links, err := tun.HostLinks([]netip.Addr{a})
		if err != nil {
			log.Warn().Err(err).Str("address", a.String()).Msg("cannot verify that a pod address claimed by two nodes is routed here; denying it")
			return false
		}
		_, ok := links[a.Unmap()]
		return ok
	}
}

// restConfig is the API server client configuration: from kubeconfig if
// set, else the in-cluster service account.
func restConfig(kubeconfig, nodeName string) (*rest.Config, error) {
	var rc *rest.Config
	var err error
	if kubeconfig != "" {
		rc, err = clientcmd.BuildConfigFromFlags("", kubeconfig)
	} else {
		rc, err = rest.InClusterConfig()
	}
	if err != nil {
		return nil, fmt.Errorf("kubernetes: %w", err)
	}
	rc.UserAgent = "meshtun/" + nodeName
	return rc, nil
}

// kubeClient is a client for restConfig's configuration.
func kubeClient(kubeconfig, nodeName string) (*kubeapi.Client, error) {
	rc, err := restConfig(kubeconfig, nodeName)
	if err != nil {
		return nil, err
	}
	return kubeapi.New(rc)
}

var klogOnce sync.Once

// klogToZerolog sends client-go's klog output into the node's log as
// warnings (client-go logs failed watches, 403s and retries there).
func klogToZerolog(log zerolog.Logger) {
	klogOnce.Do(func() {
		fs := flag.NewFlagSet("klog", flag.ContinueOnError)
		klog.InitFlags(fs)
		fs.Set("logtostderr", "false")
		fs.Set("alsologtostderr", "false")
		fs.Set("stderrthreshold", "FATAL")
		// klog writes a message to the output of its severity and of
		// every lower one: only INFO's output goes to the log, so each
		// message appears once.
		klog.SetOutput(io.Discard)
		klog.SetOutputBySeverity("INFO", klogWriter{log.With().Str("log", "client-go").Logger()})
	})
}

type klogWriter struct{ log zerolog.Logger }

func (w klogWriter) Write(p []byte) (int, error) {
	for _, line := range bytes.Split(bytes.TrimRight(p, "\n"), []byte("\n")) {
		if s := strings.TrimSpace(string(line)); s != "" {
			w.log.Warn().Msg(s)
		}
	}
	return len(p), nil
}
