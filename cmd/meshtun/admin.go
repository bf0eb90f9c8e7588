package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/meshtun/meshtun/mesh/config"
)

const adminUsage = `usage: meshtun admin [-socket path] [-X method] <path>

Calls the node's admin socket (root only), which serves every admin
endpoint, among them those the TCP admin port does not:
  meshtun admin /logging                               the log levels
  meshtun admin -X POST '/logging?level=debug'         set the level
  meshtun admin -X POST '/logging?access=off'          access log off
  meshtun admin '/debug/pprof/heap' > heap.pprof       a heap profile
  meshtun admin '/config_dump?format=ztunnel'
The same with curl:
  curl --unix-socket /var/run/meshtun/admin.sock -X POST 'http://admin/logging?level=debug'

`

// runAdmin sends one request to the admin socket and copies the answer to
// stdout; a status other than 200 is an error.
func runAdmin(ctx context.Context, args []string, out io.Writer) error {
	fs := flag.NewFlagSet("admin", flag.ContinueOnError)
	fs.Usage = func() { fmt.Fprint(fs.Output(), adminUsage); fs.PrintDefaults() }
	socket := fs.String("socket", config.DefaultAdminSocket, "the admin socket `path` (the node's listen.adminSocket)")
	method := fs.String("X", http.MethodGet, "HTTP `method`: GET, or POST to change")
	timeout := fs.Duration("timeout", time.Minute, "give up after this `duration` (a CPU profile takes ?seconds=…)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if fs.NArg() != 1 || !strings.HasPrefix(fs.Arg(0), "/") {
		fs.Usage()
		return errors.New("want one path, starting with /")
	}
	ctx, cancel := context.WithTimeout(ctx, *timeout)
	defer cancel()
	c := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", *socket)
	}}}
	req, err := http.NewRequestWithContext(ctx, strings.ToUpper(*method), "http://admin"+fs.Arg(0), nil)
	if err != nil {
		return err
	}
	resp, err := c.Do(req)
	if err != nil {
		return fmt.Errorf("admin socket %s: %w", *socket, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("%s %s: %s: %s", req.Method, fs.Arg(0), resp.Status, strings.TrimSpace(string(b)))
	}
	_, err = io.Copy(out, resp.Body)
	return err
}
