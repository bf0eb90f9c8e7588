package e2e

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"

	"github.com/meshtun/meshtun/bench/cluster"
)

// listenPacket opens a packet socket inside ns.
func listenPacket(t testing.TB, ns *cluster.NS, network, addr string) net.PacketConn {
	t.Helper()
	pc, err := ns.ListenPacket(network, addr)
	if err != nil {
		t.Fatalf("listen %s %s in %s: %v", network, addr, ns.Name(), err)
	}
	t.Cleanup(func() { pc.Close() })
	return pc
}

// udpEcho sends a datagram from client to dst:9001 where an echo server in
// srv answers with the payload and the source address it saw. Verbatim
// forwarding must keep both addresses.
func udpEcho(t testing.TB, client *cluster.NS, src netip.Addr, srv *cluster.NS, dst netip.Addr, port int) {
	t.Helper()
	sp := listenPacket(t, srv, "udp", fmt.Sprintf(":%d", port))
	go func() {
		buf := make([]byte, 2048)
		for {
			n, from, err := sp.ReadFrom(buf)
			if err != nil {
				return
			}
			sp.WriteTo(append(buf[:n:n], []byte(" from "+from.String())...), from)
		}
	}()
	cp := listenPacket(t, client, "udp", ":0")
	to := net.UDPAddrFromAddrPort(netip.AddrPortFrom(dst, uint16(port)))
	cp.SetReadDeadline(time.Now().Add(5 * time.Second))
	var reply []byte
	var from net.Addr
	buf := make([]byte, 2048)
	for attempt := 0; ; attempt++ {
		if _, err := cp.WriteTo([]byte("question"), to); err != nil {
			t.Fatalf("UDP send to %s: %v", to, err)
		}
		cp.SetReadDeadline(time.Now().Add(time.Second))
		n, f, err := cp.ReadFrom(buf)
		if err == nil {
			reply, from = buf[:n], f
			break
		}
		if attempt == 4 {
			t.Fatalf("no UDP reply from %s: %v", to, err)
		}
	}
	if got := from.(*net.UDPAddr).AddrPort().Addr().Unmap(); got != dst {
		t.Errorf("reply came from %s, want %s", got, dst)
	}
	// The server must have seen the client's own address: verbatim
	// forwarding changes neither address nor port.
	want := fmt.Sprintf("question from %s", netip.AddrPortFrom(src, uint16(cp.LocalAddr().(*net.UDPAddr).Port)))
	if got := string(reply); got != want {
		t.Fatalf("reply %q, want %q", got, want)
	}
}

// udpBurst sends count datagrams as fast as the receiver takes them, with
// at most burstWindow in flight (less than the TUN's queue of 5000, so a
// CPU-starved reader cannot make the queue overflow), and checks that every
// one arrives intact.
func udpBurst(t testing.TB, client, srv *cluster.NS, dst netip.Addr, count int) {
	t.Helper()
	const burstWindow = 1000
	sp := listenPacket(t, srv, "udp", ":9002")
	setRcvBuf(t, sp, 64<<20)
	cp := listenPacket(t, client, "udp", ":0")
	to := net.UDPAddrFromAddrPort(netip.AddrPortFrom(dst, 9002))
	var received atomic.Int64
	progress := make(chan struct{}, 1)
	done := make(chan []bool, 1)
	go func() {
		seen := make([]bool, count)
		intact := 0
		buf := make([]byte, 2048)
		for {
			sp.SetReadDeadline(time.Now().Add(3 * time.Second))
			n, _, err := sp.ReadFrom(buf)
			if err != nil {
				done <- seen
				return
			}
			received.Add(1)
			select {
			case progress <- struct{}{}:
			default:
			}
			if n != 64 {
				continue
			}
			i := binary.BigEndian.Uint32(buf)
			if int(i) < count && !seen[i] && bytes.Equal(buf[4:n], payload(i)[4:]) {
				seen[i] = true
				if intact++; intact == count {
					done <- seen
					return
				}
			}
		}
	}()
	for i := uint32(0); i < uint32(count); i++ {
		for int64(i)-received.Load() >= burstWindow {
			select {
			case <-progress:
			case <-time.After(3 * time.Second):
				t.Fatalf("receiver stalled: %d sent, %d received", i, received.Load())
			}
		}
		if _, err := cp.WriteTo(payload(i), to); err != nil {
			t.Fatalf("send datagram %d: %v", i, err)
		}
	}
	seen := <-done
	got := 0
	for _, s := range seen {
		if s {
			got++
		}
	}
	if got != count {
		t.Fatalf("%d of %d datagrams arrived intact\nreceiver UDP counters: %s\nsender UDP counters: %s\nsoftnet_stat (per CPU, hex: processed dropped squeezed):\n%s",
			got, count, udpCounters(srv), udpCounters(client), softnet())
	}
}

func payload(i uint32) []byte {
	b := make([]byte, 64)
	binary.BigEndian.PutUint32(b, i)
	for j := 4; j < len(b); j++ {
		b[j] = byte(int(i) + j)
	}
	return b
}

func setRcvBuf(t testing.TB, pc net.PacketConn, size int) {
	t.Helper()
	sc, err := pc.(syscall.Conn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	var serr error
	sc.Control(func(fd uintptr) {
		serr = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUFFORCE, size)
	})
	if serr != nil {
		t.Fatalf("SO_RCVBUFFORCE: %v", serr)
	}
}

// ping sends an ICMP (or ICMPv6) echo request from ns to dst and waits for
// the reply.
func ping(t testing.TB, ns *cluster.NS, dst netip.Addr) {
	t.Helper()
	network, laddr, typ, proto := "ip4:icmp", "0.0.0.0", icmp.Type(ipv4.ICMPTypeEcho), 1
	if dst.Is6() {
		network, laddr, typ, proto = "ip6:ipv6-icmp", "::", ipv6.ICMPTypeEchoRequest, 58
	}
	var pc *icmp.PacketConn
	if err := ns.Do(func() (err error) {
		pc, err = icmp.ListenPacket(network, laddr)
		return err
	}); err != nil {
		t.Fatalf("ICMP socket in %s: %v", ns.Name(), err)
	}
	defer pc.Close()
	id := os.Getpid() & 0xffff
	msg := icmp.Message{Type: typ, Body: &icmp.Echo{ID: id, Seq: 1, Data: []byte("meshtun")}}
	wb, err := msg.Marshal(nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := pc.WriteTo(wb, &net.IPAddr{IP: dst.AsSlice()}); err != nil {
		t.Fatalf("ICMP echo to %s: %v", dst, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	buf := make([]byte, 1500)
	for {
		pc.SetReadDeadline(deadline)
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			t.Fatalf("no ICMP echo reply from %s: %v", dst, err)
		}
		rm, err := icmp.ParseMessage(proto, buf[:n])
		if err != nil {
			continue
		}
		echo, ok := rm.Body.(*icmp.Echo)
		if !ok || echo.ID != id || (rm.Type != ipv4.ICMPTypeEchoReply && rm.Type != ipv6.ICMPTypeEchoReply) {
			continue
		}
		if got, _ := netip.AddrFromSlice(from.(*net.IPAddr).IP); got.Unmap() != dst {
			t.Fatalf("echo reply from %s, want %s", got, dst)
		}
		if string(echo.Data) != "meshtun" {
			t.Fatalf("echo reply data %q", echo.Data)
		}
		return
	}
}

// rawProto sends IPv4 packets of protocol 253 (reserved for experiments,
// unknown to meshtun) from src to dst and checks that the receiver gets
// every byte as sent except what a router may change: the TTL, which must
// be down by exactly hops (each node one hop, as without meshtun), and the
// header checksum, which must be valid for the new TTL.
func rawProto(t testing.TB, client, srv *cluster.NS, src, dst netip.Addr, hops int) {
	t.Helper()
	var rc *ipv4.RawConn
	if err := srv.Do(func() error {
		pc, err := net.ListenPacket("ip4:253", "0.0.0.0")
		if err != nil {
			return err
		}
		rc, err = ipv4.NewRawConn(pc)
		return err
	}); err != nil {
		t.Fatalf("raw socket in %s: %v", srv.Name(), err)
	}
	defer rc.Close()
	var sc *ipv4.RawConn
	if err := client.Do(func() error {
		pc, err := net.ListenPacket("ip4:253", src.String())
		if err != nil {
			return err
		}
		sc, err = ipv4.NewRawConn(pc)
		return err
	}); err != nil {
		t.Fatalf("raw socket in %s: %v", client.Name(), err)
	}
	defer sc.Close()
	const ttl = 64
	for i := 0; i < 3; i++ {
		body := []byte(fmt.Sprintf("protocol 253 payload %d \x00\xff", i))
		// DSCP EF (ECN bits clear: a router may set CE) and DF: fields a
		// forwarder has no business changing.
		h := &ipv4.Header{Version: 4, Len: ipv4.HeaderLen, TOS: 0xb8, TotalLen: ipv4.HeaderLen + len(body), ID: 0x4d00 + i,
			Flags: ipv4.DontFragment, TTL: ttl, Protocol: 253, Src: src.AsSlice(), Dst: dst.AsSlice()}
		want, err := h.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, body...)
		if err := sc.WriteTo(h, body, nil); err != nil {
			t.Fatalf("send protocol 253: %v", err)
		}
		buf := make([]byte, 1500)
		for {
			rc.SetReadDeadline(time.Now().Add(5 * time.Second))
			rh, p, _, err := rc.ReadFrom(buf)
			if err != nil {
				t.Fatalf("protocol 253 packet %d did not arrive: %v", i, err)
			}
			if rh.ID != h.ID {
				continue
			}
			got := buf[:rh.Len+len(p)]
			if len(got) != len(want) {
				t.Fatalf("packet %d arrived with %d bytes, sent %d:\n got  % x\n sent % x", i, len(got), len(want), got, want)
			}
			for j := range got {
				// TTL (8) and header checksum (10, 11) are a router's.
				if j != 8 && j != 10 && j != 11 && got[j] != want[j] {
					t.Fatalf("packet %d: byte %d is %#02x, sent %#02x:\n got  % x\n sent % x", i, j, got[j], want[j], got, want)
				}
			}
			if got[8] != ttl-byte(hops) {
				t.Fatalf("packet %d arrived with TTL %d, sent %d: want %d (%d hops, one per node)", i, got[8], ttl, ttl-hops, hops)
			}
			if ipChecksum(got[:rh.Len]) != 0 {
				t.Fatalf("packet %d arrived with a wrong header checksum: % x", i, got[:rh.Len])
			}
			break
		}
	}
}

// ipChecksum is the Internet checksum of b: 0 over a header whose
// checksum field is right.
func ipChecksum(b []byte) uint16 {
	var sum uint32
	for i := 0; i+1 < len(b); i += 2 {
		sum += uint32(b[i])<<8 | uint32(b[i+1])
	}
	if len(b)%2 == 1 {
		sum += uint32(b[len(b)-1]) << 8
	}
	for sum > 0xffff {
		sum = sum&0xffff + sum>>16
	}
	return ^uint16(sum)
}

// udpCounters returns the Udp line pair of /proc/net/snmp in ns.
func udpCounters(ns *cluster.NS) string {
	var out string
	ns.Do(func() error {
		b, err := os.ReadFile("/proc/thread-self/net/snmp")
		if err != nil {
			out = err.Error()
			return nil
		}
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "Udp:") {
				out += "\n  " + l
			}
		}
		return nil
	})
	return out
}

func softnet() string {
	b, _ := os.ReadFile("/proc/net/softnet_stat")
	var out string
	for _, l := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		f := strings.Fields(l)
		if len(f) >= 3 {
			out += "  " + strings.Join(f[:3], " ") + "\n"
		}
	}
	return out
}

// udpHops sends datagrams from client to dst with 3 hops left (TTL or hop
// limit) and returns the hops left on arrival at srv: pod → node 1 → node
// 2 → pod crosses two routers, so 1 if each node counts as one hop, as it
// does without meshtun; the datagram is lost if a node takes two.
func udpHops(t testing.TB, client, srv *cluster.NS, dst netip.Addr, port int) int {
	t.Helper()
	network := "udp4"
	if dst.Is6() {
		network = "udp6"
	}
	sp := listenPacket(t, srv, network, fmt.Sprintf(":%d", port))
	cp := listenPacket(t, client, network, ":0")
	to := net.UDPAddrFromAddrPort(netip.AddrPortFrom(dst, uint16(port)))
	var send func() error
	var recv func() (int, error)
	if dst.Is4() {
		c4, s4 := ipv4.NewPacketConn(cp), ipv4.NewPacketConn(sp)
		if err := errors.Join(c4.SetTTL(3), s4.SetControlMessage(ipv4.FlagTTL, true)); err != nil {
			t.Fatal(err)
		}
		send = func() error { _, err := c4.WriteTo([]byte("hops"), nil, to); return err }
		recv = func() (int, error) {
			_, cm, _, err := s4.ReadFrom(make([]byte, 64))
			if err != nil || cm == nil {
				return 0, errors.Join(err, errors.New("no TTL control message"))
			}
			return cm.TTL, nil
		}
	} else {
		c6, s6 := ipv6.NewPacketConn(cp), ipv6.NewPacketConn(sp)
		if err := errors.Join(c6.SetHopLimit(3), s6.SetControlMessage(ipv6.FlagHopLimit, true)); err != nil {
			t.Fatal(err)
		}
		send = func() error { _, err := c6.WriteTo([]byte("hops"), nil, to); return err }
		recv = func() (int, error) {
			_, cm, _, err := s6.ReadFrom(make([]byte, 64))
			if err != nil || cm == nil {
				return 0, errors.Join(err, errors.New("no hop limit control message"))
			}
			return cm.HopLimit, nil
		}
	}
	for attempt := 0; ; attempt++ {
		if err := send(); err != nil {
			t.Fatalf("UDP send to %s: %v", to, err)
		}
		sp.SetReadDeadline(time.Now().Add(time.Second))
		hops, err := recv()
		if err == nil {
			return hops
		}
		if attempt == 2 {
			t.Fatalf("no datagram with 3 hops left reached %s: %v", to, err)
		}
	}
}

// sendFragments sends from src to dst, through a raw socket in ns, the
// IPv4 fragments of one datagram of protocol proto whose transport part
// is first (sent with More Fragments; a multiple of 8 bytes) followed by
// rest (sent at first's offset). id is the datagram's IP ID.
func sendFragments(t testing.TB, ns *cluster.NS, proto int, src, dst netip.Addr, id int, first, rest []byte) {
	t.Helper()
	if len(first)%8 != 0 {
		t.Fatalf("first fragment of %d bytes: want a multiple of 8", len(first))
	}
	var rc *ipv4.RawConn
	if err := ns.Do(func() error {
		pc, err := net.ListenPacket(fmt.Sprintf("ip4:%d", proto), src.String())
		if err != nil {
			return err
		}
		rc, err = ipv4.NewRawConn(pc)
		return err
	}); err != nil {
		t.Fatalf("raw socket in %s: %v", ns.Name(), err)
	}
	defer rc.Close()
	for _, f := range []struct {
		b     []byte
		flags ipv4.HeaderFlags
		off   int
	}{{first, ipv4.MoreFragments, 0}, {rest, 0, len(first) / 8}} {
		h := &ipv4.Header{Version: 4, Len: ipv4.HeaderLen, TotalLen: ipv4.HeaderLen + len(f.b), ID: id,
			Flags: f.flags, FragOff: f.off, TTL: 64, Protocol: proto, Src: src.AsSlice(), Dst: dst.AsSlice()}
		if err := rc.WriteTo(h, f.b, nil); err != nil {
			t.Fatalf("send fragment (protocol %d, offset %d): %v", proto, f.off*8, err)
		}
	}
}

// fragmentedTCP sends a TCP segment from src to dst in two IPv4
// fragments, the marker in the second.
func fragmentedTCP(t testing.TB, ns *cluster.NS, src, dst netip.AddrPort, marker []byte) {
	t.Helper()
	first := make([]byte, 24) // the TCP header and 4 bytes of payload
	binary.BigEndian.PutUint16(first[0:], src.Port())
	binary.BigEndian.PutUint16(first[2:], dst.Port())
	binary.BigEndian.PutUint32(first[4:], 1)
	first[12] = 5 << 4 // data offset: 20 bytes
	first[13] = 0x02   // SYN
	first[14], first[15] = 0xff, 0xff
	copy(first[20:], "frag")
	sendFragments(t, ns, syscall.IPPROTO_TCP, src.Addr(), dst.Addr(), 0x6d01, first, marker)
}

// fragmentedUDP sends a UDP datagram from src to dst in two IPv4
// fragments, the marker in the second; the UDP checksum is 0 (none), so
// the receiver's reassembly delivers it.
func fragmentedUDP(t testing.TB, ns *cluster.NS, src, dst netip.AddrPort, marker []byte) {
	t.Helper()
	first := make([]byte, 24) // the UDP header and 16 bytes of data
	binary.BigEndian.PutUint16(first[0:], src.Port())
	binary.BigEndian.PutUint16(first[2:], dst.Port())
	binary.BigEndian.PutUint16(first[4:], uint16(len(first)+len(marker)))
	copy(first[8:], "fragmented udp: ")
	sendFragments(t, ns, syscall.IPPROTO_UDP, src.Addr(), dst.Addr(), 0x6d02, first, marker)
}
