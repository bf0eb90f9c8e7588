package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/meshtun/meshtun/bench/gen"
	"github.com/meshtun/meshtun/bench/topo"
)

// profileSeconds is the length of each CPU profile.
const profileSeconds = 3

// profileLane takes a CPU profile of every proxy on l that serves pprof
// while one TCP stream runs each way, and writes them into dir as
// <path>-<node>-<direction>.pprof. It returns the files written.
func profileLane(ctx context.Context, l *lane, dir string) ([]string, error) {
	var files []string
	for _, dirn := range []struct {
		name string
		run  func(context.Context, gen.Netns, *gen.Server, gen.TCPConfig) (gen.Throughput, error)
	}{{"up", gen.Upload}, {"down", gen.Download}} {
		var (
			wg   sync.WaitGroup
			mu   sync.Mutex
			errs []error
		)
		for _, x := range l.Proxies {
			if !x.Pprof.IsValid() {
				continue
			}
			name := fmt.Sprintf("%s-%s-%s.pprof", l.Name, strings.ReplaceAll(x.Name, " ", "-"), dirn.name)
			wg.Go(func() {
				p := filepath.Join(dir, name)
				err := fetchProfile(ctx, x, p)
				mu.Lock()
				defer mu.Unlock()
				if err != nil {
					errs = append(errs, err)
				} else {
					files = append(files, p)
				}
			})
		}
		// The stream outlasts the profile on both ends.
		_, err := dirn.run(ctx, l.Src.NS, l.srv, gen.TCPConfig{Streams: 1, Warmup: 200 * time.Millisecond, Duration: (profileSeconds + 1) * time.Second})
		wg.Wait()
		if err := errors.Join(append(errs, err)...); err != nil {
			return files, err
		}
	}
	return files, nil
}

// fetchProfile fetches a CPU profile of proxy x from inside its node's
// namespace into path.
func fetchProfile(ctx context.Context, x topo.Proxy, path string) error {
	node := x.Node
	client := &http.Client{Transport: &http.Transport{
		DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			return node.Dial(ctx, network, addr)
		},
	}}
	defer client.CloseIdleConnections()
	url := fmt.Sprintf("http://%s/debug/pprof/profile?seconds=%d", x.Pprof, profileSeconds)
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := client.Do(req)
	if err != nil {
		return fmt.Errorf("bench: profile of %s: %w", x.Name, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 512))
		return fmt.Errorf("bench: profile of %s: %s: %s", x.Name, resp.Status, b)
	}
	f, err := os.Create(path)
	if err != nil {
		return fmt.Errorf("bench: profile of %s: %w", x.Name, err)
	}
	_, err = io.Copy(f, resp.Body)
	if err = errors.Join(err, f.Close()); err != nil {
		return fmt.Errorf("bench: profile of %s: write %s: %w", x.Name, path, err)
	}
	return nil
}
