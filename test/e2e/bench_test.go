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

// BenchmarkPaths compares, in one run, a pod on node 1 talking to a pod on
// node 2 over four paths:
//
//	direct      the kernel alone (no meshtun)
//	verbatim    meshtun on both nodes, every packet through the TUN and
//	            written back (--no-intercept)
//	passthrough meshtun on both nodes, the destination outside the mesh:
//	            the flow terminated in node 1's netstack, sent on by a
//	            kernel socket
//	mesh        meshtun on both nodes, both pods in the mesh: HBONE (mTLS,
//	            HTTP/2) from node 1 to node 2
//
// and for each: one TCP stream's throughput each way (MB/s), the round
// trip of a 64-byte request/response on an open connection (ns/op), and
// connect + request + response + close (ns/op).
//
// Run: go test -run '^$' -bench Paths -benchtime 2s ./test/e2e
// Compare the paths with each other; absolute figures drift on a shared
// machine, ratios hold.
func BenchmarkPaths(b *testing.B) {
	c := cluster.NewT(b, cluster.Spec{Name: "bt", Nodes: 2, PodsPerNode: 2, NoExternal: true})
	n1, n2 := c.Nodes[0], c.Nodes[1]
	src, meshDst, plainDst := n1.Pods[0], n2.Pods[0], n2.Pods[1]
	outside := map[string]bool{plainDst.ID: true}
	for _, dst := range []*cluster.Pod{meshDst, plainDst} {
		serve(b, dst, 7100, func(c net.Conn) { io.Copy(io.Discard, c) })
		serve(b, dst, 7101, func(c net.Conn) {
			buf := make([]byte, 256<<10)
			for {
				if _, err := c.Write(buf); err != nil {
					return
				}
			}
		})
		serve(b, dst, 7102, func(c net.Conn) { io.Copy(c, c) })
	}
	run := func(name string, dst *cluster.Pod) {
		b.Run(name+"/upload", func(b *testing.B) { upload(b, src.NS, dst.IPv4, 7100) })
		b.Run(name+"/download", func(b *testing.B) { download(b, src.NS, dst.IPv4, 7101) })
		b.Run(name+"/rr", func(b *testing.B) { requestResponse(b, src.NS, dst.IPv4, 7102) })
		b.Run(name+"/crr", func(b *testing.B) { connectRequestResponse(b, src.NS, dst.IPv4, 7102) })
	}
	run("direct", meshDst)
	m1 := startMeshNode(b, c, n1, outside, nil, "--no-intercept", "--log-level", "info")
	m2 := startMeshNode(b, c, n2, outside, nil, "--no-intercept", "--log-level", "info")
	run("verbatim", meshDst)
	m1.stop(syscall.SIGTERM)
	m2.stop(syscall.SIGTERM)
	startMeshNode(b, c, n1, outside, nil, "--log-level", "info")
	startMeshNode(b, c, n2, outside, nil, "--log-level", "info")
	run("passthrough", plainDst)
	run("mesh", meshDst)
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

func requestResponse(b *testing.B, ns *cluster.NS, addr netip.Addr, port int) {
	c := benchDial(b, ns, addr, port)
	defer c.Close()
	msg := make([]byte, 64)
	reply := make([]byte, 64)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.Write(msg); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, reply); err != nil {
			b.Fatal(err)
		}
	}
}

func connectRequestResponse(b *testing.B, ns *cluster.NS, addr netip.Addr, port int) {
	msg := make([]byte, 64)
	reply := make([]byte, 64)
	for i := 0; i < b.N; i++ {
		c := benchDial(b, ns, addr, port)
		if _, err := c.Write(msg); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, reply); err != nil {
			b.Fatal(err)
		}
		c.Close()
	}
}
