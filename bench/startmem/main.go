// Command startmem measures what `meshtun bench` reports as "proxy RSS at
// start", split into its parts: it builds the bench's topology (bench/topo)
// for the meshtun paths asked for, with binary A and, beside it, binary B
// (the A/B variant paths), and prints, for every idle node proxy once it is
// ready, VmRSS and its two parts from /proc/<pid>/status: RssAnon (heap,
// stacks: the process's own memory) and RssFile (pages of the binary
// mapped from the page cache: shared by every process that runs the same
// file, and reclaimable). Root only, like the bench.
//
//	go run ./bench/startmem -a /tmp/meshtun-main -b ./bin/meshtun -paths mesh,passthrough
//
// The RssFile of a binary depends on how its file came into the page cache
// (the kernel maps file pages in folios of the size the cache holds them);
// give A and B the same history, e.g. cp both to fresh files, and run
// twice with A and B swapped.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/bench/procstat"
	"github.com/meshtun/meshtun/bench/topo"
)

func main() {
	a := flag.String("a", "", "meshtun `binary` A")
	b := flag.String("b", "", "meshtun `binary` B (default: A)")
	paths := flag.String("paths", topo.Mesh, "comma-separated meshtun `paths` (verbatim, passthrough, mesh)")
	wait := flag.Duration("wait", 0, "sample again after this long")
	flag.Parse()
	if err := run(*a, *b, strings.Split(*paths, ","), *wait); err != nil {
		fmt.Fprintln(os.Stderr, "startmem:", err)
		os.Exit(1)
	}
}

func run(a, b string, paths []string, wait time.Duration) error {
	if a == "" {
		return errors.New("no binary A (-a)")
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	t, err := topo.Build(ctx, topo.Spec{Meshtun: a, Paths: paths, Variant: &topo.Variant{Meshtun: b}, Log: zerolog.Nop()})
	if err != nil {
		return err
	}
	defer t.Close()
	for i, d := range []time.Duration{0, wait} {
		if i > 0 && d == 0 {
			break
		}
		select {
		case <-time.After(d):
		case <-ctx.Done():
			return ctx.Err()
		}
		fmt.Printf("after start +%v (kB)\n%-14s %-14s %8s %8s %8s\n", d, "path", "proxy", "VmRSS", "RssAnon", "RssFile")
		for _, p := range t.Paths {
			for _, x := range p.Proxies {
				st, err := procstat.Read("/proc", x.Pid)
				if err != nil {
					return err
				}
				fmt.Printf("%-14s %-14s %8d %8d %8d\n", p.Name, x.Name, st.RSS>>10, st.Anon>>10, st.File>>10)
			}
		}
	}
	return nil
}
