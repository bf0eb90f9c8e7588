// Command probe is the test image's server and client (meshtun-probe:dev):
//
//	probe serve [-tcp :8080] [-http :8081]   echo every TCP connection back; HTTP 200 on /
//	probe send -to host:port -msg TEXT        send TEXT, half-close, print what comes back
//	  [-then-sleep]                           then wait as sleep does (a pod's first action)
//	probe loop -to host:port -msg TEXT -for 60s  exchange TEXT every 100 ms, print a JSON summary
//	probe bench -to host:port -mode rr|crr -for 5s  request/response latency (one connection) or connection rate, JSON
//	probe sleep                               wait forever (a pod to kubectl exec into)
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"sort"
	"syscall"
	"time"
)

// quiet leaves out the echo (loop prints one summary instead).
var quiet bool

func main() {
	log.SetFlags(log.Ltime | log.Lmicroseconds)
	if len(os.Args) < 2 {
		log.Fatal("usage: probe serve|send|hold|loop|sleep")
	}
	fs := flag.NewFlagSet(os.Args[1], flag.ExitOnError)
	switch os.Args[1] {
	case "serve":
		tcp := fs.String("tcp", ":8080", "TCP echo listen address")
		httpAddr := fs.String("http", ":8081", "HTTP listen address")
		fs.Parse(os.Args[2:])
		serve(*tcp, *httpAddr)
	case "send":
		to := fs.String("to", "", "host:port")
		msg := fs.String("msg", "", "what to send")
		timeout := fs.Duration("timeout", 10*time.Second, "whole exchange")
		thenSleep := fs.Bool("then-sleep", false, "after a successful exchange, wait as sleep does")
		fs.Parse(os.Args[2:])
		if err := send(*to, *msg, *timeout); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		if *thenSleep {
			sleep()
		}
	case "loop":
		to := fs.String("to", "", "host:port")
		msg := fs.String("msg", "", "what to send on each connection")
		dur := fs.Duration("for", time.Minute, "how long to loop")
		every := fs.Duration("every", 100*time.Millisecond, "pause between connections")
		fs.Parse(os.Args[2:])
		quiet = true
		loop(*to, *msg, *dur, *every)
	case "hold":
		to := fs.String("to", "", "host:port")
		msg := fs.String("msg", "", "what to send")
		dur := fs.Duration("for", 30*time.Second, "how long to keep the connection open after the echo")
		fs.Parse(os.Args[2:])
		if err := hold(*to, *msg, *dur); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	case "bench":
		to := fs.String("to", "", "host:port of a probe serve")
		mode := fs.String("mode", "rr", "rr: 1-byte request/response on one connection; crr: a new connection for each")
		dur := fs.Duration("for", 5*time.Second, "how long")
		fs.Parse(os.Args[2:])
		if err := bench(*to, *mode, *dur); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
	case "sleep":
		sleep()
	default:
		log.Fatalf("unknown command %q", os.Args[1])
	}
}

// sleep waits until the kubelet stops the pod (a bare select{} is a
// deadlock to the runtime when nothing else runs).
func sleep() {
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
	<-sig
}

func serve(tcpAddr, httpAddr string) {
	ln, err := net.Listen("tcp", tcpAddr)
	if err != nil {
		log.Fatal(err)
	}
	go func() {
		http.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintf(w, "ok from %s\n", r.Host) })
		log.Fatal(http.ListenAndServe(httpAddr, nil))
	}()
	log.Printf("echo on %s, http on %s", tcpAddr, httpAddr)
	for {
		c, err := ln.Accept()
		if err != nil {
			log.Fatal(err)
		}
		go func() {
			defer c.Close()
			c.SetDeadline(time.Now().Add(time.Minute))
			n, err := io.Copy(c, io.LimitReader(c, 1<<20))
			log.Printf("echoed %d bytes to %s (%v)", n, c.RemoteAddr(), err)
		}()
	}
}

// hold sends msg to to, reads its echo and keeps the connection open for
// d (a connection a proxy's admin view can list) before closing it.
func hold(to, msg string, d time.Duration) error {
	c, err := net.DialTimeout("tcp", to, 10*time.Second)
	if err != nil {
		return fmt.Errorf("dial %s: %w", to, err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(d + 10*time.Second))
	if _, err := io.WriteString(c, msg); err != nil {
		return fmt.Errorf("write to %s: %w", to, err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil {
		return fmt.Errorf("read from %s: %w", to, err)
	}
	if string(got) != msg {
		return fmt.Errorf("%s echoed %q, sent %q", to, got, msg)
	}
	fmt.Println("connected")
	time.Sleep(d)
	return nil
}

// loop exchanges msg with to on a new connection every interval for d and
// prints one JSON summary: successes, failures, and the longest time
// without a successful exchange.
func loop(to, msg string, d, every time.Duration) {
	start := time.Now()
	lastOK := start
	var ok, fail int
	var maxGap time.Duration
	var lastErr string
	for time.Since(start) < d {
		if err := send(to, msg, 2*time.Second); err != nil {
			fail++
			lastErr = err.Error()
		} else {
			ok++
			if g := time.Since(lastOK); g > maxGap {
				maxGap = g
			}
			lastOK = time.Now()
		}
		time.Sleep(every)
	}
	if g := time.Since(lastOK); g > maxGap {
		maxGap = g
	}
	fmt.Printf("{\"ok\": %d, \"fail\": %d, \"maxGapMs\": %d, \"lastError\": %q}\n", ok, fail, maxGap.Milliseconds(), lastErr)
}

// bench runs 1-byte request/responses against an echo server for d: on
// one connection (rr) or each on a new connection (crr, connect, send,
// read, close), and prints the count, the rate and the p50/p99 latency.
func bench(to, mode string, d time.Duration) error {
	var lat []time.Duration
	buf := make([]byte, 1)
	exchange := func(c net.Conn) error {
		if _, err := c.Write([]byte{'x'}); err != nil {
			return err
		}
		_, err := io.ReadFull(c, buf)
		return err
	}
	var c net.Conn
	var err error
	if mode == "rr" {
		if c, err = net.DialTimeout("tcp", to, 5*time.Second); err != nil {
			return fmt.Errorf("dial %s: %w", to, err)
		}
		defer c.Close()
		c.SetDeadline(time.Now().Add(d + 10*time.Second))
	} else if mode != "crr" {
		return fmt.Errorf("mode %q: want rr or crr", mode)
	}
	start := time.Now()
	for time.Since(start) < d {
		t0 := time.Now()
		if mode == "crr" {
			cc, err := net.DialTimeout("tcp", to, 5*time.Second)
			if err != nil {
				return fmt.Errorf("dial %s: %w", to, err)
			}
			cc.SetDeadline(time.Now().Add(5 * time.Second))
			err = exchange(cc)
			cc.Close()
			if err != nil {
				return fmt.Errorf("exchange with %s: %w", to, err)
			}
		} else if err := exchange(c); err != nil {
			return fmt.Errorf("exchange with %s: %w", to, err)
		}
		lat = append(lat, time.Since(t0))
	}
	el := time.Since(start)
	sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
	pct := func(p float64) int64 { return lat[int(p*float64(len(lat)-1))].Microseconds() }
	fmt.Printf("{\"mode\": %q, \"n\": %d, \"perSec\": %.1f, \"p50us\": %d, \"p99us\": %d}\n", mode, len(lat), float64(len(lat))/el.Seconds(), pct(0.5), pct(0.99))
	return nil
}

func send(to, msg string, timeout time.Duration) error {
	c, err := net.DialTimeout("tcp", to, timeout)
	if err != nil {
		return fmt.Errorf("dial %s: %w", to, err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(timeout))
	if _, err := io.WriteString(c, msg); err != nil {
		return fmt.Errorf("write to %s: %w", to, err)
	}
	c.(*net.TCPConn).CloseWrite()
	got, err := io.ReadAll(io.LimitReader(c, 1<<20))
	if err != nil {
		return fmt.Errorf("read from %s: %w", to, err)
	}
	if string(got) != msg {
		return fmt.Errorf("%s echoed %q, sent %q", to, got, msg)
	}
	if !quiet {
		fmt.Printf("%s\n", got)
	}
	return nil
}
