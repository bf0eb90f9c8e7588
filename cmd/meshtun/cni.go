package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"time"

	"github.com/fsnotify/fsnotify"
	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/cni"
	"github.com/meshtun/meshtun/mesh/gate"
)

// cniFlags are meshtun node's flags of the CNI startup gate.
type cniFlags struct {
	enabled          bool
	binDir, confDir  string
	dir, plugin      string
	exemptNamespaces string
	timeout          time.Duration
}

func (f *cniFlags) register(fs *flag.FlagSet) {
	fs.BoolVar(&f.enabled, "cni", false, "with --kubernetes: the startup gate: install meshtun-cni into --cni-bin-dir and the node's conflist in --cni-conf-dir, and capture each enrolled pod when its sandbox is created, before it runs (see docs/kubernetes.md)")
	fs.StringVar(&f.binDir, "cni-bin-dir", "/host/opt/cni/bin", "with --cni: the node's CNI bin `directory` (a hostPath of /opt/cni/bin)")
	fs.StringVar(&f.confDir, "cni-conf-dir", "/host/etc/cni/net.d", "with --cni: the node's CNI config `directory` (a hostPath of /etc/cni/net.d); the plugin goes into its first conflist")
	fs.StringVar(&f.dir, "cni-dir", cni.DefaultDir, "with --cni: the `directory` of the gate's socket and state file, the same path on the node and in the container (a hostPath)")
	fs.StringVar(&f.plugin, "cni-plugin", "/usr/local/bin/meshtun-cni", "with --cni: the plugin `binary` to install")
	fs.StringVar(&f.exemptNamespaces, "cni-exempt-namespaces", "kube-system,"+os.Getenv("POD_NAMESPACE"), "with --cni: comma-separated `namespaces` whose pods the plugin lets start while the node is down even without its state file (meshtun's own, and what it needs to start)")
	fs.DurationVar(&f.timeout, "cni-timeout", gate.DefaultTimeout, "with --cni: how long a pod's sandbox creation waits for its capture before it fails (the kubelet then retries)")
}

// pluginConf is the plugin's conflist entry.
func (f *cniFlags) pluginConf() cni.PluginConf {
	var exempt []string
	for _, ns := range strings.Split(f.exemptNamespaces, ",") {
		if ns = strings.TrimSpace(ns); ns != "" {
			exempt = append(exempt, ns)
		}
	}
	return cni.PluginConf{
		Socket:           filepath.Join(f.dir, filepath.Base(cni.DefaultSocket)),
		StateFile:        filepath.Join(f.dir, filepath.Base(cni.DefaultStateFile)),
		ExemptNamespaces: exempt,
		// The plugin waits a little longer than the node, so that it hears
		// the node's reason.
		TimeoutSeconds: int((f.timeout + 10*time.Second) / time.Second),
	}
}

// newGate returns the gate of this node; its Pods are set by startGate.
func (f *cniFlags) newGate(nodeName string, log zerolog.Logger) (*gate.Gate, *gatePods) {
	pc := f.pluginConf()
	pods := &gatePods{}
	return gate.New(gate.Config{
		Node: nodeName, Socket: pc.Socket, StateFile: pc.StateFile, Pods: pods,
		Timeout: f.timeout, Logger: log,
	}), pods
}

// gatePods lets the gate be made before the kube source it asks (the
// source is made with the gate's Announced).
type gatePods struct{ gate.Pods }

// startGate writes the state file, installs the plugin binary and adds it
// to the node's conflist, then keeps it there until ctx ends. The state
// file comes first: from the moment the plugin is in the chain it may need
// it.
func (f *cniFlags) startGate(ctx context.Context, g *gate.Gate, log zerolog.Logger) error {
	if err := g.WriteState(); err != nil {
		return fmt.Errorf("cni state file: %w", err)
	}
	wrote, err := cni.InstallBinary(f.plugin, f.binDir)
	if err != nil {
		return err
	}
	log.Info().Str("plugin", f.plugin).Str("bin_dir", f.binDir).Bool("updated", wrote).Msg("CNI plugin binary installed")
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("cni: watch %s: %w", f.confDir, err)
	}
	if err := w.Add(f.confDir); err != nil {
		w.Close()
		return fmt.Errorf("cni: watch %s: %w", f.confDir, err)
	}
	conf := f.pluginConf()
	ensure := func(first bool) {
		path, changed, err := cni.EnsureInConflist(f.confDir, conf)
		src, _ := cni.FindConflist(f.confDir)
		switch {
		case errors.Is(err, os.ErrNotExist):
			if first || changed {
				log.Warn().Str("conf_dir", f.confDir).Msg("no pod network CNI configuration yet: meshtun's conflist is written when the pod network writes one")
			}
		case err != nil:
			log.Error().Err(err).Str("conf_dir", f.confDir).Msg("cannot write meshtun-cni's conflist: pods start without the startup gate")
		case changed:
			log.Info().Str("conflist", path).Str("pod_network", src).Msg("meshtun-cni's conflist written")
		case first:
			log.Info().Str("conflist", path).Str("pod_network", src).Msg("meshtun-cni's conflist up to date")
		}
	}
	ensure(true)
	go func() {
		defer w.Close()
		var settle <-chan time.Time
		for {
			select {
			case <-ctx.Done():
				return
			case ev, ok := <-w.Events:
				if !ok {
					return
				}
				if strings.HasPrefix(filepath.Base(ev.Name), ".") {
					continue // our own (and others') temporary files
				}
				// A writer may take a few steps: look once it settles.
				settle = time.After(100 * time.Millisecond)
			case err, ok := <-w.Errors:
				if !ok {
					return
				}
				log.Warn().Err(err).Str("conf_dir", f.confDir).Msg("CNI config watch")
			case <-settle:
				settle = nil
				ensure(false)
			}
		}
	}()
	return nil
}

// announcedFunc is kube.Config.Announced for g, or nil without it.
func announcedFunc(g *gate.Gate) func(string, string, string) []netip.Addr {
	if g == nil {
		return nil
	}
	return g.Announced
}

// runCNI runs "meshtun cni": the plugin's operator commands.
func runCNI(ctx context.Context, args []string) error {
	if len(args) == 0 || args[0] != "uninstall" {
		return errors.New("usage: meshtun cni uninstall [flags]")
	}
	fs := flag.NewFlagSet("cni uninstall", flag.ContinueOnError)
	binDir := fs.String("cni-bin-dir", "/host/opt/cni/bin", "the node's CNI bin `directory`")
	confDir := fs.String("cni-conf-dir", "/host/etc/cni/net.d", "the node's CNI config `directory`")
	dir := fs.String("cni-dir", cni.DefaultDir, "the `directory` of the gate's socket and state file")
	wait := fs.Bool("wait", false, "after uninstalling, wait until stopped (as a DaemonSet's container, which must not exit)")
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	log, err := newLogger("info")
	if err != nil {
		return err
	}
	// The conflist first: from then on the runtime no longer runs the
	// plugin, and its binary can go.
	done, err := cni.RemoveFromConflists(*confDir)
	for _, p := range done {
		log.Info().Str("conflist", p).Msg("meshtun-cni removed from the conflist")
	}
	if err != nil {
		return err
	}
	if err := os.Remove(filepath.Join(*binDir, cni.PluginType)); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if err := os.RemoveAll(*dir); err != nil {
		return err
	}
	log.Info().Str("bin_dir", *binDir).Str("cni_dir", *dir).Msg("meshtun-cni uninstalled from this node: pods start without the startup gate")
	if *wait {
		<-ctx.Done()
	}
	return nil
}
