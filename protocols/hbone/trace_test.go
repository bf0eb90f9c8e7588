package hbone

import (
	"context"
	"errors"
	"net"
	"net/http"
	"strings"
	"testing"
)

func TestTraceParent(t *testing.T) {
	const s = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
	tp, err := ParseTraceParent(s)
	if err != nil {
		t.Fatal(err)
	}
	if tp.Version != 0 || tp.Flags != 1 || tp.TraceIDString() != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Errorf("ParseTraceParent(%q) = %+v", s, tp)
	}
	if got := tp.String(); got != s {
		t.Errorf("String = %q, want %q", got, s)
	}
	// A later version may append fields; its first four are read.
	if tp, err := ParseTraceParent("01" + s[2:] + "-what-comes-next"); err != nil || tp.Version != 1 || tp.TraceIDString() != "4bf92f3577b34da6a3ce929d0e0e4736" {
		t.Errorf("version 01 with more fields: %+v, %v", tp, err)
	}
	for _, bad := range []string{
		"",
		s[:54],
		s + "-",            // version 00 has exactly four fields
		"ff" + s[2:],       // version ff is invalid
		strings.ToUpper(s), // W3C: lowercase only
		"00-00000000000000000000000000000000-00f067aa0ba902b7-01", // zero trace id
		"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01", // zero parent id
		"00_4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		"00-4bf92f3577b34da6a3ce929d0e0e473g-00f067aa0ba902b7-01",
		"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-0x",
		"01" + s[2:] + "x", // more must follow a '-'
		"01" + s[2:] + "-" + strings.Repeat("a", maxTraceParentLen), // bounded
	} {
		if tp, err := ParseTraceParent(bad); err == nil {
			t.Errorf("ParseTraceParent(%q) = %+v, want an error", bad, tp)
		}
	}
	if (TraceParent{}).String() != "" || (TraceParent{}).TraceIDString() != "" {
		t.Error("the zero TraceParent formats as non-empty")
	}
}

func TestNewTraceParent(t *testing.T) {
	seen := map[string]bool{}
	for range 1000 {
		tp := NewTraceParent()
		s := tp.String()
		back, err := ParseTraceParent(s)
		if err != nil || back != tp {
			t.Fatalf("NewTraceParent %q does not parse back: %+v, %v", s, back, err)
		}
		if tp.Version != 0 || tp.Flags != 0 {
			t.Fatalf("NewTraceParent %q: want version 00, flags 00 (ztunnel's)", s)
		}
		if seen[tp.TraceIDString()] {
			t.Fatalf("trace id %s generated twice", tp.TraceIDString())
		}
		seen[tp.TraceIDString()] = true
	}
}

func TestBaggageBounds(t *testing.T) {
	many := make([]string, MaxBaggageMembers+1)
	for i := range many {
		many[i] = "k" + strings.Repeat("x", i%5) + string(rune('a'+i%26)) + string(rune('a'+i/26)) + "=v"
	}
	if _, err := ParseBaggage(strings.Join(many[:MaxBaggageMembers], ",")); err != nil {
		t.Errorf("%d members: %v", MaxBaggageMembers, err)
	}
	if _, err := ParseBaggage(strings.Join(many, ",")); err == nil {
		t.Errorf("%d members: no error", len(many))
	}
	if _, err := ParseBaggage("k=" + strings.Repeat("v", MaxBaggageBytes)); err == nil {
		t.Errorf("baggage over %d bytes: no error", MaxBaggageBytes)
	}
	// Values are baggage octets or percent escapes; empty members are
	// skipped.
	for _, bad := range []string{`k="quoted"`, "k=a b", "k=a\\b", "k=é"} {
		if b, err := ParseBaggage(bad); err == nil {
			t.Errorf("ParseBaggage(%q) = %v, want an error", bad, b)
		}
	}
	if b, err := ParseBaggage("a=1,,b=2, ,"); err != nil || len(b) != 2 || b["a"] != "1" || b["b"] != "2" {
		t.Errorf("empty members: %v, %v", b, err)
	}
	big := Baggage{"k": strings.Repeat("é", MaxBaggageBytes/4)}
	if err := big.validate(); err == nil {
		t.Errorf("validate accepted baggage of %d bytes encoded", len(big.String()))
	}
}

// A request whose baggage or traceparent is malformed still reaches the
// handler, with them left out, as ztunnel ignores them; well-formed ones
// arrive parsed.
func TestMalformedTelemetryIgnored(t *testing.T) {
	got := make(chan *Request, 1)
	f := newFixture(t, HandlerFunc(func(ctx context.Context, req *Request) (net.Conn, error) {
		got <- req
		return nil, errors.New("refused by the test")
	}))
	for _, tc := range []struct {
		name      string
		h         http.Header
		wantTrace string
		wantBag   int
	}{
		{"bad baggage", http.Header{"Baggage": {"novalue"}, "Traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}, "4bf92f3577b34da6a3ce929d0e0e4736", 0},
		{"huge baggage", http.Header{"Baggage": {"k=" + strings.Repeat("v", MaxBaggageBytes)}}, "", 0},
		{"bad traceparent", http.Header{"Baggage": {"k8s.namespace.name=a,service.name=b"}, "Traceparent": {"not-a-trace"}}, "", 2},
		{"two traceparents", http.Header{"Traceparent": {"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "00-4bf92f3577b34da6a3ce929d0e0e4737-00f067aa0ba902b7-01"}}, "", 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, body := rawConnect(t, f, http.MethodConnect, "127.0.0.1:9", tc.h)
			if status != http.StatusServiceUnavailable || !strings.Contains(body, "refused by the test") {
				t.Fatalf("%d %q: the request did not reach the handler", status, body)
			}
			req := <-got
			if req.Trace.TraceIDString() != tc.wantTrace {
				t.Errorf("trace id %q, want %q", req.Trace.TraceIDString(), tc.wantTrace)
			}
			if (req.TraceParent == "") != (tc.wantTrace == "") {
				t.Errorf("TraceParent %q with trace %q", req.TraceParent, tc.wantTrace)
			}
			if len(req.Baggage) != tc.wantBag {
				t.Errorf("baggage %v, want %d members", req.Baggage, tc.wantBag)
			}
		})
	}
}

func TestDialRefusesBadTraceParent(t *testing.T) {
	f := newFixture(t, dialHandler)
	_, err := f.cl.Dial(context.Background(), DialRequest{Source: f.client, Destination: f.server, Endpoint: f.endpoint,
		Target: f.endpoint, TraceParent: "00-zz"})
	if err == nil || !strings.Contains(err.Error(), "traceparent") {
		t.Errorf("Dial with a malformed traceparent: %v", err)
	}
}
