// Command image builds meshtun's container image without a container
// runtime: a static binary on an empty base, written as a docker-archive
// tarball (what `docker load` and `kind load image-archive` read) and/or
// pushed to a registry as a multi-platform OCI index. Nothing is pulled: the
// base is empty and the binary is built here.
//
//	go run . --out ../../bin/meshtun-image.tar              # host platform, tag meshtun:dev
//	go run . --push registry.example/meshtun:v1 --platforms linux/amd64,linux/arm64
//
// Every timestamp is the commit time (or SOURCE_DATE_EPOCH), so two builds
// of one commit with one Go toolchain give the same image digest.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"syscall"

	"github.com/google/go-containerregistry/pkg/authn"
	"github.com/google/go-containerregistry/pkg/name"
	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/remote"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/rs/zerolog"
)

// DefaultTag is the image's local name, the one deploy/kubernetes runs.
const DefaultTag = "meshtun:dev"

// Options say what to build and where to put it.
type Options struct {
	Repo      string     // root of the meshtun module
	Platforms []Platform // one image each
	Version   string     // version label; empty: git describe
	Source    string     // source label; empty: from the module path
}

// Build builds meshtun for every platform in o and returns one image each,
// with the metadata they carry.
func Build(ctx context.Context, log zerolog.Logger, o Options) (map[Platform]v1.Image, Meta, error) {
	meta, err := GitMeta(ctx, o.Repo, o.Version)
	if err != nil {
		return nil, meta, err
	}
	meta.Source = o.Source
	if meta.Source == "" {
		if meta.Source, err = ModuleSource(o.Repo); err != nil {
			return nil, meta, err
		}
	}
	tmp, err := os.MkdirTemp("", "meshtun-image-")
	if err != nil {
		return nil, meta, err
	}
	defer os.RemoveAll(tmp)
	imgs := map[Platform]v1.Image{}
	for _, p := range o.Platforms {
		bin := filepath.Join(tmp, p.OS+"_"+p.Arch+"_"+p.Variant, "meshtun")
		log.Info().Str("platform", p.String()).Msg("building meshtun")
		if err := BuildBinary(ctx, o.Repo, bin, p); err != nil {
			return nil, meta, err
		}
		b, err := os.ReadFile(bin)
		if err != nil {
			return nil, meta, err
		}
		plugin := filepath.Join(filepath.Dir(bin), "meshtun-cni")
		if err := BuildPlugin(ctx, o.Repo, plugin, p); err != nil {
			return nil, meta, err
		}
		pb, err := os.ReadFile(plugin)
		if err != nil {
			return nil, meta, err
		}
		img, err := Image(b, pb, p, meta)
		if err != nil {
			return nil, meta, fmt.Errorf("image for %s: %w", p, err)
		}
		imgs[p] = img
	}
	return imgs, meta, nil
}

// WriteArchive writes img as a docker-archive tarball at path, tagged tag;
// the file appears complete or not at all.
func WriteArchive(path, tag string, img v1.Image) error {
	t, err := name.NewTag(tag)
	if err != nil {
		return fmt.Errorf("tag %q: %w", tag, err)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := tarball.WriteToFile(tmp, t, img); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("write %s: %w", path, err)
	}
	return os.Rename(tmp, path)
}

// Push pushes an index of imgs (in the order of platforms) to ref, with the
// credentials of the docker config (~/.docker/config.json, as `docker
// login` or `crane auth login` write them).
func Push(ctx context.Context, ref string, imgs map[Platform]v1.Image, platforms []Platform, opts ...remote.Option) (v1.Hash, error) {
	r, err := name.ParseReference(ref)
	if err != nil {
		return v1.Hash{}, fmt.Errorf("image reference %q: %w", ref, err)
	}
	idx, err := Index(imgs, platforms)
	if err != nil {
		return v1.Hash{}, err
	}
	opts = append([]remote.Option{remote.WithContext(ctx), remote.WithAuthFromKeychain(authn.DefaultKeychain)}, opts...)
	if err := remote.WriteIndex(r, idx, opts...); err != nil {
		return v1.Hash{}, fmt.Errorf("push %s: %w", ref, err)
	}
	return idx.Digest()
}

func main() {
	log := zerolog.New(zerolog.ConsoleWriter{Out: os.Stderr, TimeFormat: "15:04:05"}).With().Timestamp().Logger()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, log, os.Args[1:]); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return
		}
		log.Error().Err(err).Msg("image")
		os.Exit(1)
	}
}

func run(ctx context.Context, log zerolog.Logger, args []string) error {
	fs := flag.NewFlagSet("image", flag.ContinueOnError)
	var o Options
	fs.StringVar(&o.Repo, "repo", "../..", "root of the meshtun module")
	platforms := fs.String("platforms", "linux/"+runtime.GOARCH, "comma-separated os/arch list; --out takes one")
	fs.StringVar(&o.Version, "version", "", "version label (default: git describe --tags --always --dirty)")
	fs.StringVar(&o.Source, "source", "", "source label (default: from the module path)")
	tag := fs.String("tag", DefaultTag, "the archive's image name")
	out := fs.String("out", "", "write a docker-archive tarball here")
	push := fs.String("push", "", "push a multi-platform index to this image reference")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	if *out == "" && *push == "" {
		return errors.New("nothing to do: give --out, --push or both")
	}
	var err error
	if o.Platforms, err = ParsePlatforms(*platforms); err != nil {
		return fmt.Errorf("--platforms: %w", err)
	}
	if *out != "" && len(o.Platforms) != 1 {
		return fmt.Errorf("--out: a docker archive holds one platform, --platforms gives %d", len(o.Platforms))
	}
	imgs, meta, err := Build(ctx, log, o)
	if err != nil {
		return err
	}
	if *out != "" {
		img := imgs[o.Platforms[0]]
		if err := WriteArchive(*out, *tag, img); err != nil {
			return err
		}
		d, err := img.Digest()
		if err != nil {
			return err
		}
		log.Info().Str("archive", *out).Str("tag", *tag).Str("platform", o.Platforms[0].String()).
			Str("digest", d.String()).Str("version", meta.Version).Msg("image written")
	}
	if *push != "" {
		d, err := Push(ctx, *push, imgs, o.Platforms)
		if err != nil {
			return err
		}
		log.Info().Str("ref", *push).Str("digest", d.String()).Str("platforms", *platforms).Msg("image pushed")
	}
	return nil
}
