package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"strings"

	"github.com/meshtun/meshtun/mesh/node"
)

// listFlag collects a repeated (or comma-separated) flag.
type listFlag []string

func (l *listFlag) String() string { return strings.Join(*l, ",") }
func (l *listFlag) Set(s string) error {
	for _, v := range strings.Split(s, ",") {
		if v = strings.TrimSpace(v); v != "" {
			*l = append(*l, v)
		}
	}
	return nil
}

func runNode(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("node", flag.ContinueOnError)
	var (
		cfg      node.Config
		links    listFlag
		uplinks  listFlag
		pods     listFlag
		logLevel string
	)
	fs.StringVar(&cfg.TUN.Name, "tun", "meshtun0", "TUN device `name`")
	fs.IntVar(&cfg.TUN.MTU, "mtu", 1500, "TUN device MTU")
	fs.Var(&links, "capture-link", "node-side `link` of a captured pod (repeatable)")
	fs.Var(&uplinks, "uplink", "node `link` towards other nodes (repeatable)")
	fs.Var(&pods, "pod", "captured pod address or `prefix` (repeatable)")
	fs.BoolVar(&cfg.NoIntercept, "no-intercept", false, "intercept nothing: every packet goes through the TUN verbatim (for measuring the TUN path alone)")
	fs.StringVar(&cfg.AdminAddr, "admin", "127.0.0.1:15000", "admin HTTP `address` (pprof); empty disables it")
	fs.StringVar(&logLevel, "log-level", "info", "log `level`: trace, debug, info, warn, error")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	log, err := newLogger(logLevel)
	if err != nil {
		return err
	}
	cfg.CaptureLinks = links
	cfg.Uplinks = uplinks
	for _, s := range pods {
		p, err := parsePrefix(s)
		if err != nil {
			return fmt.Errorf("-pod %q: %w", s, err)
		}
		cfg.Pods = append(cfg.Pods, p)
	}
	cfg.Logger = log
	err = node.Run(ctx, cfg)
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}

// parsePrefix accepts a prefix or a bare address (a host prefix).
func parsePrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "/") {
		return netip.ParsePrefix(s)
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, err
	}
	return netip.PrefixFrom(a, a.BitLen()), nil
}
