package proxy

import (
	"net"
	"testing"
	"time"

	"github.com/meshtun/meshtun/protocols/hbone"
)

// tlsFailures sums the Istio TCP metric of connections refused as
// TLS_FAILURE.
func tlsFailures(t *testing.T, e *inboundEnv) float64 {
	t.Helper()
	fams, err := e.metrics.Registry.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n float64
	for _, f := range fams {
		if f.GetName() != "istio_tcp_connections_opened_total" {
			continue
		}
		for _, m := range f.Metric {
			for _, l := range m.Label {
				if l.GetName() == "response_flags" && l.GetValue() == "TLS_FAILURE" {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n
}

// TestTLSFailureAccessLogLimited: connections that fail their TLS
// handshake are all counted in Istio's metrics, but their access-log lines
// are limited to hbone.DefaultLogRate a second (after a burst of as many),
// the next line let through saying how many were held back.
func TestTLSFailureAccessLogLimited(t *testing.T) {
	e := newInboundEnv(t)
	const n = 100
	start := time.Now()
	for range n {
		c, err := net.Dial("tcp", e.endpoint.String())
		if err != nil {
			t.Fatal(err)
		}
		c.Write([]byte("GET / HTTP/1.1\r\n\r\n"))
		c.SetReadDeadline(time.Now().Add(5 * time.Second))
		c.Read(make([]byte, 1))
		c.Close()
	}
	deadline := time.Now().Add(10 * time.Second)
	for tlsFailures(t, e) < n {
		if time.Now().After(deadline) {
			t.Fatalf("%v TLS_FAILURE connections counted, want %d", tlsFailures(t, e), n)
		}
		time.Sleep(5 * time.Millisecond)
	}
	elapsed := time.Since(start)
	var lines int
	for _, l := range e.access.Lines(t) {
		if l["message"] == "connection refused" && l["response_flags"] == "TLS_FAILURE" {
			lines++
		}
	}
	allowed := hbone.DefaultLogRate + int(elapsed.Seconds()*hbone.DefaultLogRate) + 1
	t.Logf("%d TLS failures in %s: %d access-log lines", n, elapsed, lines)
	if lines == 0 || lines > allowed {
		t.Errorf("%d access-log lines for %d TLS failures in %s, want 1 to %d", lines, n, elapsed, allowed)
	}
}
