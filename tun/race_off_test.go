//go:build !race

package tun

const raceEnabled = false
