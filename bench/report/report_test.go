package report

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

func sample() *Result {
	return &Result{
		Tool: "meshtun bench", Version: "test", Command: "meshtun bench --quick",
		Started: time.Date(2025, 1, 2, 3, 4, 5, 0, time.UTC), Seconds: 42, Repetitions: 3,
		Baseline: "direct",
		Paths: []Path{
			{Name: "direct", Description: "kernel"},
			{Name: "mesh", Description: "HBONE", Proxies: []string{"meshtun n7", "meshtun n8"}},
			{Name: "peer", Description: "other", Peer: true, Proxies: []string{"tun2socks n9"}},
		},
		Metrics: []Metric{
			{ID: "tcp_up_1", Title: "TCP up, 1 stream", Label: "up ×1", Unit: "Gbit/s", Better: Higher, Chart: "TCP throughput",
				Values: map[string]Value{
					"direct": NewValue([]float64{10, 12, 11}),
					"mesh":   NewValue([]float64{2, 3, 2.5}),
					"peer":   NewValue([]float64{1, 1.25, 1}),
				}},
			{ID: "rr_p50", Title: "request/response p50", Label: "p50", Unit: "µs", Better: Lower, Chart: "Request/response latency",
				Values: map[string]Value{
					"direct": NewValue([]float64{50, 60, 55}),
					"mesh":   NewValue([]float64{100}),
				}},
			{ID: "cpu", Title: "CPU per GB", Unit: "s/GB", Better: Lower, Chart: "CPU & memory <cost>",
				Values: map[string]Value{"mesh": NewValue([]float64{4})}},
			{ID: "loss", Title: "UDP loss", Unit: "%", Better: Lower,
				Values: map[string]Value{"direct": NewValue([]float64{0}), "mesh": NewValue([]float64{2})}},
		},
		Errors: []string{"peer/rr: connection refused"},
		Limits: []string{"peer/idle connections: 9,911th timed out (tun2socks n9 holds 20000 descriptors, its open-file limit)"},
	}
}

func TestJSONRoundTrip(t *testing.T) {
	r := sample()
	var buf bytes.Buffer
	if err := WriteJSON(&buf, r); err != nil {
		t.Fatal(err)
	}
	// Machines read flat fields: the summary is inlined in each value.
	for _, want := range []string{`"median": 11`, `"min": 10`, `"max": 12`, `"n": 3`, `"samples": [`, `"better": "higher"`, `"baseline": "direct"`} {
		if !strings.Contains(buf.String(), want) {
			t.Errorf("JSON lacks %s:\n%s", want, buf.String())
		}
	}
	got, err := ReadJSON(&buf)
	if err != nil {
		t.Fatal(err)
	}
	v := got.Metric("tcp_up_1").Values["mesh"]
	if v.Median != 2.5 || v.Min != 2 || v.Max != 3 || len(v.Samples) != 3 {
		t.Errorf("mesh tcp_up_1 after round trip: %+v", v)
	}
	if fmt.Sprint(got.Peers()) != "[peer]" || !got.Started.Equal(r.Started) || len(got.Errors) != 1 {
		t.Errorf("round trip lost fields: peers %q started %v errors %v", got.Peers(), got.Started, got.Errors)
	}
	if _, err := ReadJSON(strings.NewReader("{")); err == nil {
		t.Error("ReadJSON of truncated input: no error")
	}
}

func TestRatio(t *testing.T) {
	m := sample().Metric("tcp_up_1")
	if x, ok := m.Ratio("mesh", "peer"); !ok || x != 2.5 {
		t.Errorf("mesh ÷ peer = %v, %v; want 2.5", x, ok)
	}
	if _, ok := m.Ratio("mesh", "nowhere"); ok {
		t.Error("ratio to a missing path reported ok")
	}
}

func TestTable(t *testing.T) {
	var buf bytes.Buffer
	if err := WriteTable(&buf, sample()); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	lines := strings.Split(out, "\n")
	if !strings.HasPrefix(lines[0], "metric") || !strings.Contains(lines[0], "direct") || !strings.Contains(lines[0], "peer") {
		t.Fatalf("header: %q", lines[0])
	}
	for _, want := range []string{
		"TCP up, 1 stream [Gbit/s]", "11.0 (10.0–12.0)", "2.50 (2.00–3.00)",
		"×0.227",        // mesh ÷ direct: 2.5 / 11
		"×2.50",         // mesh ÷ peer
		"+45.0µs ×1.82", // rr p50: mesh 100 vs direct 55
		"—",             // missing value
		"1 measurement(s) failed", "peer/rr: connection refused",
		"1 measurement(s) beyond a peer's own limits (not taken)", "peer/idle connections: 9,911th",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	// Percentages get no ratio rows.
	for i, l := range lines {
		if strings.HasPrefix(l, "UDP loss") && i+1 < len(lines) && strings.HasPrefix(lines[i+1], "  vs") {
			t.Errorf("ratio row under a percentage: %q", lines[i+1])
		}
	}
	// Columns line up: every cell of a column starts at the same rune
	// offset, so "direct" in the header sits over the first values.
	col := strings.Index(lines[0], "direct")
	row := lines[2]
	if !strings.HasPrefix(string([]rune(row)[col:]), "11.0") {
		t.Errorf("first value not under its header at rune %d:\n%s\n%s", col, lines[0], row)
	}
}

func TestNum(t *testing.T) {
	for v, want := range map[float64]string{
		0: "0", 31250: "31250", 123.4: "123", 12.34: "12.3", 1.234: "1.23", 0.1234: "0.123", 0.05: "0.05", 0.0001234: "0.00012", -2.5: "-2.50",
	} {
		if got := Num(v); got != want {
			t.Errorf("Num(%v) = %q, want %q", v, got, want)
		}
	}
}

func TestNiceCeil(t *testing.T) {
	for v, want := range map[float64]float64{0: 1, -3: 1, 1: 1, 1.2: 2, 2.1: 2.5, 3: 5, 7: 10, 12: 20, 0.034: 0.05, 250: 250, 251: 500} {
		if got := niceCeil(v); got < want*0.999999 || got > want*1.000001 {
			t.Errorf("niceCeil(%v) = %v, want %v", v, got, want)
		}
	}
}

func TestChartsGroupAndCheckUnits(t *testing.T) {
	r := sample()
	cs, err := Charts(r)
	if err != nil {
		t.Fatal(err)
	}
	if len(cs) != 3 || cs[0].File != "tcp-throughput.svg" || cs[2].File != "cpu-memory-cost.svg" || len(cs[0].Metrics) != 1 {
		t.Fatalf("charts: %+v", cs)
	}
	r.Metrics = append(r.Metrics, Metric{ID: "x", Unit: "MiB", Chart: "TCP throughput"})
	if _, err := Charts(r); err == nil {
		t.Error("a chart mixing Gbit/s and MiB: no error")
	}
}

// svgDoc is the part of an SVG the test inspects.
type svgDoc struct {
	XMLName xml.Name `xml:"svg"`
	Rects   []struct {
		Fill   string `xml:"fill,attr"`
		Height string `xml:"height,attr"`
		Title  string `xml:"title"`
	} `xml:"rect"`
	Texts []string `xml:"text"`
}

func TestSVGIsWellFormedWithOneBarPerValue(t *testing.T) {
	r := sample()
	cs, _ := Charts(r)
	var buf bytes.Buffer
	if err := WriteSVG(&buf, r, cs[0]); err != nil {
		t.Fatal(err)
	}
	var doc svgDoc
	if err := xml.Unmarshal(buf.Bytes(), &doc); err != nil {
		t.Fatalf("SVG does not parse: %v\n%s", err, buf.String())
	}
	bars := 0
	for _, rc := range doc.Rects {
		if strings.Contains(rc.Title, "TCP up, 1 stream") {
			bars++
			if rc.Height == "" || strings.HasPrefix(rc.Height, "-") {
				t.Errorf("bar %q has height %q", rc.Title, rc.Height)
			}
		}
	}
	if bars != 3 {
		t.Errorf("%d bars, want one per path (3)", bars)
	}
	joined := strings.Join(doc.Texts, "|")
	for _, want := range []string{"TCP throughput", "up ×1", "11.0", "2.50", "direct", "mesh", "peer"} {
		if !strings.Contains(joined, want) {
			t.Errorf("SVG texts lack %q: %s", want, joined)
		}
	}
	// The peer keeps its own colour.
	peerBar := false
	for _, rc := range doc.Rects {
		if strings.HasPrefix(rc.Title, "peer ") && rc.Fill == peerPalette[0] {
			peerBar = true
		}
	}
	if !peerBar {
		t.Error("peer bar not in the peer colour")
	}
	// Missing values say so instead of drawing a bar.
	buf.Reset()
	WriteSVG(&buf, r, cs[1])
	if !strings.Contains(buf.String(), ">n/a<") {
		t.Error("rr chart: no n/a for the peer's missing value")
	}
	// Markup in titles is escaped.
	buf.Reset()
	WriteSVG(&buf, r, cs[2])
	if err := xml.Unmarshal(buf.Bytes(), &doc); err != nil || !strings.Contains(buf.String(), "&lt;cost&gt;") {
		t.Errorf("title with <cost> not escaped (%v)", err)
	}
}

func TestWriteCharts(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "out")
	files, err := WriteCharts(dir, sample())
	if err != nil {
		t.Fatal(err)
	}
	if len(files) != 4 {
		t.Fatalf("wrote %v, want 3 charts and index.html", files)
	}
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil || len(b) == 0 {
			t.Errorf("%s: %v, %d bytes", f, err, len(b))
		}
	}
	idx, _ := os.ReadFile(filepath.Join(dir, "index.html"))
	for _, want := range []string{`src="tcp-throughput.svg"`, "TCP up, 1 stream", "meshtun bench --quick"} {
		if !strings.Contains(string(idx), want) {
			t.Errorf("index.html lacks %q", want)
		}
	}
}

func TestSVGAxisEndsAtANiceStepAboveTheData(t *testing.T) {
	r := sample()
	r.Metrics = []Metric{{ID: "x", Title: "x", Unit: "µs", Better: Lower, Chart: "c",
		Values: map[string]Value{"direct": NewValue([]float64{2816, 2000})}}}
	cs, _ := Charts(r)
	var buf bytes.Buffer
	if err := WriteSVG(&buf, r, cs[0]); err != nil {
		t.Fatal(err)
	}
	var doc svgDoc
	if err := xml.Unmarshal(buf.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	// Data up to 2816: steps of 1000, axis to 3000 (not 5000).
	joined := "|" + strings.Join(doc.Texts, "|") + "|"
	for _, want := range []string{"|0|", "|1000|", "|3000|"} {
		if !strings.Contains(joined, want) {
			t.Errorf("axis lacks %s: %s", want, joined)
		}
	}
	if strings.Contains(joined, "|4000|") {
		t.Errorf("axis runs past 3000: %s", joined)
	}
}

func TestTableComparesEachVariantWithItsPath(t *testing.T) {
	r := sample()
	r.Variant = "environment GOMAXPROCS=1"
	r.Paths = append(r.Paths[:2:2], Path{Name: "mesh·B", VariantOf: "mesh"}, r.Paths[2])
	r.Metrics[0].Values["mesh·B"] = NewValue([]float64{5})
	r.Metrics[1].Values["mesh·B"] = NewValue([]float64{80})
	r.Metrics[3].Values["mesh·B"] = NewValue([]float64{1})
	var buf bytes.Buffer
	if err := WriteTable(&buf, r); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	var bRows []string
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(l, "  B vs A") {
			bRows = append(bRows, l)
		}
	}
	// Only TCP and rr p50 have both an A and a B value; the percentage
	// gets no ratio at all.
	if len(bRows) != 2 {
		t.Fatalf("B vs A rows %q, want 2 (TCP, rr p50):\n%s", bRows, out)
	}
	if !strings.Contains(bRows[0], "×2.00") { // 5 ÷ 2.5
		t.Errorf("TCP B vs A row %q lacks ×2.00", bRows[0])
	}
	if !strings.Contains(bRows[1], "−20.0µs ×0.8") { // 80 vs 100
		t.Errorf("rr B vs A row %q lacks −20.0µs ×0.8", bRows[1])
	}
	if !strings.Contains(out, "B paths (·): environment GOMAXPROCS=1") {
		t.Errorf("table does not say what B ran with:\n%s", out)
	}
	// Without a variant there is no such row.
	buf.Reset()
	WriteTable(&buf, sample())
	if strings.Contains(buf.String(), "B vs A") {
		t.Errorf("B vs A row without a variant:\n%s", buf.String())
	}
}

// twoPeers is sample with a second peer, "peer2", measured on every
// metric the first one is.
func twoPeers() *Result {
	r := sample()
	r.Paths = append(r.Paths, Path{Name: "peer2", Description: "yet another", Peer: true, Proxies: []string{"p2 n11", "p2 n12"}})
	r.Metrics[0].Values["peer2"] = NewValue([]float64{5})
	r.Metrics[1].Values["peer"] = NewValue([]float64{70})
	r.Metrics[1].Values["peer2"] = NewValue([]float64{200})
	return r
}

func TestTableComparesWithEveryPeer(t *testing.T) {
	r := twoPeers()
	if got := fmt.Sprint(r.Peers()); got != "[peer peer2]" {
		t.Fatalf("Peers() = %s", got)
	}
	var buf bytes.Buffer
	if err := WriteTable(&buf, r); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	lines := strings.Split(out, "\n")
	// Cells by column: the header's column starts, in runes.
	var starts []int
	for _, name := range []string{"direct", "mesh", "peer", "peer2"} {
		i := strings.Index(lines[0], "  "+name)
		if i < 0 {
			t.Fatalf("header lacks %s: %q", name, lines[0])
		}
		starts = append(starts, len([]rune(lines[0][:i]))+2)
	}
	cellAt := func(line string, col int) string {
		rs := []rune(line)
		if starts[col] >= len(rs) {
			return ""
		}
		end := len(rs)
		if col+1 < len(starts) {
			end = min(end, starts[col+1])
		}
		return strings.TrimSpace(string(rs[starts[col]:end]))
	}
	rows := map[string][]string{} // "metric|vs ref" → the row's lines
	metric := ""
	for _, l := range lines[2:] {
		switch {
		case strings.HasPrefix(l, "  vs "):
			ref := strings.TrimSpace(string([]rune(l)[:starts[0]]))
			rows[metric+"|"+ref] = append(rows[metric+"|"+ref], l)
		case l != "" && !strings.HasPrefix(l, " "):
			metric, _, _ = strings.Cut(l, " [")
		}
	}
	const tcp, rr = "TCP up, 1 stream", "request/response p50"
	for _, k := range []string{tcp + "|vs direct", tcp + "|vs peer", tcp + "|vs peer2", rr + "|vs peer", rr + "|vs peer2"} {
		if len(rows[k]) != 1 {
			t.Errorf("%s: %d rows, want 1:\n%s", k, len(rows[k]), out)
		}
	}
	if t.Failed() {
		return
	}
	for _, c := range []struct {
		row  string
		col  int
		want string
	}{
		{tcp + "|vs peer", 1, "×2.50"},        // mesh 2.5 ÷ peer 1
		{tcp + "|vs peer2", 1, "×0.5"},        // mesh 2.5 ÷ peer2 5
		{tcp + "|vs peer", 3, ""},             // peers are not compared with one another
		{tcp + "|vs peer2", 2, ""},            // nor the other way round
		{tcp + "|vs direct", 3, "×0.455"},     // but each with the baseline: 5 ÷ 11
		{rr + "|vs peer2", 1, "−100µs ×0.5"},  // mesh 100 vs peer2 200
		{rr + "|vs peer", 1, "+30.0µs ×1.43"}, // mesh 100 vs peer 70
	} {
		if got := cellAt(rows[c.row][0], c.col); got != c.want {
			t.Errorf("%s, column %d: %q, want %q\n%s", c.row, c.col, got, c.want, out)
		}
	}
}

func TestSVGGivesEachPeerItsColourAndKeepsTheLegendInside(t *testing.T) {
	r := twoPeers()
	// Long names, in a one-metric chart (the narrowest): the legend must
	// wrap rather than run off the picture.
	for i := range r.Paths {
		r.Paths[i].Name = strings.Repeat(r.Paths[i].Name, 3)
	}
	m := Metric{ID: "x", Title: "x", Unit: "Gbit/s", Better: Higher, Chart: "one", Values: map[string]Value{}}
	for _, p := range r.Paths {
		m.Values[p.Name] = NewValue([]float64{1})
	}
	r.Metrics = []Metric{m}
	cs, _ := Charts(r)
	var buf bytes.Buffer
	if err := WriteSVG(&buf, r, cs[0]); err != nil {
		t.Fatal(err)
	}
	var doc struct {
		Width int `xml:"width,attr"`
		Rects []struct {
			X     float64 `xml:"x,attr"`
			Y     float64 `xml:"y,attr"`
			Fill  string  `xml:"fill,attr"`
			Title string  `xml:"title"`
		} `xml:"rect"`
		Texts []struct {
			X    float64 `xml:"x,attr"`
			Text string  `xml:",chardata"`
		} `xml:"text"`
	}
	if err := xml.Unmarshal(buf.Bytes(), &doc); err != nil {
		t.Fatal(err)
	}
	fills := map[string]string{}
	for _, rc := range doc.Rects {
		if name, _, ok := strings.Cut(rc.Title, " x: "); ok {
			fills[name] = rc.Fill
		}
	}
	peer, peer2 := r.Paths[2].Name, r.Paths[3].Name
	if fills[peer] != peerPalette[0] || fills[peer2] != peerPalette[1] {
		t.Errorf("peer colours %q and %q, want %q and %q", fills[peer], fills[peer2], peerPalette[0], peerPalette[1])
	}
	if fills[r.Paths[1].Name] != palette[1] {
		t.Errorf("mesh colour %q, want %q (peers do not shift the others)", fills[r.Paths[1].Name], palette[1])
	}
	lines := map[float64]bool{}
	for _, tx := range doc.Texts {
		for _, p := range r.Paths {
			if tx.Text == p.Name {
				if end := tx.X + float64(7*len(p.Name)); end > float64(doc.Width) {
					t.Errorf("legend entry %q ends at %v, past the width %d", p.Name, end, doc.Width)
				}
			}
		}
	}
	for _, rc := range doc.Rects {
		if rc.Title == "" && rc.Fill != "white" {
			lines[rc.Y] = true
		}
	}
	if len(lines) < 2 {
		t.Errorf("legend on %d line(s), want it wrapped", len(lines))
	}
}
