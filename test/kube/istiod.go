package kube

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"

	"github.com/meshtun/meshtun/bench/cluster"
)

// IstioVersion is the istio.io/istio module version whose pilot-discovery
// (istiod) the tests run: the one test/interop already requires. Its go.mod
// has no replace directives, so a scratch module that requires it alone
// builds istiod.
const IstioVersion = "v0.0.0-20260827124520-eed52ebb66ad"

// Ports of istiod inside its namespace. The secure gRPC port (xDS and CA,
// TLS) is on the namespace's fabric address so that nodes reach it; the
// others stay on loopback. istiod also listens on *:15017 (webhooks),
// which is why it runs inside the sealed namespace.
const (
	IstiodGRPCPort       = 15012
	istiodHTTPPort       = 18080
	istiodMonitoringPort = 15014
	istiodPlainGRPCPort  = 15010
)

// BuildIstiod builds istiod's pilot-discovery at IstioVersion into
// CacheDir()/bin, once: a binary already there is reused (a cold build
// takes 20 minutes or more on two busy cores). It shares Build's lock.
func BuildIstiod(ctx context.Context, logf func(format string, args ...any)) (string, error) {
	dir, err := CacheDir()
	if err != nil {
		return "", err
	}
	out := filepath.Join(dir, "bin", "pilot-discovery-"+IstioVersion)
	if exists(out) {
		return out, nil
	}
	if err := os.MkdirAll(filepath.Dir(out), 0o755); err != nil {
		return "", err
	}
	unlock, err := lockFile(ctx, filepath.Join(dir, "build.lock"))
	if err != nil {
		return "", err
	}
	defer unlock()
	if exists(out) {
		return out, nil
	}
	src := filepath.Join(dir, "src", "pilot-discovery-"+IstioVersion)
	if err := os.MkdirAll(src, 0o755); err != nil {
		return "", err
	}
	gomod := "module meshtuntest/pilotdiscovery\n\ngo 1.26.0\n\nrequire istio.io/istio " + IstioVersion + "\n"
	if err := os.WriteFile(filepath.Join(src, "go.mod"), []byte(gomod), 0o644); err != nil {
		return "", err
	}
	start := time.Now()
	logf("building pilot-discovery %s in %s (20 minutes or more when the Go build cache is cold)", IstioVersion, src)
	tmp := out + ".tmp"
	cmd := exec.CommandContext(ctx, "go", "build", "-o", tmp, "istio.io/istio/pilot/cmd/pilot-discovery")
	cmd.Dir = src
	cmd.Env = goEnv()
	if b, err := cmd.CombinedOutput(); err != nil {
		os.Remove(tmp)
		return "", fmt.Errorf("go build pilot-discovery in %s: %w\n%s", src, err, b)
	}
	if err := os.Rename(tmp, out); err != nil {
		return "", err
	}
	logf("built pilot-discovery in %s", time.Since(start).Round(time.Second))
	return out, nil
}

// IstioCRDs returns the path of the Istio CRDs (crd-all.gen.yaml) of
// IstioVersion in the Go module cache, downloading the module if needed.
func IstioCRDs(ctx context.Context) (string, error) {
	cmd := exec.CommandContext(ctx, "go", "mod", "download", "-json", "istio.io/istio@"+IstioVersion)
	dir, err := CacheDir()
	if err != nil {
		return "", err
	}
	cmd.Dir = dir
	cmd.Env = goEnv()
	out, err := cmd.Output()
	if err != nil {
		return "", fmt.Errorf("go mod download istio.io/istio@%s: %w: %s", IstioVersion, err, stderrOf(err))
	}
	var info struct{ Dir, Error string }
	if err := json.Unmarshal(out, &info); err != nil || info.Dir == "" {
		return "", fmt.Errorf("go mod download istio.io/istio@%s: no directory (%v %s)", IstioVersion, err, info.Error)
	}
	return filepath.Join(info.Dir, "manifests", "charts", "base", "files", "crd-all.gen.yaml"), nil
}

// Istiod is a pilot-discovery process running in the control plane's
// namespace against its API server.
type Istiod struct {
	// Addr is the secure gRPC address (xDS and CA over TLS) nodes dial.
	Addr netip.AddrPort
	// ServerName is the name its serving certificate is valid for.
	ServerName string

	cp      *ControlPlane
	bin     string
	args    []string
	env     []string
	proc    *cluster.Proc
	logName string
}

// IstiodConfig configures StartIstiod.
type IstiodConfig struct {
	// TrustedNodeAccounts are "<namespace>/<service account>" of the node
	// proxies istiod lets impersonate the workloads of their node
	// (CA_TRUSTED_NODE_ACCOUNTS).
	TrustedNodeAccounts []string
	// Env adds environment variables (KEY=value).
	Env []string
}

// StartIstiod applies the Istio CRDs and the istio-system namespace
// (server-side), writes a kubeconfig for istiod (the admin token: istiod's
// own RBAC is not what these tests check), starts pilot-discovery in the
// control plane's namespace with ambient enabled and waits until /ready
// answers 200. The control plane's cluster stops it on Close; Stop does
// it earlier.
func (cp *ControlPlane) StartIstiod(ctx context.Context, bin string, cfg IstiodConfig) (*Istiod, error) {
	crds, err := IstioCRDs(ctx)
	if err != nil {
		return nil, err
	}
	ms, err := readManifestFile(crds)
	if err != nil {
		return nil, err
	}
	ns := Manifest{File: "istio-system", Obj: namespaceObject("istio-system")}
	if err := cp.Apply(ctx, append([]Manifest{ns}, ms...), false); err != nil {
		return nil, fmt.Errorf("istio CRDs: %w", err)
	}
	kc := filepath.Join(cp.dir, "istiod.kubeconfig")
	if err := os.WriteFile(kc, cp.Kubeconfig(cp.AdminToken), 0o600); err != nil {
		return nil, err
	}
	host := cp.Host.IPv4.String()
	d := &Istiod{
		Addr:       netip.AddrPortFrom(cp.Host.IPv4, IstiodGRPCPort),
		ServerName: "istiod.istio-system.svc",
		cp:         cp, bin: bin, logName: "istiod",
		args: []string{
			"discovery", "--kubeconfig", kc,
			"--httpAddr", "127.0.0.1:" + strconv.Itoa(istiodHTTPPort),
			"--monitoringAddr", "127.0.0.1:" + strconv.Itoa(istiodMonitoringPort),
			"--grpcAddr", "127.0.0.1:" + strconv.Itoa(istiodPlainGRPCPort),
			"--secureGRPCAddr", host + ":" + strconv.Itoa(IstiodGRPCPort),
			"--log_output_level", "default:info",
		},
		env: append([]string{
			"POD_NAMESPACE=istio-system",
			"POD_NAME=istiod-test",
			"PILOT_ENABLE_AMBIENT=true",
			"PILOT_ENABLE_GATEWAY_API=false",
			"CA_TRUSTED_NODE_ACCOUNTS=" + strings.Join(cfg.TrustedNodeAccounts, ","),
		}, cfg.Env...),
	}
	if err := d.Start(ctx); err != nil {
		return nil, err
	}
	return d, nil
}

// Start starts istiod (again, after Stop) and waits until it is ready.
func (d *Istiod) Start(ctx context.Context) error {
	logFile, err := os.OpenFile(filepath.Join(d.cp.dir, d.logName+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return err
	}
	defer logFile.Close()
	cmd := d.cp.Host.Command(context.Background(), d.bin, d.args...)
	cmd.Env = append(os.Environ(), d.env...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	p, err := d.cp.Host.Start(cmd)
	if err != nil {
		return fmt.Errorf("start istiod: %w", err)
	}
	d.proc = p
	start := time.Now()
	hc := &http.Client{Transport: &http.Transport{DialContext: d.cp.Host.Dial}, Timeout: 2 * time.Second}
	url := fmt.Sprintf("http://127.0.0.1:%d/ready", istiodHTTPPort)
	for {
		if resp, err := hc.Get(url); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				d.cp.logf("istiod ready on %s after %s", d.Addr, time.Since(start).Round(10*time.Millisecond))
				return nil
			}
		}
		select {
		case <-p.Done():
			return fmt.Errorf("istiod exited (%v) before it was ready:\n%s", p.Wait(), d.cp.LogTail(d.logName, 40))
		case <-ctx.Done():
			return fmt.Errorf("istiod not ready: %w\n%s", ctx.Err(), d.cp.LogTail(d.logName, 40))
		case <-time.After(200 * time.Millisecond): // istiod has no readiness signal but /ready
		}
	}
}

// Stop stops istiod.
func (d *Istiod) Stop() {
	if d.proc != nil {
		d.proc.Stop(5 * time.Second)
		d.proc = nil
	}
}

// LogTail returns the last n lines of istiod's log.
func (d *Istiod) LogTail(n int) string { return d.cp.LogTail(d.logName, n) }

func namespaceObject(name string) *unstructured.Unstructured {
	u := &unstructured.Unstructured{}
	u.SetAPIVersion("v1")
	u.SetKind("Namespace")
	u.SetName(name)
	return u
}
