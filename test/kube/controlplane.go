package kube

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"

	"github.com/meshtun/meshtun/bench/cluster"
)

// Loopback and fabric ports of the control plane inside its namespace.
const (
	etcdClientPort = 2379
	etcdPeerPort   = 2380
	apiServerPort  = 6443
)

// ServiceCIDRs are the service cluster IP ranges the API server allocates
// ClusterIPs from: inside the test address plan (198.18.0.0/15,
// fd00:6d74::/32), clear of the nodes' and pods' /24s and /64s.
var ServiceCIDRs = []netip.Prefix{
	netip.MustParsePrefix("198.19.0.0/16"),
	netip.MustParsePrefix("fd00:6d74:ffff::/112"),
}

// ControlPlane is etcd and kube-apiserver running in one namespace of a
// test cluster: etcd on the namespace's loopback, the API server on the
// namespace's fabric address so that the cluster's nodes reach it.
type ControlPlane struct {
	// Host is the namespace they run in.
	Host *cluster.Host
	// Server is the API server's address (https).
	Server netip.AddrPort
	// CAData is the PEM bundle that verifies the API server's serving
	// certificate.
	CAData []byte
	// AdminToken authenticates as a member of system:masters.
	AdminToken string
	// Admin is a client with AdminToken; it dials from inside Host.
	Admin *kubernetes.Clientset
	// AdminConfig is Admin's configuration.
	AdminConfig *rest.Config

	bins      Binaries
	dir       string
	apiArgs   []string
	etcd      *cluster.Proc
	apiserver *cluster.Proc
	logf      func(string, ...any)
}

// StartControlPlane starts etcd and kube-apiserver in host (the external
// host of a test cluster), with their state, keys and logs in dir, and
// waits until the API server is ready. The cluster stops them on Close;
// Stop does it earlier.
func StartControlPlane(ctx context.Context, bins Binaries, host *cluster.Host, dir string, logf func(string, ...any)) (*ControlPlane, error) {
	cp := &ControlPlane{
		Host:       host,
		Server:     netip.AddrPortFrom(host.IPv4, apiServerPort),
		AdminToken: "admin-" + strconv.FormatInt(time.Now().UnixNano(), 36),
		bins:       bins,
		dir:        dir,
		logf:       logf,
	}
	for _, d := range []string{"etcd", "certs"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o700); err != nil {
			return nil, err
		}
	}
	if err := writeSAKeys(dir); err != nil {
		return nil, err
	}
	tokens := cp.AdminToken + ",test-admin,test-admin,system:masters\n"
	if err := os.WriteFile(filepath.Join(dir, "tokens.csv"), []byte(tokens), 0o600); err != nil {
		return nil, err
	}
	etcdURL := fmt.Sprintf("http://127.0.0.1:%d", etcdClientPort)
	peerURL := fmt.Sprintf("http://127.0.0.1:%d", etcdPeerPort)
	etcd, err := cp.start("etcd", bins.Etcd,
		"--name", "test",
		"--data-dir", filepath.Join(dir, "etcd"),
		"--listen-client-urls", etcdURL, "--advertise-client-urls", etcdURL,
		"--listen-peer-urls", peerURL, "--initial-advertise-peer-urls", peerURL,
		"--initial-cluster", "test="+peerURL,
		"--unsafe-no-fsync", "--log-level", "warn",
	)
	if err != nil {
		return nil, err
	}
	cp.etcd = etcd
	cidrs := make([]string, len(ServiceCIDRs))
	for i, p := range ServiceCIDRs {
		cidrs[i] = p.String()
	}
	cp.apiArgs = []string{
		"--etcd-servers", etcdURL,
		"--bind-address", host.IPv4.String(),
		"--secure-port", strconv.Itoa(apiServerPort),
		"--cert-dir", filepath.Join(dir, "certs"),
		"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file", filepath.Join(dir, "sa.pub"),
		"--service-account-signing-key-file", filepath.Join(dir, "sa.key"),
		"--token-auth-file", filepath.Join(dir, "tokens.csv"),
		"--authorization-mode", "RBAC",
		"--service-cluster-ip-range", strings.Join(cidrs, ","),
		"--enable-priority-and-fairness=false",
	}
	if err := cp.StartAPIServer(ctx); err != nil {
		cp.Stop()
		return nil, err
	}
	return cp, nil
}

// start runs bin in the control plane's namespace with its output in
// dir/<name>.log.
func (cp *ControlPlane) start(name, bin string, args ...string) (*cluster.Proc, error) {
	logFile, err := os.OpenFile(filepath.Join(cp.dir, name+".log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, err
	}
	defer logFile.Close()
	cmd := cp.Host.Command(context.Background(), bin, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	p, err := cp.Host.Start(cmd)
	if err != nil {
		return nil, fmt.Errorf("start %s: %w", name, err)
	}
	return p, nil
}

// StartAPIServer starts kube-apiserver (again, after StopAPIServer) and
// waits until /readyz answers ok.
func (cp *ControlPlane) StartAPIServer(ctx context.Context) error {
	p, err := cp.start("kube-apiserver", cp.bins.APIServer, cp.apiArgs...)
	if err != nil {
		return err
	}
	cp.apiserver = p
	start := time.Now()
	// The serving certificate appears when the server has generated it.
	crt := filepath.Join(cp.dir, "certs", "apiserver.crt")
	for {
		if data, err := os.ReadFile(crt); err == nil && len(data) > 0 {
			cp.CAData = data
			break
		}
		if err := cp.waitTick(ctx, p); err != nil {
			return err
		}
	}
	cp.AdminConfig = cp.Config(cp.AdminToken)
	cs, err := kubernetes.NewForConfig(cp.AdminConfig)
	if err != nil {
		return err
	}
	cp.Admin = cs
	for {
		body, err := cs.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err == nil && string(body) == "ok" {
			cp.logf("kube-apiserver ready on %s after %s", cp.Server, time.Since(start).Round(10*time.Millisecond))
			return nil
		}
		if err := cp.waitTick(ctx, p); err != nil {
			return err
		}
	}
}

// waitTick waits a moment while polling for readiness (the API server has
// no other readiness signal), failing if p exits or ctx ends.
func (cp *ControlPlane) waitTick(ctx context.Context, p *cluster.Proc) error {
	select {
	case <-p.Done():
		return fmt.Errorf("kube-apiserver exited (%v) before it was ready:\n%s", p.Wait(), cp.LogTail("kube-apiserver", 40))
	case <-ctx.Done():
		return fmt.Errorf("kube-apiserver not ready: %w\n%s", ctx.Err(), cp.LogTail("kube-apiserver", 40))
	case <-time.After(100 * time.Millisecond):
		return nil
	}
}

// StopAPIServer stops kube-apiserver; etcd keeps running.
func (cp *ControlPlane) StopAPIServer() {
	if cp.apiserver != nil {
		cp.apiserver.Stop(5 * time.Second)
		cp.apiserver = nil
	}
}

// Stop stops the API server and etcd.
func (cp *ControlPlane) Stop() {
	cp.StopAPIServer()
	if cp.etcd != nil {
		cp.etcd.Stop(5 * time.Second)
		cp.etcd = nil
	}
}

// Config returns a client configuration that authenticates with token and
// dials from inside the control plane's namespace (the test process
// itself runs outside the cluster).
func (cp *ControlPlane) Config(token string) *rest.Config {
	return &rest.Config{
		Host:            "https://" + cp.Server.String(),
		BearerToken:     token,
		TLSClientConfig: rest.TLSClientConfig{CAData: cp.CAData},
		Dial:            cp.Host.Dial,
		QPS:             200,
		Burst:           400,
		Timeout:         30 * time.Second,
	}
}

// Kubeconfig returns a kubeconfig file's contents for a process inside the
// cluster that authenticates with token.
func (cp *ControlPlane) Kubeconfig(token string) []byte {
	return []byte(fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: https://%s
    certificate-authority-data: %s
users:
- name: test
  user:
    token: %s
contexts:
- name: test
  context: {cluster: test, user: test}
current-context: test
`, cp.Server, b64(cp.CAData), token))
}

// LogTail returns the last n lines of a component's log (etcd,
// kube-apiserver).
func (cp *ControlPlane) LogTail(name string, n int) string {
	data, err := os.ReadFile(filepath.Join(cp.dir, name+".log"))
	if err != nil {
		return err.Error()
	}
	lines := strings.Split(strings.TrimRight(string(data), "\n"), "\n")
	if len(lines) > n {
		lines = lines[len(lines)-n:]
	}
	return strings.Join(lines, "\n")
}

// writeSAKeys writes the key pair that signs service-account tokens.
func writeSAKeys(dir string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	pub, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return err
	}
	return errors.Join(
		os.WriteFile(filepath.Join(dir, "sa.key"), pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), 0o600),
		os.WriteFile(filepath.Join(dir, "sa.pub"), pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pub}), 0o644),
	)
}
