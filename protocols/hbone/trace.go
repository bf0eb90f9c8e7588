package hbone

import (
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"math/rand/v2"
)

// TraceParent is a W3C trace context (https://www.w3.org/TR/trace-context/),
// the traceparent header: version, trace id, parent (span) id and flags.
// ztunnel sends one with every CONNECT, generated per connection, and its
// inbound side takes the trace id from it (or makes one up when the header
// is absent or malformed) so that one connection carries the same id in
// the access logs of both nodes.
type TraceParent struct {
	Version  byte
	TraceID  [16]byte
	ParentID [8]byte
	Flags    byte
}

// traceParentLen is the length of a version 00 traceparent:
// 2 + 1 + 32 + 1 + 16 + 1 + 2.
const traceParentLen = 55

// NewTraceParent returns a version 00 trace context with a random trace id
// and parent id, not sampled (flags 00), as ztunnel generates them. The ids
// are not secrets: a fast non-cryptographic generator suffices.
func NewTraceParent() TraceParent {
	var t TraceParent
	for t.TraceID == [16]byte{} {
		binary.BigEndian.PutUint64(t.TraceID[:8], rand.Uint64())
		binary.BigEndian.PutUint64(t.TraceID[8:], rand.Uint64())
	}
	for t.ParentID == [8]byte{} {
		binary.BigEndian.PutUint64(t.ParentID[:], rand.Uint64())
	}
	return t
}

// IsZero reports whether t holds no trace (the zero TraceParent).
func (t TraceParent) IsZero() bool { return t.TraceID == [16]byte{} }

// String formats t as a traceparent header value; "" for the zero value.
func (t TraceParent) String() string {
	if t.IsZero() {
		return ""
	}
	b := make([]byte, 0, traceParentLen)
	b = hex.AppendEncode(b, []byte{t.Version})
	b = append(b, '-')
	b = hex.AppendEncode(b, t.TraceID[:])
	b = append(b, '-')
	b = hex.AppendEncode(b, t.ParentID[:])
	b = append(b, '-')
	b = hex.AppendEncode(b, []byte{t.Flags})
	return string(b)
}

// TraceIDString is the trace id in lowercase hex (32 digits), what the
// access log carries; "" for the zero value.
func (t TraceParent) TraceIDString() string {
	if t.IsZero() {
		return ""
	}
	return hex.EncodeToString(t.TraceID[:])
}

// ParseTraceParent parses a traceparent header value as the W3C
// recommendation says a receiver must: lowercase hex fields of fixed
// length, version ff invalid, trace id and parent id not all zeros. A
// version above 00 may carry more fields after a '-' (ignored); version
// 00 has exactly four.
func ParseTraceParent(s string) (TraceParent, error) {
	var t TraceParent
	if len(s) < traceParentLen {
		return t, fmt.Errorf("traceparent %q: %d bytes, want %d", s, len(s), traceParentLen)
	}
	if len(s) > maxTraceParentLen {
		return t, fmt.Errorf("traceparent of %d bytes: over %d", len(s), maxTraceParentLen)
	}
	if s[2] != '-' || s[35] != '-' || s[52] != '-' {
		return t, fmt.Errorf("traceparent %q: fields are not version-traceid-parentid-flags", s)
	}
	var v [1]byte
	if err := lowerHex(v[:], s[0:2]); err != nil {
		return t, fmt.Errorf("traceparent %q: version: %w", s, err)
	}
	t.Version = v[0]
	switch {
	case t.Version == 0xff:
		return TraceParent{}, fmt.Errorf("traceparent %q: version ff is invalid", s)
	case t.Version == 0 && len(s) != traceParentLen:
		return TraceParent{}, fmt.Errorf("traceparent %q: version 00 has %d bytes, not %d", s, traceParentLen, len(s))
	case len(s) > traceParentLen && s[traceParentLen] != '-':
		return TraceParent{}, fmt.Errorf("traceparent %q: flags are not followed by '-'", s)
	}
	if err := lowerHex(t.TraceID[:], s[3:35]); err != nil {
		return TraceParent{}, fmt.Errorf("traceparent %q: trace id: %w", s, err)
	}
	if err := lowerHex(t.ParentID[:], s[36:52]); err != nil {
		return TraceParent{}, fmt.Errorf("traceparent %q: parent id: %w", s, err)
	}
	var f [1]byte
	if err := lowerHex(f[:], s[53:55]); err != nil {
		return TraceParent{}, fmt.Errorf("traceparent %q: flags: %w", s, err)
	}
	t.Flags = f[0]
	if t.TraceID == [16]byte{} {
		return TraceParent{}, fmt.Errorf("traceparent %q: trace id is all zeros", s)
	}
	if t.ParentID == [8]byte{} {
		return TraceParent{}, fmt.Errorf("traceparent %q: parent id is all zeros", s)
	}
	return t, nil
}

// maxTraceParentLen bounds a traceparent of a future version (more
// fields): what a peer sends is not repeated in logs beyond this.
const maxTraceParentLen = 256

// lowerHex decodes s (lowercase hex digits only, as W3C requires) into dst.
func lowerHex(dst []byte, s string) error {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < '0' || c > '9') && (c < 'a' || c > 'f') {
			return errNotLowerHex
		}
	}
	_, err := hex.Decode(dst, []byte(s))
	return err
}

var errNotLowerHex = errors.New("not lowercase hex")
