package e2e

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/ipv4"

	"github.com/meshtun/meshtun/bench/cluster"
)

// TestVerbatimUDPCoalesced: a fast stream of datagrams from a pod to a pod
// on the other node, IPv4 and IPv6, sent 64 per sendmmsg: node 1 writes
// those its TUN queued back to back as UDP GSO super-packets
// (meshtun_verbatim_udp_coalesced_total grows), and every datagram arrives
// intact, with its own length, also the shorter ones that end a
// super-packet.
func TestVerbatimUDPCoalesced(t *testing.T) {
	mc := newMeshCluster(t, "ug")
	mc.m1 = mc.start(t, mc.n1)
	mc.m2 = mc.start(t, mc.n2)
	coalesced := func() float64 {
		return value(scrape(t, mc.n1), "meshtun_verbatim_udp_coalesced_total", nil)
	}
	for i, dst := range []netip.Addr{mc.p21.IPv4, mc.p21.IPv6} {
		t.Run(fmt.Sprint(dst), func(t *testing.T) {
			before := coalesced()
			udpStream(t, mc.p11.NS, mc.p21.NS, netip.AddrPortFrom(dst, uint16(9301+i)), 20000)
			after := coalesced()
			t.Logf("node 1 wrote %v of 20000 datagrams back in super-packets", after-before)
			if after <= before {
				t.Errorf("node 1 coalesced no datagram (%v before, %v after)", before, after)
			}
		})
	}
}

// streamSize is the length of datagram i of udpStream: mostly 1200 bytes,
// every 37th 600.
func streamSize(i uint32) int {
	if i%37 == 36 {
		return 600
	}
	return 1200
}

// streamFill writes datagram i's content into b (streamSize(i) bytes).
func streamFill(b []byte, i uint32) {
	binary.BigEndian.PutUint32(b, i)
	for j := 4; j < len(b); j++ {
		b[j] = byte(uint32(j)*31 + i)
	}
}

// udpStream sends count datagrams from ns client to dst in server ns,
// batches of 64 per sendmmsg with at most 2000 not yet received, and fails
// unless each arrives once, intact.
func udpStream(t *testing.T, client, server *cluster.NS, dst netip.AddrPort, count int) {
	t.Helper()
	const window, batch = 2000, 64
	sp, err := server.ListenPacket("udp", fmt.Sprintf(":%d", dst.Port()))
	if err != nil {
		t.Fatal(err)
	}
	defer sp.Close()
	setRcvBuf(t, sp, 64<<20)
	cp, err := client.ListenPacket("udp", ":0")
	if err != nil {
		t.Fatal(err)
	}
	defer cp.Close()
	var received, bad atomic.Int64
	progress := make(chan struct{}, 1)
	done := make(chan []bool, 1)
	go func() {
		seen := make([]bool, count)
		buf := make([]byte, 2048)
		for n := 0; n < count; {
			sp.SetReadDeadline(time.Now().Add(5 * time.Second))
			l, _, err := sp.ReadFrom(buf)
			if err != nil {
				break
			}
			received.Add(1)
			select {
			case progress <- struct{}{}:
			default:
			}
			i := binary.BigEndian.Uint32(buf)
			want := make([]byte, streamSize(i))
			streamFill(want, i)
			if int(i) >= count || l != len(want) || string(buf[:l]) != string(want) || seen[i] {
				bad.Add(1)
				continue
			}
			seen[i] = true
			n++
		}
		done <- seen
	}()
	pc := ipv4.NewPacketConn(cp) // WriteBatch is sendmmsg for IPv6 too
	to := net.UDPAddrFromAddrPort(dst)
	msgs := make([]ipv4.Message, batch)
	for j := range msgs {
		msgs[j].Buffers = [][]byte{make([]byte, 1200)}
		msgs[j].Addr = to
	}
	for i := uint32(0); i < uint32(count); {
		for int64(i)-received.Load() >= window {
			select {
			case <-progress:
			case <-time.After(5 * time.Second):
				t.Fatalf("receiver stalled: %d sent, %d received", i, received.Load())
			}
		}
		k := min(batch, count-int(i))
		for j := range k {
			b := msgs[j].Buffers[0][:streamSize(i+uint32(j))] // capacity 1200
			streamFill(b, i+uint32(j))
			msgs[j].Buffers[0] = b
		}
		n, err := pc.WriteBatch(msgs[:k], 0)
		if err != nil {
			t.Fatalf("sendmmsg at datagram %d: %v", i, err)
		}
		i += uint32(n)
	}
	seen := <-done
	got := 0
	for _, s := range seen {
		if s {
			got++
		}
	}
	if got != count || bad.Load() != 0 {
		t.Fatalf("%d of %d datagrams arrived intact, %d damaged or duplicated", got, count, bad.Load())
	}
}
