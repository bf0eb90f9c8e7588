package demo

import (
	"errors"
	"strings"
	"testing"

	"github.com/meshtun/meshtun/bench/noderun"
)

// TestApplyLog checks how a flow's route, identities and outcome follow
// from its access log lines.
func TestApplyLog(t *testing.T) {
	hbone := func(dir string) noderun.Line {
		return noderun.Line{"route": "hbone", "direction": dir,
			"src.identity": "spiffe://cluster.local/ns/default/sa/client",
			"dst.identity": "spiffe://cluster.local/ns/default/sa/echo"}
	}
	for _, tc := range []struct {
		name        string
		lines       []noderun.Line
		failed      error
		want        Flow
		route, out  string
		ok          bool
		wantNoIdent bool
	}{
		{name: "no line is verbatim", want: Flow{WantRoute: RouteVerbatim}, route: RouteVerbatim, out: OutcomeOK, ok: true, wantNoIdent: true},
		{name: "passthrough", lines: []noderun.Line{{"route": "passthrough", "direction": "outbound"}},
			want: Flow{WantRoute: RoutePassthrough}, route: RoutePassthrough, out: OutcomeOK, ok: true, wantNoIdent: true},
		{name: "outbound line wins", lines: []noderun.Line{{"route": "inbound-plain", "direction": "inbound"}, hbone("outbound")},
			want: Flow{WantRoute: RouteHBONE}, route: RouteHBONE, out: OutcomeOK, ok: true},
		{name: "denied", lines: []noderun.Line{hbone("inbound"), {"route": "hbone", "direction": "outbound", "error": "denied by policy"}},
			failed: errors.New("connection reset"), want: Flow{WantRoute: RouteHBONE, WantOutcome: OutcomeDenied},
			route: RouteHBONE, out: OutcomeDenied, ok: true},
		{name: "failure without denial", lines: []noderun.Line{{"route": "passthrough"}}, failed: errors.New("timeout"),
			want: Flow{WantRoute: RoutePassthrough}, route: RoutePassthrough, out: OutcomeFailed, wantNoIdent: true},
		{name: "unexpected route", want: Flow{WantRoute: RouteHBONE}, route: RouteVerbatim, out: OutcomeOK, wantNoIdent: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := Result{Flow: tc.want, failed: tc.failed}
			if r.WantOutcome == "" {
				r.WantOutcome = OutcomeOK
			}
			r.applyLog(tc.lines)
			r.judge()
			if r.Route != tc.route || r.Outcome != tc.out || r.OK != tc.ok {
				t.Errorf("route %q outcome %q ok %v, want %q %q %v", r.Route, r.Outcome, r.OK, tc.route, tc.out, tc.ok)
			}
			if got := r.identities(); (got == "-") != tc.wantNoIdent {
				t.Errorf("identities %q", got)
			}
			if !r.OK && !strings.HasPrefix(r.resultWord(), "UNEXPECTED") {
				t.Errorf("result word %q for an unexpected flow", r.resultWord())
			}
		})
	}
}

// TestWriteTable checks that the table has a row per flow and that the
// wire verdict counts plaintext and encrypted flows.
func TestWriteTable(t *testing.T) {
	rs := []Result{
		{Flow: Flow{Name: "a", From: "client", To: "echo", Kind: TCPEcho}, Protocol: "tcp", Route: RouteHBONE,
			SrcIdentity: "spiffe://td.example/ns/default/sa/client", DstIdentity: "spiffe://td.example/ns/default/sa/echo",
			Outcome: OutcomeOK, CrossesWire: true, PlaintextOnWire: "no", OK: true},
		{Flow: Flow{Name: "b", From: "client", To: "dns", Kind: UDPQuery}, Protocol: "udp", Route: RouteVerbatim,
			Outcome: OutcomeOK, CrossesWire: true, PlaintextOnWire: "yes", OK: true},
		{Flow: Flow{Name: "c", From: "client", To: "web", Kind: TCPEcho}, Protocol: "tcp", Route: RoutePassthrough,
			Outcome: OutcomeOK, PlaintextOnWire: "n/a", OK: true},
	}
	var b strings.Builder
	WriteTable(&b, rs)
	out := b.String()
	for _, want := range []string{"HOW IT TRAVELLED", "echo:8080", "dns:53", "1 of the 2 flows that crossed it showed their payload in plaintext; 1 crossed it encrypted",
		"ns/default/sa/client → ns/default/sa/echo", "spiffe://td.example/<as shown>"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	if n := strings.Count(out, "\n"); n < 5 {
		t.Errorf("table has %d lines:\n%s", n, out)
	}
}
