package cluster

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"reflect"
	"strconv"
	"strings"

	"github.com/rs/zerolog"
)

// Capability bits in /proc/self/status CapEff.
const (
	capNetAdmin = 12
	capSysAdmin = 21
)

// Preflight reports everything missing for building a cluster and running
// a TUN-based proxy in it: CAP_SYS_ADMIN and CAP_NET_ADMIN (creating and
// entering namespaces, mounting under /run/netns), /dev/net/tun, and the
// `ip` command used by (*NS).Command. It returns nil if nothing is missing.
func Preflight() error {
	var missing []string
	caps, err := effectiveCaps()
	if err != nil {
		missing = append(missing, "readable capabilities ("+err.Error()+")")
	} else {
		if caps&(1<<capSysAdmin) == 0 {
			missing = append(missing, "CAP_SYS_ADMIN (run as root) to create and mount network namespaces")
		}
		if caps&(1<<capNetAdmin) == 0 {
			missing = append(missing, "CAP_NET_ADMIN (run as root) to configure interfaces and routes")
		}
	}
	if f, err := os.OpenFile("/dev/net/tun", os.O_RDWR, 0); err != nil {
		missing = append(missing, "/dev/net/tun ("+err.Error()+")")
	} else {
		f.Close()
	}
	if _, err := os.Stat("/proc/self/ns/net"); err != nil {
		missing = append(missing, "network namespace support, /proc/self/ns/net ("+err.Error()+")")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		missing = append(missing, "the ip command from iproute2 in PATH ("+err.Error()+")")
	}
	if len(missing) == 0 {
		return nil
	}
	return errors.New("missing: " + strings.Join(missing, "; "))
}

func effectiveCaps() (uint64, error) {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), "CapEff:"); ok {
			return strconv.ParseUint(strings.TrimSpace(v), 16, 64)
		}
	}
	if err := s.Err(); err != nil {
		return 0, err
	}
	return 0, fmt.Errorf("no CapEff line in /proc/self/status")
}

// TB is the part of testing.TB that NewT uses, so that this package (which
// meshtun's demo and bench link) needs no import of testing.
type TB interface {
	Helper()
	Log(args ...any)
	Logf(format string, args ...any)
	Errorf(format string, args ...any)
	Fatalf(format string, args ...any)
	Cleanup(func())
	Context() context.Context
}

// NewT builds a cluster for a test or benchmark (t is its *testing.T or
// *testing.B) and closes it in t.Cleanup. It fails the test (never skips)
// with a message naming what is missing if the machine cannot host the
// cluster. If spec.Log is the zero Logger, messages go to the test log.
func NewT(t TB, spec Spec) *Cluster {
	t.Helper()
	if err := Preflight(); err != nil {
		t.Fatalf("cluster: this test needs root, network namespaces and /dev/net/tun: %v", err)
	}
	if reflect.ValueOf(spec.Log).IsZero() {
		spec.Log = zerolog.New(zerolog.NewTestWriter(t)).Level(zerolog.InfoLevel)
	}
	c, err := New(t.Context(), spec)
	if err != nil {
		t.Fatalf("cluster: build %d nodes x %d pods: %v", spec.Nodes, spec.PodsPerNode, err)
	}
	t.Cleanup(func() {
		if err := c.Close(); err != nil {
			t.Errorf("cluster: close %s: %v", c.Name, err)
		}
	})
	return c
}
