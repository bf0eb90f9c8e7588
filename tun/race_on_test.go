//go:build race

package tun

// raceEnabled is true when the race detector instruments the build; it
// allocates on its own, so allocation counts mean nothing then.
const raceEnabled = true
