# meshtun — see README.md.
GO      ?= go
BIN     := bin/meshtun
PKGS    := ./...

.PHONY: all build test unit e2e vet fuzz bench demo clean

all: build

build:
	$(GO) build -o $(BIN) ./cmd/meshtun

vet:
	$(GO) vet $(PKGS)

# test runs everything CI runs: vet, unit tests, a short fuzz pass over the
# packet classifier, and the end-to-end tests on the network-namespace
# cluster (these need root and /dev/net/tun; they fail, not skip, without).
test: vet build
	$(GO) test -count=1 -timeout 30m $(PKGS)
	$(GO) test -run '^$$' -fuzz FuzzClassify -fuzztime 200000x ./stack/classify
	cd test/interop && $(GO) vet ./... && $(GO) test -count=1 -timeout 10m ./...

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

clean:
	rm -rf bin
