package config

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
)

// Error is one problem in a config file: where it is (file, line, column),
// which field (Path, as "workloads[2].addresses[0]") and what is wrong.
type Error struct {
	File   string
	Line   int // 1-based; 0 when unknown
	Column int
	Path   string
	Reason string
}

// Error returns "file:line:column: path: reason".
func (e *Error) Error() string {
	var sb strings.Builder
	sb.WriteString(e.File)
	if e.Line > 0 {
		fmt.Fprintf(&sb, ":%d", e.Line)
		if e.Column > 0 {
			fmt.Fprintf(&sb, ":%d", e.Column)
		}
	}
	sb.WriteString(": ")
	if e.Path != "" {
		sb.WriteString(e.Path)
		sb.WriteString(": ")
	}
	sb.WriteString(e.Reason)
	return sb.String()
}

// Errors is every problem found in a config file, in file order. Load
// returns it as its error.
type Errors []*Error

// Error returns the problems, one per line.
func (es Errors) Error() string {
	var sb strings.Builder
	for i, e := range es {
		if i > 0 {
			sb.WriteString("\n")
		}
		sb.WriteString(e.Error())
	}
	return sb.String()
}

// Unwrap returns the problems as errors.
func (es Errors) Unwrap() []error {
	out := make([]error, len(es))
	for i, e := range es {
		out[i] = e
	}
	return out
}

func sortErrors(es []*Error) {
	slices.SortStableFunc(es, func(a, b *Error) int {
		return cmp.Or(cmp.Compare(a.Line, b.Line), cmp.Compare(a.Column, b.Column))
	})
}
