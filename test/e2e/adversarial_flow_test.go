package e2e

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
	"gvisor.dev/gvisor/pkg/tcpip"
	"gvisor.dev/gvisor/pkg/tcpip/checksum"
	"gvisor.dev/gvisor/pkg/tcpip/header"

	"github.com/meshtun/meshtun/bench/cluster"
)

// The adversarial flow tests attack the flow state of the data path: a
// spoofed RST, a proxy killed under a live connection, a SYN flood. Each
// captures the node-to-node link and asserts that a connection between
// mesh workloads never shows its bytes there in plaintext, and that the
// mesh keeps (or resumes) working.

// rawSender sends hand-built IPv4 packets from a namespace, source
// addresses included (IPPROTO_RAW: the kernel fills in only the IP
// checksum and length).
type rawSender struct{ fd int }

func newRawSender(t testing.TB, ns *cluster.NS) *rawSender {
	t.Helper()
	var fd int
	err := ns.Do(func() (err error) {
		fd, err = unix.Socket(unix.AF_INET, unix.SOCK_RAW|unix.SOCK_CLOEXEC, unix.IPPROTO_RAW)
		return err
	})
	if err != nil {
		t.Fatalf("raw socket in %s: %v", ns.Name(), err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	return &rawSender{fd: fd}
}

func (r *rawSender) send(pkt []byte) error {
	ip := header.IPv4(pkt)
	to := &unix.SockaddrInet4{Addr: ip.DestinationAddress().As4()}
	return unix.Sendto(r.fd, pkt, 0, to)
}

// tcpPacket builds an IPv4 TCP segment without payload, checksums
// complete.
func tcpPacket(src, dst netip.AddrPort, seq, ack uint32, flags header.TCPFlags) []byte {
	b := make([]byte, header.IPv4MinimumSize+header.TCPMinimumSize)
	s, d := tcpip.AddrFrom4(src.Addr().As4()), tcpip.AddrFrom4(dst.Addr().As4())
	ip := header.IPv4(b)
	ip.Encode(&header.IPv4Fields{
		TotalLength: uint16(len(b)), TTL: 64, Protocol: uint8(header.TCPProtocolNumber),
		Flags: header.IPv4FlagDontFragment, SrcAddr: s, DstAddr: d,
	})
	ip.SetChecksum(^ip.CalculateChecksum())
	th := header.TCP(b[header.IPv4MinimumSize:])
	th.Encode(&header.TCPFields{
		SrcPort: src.Port(), DstPort: dst.Port(), SeqNum: seq, AckNum: ack,
		DataOffset: header.TCPMinimumSize, Flags: flags, WindowSize: 65535,
	})
	xsum := header.PseudoHeaderChecksum(header.TCPProtocolNumber, s, d, header.TCPMinimumSize)
	th.SetChecksum(^checksum.Checksum(th, xsum))
	return b
}

// capture starts the fabric capture and proves it sees the wire: a
// plaintext marker sent from p11 to a pod outside the mesh (passthrough)
// must show up.
func (mc *meshCluster) capture(t *testing.T, port int) *sniffer {
	t.Helper()
	sn := sniff(t, mc.c.Fabric)
	serve(t, mc.p22, port, func(c net.Conn) { io.Copy(c, c) })
	cl := dial(t, mc.p11.NS, mc.p22.IPv4, port)
	probe := []byte(fmt.Sprintf("MESHTUN-CAPTURE-PROBE-%d", time.Now().UnixNano()))
	cl.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := cl.Write(probe); err != nil {
		t.Fatal(err)
	}
	if _, err := io.ReadFull(cl, make([]byte, len(probe))); err != nil {
		t.Fatal(err)
	}
	cl.Close()
	if !sn.waitSeen(probe, 5*time.Second) {
		t.Fatalf("the plaintext probe never showed in %d captured bytes: the capture does not see the wire", sn.captured())
	}
	return sn
}

// seenSince reports whether marker appeared in the frames captured after
// the first from bytes.
func (s *sniffer) seenSince(from int, marker []byte) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return bytes.Contains(s.data[from:], marker)
}

// echoLoop writes marker to c every interval and reads it back, until
// stop is closed or the connection fails; it returns the error (nil if
// stopped) and how many round trips succeeded.
func echoLoop(c net.Conn, marker []byte, interval time.Duration, stop <-chan struct{}) (int, error) {
	buf := make([]byte, len(marker))
	n := 0
	for {
		select {
		case <-stop:
			return n, nil
		case <-time.After(interval):
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := c.Write(marker); err != nil {
			return n, err
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			return n, err
		}
		if !bytes.Equal(buf, marker) {
			return n, fmt.Errorf("echo %q, want %q", buf, marker)
		}
		n++
	}
}

// TestAdversarialSpoofedRST: an attacker on the node-to-node link injects
// RSTs with the 4-tuple of a mesh connection but a guessed sequence
// number, towards both ends. The connection must go on through the mesh
// (or be reset), never continue in plaintext: before the fix, any RST
// closed the flow and, once its close grace ran out (15 s), the pod's
// next segments went out verbatim.
func TestAdversarialSpoofedRST(t *testing.T) {
	mc := newMeshCluster(t, "arst")
	mc.m1 = mc.start(t, mc.n1)
	mc.m2 = mc.start(t, mc.n2)
	sn := mc.capture(t, 7410)

	serve(t, mc.p21, 7411, func(c net.Conn) { io.Copy(c, c) })
	cl := dial(t, mc.p11.NS, mc.p21.IPv4, 7411)
	marker := []byte(fmt.Sprintf("MESHTUN-SECRET-RST-%d", time.Now().UnixNano()))
	// One round trip establishes the flow on both nodes.
	if err := roundTrip(cl, []byte("warm-up")); err != nil {
		t.Fatalf("mesh connection does not work before the attack: %v", err)
	}
	client, server := localAddr(cl), remoteAddr(cl)

	// Blind RSTs from the external host on the fabric, spread over the
	// sequence space, in both directions: towards the client (node 1
	// captures it) and towards the server (node 2).
	raw := newRawSender(t, mc.ext.NS)
	for i := range 64 {
		seq := uint32(i) << 26
		for _, p := range [][]byte{
			tcpPacket(server, client, seq, 0, header.TCPFlagRst),
			tcpPacket(client, server, seq, 0, header.TCPFlagRst),
		} {
			if err := raw.send(p); err != nil {
				t.Fatalf("inject RST: %v", err)
			}
		}
	}

	// Both nodes saw the RSTs and refused them.
	for _, n := range []*cluster.Node{mc.n1, mc.n2} {
		waitMetric(t, n, "meshtun_classifier_drops_total", map[string]string{"reason": "rst-out-of-window"}, 5*time.Second)
	}

	// Keep talking for longer than a closed flow's grace period and the
	// sweep interval: 15 s + 5 s.
	done := make(chan struct{})
	time.AfterFunc(22*time.Second, func() { close(done) })
	n, err := echoLoop(cl, marker, 200*time.Millisecond, done)
	if sn.seen(marker) {
		t.Fatalf("the marker crossed the node-to-node link in plaintext after a spoofed RST (%d round trips, then %v)", n, err)
	}
	switch {
	case err == nil:
		t.Logf("the connection went on through the mesh: %d round trips", n)
	case isReset(err):
		t.Logf("the connection was reset after %d round trips", n)
	default:
		t.Fatalf("the connection failed after %d round trips with %v, want it to go on or be reset", n, err)
	}
	// A new connection goes through the mesh.
	cl2 := dial(t, mc.p11.NS, mc.p21.IPv4, 7411)
	if err := roundTrip(cl2, marker); err != nil {
		t.Fatalf("new mesh connection after the attack: %v", err)
	}
	if sn.seen(marker) {
		t.Fatal("the marker crossed the node-to-node link in plaintext")
	}
}

// roundTrip writes b to c and reads it back.
func roundTrip(c net.Conn, b []byte) error {
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(b); err != nil {
		return err
	}
	got := make([]byte, len(b))
	if _, err := io.ReadFull(c, got); err != nil {
		return err
	}
	if !bytes.Equal(got, b) {
		return fmt.Errorf("echo %q, want %q", got, b)
	}
	return nil
}

// TestAdversarialProxyKilled: node 1's proxy is SIGKILLed in the middle of
// a mesh transfer while the pod keeps sending, and restarted. Nothing of
// the connection may cross the wire in plaintext while the proxy is down
// (fail-closed routing blocks it) nor after the restart: the restarted
// proxy resets the old connection's segments, the application sees the
// reset, and its new connection goes through the mesh. Before the fix the
// restarted proxy knew no flow and forwarded them verbatim.
func TestAdversarialProxyKilled(t *testing.T) {
	mc := newMeshCluster(t, "akill")
	cfgStart := func() nodeProc { return mc.start(t, mc.n1) }
	k := cfgStart()
	mc.m2 = mc.start(t, mc.n2)
	sn := mc.capture(t, 7420)

	serve(t, mc.p21, 7421, func(c net.Conn) { io.Copy(c, c) })
	cl := dial(t, mc.p11.NS, mc.p21.IPv4, 7421)
	marker := []byte(fmt.Sprintf("MESHTUN-SECRET-KILL-%d", time.Now().UnixNano()))
	if err := roundTrip(cl, marker); err != nil {
		t.Fatalf("mesh connection does not work before the kill: %v", err)
	}

	// The pod keeps sending, without waiting for echoes, all along.
	var sent atomic.Int64
	writeErr := make(chan error, 1)
	stopWriting := make(chan struct{})
	go func() {
		for {
			select {
			case <-stopWriting:
				writeErr <- nil
				return
			case <-time.After(50 * time.Millisecond):
			}
			cl.SetWriteDeadline(time.Now().Add(30 * time.Second))
			if _, err := cl.Write(marker); err != nil {
				writeErr <- err
				return
			}
			sent.Add(1)
		}
	}()
	go io.Copy(io.Discard, cl) // echoes, while they come

	time.Sleep(300 * time.Millisecond) // some transfer before the kill
	// While no proxy runs, captured traffic is blocked (the prohibit
	// route behind the TUN's), not routed around the missing TUN.
	k.stop(syscall.SIGKILL)
	downFrom := sn.captured()
	time.Sleep(time.Second) // down for a second, the pod still sending
	if sn.seenSince(downFrom, marker) {
		t.Fatalf("the marker crossed the node-to-node link in plaintext while the proxy was down")
	}
	r := cfgStart()
	mc.m1 = r
	upFrom := sn.captured()

	// After the restart: the pod's next segments are reset, its write
	// fails, and nothing of it shows in plaintext.
	var err error
	select {
	case err = <-writeErr:
	case <-time.After(40 * time.Second):
		close(stopWriting)
		err = <-writeErr
	}
	if sn.seenSince(upFrom, marker) {
		t.Fatalf("the marker crossed the node-to-node link in plaintext after the proxy restarted")
	}
	if err == nil || !isReset(err) && !errors.Is(err, syscall.EPIPE) {
		t.Fatalf("the pod's connection after the restart: %v, want a reset (sent %d writes)", err, sent.Load())
	}
	// The reset came from the restarted proxy, which met segments of a
	// flow it did not know.
	waitMetric(t, mc.n1, "meshtun_unknown_segments_intercepted_total", nil, 5*time.Second)
	// Reconnecting goes through the mesh.
	cl2 := dial(t, mc.p11.NS, mc.p21.IPv4, 7421)
	if err := roundTrip(cl2, marker); err != nil {
		t.Fatalf("new connection after the restart: %v", err)
	}
	cl2.Close()
	if sn.seenSince(upFrom, marker) {
		t.Fatalf("the marker crossed the node-to-node link in plaintext after the proxy restarted")
	}
	out := accessLog(t, r, cl2, "connection complete")
	wantFields(t, out, "route", "hbone")
}

// waitMetric waits until node n's metric name (summed over the series
// with labels) is above zero.
func waitMetric(t testing.TB, n *cluster.Node, name string, labels map[string]string, timeout time.Duration) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for value(scrape(t, n), name, labels) == 0 {
		if time.Now().After(deadline) {
			t.Fatalf("%s%v on %s is still 0 after %v", name, labels, n.Name(), timeout)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// synFlood sends SYNs to dst from random sources of the prefix src (whose
// addresses the node routes, so reverse-path filtering lets them in) at
// about rate per second until stop is closed. It returns how many it sent.
func synFlood(t testing.TB, from *cluster.NS, src netip.Prefix, dst netip.AddrPort, rate int, stop <-chan struct{}) <-chan int {
	raw := newRawSender(t, from)
	sent := make(chan int, 1)
	go func() {
		n := 0
		base := src.Addr().As4()
		tick := time.NewTicker(10 * time.Millisecond)
		defer tick.Stop()
		per := max(rate/100, 1)
		for {
			select {
			case <-stop:
				sent <- n
				return
			case <-tick.C:
			}
			for range per {
				a := base
				a[3] = byte(20 + rand.IntN(230)) // no pod there
				s := netip.AddrPortFrom(netip.AddrFrom4(a), uint16(1024+rand.IntN(60000)))
				if raw.send(tcpPacket(s, dst, rand.Uint32(), 0, header.TCPFlagSyn)) == nil {
					n++
				}
			}
		}
	}()
	return sent
}

// crr connects to dst from ns, exchanges one request and response and
// closes, again and again until stop; it counts the outcomes.
func crr(ns *cluster.NS, dst netip.AddrPort, payload []byte, stop <-chan struct{}, ok, failed *atomic.Int64) {
	for {
		select {
		case <-stop:
			return
		default:
		}
		ctx, cancel := context.WithTimeout(context.Background(), 3*time.Second)
		c, err := ns.Dial(ctx, "tcp", dst.String())
		cancel()
		if err == nil {
			err = roundTrip(c, payload)
			c.Close()
		}
		if err != nil {
			failed.Add(1)
			time.Sleep(10 * time.Millisecond)
			continue
		}
		ok.Add(1)
	}
}

// floodSetup is the SYN flood scenario: meshtun on both nodes (node 2
// with inbound HBONE on the netstack), an echo server on n2p1, the
// legitimate mesh client n1p1, the attacker n2p2 (outside the mesh)
// flooding n2p1's HBONE port from spoofed sources.
type floodSetup struct {
	mc     *meshCluster
	sn     *sniffer
	target netip.AddrPort // the legitimate client's server
	hbone  netip.AddrPort // the flood's target
	marker []byte
}

func newFloodSetup(t testing.TB, name string) *floodSetup {
	mc := newMeshCluster(t, name)
	mc.m1 = mc.start(t, mc.n1)
	// Inbound HBONE on the netstack: with the kernel socket (the
	// default), SYNs to :15008 never reach the TUN and the kernel's own
	// SYN cookies take the flood; the netstack path is the fallback when
	// the kernel socket cannot be set up, and the one under test here.
	mc.m2 = mc.start(t, mc.n2, "--hbone-netstack")
	f := &floodSetup{mc: mc, target: netip.AddrPortFrom(mc.p21.IPv4, 7431), hbone: netip.AddrPortFrom(mc.p21.IPv4, 15008)}
	serve(t, mc.p21, 7431, func(c net.Conn) { io.Copy(c, c) })
	f.marker = []byte(fmt.Sprintf("MESHTUN-SECRET-FLOOD-%d", time.Now().UnixNano()))
	return f
}

// measure runs the legitimate client for d, with or without the flood,
// and returns its successful and failed connections.
func (f *floodSetup) measure(t testing.TB, d time.Duration, rate int) (ok, failed int64, syns int) {
	var okN, failN atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var sent <-chan int
	if rate > 0 {
		sent = synFlood(t, f.mc.p22.NS, netip.MustParsePrefix("198.18.1.0/24"), f.hbone, rate, stop)
	}
	wg.Add(1)
	go func() { defer wg.Done(); crr(f.mc.p11.NS, f.target, f.marker, stop, &okN, &failN) }()
	time.Sleep(d)
	close(stop)
	wg.Wait()
	if sent != nil {
		syns = <-sent
	}
	return okN.Load(), failN.Load(), syns
}

// TestAdversarialSYNFlood: while a pod floods a mesh workload's HBONE port
// with spoofed SYNs, a legitimate mesh client keeps connecting to that
// workload and keeps succeeding, and once the flood ends the flow table
// drains back. Before the fix the flood filled the table (a SYN-ACK made a
// flow established for 24 h), and the destination node could register no
// new flow: the legitimate client's connections failed.
func TestAdversarialSYNFlood(t *testing.T) {
	f := newFloodSetup(t, "asyn")
	f.sn = f.mc.capture(t, 7430)
	ok0, failed0, _ := f.measure(t, 2*time.Second, 0)
	if ok0 == 0 {
		t.Fatalf("the legitimate client made no connection before the flood (%d failed)", failed0)
	}
	// 20,000 SYN/s for 8 s: three times the 65,536-flow table.
	var okN, failN atomic.Int64
	stop := make(chan struct{})
	sent := synFlood(t, f.mc.p22.NS, netip.MustParsePrefix("198.18.1.0/24"), f.hbone, 20000, stop)
	done := make(chan struct{})
	go func() { defer close(done); crr(f.mc.p11.NS, f.target, f.marker, stop, &okN, &failN) }()
	// Once a second: the client must have succeeded in every second of
	// the flood after the first.
	var stalls []int
	last := int64(0)
	for s := range 8 {
		time.Sleep(time.Second)
		now := okN.Load()
		if s > 0 && now == last {
			stalls = append(stalls, s)
		}
		last = now
	}
	close(stop)
	<-done
	syns := <-sent
	fams := scrape(t, f.mc.n2)
	t.Logf("unloaded: %d ok / %d failed in 2 s; flood: %d SYNs sent, client %d ok / %d failed in 8 s; node 2 flows %v, drops %v",
		ok0, failed0, syns, okN.Load(), failN.Load(), value(fams, "meshtun_flows", nil), value(fams, "meshtun_classifier_drops_total", nil))
	if half := value(fams, "meshtun_flows_half_open", nil); half > 65536/4 {
		t.Errorf("node 2 holds %v half-open flows, above its bound of %d", half, 65536/4)
	}
	if v := value(fams, "meshtun_classifier_drops_total", map[string]string{"reason": "half-open-full"}) +
		value(fams, "meshtun_classifier_drops_total", map[string]string{"reason": "half-open-per-source"}); v == 0 {
		t.Errorf("node 2 dropped no SYN for its half-open bounds: the flood did not reach them")
	}
	if syns < 50000 {
		t.Logf("only %d SYNs sent: the machine is too busy for a full flood", syns)
	}
	if len(stalls) > 0 {
		t.Errorf("the legitimate client made no connection in seconds %v of the flood", stalls)
	}
	if f.sn.seen(f.marker) {
		t.Fatal("the marker crossed the node-to-node link in plaintext")
	}
	// The table drains: half-open flows expire in seconds, and a new
	// connection works at once.
	deadline := time.Now().Add(30 * time.Second)
	for {
		flows := value(scrape(t, f.mc.n2), "meshtun_flows", nil)
		if flows < 1000 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("node 2 still has %v flows 30 s after the flood: the table is stuck", flows)
		}
		time.Sleep(time.Second)
	}
	if err := roundTrip(dial(t, f.mc.p11.NS, f.target.Addr(), int(f.target.Port())), f.marker); err != nil {
		t.Fatalf("connection after the flood: %v", err)
	}
}

// BenchmarkSYNFloodCRR measures the connect+request+close rate of a
// legitimate mesh client (n1p1 → n2p1) unloaded and while n2p2 sends
// 20,000 spoofed SYN/s to n2p1's HBONE port (on the netstack: see
// newFloodSetup), in the same run, and reports
// both and their ratio (the goal is ≥ 50 %). Run it on its own:
//
//	go test -run '^$' -bench SYNFloodCRR -benchtime 1x ./test/e2e
func BenchmarkSYNFloodCRR(b *testing.B) {
	f := newFloodSetup(b, "bsyn")
	const d = 5 * time.Second
	var okU, okF int64
	var syns int
	for range b.N {
		u, _, _ := f.measure(b, d, 0)
		l, _, s := f.measure(b, d, 20000)
		okU += u
		okF += l
		syns += s
	}
	unloaded := float64(okU) / d.Seconds() / float64(b.N)
	loaded := float64(okF) / d.Seconds() / float64(b.N)
	b.ReportMetric(unloaded, "crr/s-unloaded")
	b.ReportMetric(loaded, "crr/s-flood")
	b.ReportMetric(float64(syns)/d.Seconds()/float64(b.N), "syn/s")
	if unloaded > 0 {
		b.ReportMetric(loaded/unloaded, "ratio")
	}
}
