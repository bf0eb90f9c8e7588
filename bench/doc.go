// Package bench is meshtun's packet-level benchmark suite, run as
// `meshtun bench`.
//
// It builds a sealed network-namespace cluster (package topo), one pair of
// nodes per data path, and measures every path side by side in one run:
// the kernel alone (direct), packets through the TUN and written back
// (verbatim), TCP terminated in meshtun's netstack and sent on by kernel
// sockets (passthrough), cross-node HBONE mTLS (mesh) and, on request, the
// tun2socks peer on the same TUN path. Measurements are interleaved — each
// scenario runs on every path in turn before the next scenario, and the
// whole list again in each repetition, the path order rotated — and each
// figure is reported as the median of the repetitions with their minimum
// and maximum. The traffic generators are the suite's own Go code (package
// gen); proxy CPU and memory come from /proc (package procstat); the
// results are written as a terminal table, JSON and SVG charts (package
// report).
package bench
