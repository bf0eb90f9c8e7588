package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"time"

	"github.com/meshtun/meshtun/mesh/config"
	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/node"
	"github.com/meshtun/meshtun/tun"
)

func runNode(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("node", flag.ContinueOnError)
	var (
		path, name, logLevel string
		noIntercept          bool
		drain                time.Duration
	)
	fs.StringVar(&path, "config", "/etc/meshtun/mesh.yaml", "the mesh config `file` (see docs/config.md)")
	fs.StringVar(&name, "node", "", "this node's `name` in the config file (required)")
	fs.BoolVar(&noIntercept, "no-intercept", false, "intercept nothing: every packet goes through the TUN verbatim (for measuring the TUN path alone)")
	fs.DurationVar(&drain, "drain-period", node.DefaultDrainPeriod, "on SIGTERM, how long open connections may take to finish")
	fs.StringVar(&logLevel, "log-level", "info", "log `level`: trace, debug, info, warn, error")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	if name == "" {
		return errors.New("-node is required")
	}
	log, err := newLogger(logLevel)
	if err != nil {
		return err
	}
	c, err := config.Load(path)
	if err != nil {
		return err
	}
	for _, w := range c.Warnings {
		log.Warn().Str("config", path).Msg(w)
	}
	nc, err := c.Node(name)
	if err != nil {
		return err
	}
	mesh, err := c.Snapshot()
	if err != nil {
		return err
	}
	err = node.Run(ctx, node.Config{
		Name:          nc.Name,
		TUN:           tun.Config{Name: nc.TUN.Name, MTU: nc.TUN.MTU, TxQueueLen: nc.TUN.TxQueueLen},
		CaptureLinks:  nc.CaptureLinks,
		Mesh:          mesh,
		CA:            identity.CAConfig{Dir: c.CA.Dir, SVIDTTL: c.CA.SVIDTTL},
		ConfigPath:    c.Path,
		NoIntercept:   noIntercept,
		AdminAddr:     nc.Listen.Admin,
		MetricsAddr:   nc.Listen.Metrics,
		ReadinessAddr: nc.Listen.Readiness,
		DrainPeriod:   drain,
		Logger:        log,
	})
	if errors.Is(err, context.Canceled) {
		return nil
	}
	return err
}
