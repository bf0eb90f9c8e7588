package demo

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// Summary is the machine-readable outcome of a demo run (`meshtun demo
// --json`).
type Summary struct {
	// Mode is "root" or "rootless" (inside a user namespace).
	Mode    string `json:"mode"`
	Cluster string `json:"cluster"`
	// Namespaces are the names of the cluster's network namespaces.
	Namespaces []string   `json:"namespaces"`
	Nodes      []NodeInfo `json:"nodes"`
	// Dir held the generated config and the logs.
	Dir   string   `json:"dir"`
	Flows []Result `json:"flows"`
	// OK is true when every flow had its expected outcome and route.
	OK      bool    `json:"ok"`
	Seconds float64 `json:"seconds"`
}

// Judge sets s.OK from the flows.
func (s *Summary) Judge() {
	s.OK = len(s.Flows) > 0
	for _, r := range s.Flows {
		s.OK = s.OK && r.OK
	}
}

// resultWord is the RESULT column: "ok", or what was unexpected.
func (r Result) resultWord() string {
	if r.OK {
		return "ok"
	}
	var why []string
	if r.Outcome != r.WantOutcome {
		why = append(why, r.Outcome+", want "+r.WantOutcome)
	}
	if r.Route != r.WantRoute {
		why = append(why, "route "+r.Route+", want "+r.WantRoute)
	}
	return "UNEXPECTED: " + strings.Join(why, "; ")
}

// identities is the IDENTITIES column: source and destination identity
// without their "spiffe://<trust domain>/" (WriteTable names the trust
// domain once), "-" for none.
func (r Result) identities() string {
	if r.SrcIdentity == "" && r.DstIdentity == "" {
		return "-"
	}
	return shortID(r.SrcIdentity) + " → " + shortID(r.DstIdentity)
}

func shortID(id string) string {
	td, path, ok := splitID(id)
	switch {
	case id == "":
		return "-"
	case !ok || td == "":
		return id
	}
	return path
}

// splitID splits "spiffe://<trust domain>/<path>".
func splitID(id string) (td, path string, ok bool) {
	rest, ok := strings.CutPrefix(id, "spiffe://")
	if !ok {
		return "", "", false
	}
	td, path, _ = strings.Cut(rest, "/")
	return td, path, true
}

func (r Result) bytes() string { return fmt.Sprintf("%d/%d", r.BytesSent, r.BytesRecv) }

func (r Result) latency() string { return fmt.Sprintf("%.1f ms", r.LatencyMS) }

func (r Result) to() string {
	if r.Protocol == "icmp" {
		return r.To
	}
	return fmt.Sprintf("%s:%d", r.To, r.Kind.Port())
}

// WriteLine writes the one-line live report of a flow.
func WriteLine(w io.Writer, r Result) {
	mark := "ok  "
	if !r.OK {
		mark = "FAIL"
	}
	fmt.Fprintf(w, "  %s %-26s %-8s → %-14s %-4s  %-12s wire: %-4s %9s", mark, r.Name, r.From, r.to(), r.Protocol, r.Route, r.PlaintextOnWire, r.latency())
	if r.Outcome != OutcomeOK {
		fmt.Fprintf(w, "  %s: %s", r.Outcome, r.Error)
	}
	if !r.OK {
		fmt.Fprintf(w, "  (%s)", r.resultWord())
	}
	fmt.Fprintln(w)
}

// WriteTable writes the final table of all flows and a verdict on the
// wire capture.
func WriteTable(w io.Writer, results []Result) {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "FLOW\tFROM\tTO\tPROTO\tHOW IT TRAVELLED\tIDENTITIES\tBYTES OUT/IN\tLATENCY\tPLAINTEXT ON WIRE\tRESULT")
	for _, r := range results {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Name, r.From, r.to(), r.Protocol,
			r.Route, r.identities(), r.bytes(), r.latency(), r.PlaintextOnWire, r.resultWord())
	}
	tw.Flush()

	domains := map[string]bool{}
	for _, r := range results {
		for _, id := range []string{r.SrcIdentity, r.DstIdentity} {
			if td, _, ok := splitID(id); ok && td != "" {
				domains[td] = true
			}
		}
	}
	for td := range domains {
		fmt.Fprintf(w, "\nIdentities are SPIFFE IDs: spiffe://%s/<as shown>.", td)
	}
	if len(domains) > 0 {
		fmt.Fprintln(w)
	}

	var crossed, plain, hidden int
	for _, r := range results {
		if !r.CrossesWire {
			continue
		}
		crossed++
		switch {
		case r.PlaintextOnWire == "yes":
			plain++
		case r.PlaintextOnWire == "no" && r.Outcome == OutcomeOK:
			hidden++
		}
	}
	fmt.Fprintf(w, "\nNode-to-node link: %d of the %d flows that crossed it showed their payload in plaintext", plain, crossed)
	if hidden > 0 {
		fmt.Fprintf(w, "; %d crossed it encrypted.\n", hidden)
	} else {
		fmt.Fprintf(w, "; none crossed it encrypted.\n")
	}
}
