// Package node assembles a meshtun node proxy: the TUN device and its
// routing, the classifier, the netstack and the proxy, started in that
// order and torn down in reverse.
package node

import (
	"context"
	"errors"
	"fmt"
	"net/netip"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/proxy"
	"github.com/meshtun/meshtun/stack"
	"github.com/meshtun/meshtun/stack/classify"
	"github.com/meshtun/meshtun/tun"
)

// Config is what a node proxy needs to know about its node.
type Config struct {
	TUN tun.Config
	// CaptureLinks are the node-side links of the captured pods.
	CaptureLinks []string
	// Uplinks are the node's links towards other nodes.
	Uplinks []string
	// Pods are the addresses of the captured pods on this node.
	Pods []netip.Prefix
	// NoIntercept leaves every packet verbatim: the TUN is in the path but
	// no flow is proxied. For measuring the TUN path alone.
	NoIntercept bool
	// AdminAddr is where the admin HTTP server listens (pprof under
	// /debug/pprof/); empty disables it. Keep it on loopback.
	AdminAddr string
	Logger    zerolog.Logger
}

// ReadyMessage is the log message Run writes once traffic is captured.
const ReadyMessage = "node ready"

// Run runs the node proxy until ctx is done, then removes everything it
// installed. It returns ctx's error after a clean shutdown.
func Run(ctx context.Context, cfg Config) (err error) {
	log := cfg.Logger
	if len(cfg.Pods) == 0 {
		return errors.New("node: no captured pod addresses")
	}
	dev, err := tun.Open(cfg.TUN)
	if err != nil {
		return err
	}
	sys, err := tun.SetSysctls(dev.Name())
	if err != nil {
		dev.Close()
		return err
	}
	// Teardown runs in reverse: routing first, so traffic flows directly
	// again at once; then the device, which ends the stack's reader; then
	// the stack and the sysctls.
	var (
		st     *stack.Stack
		routes *tun.Routing
	)
	defer func() {
		if routes != nil {
			if rerr := routes.Close(); rerr != nil {
				log.Error().Err(rerr).Msg("remove routing")
			}
		}
		if cerr := dev.Close(); cerr != nil {
			log.Warn().Err(cerr).Msg("close TUN")
		}
		if st != nil {
			st.Close()
		}
		if rerr := sys.Restore(); rerr != nil {
			log.Error().Err(rerr).Msg("restore sysctls")
		}
	}()

	pods := append([]netip.Prefix(nil), cfg.Pods...)
	// The capture policy: TCP connections opened by a captured pod.
	var policy classify.Policy = classify.PolicyFunc(func(src, _ netip.AddrPort) bool {
		a := src.Addr()
		for _, p := range pods {
			if p.Contains(a) {
				return true
			}
		}
		return false
	})
	if cfg.NoIntercept {
		policy = nil
	}
	cls := classify.New(classify.Config{Policy: policy})
	sweepCtx, stopSweep := context.WithCancel(ctx)
	defer stopSweep()
	go cls.Run(sweepCtx, 5*time.Second)

	px := proxy.New(ctx, proxy.Config{Logger: log})
	st, err = stack.New(stack.Config{
		Device:     dev,
		Classifier: cls,
		HandleTCP:  px.HandleTCP,
		Logger:     log,
	})
	if err != nil {
		return err
	}
	routes, err = tun.InstallRouting(dev, tun.RoutingConfig{
		CaptureLinks: cfg.CaptureLinks,
		Uplinks:      cfg.Uplinks,
		PodPrefixes:  cfg.Pods,
	})
	if err != nil {
		return err
	}

	if cfg.AdminAddr != "" {
		stopAdmin, err := serveAdmin(ctx, cfg.AdminAddr, log)
		if err != nil {
			return err
		}
		defer stopAdmin()
	}

	log.Info().Str("tun", dev.Name()).Int("mtu", dev.MTU()).
		Strs("capture_links", cfg.CaptureLinks).Strs("uplinks", cfg.Uplinks).
		Str("pods", fmt.Sprint(cfg.Pods)).Msg(ReadyMessage)
	<-ctx.Done()
	log.Info().Msg("shutting down")
	return ctx.Err()
}
