// Package spire tests meshtun nodes that take their workloads' identities
// from SPIRE agents through the Delegated Identity API, against a real
// SPIRE server and agents (v1.13.3) built from the Go module proxy once and
// cached in ~/.cache/meshtun-test/bin. It is a module of its own so that
// SPIRE's build never touches meshtun's.
package spire
