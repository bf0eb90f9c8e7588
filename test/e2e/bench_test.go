package e2e

import (
	"context"
	"io"
	"net"
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/meshtun/meshtun/test/cluster"
)

// BenchmarkThroughput compares one TCP stream from a pod on node 1 to a
// pod on node 2 over three paths, in one run:
//
//	direct      the kernel alone (no meshtun)
//	verbatim    meshtun on both nodes, every packet through the TUN and
//	            written back (--no-intercept)
//	passthrough meshtun on both nodes, the flow terminated in the netstack
//	            of node 1 and sent on by a kernel socket
//
// Run: go test -run '^$' -bench Throughput -benchtime 2s ./test/e2e
// and compare the MB/s of the three (the ratios hold on a noisy machine).
func BenchmarkThroughput(b *testing.B) {
	c := cluster.NewT(b, cluster.Spec{Name: "bt", Nodes: 2, PodsPerNode: 1, NoExternal: true})
	n1, n2 := c.Nodes[0], c.Nodes[1]
	src, dst := n1.Pods[0], n2.Pods[0]
	sink := serve(b, dst, 7100, func(c net.Conn) { io.Copy(io.Discard, c) })
	_ = sink
	source := serve(b, dst, 7101, func(c net.Conn) {
		buf := make([]byte, 256<<10)
		for {
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	})
	_ = source

	run := func(name string) {
		b.Run(name+"/upload", func(b *testing.B) { upload(b, src.NS, dst.IPv4, 7100) })
		b.Run(name+"/download", func(b *testing.B) { download(b, src.NS, dst.IPv4, 7101) })
	}
	run("direct")
	m1, m2 := startNode(b, c, n1, "--no-intercept", "--log-level", "info"), startNode(b, c, n2, "--no-intercept", "--log-level", "info")
	run("verbatim")
	m1.stop(syscall.SIGTERM)
	m2.stop(syscall.SIGTERM)
	startNode(b, c, n1, "--log-level", "info")
	startNode(b, c, n2, "--log-level", "info")
	run("passthrough")
}

const benchChunk = 1 << 20

func benchDial(b *testing.B, ns *cluster.NS, addr netip.Addr, port int) net.Conn {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := ns.Dial(ctx, "tcp", netip.AddrPortFrom(addr, uint16(port)).String())
	if err != nil {
		b.Fatalf("dial: %v", err)
	}
	return c
}

func upload(b *testing.B, ns *cluster.NS, addr netip.Addr, port int) {
	c := benchDial(b, ns, addr, port)
	defer c.Close()
	buf := make([]byte, benchChunk)
	b.SetBytes(benchChunk)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.Write(buf); err != nil {
			b.Fatal(err)
		}
	}
	// Wait until the receiver has everything: half-close and wait for its
	// close in return.
	c.(*net.TCPConn).CloseWrite()
	io.Copy(io.Discard, c)
	b.StopTimer()
}

func download(b *testing.B, ns *cluster.NS, addr netip.Addr, port int) {
	c := benchDial(b, ns, addr, port)
	defer c.Close()
	b.SetBytes(benchChunk)
	b.ResetTimer()
	if _, err := io.CopyN(io.Discard, c, int64(b.N)*benchChunk); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
}
