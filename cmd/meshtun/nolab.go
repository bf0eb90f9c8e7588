//go:build nolab

package main

import (
	"context"
	"errors"
)

var errNoLab = errors.New("not in this build (built with -tags nolab: the node image's binary has no lab commands; use a full build)")

func runDemo(context.Context, []string) error  { return errNoLab }
func runBench(context.Context, []string) error { return errNoLab }
