package demo

import (
	"bufio"
	"fmt"
	"io"
	"net"
	"strings"
	"time"
)

// service is what a pod (or the external host) runs.
type service int

const (
	svcNone   service = iota
	svcEcho           // TCP echo: returns every byte until the client's FIN
	svcBanner         // TCP, server speaks first: an SMTP-like greeting
	svcDNS            // UDP, a DNS-like responder: one answer per question
)

// Ports of the services.
const (
	echoPort   = 8080
	bannerPort = 2525
	dnsPort    = 53
)

func (s service) String() string {
	switch s {
	case svcEcho:
		return fmt.Sprintf("tcp echo :%d", echoPort)
	case svcBanner:
		return fmt.Sprintf("server-first tcp :%d", bannerPort)
	case svcDNS:
		return fmt.Sprintf("udp dns-like :%d", dnsPort)
	}
	return ""
}

// serve starts s in e's namespace (on every address of both families) and
// registers its socket for Close.
func (d *Demo) serve(e *Endpoint, s service) error {
	var handle func(net.Conn)
	var port int
	switch s {
	case svcNone:
		return nil
	case svcEcho:
		handle, port = echo, echoPort
	case svcBanner:
		handle, port = banner, bannerPort
	case svcDNS:
		pc, err := e.NS.ListenPacket("udp", fmt.Sprintf(":%d", dnsPort))
		if err != nil {
			return fmt.Errorf("demo: %s: %w", e.Name, err)
		}
		d.closers = append(d.closers, pc)
		go answerDNS(pc, d.answers())
		return nil
	}
	ln, err := e.NS.Listen("tcp", fmt.Sprintf(":%d", port))
	if err != nil {
		return fmt.Errorf("demo: %s: %w", e.Name, err)
	}
	d.closers = append(d.closers, ln)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				c.SetDeadline(time.Now().Add(deadline))
				handle(c)
			}()
		}
	}()
	return nil
}

func echo(c net.Conn) { io.Copy(c, c) }

// banner greets, answers one HELO and closes.
func banner(c net.Conn) {
	fmt.Fprintf(c, "220 banner.demo ESMTP meshtun demo\r\n")
	line, err := bufio.NewReader(c).ReadString('\n')
	if err != nil {
		return
	}
	name, ok := strings.CutPrefix(strings.TrimSpace(line), "HELO ")
	if !ok {
		fmt.Fprintf(c, "500 say HELO\r\n")
		return
	}
	fmt.Fprintf(c, "250 banner.demo hello %s\r\n", name)
}

// answers maps the names the DNS-like service knows ("<pod>.demo.") to
// IPv4 addresses.
func (d *Demo) answers() map[string]string {
	m := map[string]string{}
	for _, e := range d.order {
		m[e.Name+".demo."] = e.IPv4.String()
	}
	return m
}

// answerDNS answers "QUERY <name> <tag>" with "ANSWER <name> A <addr>
// <tag>" (or NXDOMAIN) until pc is closed. The answers map is read only.
func answerDNS(pc net.PacketConn, answers map[string]string) {
	buf := make([]byte, 1500)
	for {
		n, from, err := pc.ReadFrom(buf)
		if err != nil {
			return
		}
		f := strings.Fields(string(buf[:n]))
		if len(f) != 3 || f[0] != "QUERY" {
			continue
		}
		reply := fmt.Sprintf("ANSWER %s NXDOMAIN %s", f[1], f[2])
		if a, ok := answers[f[1]]; ok {
			reply = fmt.Sprintf("ANSWER %s A %s %s", f[1], a, f[2])
		}
		pc.WriteTo([]byte(reply), from)
	}
}
