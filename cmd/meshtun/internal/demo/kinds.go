package demo

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"time"

	"golang.org/x/net/icmp"
	"golang.org/x/net/ipv4"
	"golang.org/x/net/ipv6"

	"github.com/meshtun/meshtun/bench/cluster"
)

// Kind is what a flow exchanges.
type Kind string

// The kinds of flow.
const (
	// TCPEcho sends a line to the echo service and expects it back.
	TCPEcho Kind = "tcp-echo"
	// ServerFirst reads the banner service's greeting, then says HELO.
	ServerFirst Kind = "server-first"
	// UDPQuery asks the DNS-like service for a name.
	UDPQuery Kind = "udp-query"
	// Ping sends an ICMP echo request.
	Ping Kind = "ping"
)

// Protocol is the IP protocol of the kind.
func (k Kind) Protocol() string {
	switch k {
	case UDPQuery:
		return "udp"
	case Ping:
		return "icmp"
	}
	return "tcp"
}

// Port is the destination port of the kind, 0 for ICMP.
func (k Kind) Port() int {
	switch k {
	case TCPEcho:
		return echoPort
	case ServerFirst:
		return bannerPort
	case UDPQuery:
		return dnsPort
	}
	return 0
}

// exchange is what the client saw of a flow.
type exchange struct {
	local      netip.AddrPort // the client's address; zero for ICMP
	sent, recv int64
	latency    time.Duration
	err        error
}

// drive runs one flow of kind k from ns (source address src) to dst,
// carrying marker in its payload, until ctx's deadline.
func (k Kind) drive(ctx context.Context, ns *cluster.NS, src, dst netip.Addr, marker string) exchange {
	start := time.Now()
	var x exchange
	switch k {
	case TCPEcho, ServerFirst:
		x = tcpFlow(ctx, ns, src, netip.AddrPortFrom(dst, uint16(k.Port())), marker, k == ServerFirst)
	case UDPQuery:
		x = udpQuery(ctx, ns, src, netip.AddrPortFrom(dst, uint16(k.Port())), marker)
	case Ping:
		x = ping(ctx, ns, dst, marker)
	default:
		x.err = fmt.Errorf("unknown flow kind %q", k)
	}
	x.latency = time.Since(start)
	return x
}

// tcpFlow connects from src to dst and either echoes a line (reading
// everything back until the server closes) or, serverFirst, reads the
// greeting, says HELO and reads the answer.
func tcpFlow(ctx context.Context, ns *cluster.NS, src netip.Addr, dst netip.AddrPort, marker string, serverFirst bool) (x exchange) {
	c, local, err := dialFrom(ctx, ns, src, dst)
	x.local = local
	if err != nil {
		x.err = err
		return x
	}
	defer c.Close()
	if dl, ok := ctx.Deadline(); ok {
		c.SetDeadline(dl)
	}
	r := bufio.NewReader(c)
	count := func(s string, err error) (string, error) {
		x.recv += int64(len(s))
		return s, err
	}
	send := func(s string) error {
		n, err := io.WriteString(c, s)
		x.sent += int64(n)
		return err
	}
	if !serverFirst {
		msg := "hello " + marker + "\n"
		if err := send(msg); err != nil {
			x.err = fmt.Errorf("send: %w", err)
			return x
		}
		c.(*net.TCPConn).CloseWrite()
		got, err := io.ReadAll(r)
		x.recv = int64(len(got))
		switch {
		case err != nil:
			x.err = fmt.Errorf("read echo: %w", err)
		case string(got) != msg:
			x.err = fmt.Errorf("echo returned %q, want %q", got, msg)
		}
		return x
	}
	greeting, err := count(r.ReadString('\n'))
	if err != nil {
		x.err = fmt.Errorf("read greeting: %w", err)
		return x
	}
	if !strings.HasPrefix(greeting, "220 ") {
		x.err = fmt.Errorf("greeting %q, want 220", greeting)
		return x
	}
	if err := send("HELO " + marker + "\r\n"); err != nil {
		x.err = fmt.Errorf("send HELO: %w", err)
		return x
	}
	reply, err := count(r.ReadString('\n'))
	if err != nil {
		x.err = fmt.Errorf("read HELO reply: %w", err)
		return x
	}
	if want := "250 banner.demo hello " + marker + "\r\n"; reply != want {
		x.err = fmt.Errorf("HELO reply %q, want %q", reply, want)
		return x
	}
	rest, err := io.ReadAll(r)
	x.recv += int64(len(rest))
	if err != nil {
		x.err = fmt.Errorf("read until close: %w", err)
	}
	return x
}

// dialFrom connects from src, on a source port it picks itself, to dst,
// and returns the source address and port also when the connection fails,
// so that a refusal can be matched with the node's access log.
func dialFrom(ctx context.Context, ns *cluster.NS, src netip.Addr, dst netip.AddrPort) (net.Conn, netip.AddrPort, error) {
	var err error
	for range 5 {
		local := netip.AddrPortFrom(src, uint16(33000+mrand.IntN(27000)))
		var c net.Conn
		err = ns.Do(func() error {
			d := net.Dialer{LocalAddr: net.TCPAddrFromAddrPort(local)}
			var derr error
			c, derr = d.DialContext(ctx, "tcp", dst.String())
			return derr
		})
		if !errors.Is(err, syscall.EADDRINUSE) {
			return c, local, err
		}
	}
	return nil, netip.AddrPort{}, err
}

// udpQuery asks dst for "echo.demo." and checks the answer, retrying a
// lost datagram every second.
func udpQuery(ctx context.Context, ns *cluster.NS, src netip.Addr, dst netip.AddrPort, marker string) (x exchange) {
	pc, err := ns.ListenPacket("udp", ":0")
	if err != nil {
		x.err = err
		return x
	}
	defer pc.Close()
	x.local = netip.AddrPortFrom(src, uint16(pc.LocalAddr().(*net.UDPAddr).Port))
	q := "QUERY echo.demo. " + marker
	buf := make([]byte, 1500)
	for {
		n, err := pc.WriteTo([]byte(q), net.UDPAddrFromAddrPort(dst))
		x.sent += int64(n)
		if err != nil {
			x.err = fmt.Errorf("send: %w", err)
			return x
		}
		retry := time.Now().Add(time.Second)
		if dl, ok := ctx.Deadline(); ok && dl.Before(retry) {
			retry = dl
		}
		pc.SetReadDeadline(retry)
		n, _, err = pc.ReadFrom(buf)
		if err == nil {
			x.recv += int64(n)
			a := strings.Fields(string(buf[:n]))
			if len(a) != 5 || a[0] != "ANSWER" || a[2] != "A" || a[4] != marker {
				x.err = fmt.Errorf("answer %q", buf[:n])
			}
			return x
		}
		if ctx.Err() != nil {
			x.err = fmt.Errorf("no answer: %w", err)
			return x
		}
	}
}

// ping sends one ICMP echo request with marker as data and waits for the
// reply.
func ping(ctx context.Context, ns *cluster.NS, dst netip.Addr, marker string) (x exchange) {
	network, laddr, typ, reply, proto := "ip4:icmp", "0.0.0.0", icmp.Type(ipv4.ICMPTypeEcho), icmp.Type(ipv4.ICMPTypeEchoReply), 1
	if dst.Is6() {
		network, laddr, typ, reply, proto = "ip6:ipv6-icmp", "::", ipv6.ICMPTypeEchoRequest, ipv6.ICMPTypeEchoReply, 58
	}
	var pc *icmp.PacketConn
	if err := ns.Do(func() (err error) {
		pc, err = icmp.ListenPacket(network, laddr)
		return err
	}); err != nil {
		x.err = fmt.Errorf("ICMP socket: %w", err)
		return x
	}
	defer pc.Close()
	id := int(binary.BigEndian.Uint16([]byte(marker[len(marker)-2:])))
	wb, err := (&icmp.Message{Type: typ, Body: &icmp.Echo{ID: id, Seq: 1, Data: []byte(marker)}}).Marshal(nil)
	if err != nil {
		x.err = err
		return x
	}
	if _, err := pc.WriteTo(wb, &net.IPAddr{IP: dst.AsSlice()}); err != nil {
		x.err = fmt.Errorf("send: %w", err)
		return x
	}
	x.sent = int64(len(marker))
	if dl, ok := ctx.Deadline(); ok {
		pc.SetReadDeadline(dl)
	}
	buf := make([]byte, 1500)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			x.err = fmt.Errorf("no echo reply: %w", err)
			return x
		}
		m, err := icmp.ParseMessage(proto, buf[:n])
		if err != nil || m.Type != reply {
			continue
		}
		echo, ok := m.Body.(*icmp.Echo)
		if !ok || echo.ID != id || string(echo.Data) != marker {
			continue
		}
		if a, _ := netip.AddrFromSlice(from.(*net.IPAddr).IP); a.Unmap() != dst {
			x.err = errors.New("echo reply from " + a.String())
		}
		x.recv = int64(len(echo.Data))
		return x
	}
}
