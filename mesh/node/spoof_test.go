package node

import (
	"fmt"
	"net/netip"
	"testing"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/mesh/config"
)

// TestCaptureLinks: each capture link of a config file's model may carry
// exactly the addresses of the node's mesh workloads that name it; a link
// no workload names, those of the node's mesh workloads that name no link;
// never another node's, nor a workload's outside the mesh. No link is
// looked for by route: the file knows them all.
func TestCaptureLinks(t *testing.T) {
	c, err := config.Parse("mesh.yaml", []byte(`
nodes:
  - {name: n1, captureLinks: [spare]}
  - {name: n2}
workloads:
  - {name: a, node: n1, addresses: [198.18.1.11, "fd00:6d74:1::11"], captureLink: va}
  - {name: b, node: n1, addresses: [198.18.1.12], captureLink: vb}
  - {name: c, node: n1, addresses: [198.18.1.13]}
  - {name: d, node: n1, addresses: [198.18.1.14], mesh: false}
  - {name: e, node: n2, addresses: [198.18.2.11], captureLink: va}
`))
	if err != nil {
		t.Fatal(err)
	}
	nc, err := c.Node("n1")
	if err != nil {
		t.Fatal(err)
	}
	snap, err := c.Snapshot()
	if err != nil {
		t.Fatal(err)
	}
	n := &node{cfg: Config{Name: "n1", CaptureLinks: nc.CaptureLinks}, log: zerolog.Nop()}
	links, complete := n.captureLinks(snap, localWorkloads(snap, "n1"))
	if !complete {
		t.Errorf("captureLinks: incomplete, want every link known from the file")
	}
	got := map[string][]netip.Addr{}
	for _, l := range links {
		got[l.Name] = l.Sources
	}
	want := map[string][]netip.Addr{
		"va":    {netip.MustParseAddr("198.18.1.11"), netip.MustParseAddr("fd00:6d74:1::11")},
		"vb":    {netip.MustParseAddr("198.18.1.12")},
		"spare": {netip.MustParseAddr("198.18.1.13")},
	}
	if fmt.Sprint(got) != fmt.Sprint(want) || len(links) != len(want) {
		t.Errorf("CaptureLinks(n1) = %v, want %v", got, want)
	}
	if s := SinkName("meshtun0"); s != "meshtun0s" {
		t.Errorf("SinkName(meshtun0) = %q", s)
	}
	for name, want := range map[string]string{"fifteen-bytes-x": "fifteen-bytes-s", "fifteen-bytes-s": "fifteen-bytes-z"} {
		if s := SinkName(name); s != want {
			t.Errorf("SinkName(%s) = %q, want %q", name, s, want)
		}
	}
}
