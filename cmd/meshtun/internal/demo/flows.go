package demo

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net/netip"
	"strings"
	"time"

	"github.com/meshtun/meshtun/bench/noderun"
)

// Routes a flow can take, as the node's access log names them, plus
// RouteVerbatim for flows no node logged (forwarded packet by packet).
const (
	RouteVerbatim    = "verbatim"
	RoutePassthrough = "passthrough" // plain TCP from the pod's own address, through the proxy
	RouteHBONE       = "hbone"       // mTLS tunnel to the destination's node
	RouteLocal       = "local"       // between mesh pods of the same node
	RoutePlaintext   = "plaintext"   // plaintext to a workload its node protects (STRICT, policy)
)

// Outcomes of a flow.
const (
	OutcomeOK     = "ok"
	OutcomeDenied = "denied"
	OutcomeFailed = "failed"
)

// Flow is one row of the demo: who talks to whom, how, and how the flow
// is expected to travel.
type Flow struct {
	Name string `json:"name"`
	// From and To are pod names or ExternalName.
	From string `json:"from"`
	To   string `json:"to"`
	Kind Kind   `json:"kind"`
	// IPv6 makes the flow use the IPv6 addresses.
	IPv6 bool `json:"ipv6,omitempty"`
	// WantRoute is the expected route: RouteVerbatim, RoutePassthrough,
	// RouteHBONE or another route the node logs.
	WantRoute string `json:"want_route"`
	// WantOutcome is OutcomeOK (also when empty) or OutcomeDenied.
	WantOutcome string `json:"want_outcome"`
}

// Flows returns the demo's flows, in the order they run. Add a row here to
// add a flow; Kind says what is exchanged.
func Flows() []Flow {
	return []Flow{
		{Name: "tcp echo, cross-node", From: "client", To: "echo", Kind: TCPEcho, WantRoute: RouteHBONE},
		{Name: "tcp echo, same node", From: "client", To: "web", Kind: TCPEcho, WantRoute: RouteLocal},
		{Name: "tcp echo over IPv6", From: "client", To: "echo", Kind: TCPEcho, IPv6: true, WantRoute: RouteHBONE},
		{Name: "server speaks first", From: "client", To: "banner", Kind: ServerFirst, WantRoute: RouteHBONE},
		{Name: "udp dns-like query", From: "client", To: "dns", Kind: UDPQuery, WantRoute: RouteVerbatim},
		{Name: "ping", From: "client", To: "echo", Kind: Ping, WantRoute: RouteVerbatim},
		{Name: "pod to external host", From: "client", To: ExternalName, Kind: TCPEcho, WantRoute: RoutePassthrough},
		{Name: "external host to pod", From: ExternalName, To: "echo", Kind: TCPEcho, WantRoute: RouteVerbatim},
		{Name: "to pod outside the mesh", From: "client", To: "legacy", Kind: TCPEcho, WantRoute: RoutePassthrough},
		{Name: "from pod outside the mesh", From: "legacy", To: "echo", Kind: TCPEcho, WantRoute: RouteVerbatim},
		{Name: "mesh pod to STRICT pod", From: "client", To: "secure", Kind: TCPEcho, WantRoute: RouteHBONE},
		{Name: "plaintext to STRICT pod", From: "legacy", To: "secure", Kind: TCPEcho, WantRoute: RoutePlaintext, WantOutcome: OutcomeDenied},
		{Name: "denied by policy", From: "web", To: "banner", Kind: ServerFirst, WantRoute: RouteHBONE, WantOutcome: OutcomeDenied},
	}
}

// Result is what became of a flow.
type Result struct {
	Flow
	Protocol string `json:"protocol"`
	// Dst is the destination address (and port).
	Dst string `json:"dst"`
	// Route is how the flow travelled: the "route" of its access log
	// line, RouteVerbatim if no node logged it.
	Route       string `json:"route"`
	SrcIdentity string `json:"src_identity,omitempty"`
	DstIdentity string `json:"dst_identity,omitempty"`
	Outcome     string `json:"outcome"`
	Error       string `json:"error,omitempty"`
	// BytesSent and BytesRecv are payload bytes as the client counted them.
	BytesSent int64   `json:"bytes_sent"`
	BytesRecv int64   `json:"bytes_recv"`
	LatencyMS float64 `json:"latency_ms"`
	// CrossesWire is true when the flow crosses the node-to-node link.
	CrossesWire bool `json:"crosses_wire"`
	// PlaintextOnWire is "yes" if the flow's marker was captured on the
	// node-to-node link, "no" if not, "n/a" if the flow does not cross it
	// or sent nothing.
	PlaintextOnWire string `json:"plaintext_on_wire"`
	// OK is true when outcome and route are the expected ones.
	OK bool `json:"ok"`

	src, dst  netip.AddrPort // for matching access log lines
	failed    error          // the client's error, if any
	logDenied bool           // a node logged the flow as denied
}

// Run drives flows one after the other, until ctx ends, and calls
// progress with each result as soon as it is known. At the end it looks
// at the access logs once more, so that a line that came late still
// counts, and returns the final results of the flows that ran.
func (d *Demo) Run(ctx context.Context, flows []Flow, progress func(Result)) []Result {
	results := make([]Result, 0, len(flows))
	for i, f := range flows {
		if ctx.Err() != nil {
			break
		}
		results = append(results, d.run(ctx, i, f))
		if progress != nil {
			progress(results[i])
		}
	}
	for i := range results {
		if results[i].src.IsValid() {
			results[i].applyLog(d.accessLines(results[i].src, results[i].dst))
		}
		results[i].judge()
	}
	return results
}

// logWait is how long a flow's access log line is waited for when the
// flow is expected to be proxied; logGrace when it is not.
const (
	logWait  = 2 * time.Second
	logGrace = 200 * time.Millisecond
)

func (d *Demo) run(ctx context.Context, i int, f Flow) Result {
	r := Result{Flow: f, Protocol: f.Kind.Protocol(), Route: RouteVerbatim, PlaintextOnWire: "n/a"}
	if r.WantOutcome == "" {
		r.WantOutcome = OutcomeOK
	}
	from, to := d.endpoints[f.From], d.endpoints[f.To]
	if from == nil || to == nil {
		r.failed = fmt.Errorf("flow %q: unknown endpoint %q or %q", f.Name, f.From, f.To)
		r.judge()
		return r
	}
	src, dst := from.IPv4, to.IPv4
	if f.IPv6 {
		src, dst = from.IPv6, to.IPv6
	}
	r.Dst = dst.String()
	if port := f.Kind.Port(); port != 0 {
		r.Dst = netip.AddrPortFrom(dst, uint16(port)).String()
	}
	r.CrossesWire = from.Node != to.Node

	marker := fmt.Sprintf("MESHTUN-DEMO-%02d-%s", i+1, rand.Text()[:12])
	d.wire.watch(marker)
	fctx, cancel := context.WithTimeout(ctx, deadline)
	x := f.Kind.drive(fctx, from.NS, src, dst, marker)
	cancel()
	r.src, r.failed = x.local, x.err
	if r.failed != nil && ctx.Err() != nil {
		r.failed = errors.New("interrupted")
	}
	r.BytesSent, r.BytesRecv = x.sent, x.recv
	r.LatencyMS = float64(x.latency.Microseconds()) / 1000
	if x.local.IsValid() {
		r.dst = netip.AddrPortFrom(dst, uint16(f.Kind.Port()))
	}

	seen, err := d.wire.seen(ctx, marker)
	switch {
	case err != nil:
		if ctx.Err() == nil {
			d.log.Warn().Err(err).Str("flow", f.Name).Msg("demo: capture")
		}
		r.PlaintextOnWire = "unknown"
	case r.CrossesWire && seen:
		r.PlaintextOnWire = "yes"
	case r.CrossesWire && r.BytesSent > 0:
		r.PlaintextOnWire = "no"
	}

	if r.src.IsValid() {
		wait := logGrace
		if f.WantRoute != RouteVerbatim {
			wait = logWait
		}
		d.waitAccessLine(ctx, r.src, r.dst, wait)
		r.applyLog(d.accessLines(r.src, r.dst))
	}
	r.judge()
	return r
}

// isAccessLine reports whether l is an access log line of the flow from
// src to dst.
func isAccessLine(l noderun.Line, src, dst netip.AddrPort) bool {
	return l.Str("route") != "" && l.Str("src.addr") == src.String() && l.Str("dst.addr") == dst.String()
}

// accessLines returns every node's access log lines of the flow.
func (d *Demo) accessLines(src, dst netip.AddrPort) []noderun.Line {
	var out []noderun.Line
	for _, p := range d.nodes {
		for _, l := range p.Lines() {
			if isAccessLine(l, src, dst) {
				out = append(out, l)
			}
		}
	}
	return out
}

// waitAccessLine waits up to wait for any node to log the flow.
func (d *Demo) waitAccessLine(ctx context.Context, src, dst netip.AddrPort, wait time.Duration) {
	ctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	found := make(chan bool, len(d.nodes))
	for _, p := range d.nodes {
		go func() {
			_, err := p.WaitLog(ctx, func(l noderun.Line) bool { return isAccessLine(l, src, dst) })
			found <- err == nil
		}()
	}
	for range d.nodes {
		if <-found {
			return
		}
	}
}

// applyLog sets route, identities and the denial from the flow's access
// log lines; the source node's outbound line wins over others. A flow is
// denied when the mesh refused it: a line with an error that says
// "denied" or, on any route but passthrough (where the destination itself
// answered), "refused".
func (r *Result) applyLog(lines []noderun.Line) {
	r.Route, r.SrcIdentity, r.DstIdentity, r.logDenied = RouteVerbatim, "", "", false
	for i, l := range lines {
		if i == 0 || l.Str("direction") == "outbound" {
			r.Route = l.Str("route")
		}
		if v := l.Str("src.identity"); v != "" {
			r.SrcIdentity = v
		}
		if v := l.Str("dst.identity"); v != "" {
			r.DstIdentity = v
		}
		e := l.Str("error")
		if strings.Contains(e, "denied") || l.Str("route") != RoutePassthrough && strings.Contains(e, "refused") {
			r.logDenied = true
		}
	}
}

// judge sets the outcome and whether the flow did what it should.
func (r *Result) judge() {
	switch {
	case r.failed == nil:
		r.Outcome, r.Error = OutcomeOK, ""
	case r.logDenied:
		r.Outcome, r.Error = OutcomeDenied, r.failed.Error()
	default:
		r.Outcome, r.Error = OutcomeFailed, r.failed.Error()
	}
	r.OK = r.Outcome == r.WantOutcome && r.Route == r.WantRoute
}
