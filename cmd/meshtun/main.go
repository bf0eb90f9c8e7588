// Command meshtun is the meshtun node proxy.
//
//	meshtun node [flags]     run the node proxy in this network namespace
//	meshtun version          print the version
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"runtime/debug"
	"syscall"

	"github.com/rs/zerolog"
)

const usage = `usage: meshtun <command> [flags]

commands:
  node      run the node proxy in the current network namespace
            (node --uninstall: remove meshtun's rules from it)
  cni       the CNI startup gate's operator commands (cni uninstall)
  ca        the certificate service and its operator commands (see docs/identity.md)
  admin     call the node's admin socket (root): log levels, pprof
  bench     measure meshtun's data paths side by side (root; see -h)
  version   print the version

Run "meshtun <command> -h" for a command's flags.
`

func main() {
	if len(os.Args) < 2 {
		fmt.Fprint(os.Stderr, usage)
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	var err error
	switch cmd, args := os.Args[1], os.Args[2:]; cmd {
	case "node":
		err = runNode(ctx, args)
	case "ca":
		err = runCA(ctx, args)
	case "cni":
		err = runCNI(ctx, args)
	case "demo":
		err = runDemo(ctx, args)
	case "bench":
		err = runBench(ctx, args)
	case "admin":
		err = runAdmin(ctx, args, os.Stdout)
	case "version":
		fmt.Println(version())
	case "-h", "-help", "--help", "help":
		fmt.Print(usage)
	default:
		fmt.Fprintf(os.Stderr, "meshtun: unknown command %q\n\n%s", cmd, usage)
		os.Exit(2)
	}
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintf(os.Stderr, "meshtun %s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
}

func version() string {
	v := "meshtun (devel)"
	if bi, ok := debug.ReadBuildInfo(); ok {
		for _, s := range bi.Settings {
			if s.Key == "vcs.revision" {
				v += " " + s.Value
			}
		}
	}
	return v
}

// newLogger returns a JSON logger on stderr, or a human one when stderr is
// a terminal.
func newLogger(level string) (zerolog.Logger, error) {
	lvl, err := zerolog.ParseLevel(level)
	if err != nil {
		return zerolog.Nop(), fmt.Errorf("log level %q: %w", level, err)
	}
	var log zerolog.Logger
	if fi, err := os.Stderr.Stat(); err == nil && fi.Mode()&os.ModeCharDevice != 0 {
		log = zerolog.New(zerolog.ConsoleWriter{Out: os.Stderr})
	} else {
		log = zerolog.New(os.Stderr)
	}
	// The level is zerolog's global one, so that the admin endpoint
	// (/logging) can change it while the node runs.
	zerolog.SetGlobalLevel(lvl)
	return log.With().Timestamp().Logger(), nil
}
