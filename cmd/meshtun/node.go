package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/netip"
	"strings"

	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/node"
	"github.com/meshtun/meshtun/mesh/registry"
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

// workloadFlag collects --workload values, one workload each.
type workloadFlag []*registry.Workload

func (l *workloadFlag) String() string { return fmt.Sprint(len(*l), " workloads") }

// Set parses node/namespace/name[/serviceaccount]=addr[+addr…][;strict].
func (l *workloadFlag) Set(s string) error {
	spec, opts, _ := strings.Cut(s, ";")
	ref, addrs, ok := strings.Cut(spec, "=")
	parts := strings.Split(ref, "/")
	if !ok || len(parts) < 3 || len(parts) > 4 {
		return fmt.Errorf("%q: want node/namespace/name[/serviceaccount]=addr[+addr…][;strict]", s)
	}
	w := &registry.Workload{Node: parts[0], Namespace: parts[1], Name: parts[2], ServiceAccount: parts[2], InMesh: true}
	if len(parts) == 4 {
		w.ServiceAccount = parts[3]
	}
	for _, a := range strings.Split(addrs, "+") {
		ip, err := netip.ParseAddr(a)
		if err != nil {
			return fmt.Errorf("%q: address %q: %w", s, a, err)
		}
		w.Addresses = append(w.Addresses, ip)
	}
	switch opts {
	case "":
	case "strict":
		w.PeerAuth = registry.Strict
	default:
		return fmt.Errorf("%q: unknown option %q (want strict)", s, opts)
	}
	*l = append(*l, w)
	return nil
}

func runNode(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("node", flag.ContinueOnError)
	var (
		cfg         node.Config
		links       listFlag
		uplinks     listFlag
		workloads   workloadFlag
		trustDomain string
		logLevel    string
	)
	fs.StringVar(&cfg.Name, "node", "", "this node's `name`")
	fs.StringVar(&cfg.TUN.Name, "tun", "meshtun0", "TUN device `name`")
	fs.IntVar(&cfg.TUN.MTU, "mtu", 1500, "TUN device MTU")
	fs.Var(&links, "capture-link", "node-side `link` of a captured pod (repeatable)")
	fs.Var(&uplinks, "uplink", "node `link` towards other nodes (repeatable)")
	fs.Var(&workloads, "workload", "a mesh workload: `node/namespace/name[/sa]=addr[+addr][;strict]` (repeatable)")
	fs.StringVar(&trustDomain, "trust-domain", "cluster.local", "SPIFFE trust `domain`")
	fs.StringVar(&cfg.CA.Dir, "ca-dir", "/var/lib/meshtun/ca", "`directory` of the built-in CA's root (shared by the nodes)")
	fs.BoolVar(&cfg.NoIntercept, "no-intercept", false, "intercept nothing: every packet goes through the TUN verbatim (for measuring the TUN path alone)")
	fs.StringVar(&cfg.AdminAddr, "admin", "127.0.0.1:15000", "admin HTTP `address` (pprof); empty disables it")
	fs.StringVar(&logLevel, "log-level", "info", "log `level`: trace, debug, info, warn, error")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if cfg.Name == "" {
		return errors.New("-node is required")
	}
	log, err := newLogger(logLevel)
	if err != nil {
		return err
	}
	td, err := spiffeid.TrustDomainFromString(trustDomain)
	if err != nil {
		return fmt.Errorf("-trust-domain %q: %w", trustDomain, err)
	}
	cfg.Mesh, err = registry.NewSnapshot(td, workloads)
	if err != nil {
		return err
	}
	cfg.CaptureLinks = links
	cfg.Uplinks = uplinks
	cfg.Logger = log
	err = node.Run(ctx, cfg)
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}
