# meshtun — see README.md.
GO      ?= go
BIN     := bin/meshtun
PKGS    := ./...
# GOTAGS: grpcnotrace leaves out gRPC's golang.org/x/net/trace, whose
# html/template use turns off the linker's dead-code elimination of methods
# (binary 102 → 57 MB, RSS at start −12 MiB; docs/decisions/2026-12-01-binary-size-rss.md:
# what the binary and its RSS at start are made of). Every build passes it:
# here, bench/noderun.BuildTags, deploy/image.
GOTAGS  := grpcnotrace

.PHONY: all build test unit e2e vet lint race fuzz bench bench-kube bench-istiod demo mutate clean image image-push image-test kind-up kind-down

all: build

build:
	$(GO) build -tags $(GOTAGS) -trimpath -ldflags='-s -w' -o $(BIN) ./cmd/meshtun

vet:
	$(GO) vet $(PKGS)

# unit runs the unit tests: every package of the product's module but the
# two whose tests need root throughout (E2E_PKGS). No root needed: a unit
# test that needs root (a private network namespace, a TUN) skips with
# what it needs when not run as root (MESHTUN_TEST_SKIP_ROOT=1); under
# `make test` and a plain `go test` it fails instead. -short leaves out
# the few slow unit tests (mesh/xds's 100,000 workloads, ~10 s of CPU);
# make test runs them. Times in docs/testing.md.
E2E_PKGS  := ./test/e2e ./bench/topo
UNIT_PKGS  = $(filter-out $(addprefix github.com/meshtun/meshtun/,$(E2E_PKGS:./%=%)),$(shell $(GO) list $(PKGS)))

unit:
	MESHTUN_TEST_SKIP_ROOT=1 $(GO) test -short -count=1 -timeout 10m $(UNIT_PKGS)

# e2e runs the end-to-end tests on the network-namespace cluster
# (bench/cluster) and the topology tests (root and /dev/net/tun; they fail,
# not skip, without).
e2e:
	$(GO) test -count=1 -timeout 30m $(E2E_PKGS)

# race runs the unit tests under the race detector (as root, the tests
# that need it run too), -short as make unit: the scale tests it leaves
# out find no race the small ones miss and take minutes under the detector.
# Allocation counts are not asserted there: the detector allocates on its
# own (test/fixture.Race).
race:
	$(GO) test -race -short -count=1 -timeout 30m $(UNIT_PKGS)

# lint runs staticcheck over the product's module, its default checks; an
# exception is a //lint:ignore line with its reason. It is pinned as a tool of test/lint/go.mod, a module of
# its own (as gremlins is in test/mutate), and built into bin/staticcheck.
STATICCHECK := bin/staticcheck

$(STATICCHECK): test/lint/go.mod test/lint/go.sum
	cd test/lint && $(GO) build -o ../../$(STATICCHECK) honnef.co/go/tools/cmd/staticcheck

lint: $(STATICCHECK)
	./$(STATICCHECK) $(PKGS)

# fuzz runs the four fuzzers, each for a short budget beyond its seeds:
# the packet classifier, the UDP super-packet builder, the HBONE server's
# hand-written HTTP/2 frame handling (each input a TLS connection, so
# counted in seconds) and the config parser. FUZZTIME=10m runs each for ten
# minutes instead, by hand.
FUZZTIME ?=

fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzClassify$$' -fuzztime $(or $(FUZZTIME),200000x) ./stack/classify
	$(GO) test -run '^$$' -fuzz '^FuzzUDPBatch$$' -fuzztime $(or $(FUZZTIME),100000x) ./stack
	$(GO) test -run '^$$' -fuzz '^FuzzServerFrames$$' -fuzztime $(or $(FUZZTIME),100x) ./protocols/hbone
	$(GO) test -run '^$$' -fuzz '^FuzzParse$$' -fuzztime $(or $(FUZZTIME),20000x) ./mesh/config

# test runs everything CI runs: vet, staticcheck (lint), every test of the
# product's module (unit and end-to-end, as root: the end-to-end tests on
# the network-namespace cluster need root and /dev/net/tun; they fail, not
# skip, without), the unit tests again under the race detector (race), the
# four fuzzers for their short budgets (fuzz),
# the Istio interop tests, the SPIRE tests (SPIRE is built once, ~30
# minutes on a busy 2-core machine, and cached in ~/.cache/meshtun-test) and
# the container image's checks (image-test: about 25 s warm, 4 minutes
# the first time on a busy 2-core machine, which cross-builds for arm64).
# test/kube builds kube-apiserver and etcd once into ~/.cache/meshtun-test
# (from an empty Go build cache: kube-apiserver 8 CPU-minutes and 2.9 GB of
# memory, 28 minutes at nice 19 on this 2-core machine under load 20; etcd
# about 1 minute; seconds when cached), then runs in about 3 minutes; and
# istiod's pilot-discovery for the istiod e2e (MESHTUN_TEST_ISTIOD=1; 28
# minutes cold at nice 19 under load 20, then cached; the e2e ~20 s, plus
# 2-4 s to link test/interop's istio-hbone-peer, whose packages the interop
# tests above have already compiled). All of it cold (.ci/run with empty
# GOMODCACHE, GOCACHE and ~/.cache/meshtun-test): 20 min 46 s on a new idle
# 2-core machine (test/spire 5.3 min, test/kube with the kube-apiserver,
# etcd and pilot-discovery builds 8.3 min); 46 min 14 s at load 8-11.
# test/kind (docs/kind.md) brings up a real 3-node kind cluster on rootful
# podman, offline, and runs deploy/kubernetes/ on it: its parts are built
# once into ~/.cache/meshtun-test/kind (about 34 CPU-minutes cold, 20 of
# them the seven Kubernetes binaries, which share the Go build cache with
# test/kube's kube-apiserver; debootstrap ~5 min), then each run takes about
# 4 minutes to bring up its cluster and 5 to test; it needs podman, runc,
# debootstrap, libseccomp-dev and pkg-config (.ci/run installs them).
test: vet lint build image-test
	$(GO) test -count=1 -timeout 30m $(PKGS)
	$(MAKE) --no-print-directory race fuzz
	cd test/interop && $(GO) vet ./... && $(GO) test -count=1 -timeout 10m ./...
	cd test/spire && $(GO) vet ./... && $(GO) test -count=1 -timeout 30m ./...
	cd test/kube && $(GO) vet ./... && MESHTUN_TEST_ISTIOD=1 $(GO) test -count=1 -timeout 90m ./...
	cd test/kind && $(GO) vet ./... && $(GO) test -count=1 -timeout 85m ./...

# mutate runs mutation testing over the packages whose logic decides
# security and routing, one package at a time, at low priority: gremlins
# changes one operator or condition at a time and runs the package's tests,
# and a mutant that no test notices (LIVED) is a gap. Slow (tens of minutes
# on 2 cores), so not part of `make test`; MUTATE_PKGS=./mesh/policy runs
# one package. gremlins is pinned in test/mutate/go.mod, a module of its
# own, so that the product's go.mod does not carry a tool's dependencies.
# Results (JSON) go to out/mutate/; docs/testing.md keeps the efficacy per
# package and what each living mutant means.
GREMLINS    := bin/gremlins
MUTATE_PKGS ?= ./stack/classify ./mesh/policy ./mesh/registry ./protocols/hbone ./mesh/proxy

$(GREMLINS): test/mutate/go.mod test/mutate/go.sum
	cd test/mutate && $(GO) build -o ../../$(GREMLINS) github.com/go-gremlins/gremlins/cmd/gremlins

mutate: $(GREMLINS)
	mkdir -p out/mutate
	set -e; for p in $(MUTATE_PKGS); do \
		nice -n 19 ./$(GREMLINS) unleash --workers 1 --test-cpu 1 --timeout-coefficient 10 \
			-o out/mutate/$$(echo $$p | sed 's|^\./||; s|/|-|g').json $$p; \
	done

# demo builds meshtun and runs `meshtun demo`: a two-node cluster in
# network namespaces, real traffic through it and how each flow travelled.
# As root it uses the machine's namespaces; as any other user, namespaces of
# its own (unprivileged user namespaces and a usable /dev/net/tun needed).
demo: build
	./$(BIN) demo

# bench builds meshtun and runs its benchmark suite (root): direct, verbatim,
# passthrough and mesh side by side with the peers tun2socks and wireguard-go
# (built once into ~/.cache/meshtun-bench) and pasta (Debian's passt,
# installed with apt-get if missing), interleaved and repeated, about 10
# minutes. The table goes to the terminal, JSON and SVG charts to
# bench/results/.
# BENCHFLAGS=--quick for a smoke run of under a minute.
bench: build
	$(GO) test -run '^$$' -bench . -benchmem ./stack/classify
	./$(BIN) bench --peers --json bench/results/bench.json --out bench/results $(BENCHFLAGS)

# bench-kube runs test/kube's benchmarks once (root; not part of `make
# test`, which only vets them): meshtun node --kubernetes against a real
# API server holding 10,000 pods and 2,000 services: the node's RSS, and
# the p50/p99 time from a pod's status patch to its capture rule and from
# an AuthorizationPolicy's creation to its enforcement (200 changes each).
# About 5 minutes on a busy 2-core machine; docs/kubernetes.md has numbers.
bench-kube:
	cd test/kube && $(GO) test -run '^$$' -bench 'BenchmarkKube$$' -benchtime 1x -timeout 60m ./...

# bench-istiod runs test/kube's BenchmarkIstiodScale once (root; not part
# of `make test`): meshtun nodes against a real istiod (delta xDS) whose
# API server holds the same 10,000 pods and 2,000 services: the node's RSS
# and live heap per workload, the xDS full state's size and the time from
# a node's start to its first full model. It needs istiod's
# pilot-discovery, built once into the cache (20 minutes or more cold).
# MESHTUN_BENCH_PROFILE_DIR=<dir> keeps the nodes' heap profiles.
# docs/decisions/2026-12-04-xds-memory.md has numbers.
bench-istiod:
	cd test/kube && $(GO) test -run '^$$' -bench 'BenchmarkIstiodScale$$' -benchtime 1x -timeout 90m ./...

# image builds the container image without a container runtime or a base
# image to pull (deploy/image, go-containerregistry): a static meshtun at
# /usr/local/bin/meshtun on an empty base, written as a docker-archive
# tarball for `kind load image-archive` or `docker load`. IMAGE_TAG names it
# (deploy/kubernetes runs meshtun:dev); IMAGE_PLATFORM picks the
# architecture (the host's by default). Timestamps are the commit time, or
# SOURCE_DATE_EPOCH: one commit gives one image digest.
IMAGE_TAG      ?= meshtun:dev
IMAGE_PLATFORM ?= linux/$(shell $(GO) env GOARCH)
IMAGE_ARCHIVE  := bin/meshtun-image.tar

image:
	cd deploy/image && GO=$(GO) $(GO) run . --repo $(CURDIR) --tag $(IMAGE_TAG) \
		--platforms $(IMAGE_PLATFORM) --out $(CURDIR)/$(IMAGE_ARCHIVE)

# image-push builds the image for IMAGE_PLATFORMS and pushes it, as one
# multi-platform index, to IMAGE (a full reference such as
# registry.example/meshtun:v1), with the credentials of `docker login` or
# `crane auth login` (~/.docker/config.json). Never run by make test.
IMAGE_PLATFORMS ?= linux/amd64,linux/arm64

image-push:
	@test -n "$(IMAGE)" || { echo 'image-push: set IMAGE, e.g. make image-push IMAGE=registry.example/meshtun:v1' >&2; exit 2; }
	cd deploy/image && GO=$(GO) $(GO) run . --repo $(CURDIR) --platforms $(IMAGE_PLATFORMS) --push $(IMAGE)

# image-test builds the image (both platforms) and checks what is inside it:
# tag, layer, entrypoint, labels, that the binary runs, that two builds match,
# and a push to a registry on loopback.
image-test:
	cd deploy/image && $(GO) vet ./... && GO=$(GO) $(GO) test -count=1 -timeout 15m ./...

# kind-up creates the kind cluster `meshtun` (deploy/kind/cluster.yaml:
# one control plane, two workers, dual stack) on rootful podman, offline:
# the node image is assembled from parts built from the Go module proxy and
# Debian's archive and cached in ~/.cache/meshtun-test/kind (docs/kind.md;
# about 25 CPU-minutes the first time), then builds and loads meshtun:dev,
# applies deploy/kubernetes/ as docs/kubernetes.md says and waits until the
# DaemonSet is ready on every node. kind-down deletes the cluster and its
# podman network. The kubeconfig is printed by kind-up. KIND_NAME picks
# another cluster (e.g. one kept by the tests with MESHTUN_KIND_KEEP=1).
KIND_NAME ?= meshtun
kind-up:
	cd test/kind && $(GO) run ./cmd/kindctl up $(KIND_NAME)

kind-down:
	cd test/kind && $(GO) run ./cmd/kindctl down $(KIND_NAME)

clean:
	rm -rf bin
