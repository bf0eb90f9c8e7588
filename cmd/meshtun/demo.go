//go:build !nolab

package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/bench/cluster"
	"github.com/meshtun/meshtun/cmd/meshtun/internal/demo"
)

// demoFlags are the flags of `meshtun demo`.
type demoFlags struct {
	keep, down, json bool
	logLevel         string
}

func runDemo(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	var f demoFlags
	fs.BoolVar(&f.keep, "keep", false, "leave the cluster up after the flows and print how to reach it")
	fs.BoolVar(&f.down, "down", false, "tear down a cluster left up by --keep")
	fs.BoolVar(&f.json, "json", false, "print a JSON summary instead of the table")
	fs.StringVar(&f.logLevel, "log-level", "warn", "diagnostic log `level` (stderr): trace, debug, info, warn, error")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), `usage: meshtun demo [--keep | --down] [--json]

Builds a two-node cluster in network namespaces on this machine, runs
meshtun node on each node, drives TCP, UDP and ICMP flows through it and
reports how each flow travelled. As root it uses the machine's network
namespaces; otherwise it creates user, network and mount namespaces of
its own (no privilege on the machine itself is needed or gained).

`)
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments: %q", fs.Args())
	}
	log, err := newLogger(f.logLevel)
	if err != nil {
		return err
	}
	if f.down {
		if f.keep {
			return errors.New("--down and --keep exclude each other")
		}
		return demoDown()
	}

	switch os.Getenv(demo.StageEnv) {
	case demo.StageRootless:
		if err := demo.SetupRootless(); err != nil {
			return err
		}
		return demoHere(ctx, log, f, "rootless", os.Getenv(demo.DirEnv), nil)
	case demo.StageDaemon:
		ready := daemonReady()
		defer ready.Close()
		return demoHere(ctx, log, f, "root", demo.StateDir(), ready)
	}

	rootErr := cluster.Preflight()
	if rootErr == nil {
		if f.keep {
			return startDaemon(ctx, args)
		}
		return demoHere(ctx, log, f, "root", demo.StateDir(), nil)
	}
	if p := demo.RootlessProblems(); len(p) > 0 {
		return fmt.Errorf("cannot build the demo cluster here.\n"+
			"As root: this process is not privileged enough (%s); run: sudo meshtun demo\n"+
			"Rootless, in namespaces of its own, it cannot run because:\n  - %s",
			strings.TrimPrefix(rootErr.Error(), "missing: "), strings.Join(p, "\n  - "))
	}
	dir, err := os.MkdirTemp("", "meshtun-demo-")
	if err != nil {
		return fmt.Errorf("demo: %w", err)
	}
	err = demo.RunRootless(ctx, append([]string{"demo"}, args...), dir)
	os.RemoveAll(dir)
	if ee := (*demo.ExitError)(nil); errors.As(err, &ee) {
		// The demo inside has said what went wrong; pass on its status.
		os.Exit(ee.Code)
	}
	return err
}

// demoHere runs the demo in this process: builds the cluster, drives the
// flows, reports, and (with --keep) waits for ctx before tearing down.
// ready is the readiness pipe when this process is the daemon of a kept
// root demo, else nil.
func demoHere(ctx context.Context, log zerolog.Logger, f demoFlags, mode, dir string, ready *os.File) error {
	start := time.Now()
	var out io.Writer = os.Stdout
	if f.json {
		out = io.Discard
	}
	bin, err := os.Executable()
	if err != nil {
		return fmt.Errorf("demo: find own binary: %w", err)
	}
	where := "the machine's network namespaces (as root)"
	if mode == "rootless" {
		where = fmt.Sprintf("namespaces of its own (rootless: host uid %s is root only inside them)", hostUID())
	}
	fmt.Fprintf(out, "meshtun demo: building a 2-node cluster in %s ...\n", where)
	d, err := demo.Start(ctx, demo.Options{Bin: bin, Dir: dir, Log: log})
	if err != nil {
		return err
	}
	defer d.Close()
	writeTopology(out, d)

	fmt.Fprintf(out, "\nFlows (wire = payload seen in plaintext on the node-to-node link):\n")
	results := d.Run(ctx, demo.Flows(), func(r demo.Result) { demo.WriteLine(out, r) })
	if ctx.Err() != nil {
		fmt.Fprintf(out, "  interrupted after %d of %d flows\n", len(results), len(demo.Flows()))
	}
	fmt.Fprintln(out)
	demo.WriteTable(out, results)
	sum := demo.Summary{Mode: mode, Cluster: d.Cluster(), Namespaces: d.Namespaces(), Nodes: d.Nodes(),
		Dir: d.Dir(), Flows: results}
	sum.Judge()
	if ctx.Err() != nil {
		sum.OK = false
	}

	kept := f.keep && ctx.Err() == nil
	if kept {
		if f.json {
			writeJSON(sum, time.Since(start))
		}
		if err := keepUp(ctx, d, mode, f.json, ready); err != nil {
			return err
		}
	}
	fmt.Fprintf(out, "\nTearing down ... ")
	cerr := d.Close()
	os.RemoveAll(d.Dir())
	os.Remove(dir) // the parent, if this run was its only user
	if ready != nil {
		demo.ForgetKept()
	}
	if cerr != nil {
		fmt.Fprintln(out, "failed")
		return cerr
	}
	fmt.Fprintf(out, "done: no namespace, link, rule or process of the demo is left. Total %.1fs.\n", time.Since(start).Seconds())
	if f.json && !f.keep {
		writeJSON(sum, time.Since(start))
	}
	switch {
	case kept:
		return nil // ended by --down or Ctrl-C, as asked
	case ctx.Err() != nil:
		return errors.New("interrupted; everything was torn down")
	case !sum.OK:
		return errors.New("some flows did not behave as expected (see RESULT)")
	}
	return nil
}

func writeJSON(s demo.Summary, took time.Duration) {
	s.Seconds = took.Seconds()
	enc := json.NewEncoder(os.Stdout)
	enc.SetIndent("", "  ")
	enc.Encode(s)
}

// hostUID returns the uid this process has on the machine (the user
// namespace maps it to 0 inside).
func hostUID() string {
	b, err := os.ReadFile("/proc/self/uid_map")
	if err != nil {
		return "?"
	}
	f := strings.Fields(string(b))
	if len(f) < 2 {
		return "?"
	}
	return f[1]
}

func writeTopology(w io.Writer, d *demo.Demo) {
	fmt.Fprintf(w, "\nCluster %s: namespaces %s-*, generated config %s/config.json\n", d.Cluster(), d.Cluster(), d.Dir())
	for _, n := range d.Nodes() {
		fmt.Fprintf(w, "  node %s  %-15s meshtun node pid %d\n", n.Name, n.IPv4, n.PID)
		for _, e := range d.Endpoints() {
			if fmt.Sprintf("n%d", e.Node) == n.Name {
				writeEndpoint(w, e)
			}
		}
	}
	for _, e := range d.Endpoints() {
		if e.Node == 0 {
			fmt.Fprintf(w, "  outside the cluster, on the node-to-node link:\n")
			writeEndpoint(w, e)
		}
	}
}

func writeEndpoint(w io.Writer, e demo.Endpoint) {
	mesh := "in the mesh"
	switch {
	case !e.InMesh:
		mesh = "outside the mesh"
	case e.Strict:
		mesh = "in mesh, STRICT"
	}
	serves := e.Serves
	if serves == "" {
		serves = "-"
	}
	fmt.Fprintf(w, "    %-9s %-12s %-16s %-17s %s\n", e.Name, e.IPv4, e.IPv6, mesh, serves)
}
