// Command kindctl builds the offline kind toolchain and brings a cluster up
// or down (make kind-up, make kind-down); see docs/kind.md.
//
//	kindctl toolchain        build (or find cached) every part
//	kindctl up [NAME]        a cluster with meshtun running (default name meshtun)
//	kindctl down [NAME]      delete it and its podman network
//	kindctl probe-image [NAME]  rebuild and load the test image into it
//	kindctl toolbox-image    build (or find cached) meshtun-toolbox:dev
//
// The kubeconfig goes to ~/.cache/meshtun-test/kind/clusters/NAME/kubeconfig.
package main

import (
	"context"
	"fmt"
	"log"
	"os"
	"os/signal"
	"path/filepath"

	"github.com/meshtun/meshtun/test/kind"
)

func main() {
	log.SetFlags(log.Ltime)
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: kindctl toolchain|up|down [NAME]")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	name := "meshtun"
	if len(os.Args) > 2 {
		name = os.Args[2]
	}
	cache, err := kind.CacheDir()
	if err != nil {
		log.Fatal(err)
	}
	dir := filepath.Join(cache, "clusters", name)
	switch os.Args[1] {
	case "toolchain":
		_, err = kind.BuildToolchain(ctx, log.Printf)
	case "toolbox-image":
		var tar string
		if tar, err = kind.ToolboxArchive(ctx, log.Printf); err == nil {
			log.Printf("%s: %s", kind.ToolboxImage, tar)
		}
	case "up":
		var c *kind.Cluster
		c, err = kind.Up(ctx, log.Printf, name, dir)
		if err == nil {
			log.Printf("cluster %s is up: export KUBECONFIG=%s", c.Name, c.Kubeconfig)
		}
	case "probe-image":
		// Rebuild meshtun-probe:dev and load it into the running cluster.
		var c *kind.Cluster
		if c, err = kind.Attach(ctx, log.Printf, name, dir); err == nil {
			tar := filepath.Join(dir, "probe-image.tar")
			if err = kind.WriteProbeImage(ctx, dir, tar); err == nil {
				err = c.LoadImage(ctx, tar)
			}
		}
	case "down":
		var c *kind.Cluster
		if c, err = kind.Attach(ctx, log.Printf, name, dir); err == nil {
			err = c.Delete(ctx)
		}
		if err == nil {
			os.RemoveAll(dir)
		}
	default:
		err = fmt.Errorf("unknown command %q", os.Args[1])
	}
	if err != nil {
		log.Fatal(err)
	}
}
