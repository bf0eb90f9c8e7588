package main

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/config"
	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/identity/caserver"
)

const caUsage = `usage: meshtun ca <command> [flags]

commands:
  init         create a CA root (key and certificate) in a directory, for a Secret
  serve        run the certificate service (IstioCertificateService on ca.listen)
  issue-node   issue a node credential (run where the CA directory is)
  root         rotate the CA root: prepare | activate | retire

See docs/identity.md.
`

func runCA(ctx context.Context, args []string) error {
	if len(args) == 0 {
		fmt.Fprint(os.Stderr, caUsage)
		return errors.New("missing command")
	}
	switch args[0] {
	case "serve":
		return runCAServe(ctx, args[1:])
	case "init":
		return runCAInit(args[1:])
	case "issue-node":
		return runCAIssueNode(args[1:])
	case "root":
		return runCARoot(args[1:])
	case "-h", "-help", "--help", "help":
		fmt.Print(caUsage)
		return nil
	}
	return fmt.Errorf("unknown command %q\n\n%s", args[0], caUsage)
}

// loadCAConfig loads the config file and opens the CA of its ca.dir.
func loadCAConfig(path string, log zerolog.Logger) (*config.Config, *identity.CA, error) {
	c, err := config.Load(path)
	if err != nil {
		return nil, nil, err
	}
	snap, err := c.Snapshot()
	if err != nil {
		return nil, nil, err
	}
	ca, err := identity.OpenCA(identity.CAConfig{Dir: c.CA.Dir, TrustDomain: snap.TrustDomain, SVIDTTL: c.CA.SVIDTTL, Logger: log})
	if err != nil {
		return nil, nil, err
	}
	return c, ca, nil
}

func updateFileMode(f *caserver.FileMode, c *config.Config) error {
	snap, err := c.Snapshot()
	if err != nil {
		return err
	}
	nodes := make([]string, len(c.Nodes))
	for i, n := range c.Nodes {
		nodes[i] = n.Name
	}
	f.Update(nodes, snap.Workloads, c.CA.RevokedNodeCredentials)
	return nil
}

func runCAServe(ctx context.Context, args []string) error {
	fs := flag.NewFlagSet("ca serve", flag.ContinueOnError)
	path := fs.String("config", "/etc/meshtun/mesh.yaml", "the mesh config `file`: ca.dir, ca.listen, and which workloads run on which node")
	listen := fs.String("listen", "", "`address` to listen on (overrides ca.listen)")
	logLevel := fs.String("log-level", "info", "log `level`")
	useKube := fs.Bool("kubernetes", false, "authenticate nodes by their projected service-account token (TokenReview) and grant a workload identity only to the node its pod runs on, instead of node credentials and the config file's workloads")
	kubeconfig := fs.String("kubeconfig", "", "with --kubernetes: the kubeconfig `file`; empty: the in-cluster service account")
	nodeAccounts := fs.String("node-accounts", "meshtun-system/meshtun", "with --kubernetes: comma-separated `namespace/serviceaccount` of the node proxies; only they may ask for workload identities")
	audience := fs.String("audience", caserver.DefaultAudience, "with --kubernetes: the `audience` the nodes' tokens must be for")
	rootFrom := fs.String("root-from", "", "`directory` holding "+identity.RootKeyFile+" and "+identity.RootCertFile+" (a Secret volume) to copy into ca.dir when ca.dir has no root")
	rootSecret := fs.String("root-secret", "", "with --kubernetes: `namespace/name` of the Secret that holds the CA root (root-key.pem, root-cert.pem); created with a new self-signed root on first start when it does not exist")
	rootConfigMap := fs.String("root-configmap", "", "with --root-secret: `namespace/name` of the ConfigMap the root certificate (root-cert.pem, no key) is published to, for the nodes; same namespace as the Secret")
	if err := fs.Parse(args); err != nil {
		return err
	}
	log, err := newLogger(*logLevel)
	if err != nil {
		return err
	}
	if *rootSecret != "" {
		if !*useKube || *rootFrom != "" {
			return errors.New("--root-secret needs --kubernetes and excludes --root-from")
		}
		sns, sname, ok := strings.Cut(*rootSecret, "/")
		cns, cname, ok2 := strings.Cut(*rootConfigMap, "/")
		if !ok || !ok2 || sns == "" || sname == "" || cname == "" || cns != sns {
			return fmt.Errorf("--root-secret %q and --root-configmap %q: want namespace/name each, in one namespace", *rootSecret, *rootConfigMap)
		}
		c, err := config.Load(*path)
		if err != nil {
			return err
		}
		snap, err := c.Snapshot()
		if err != nil {
			return err
		}
		cs, err := kubeClient(*kubeconfig, "ca")
		if err != nil {
			return err
		}
		kr := caserver.KubeRoot{Store: cs, Namespace: sns, Secret: sname, ConfigMap: cname,
			Dir: c.CA.Dir, TrustDomain: snap.TrustDomain, Logger: log}
		if err := kr.Ensure(ctx); err != nil {
			return err
		}
	}
	if *rootFrom != "" {
		c, err := config.Load(*path)
		if err != nil {
			return err
		}
		if err := copyRoot(*rootFrom, c.CA.Dir); err != nil {
			return err
		}
	}
	c, ca, err := loadCAConfig(*path, log)
	if err != nil {
		return err
	}
	file := caserver.NewFileMode(ca.TrustDomain(), ca.Roots)
	var authn []caserver.Authenticator
	var authz caserver.Authorizer
	if *useKube {
		cs, err := kubeClient(*kubeconfig, "ca")
		if err != nil {
			return err
		}
		var accounts []string
		for _, a := range strings.Split(*nodeAccounts, ",") {
			if a = strings.TrimSpace(a); a == "" {
				continue
			}
			if ns, sa, ok := strings.Cut(a, "/"); !ok || ns == "" || sa == "" {
				return fmt.Errorf("--node-accounts: %q is not namespace/serviceaccount", a)
			}
			accounts = append(accounts, a)
		}
		if len(accounts) == 0 {
			return errors.New("--node-accounts: none given; no node could get a certificate")
		}
		api := caserver.KubeAPI{Client: cs}
		km := &caserver.KubeMode{TrustDomain: ca.TrustDomain(), Reviewer: api, Pods: api, Audience: *audience, NodeAccounts: accounts}
		authn, authz = []caserver.Authenticator{km}, km
		log.Info().Strs("node_accounts", accounts).Str("audience", *audience).Msg("nodes authenticate with service-account tokens (TokenReview)")
	} else {
		if err := updateFileMode(file, c); err != nil {
			return err
		}
		authn, authz = []caserver.Authenticator{file}, file
	}
	srv, err := caserver.New(caserver.Config{CA: ca, Authenticators: authn, Authorizer: authz,
		MaxTTL: c.CA.SVIDTTL, Logger: log})
	if err != nil {
		return err
	}
	addr := c.CA.Listen
	if *listen != "" {
		addr = *listen
	}
	lis, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("listen on %s: %w", addr, err)
	}
	go func() {
		if *useKube {
			return
		}
		err := config.Watch(ctx, c.Path, func(nc *config.Config) {
			if err := updateFileMode(file, nc); err != nil {
				log.Error().Err(err).Str("config", c.Path).Msg("config reload failed; keeping the last good one")
				return
			}
			log.Info().Str("config", c.Path).Int("nodes", len(nc.Nodes)).Int("revoked", len(nc.CA.RevokedNodeCredentials)).Msg("config reloaded")
		}, func(err error) {
			log.Error().Err(err).Str("config", c.Path).Msg("config reload failed; keeping the last good one")
		})
		if err != nil && !errors.Is(err, context.Canceled) {
			log.Error().Err(err).Msg("config watch stopped")
		}
	}()
	go watchRoots(ctx, ca, c.CA.Dir, log)
	go func() {
		<-ctx.Done()
		srv.Stop()
	}()
	log.Info().Str("addr", lis.Addr().String()).Str("trust_domain", ca.TrustDomain().String()).
		Int("roots", len(ca.Roots())).Dur("svid_ttl", c.CA.SVIDTTL).Msg(caserver.ReadyMessage)
	if err := srv.Serve(lis); err != nil && ctx.Err() == nil {
		return err
	}
	return nil
}

// copyRoot copies the root key and certificate from dir (a read-only
// Secret volume) into caDir, unless caDir has a root key already.
func copyRoot(dir, caDir string) error {
	if _, err := os.Stat(filepath.Join(caDir, identity.RootKeyFile)); err == nil {
		return nil
	}
	if err := os.MkdirAll(caDir, 0o700); err != nil {
		return err
	}
	for _, f := range []string{identity.RootCertFile, identity.RootKeyFile} {
		data, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			return fmt.Errorf("--root-from: %w", err)
		}
		if err := os.WriteFile(filepath.Join(caDir, f), data, 0o600); err != nil {
			return err
		}
	}
	return nil
}

// watchRoots reloads the CA's roots on SIGHUP and whenever a file of the
// CA directory changes (checked every second), so that `meshtun ca root`
// takes effect without a restart.
func watchRoots(ctx context.Context, ca *identity.CA, dir string, log zerolog.Logger) {
	hup := make(chan os.Signal, 1)
	signal.Notify(hup, syscall.SIGHUP)
	defer signal.Stop(hup)
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	last := dirStamp(dir)
	for {
		select {
		case <-ctx.Done():
			return
		case <-hup:
		case <-tick.C:
			if s := dirStamp(dir); s != last {
				last = s
			} else {
				continue
			}
		}
		if err := ca.Reload(); err != nil {
			log.Error().Err(err).Msg("CA reload failed; keeping the current roots")
		}
	}
}

func dirStamp(dir string) string {
	var s string
	for _, f := range []string{identity.RootCertFile, identity.NextRootCertFile, identity.PreviousRootsFile} {
		if fi, err := os.Stat(filepath.Join(dir, f)); err == nil {
			s += fmt.Sprintf("%s:%d:%d;", f, fi.ModTime().UnixNano(), fi.Size())
		}
	}
	return s
}

func runCAInit(args []string) error {
	fs := flag.NewFlagSet("ca init", flag.ContinueOnError)
	td := fs.String("trust-domain", "cluster.local", "the mesh's trust `domain`")
	out := fs.String("out", "", "`directory` to create "+identity.RootKeyFile+" (0600) and "+identity.RootCertFile+" in (required); an existing root there is kept")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *out == "" {
		return errors.New("-out is required")
	}
	d, err := spiffeid.TrustDomainFromString(*td)
	if err != nil {
		return fmt.Errorf("-trust-domain: %w", err)
	}
	ca, err := identity.OpenCA(identity.CAConfig{Dir: *out, TrustDomain: d, Logger: zerolog.Nop()})
	if err != nil {
		return err
	}
	root := ca.Roots()[0]
	fmt.Printf("CA root of %s in %s: serial %s, valid until %s\n", d, *out, root.SerialNumber.Text(16), root.NotAfter.UTC().Format(time.RFC3339))
	return nil
}

func runCAIssueNode(args []string) error {
	fs := flag.NewFlagSet("ca issue-node", flag.ContinueOnError)
	path := fs.String("config", "/etc/meshtun/mesh.yaml", "the mesh config `file`")
	node := fs.String("node", "", "the node's `name` in the config file (required)")
	out := fs.String("out", "", "`directory` to write cert.pem, key.pem (0600) and roots.pem to (required); give it to `meshtun node --credentials`")
	ttl := fs.Duration("ttl", 0, "lifetime (default: ca.nodeCredentialTTL)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *node == "" || *out == "" {
		return errors.New("-node and -out are required")
	}
	log := zerolog.Nop()
	c, ca, err := loadCAConfig(*path, log)
	if err != nil {
		return err
	}
	if _, err := c.Node(*node); err != nil {
		return err
	}
	if *ttl <= 0 {
		*ttl = c.CA.NodeCredentialTTL
	}
	id, err := identity.NodeID(ca.TrustDomain(), *node)
	if err != nil {
		return err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	// The node credential outlives SVIDs: sign it with its own lifetime,
	// not capped by the SVID TTL.
	nodeCA, err := identity.OpenCA(identity.CAConfig{Dir: c.CA.Dir, TrustDomain: ca.TrustDomain(), SVIDTTL: *ttl, Logger: log})
	if err != nil {
		return err
	}
	chain, err := nodeCA.Sign(&key.PublicKey, id, *ttl)
	if err != nil {
		return err
	}
	if err := identity.WriteNodeCredential(*out, chain[0], key, nodeCA.Roots()); err != nil {
		return err
	}
	fmt.Printf("node credential for %s written to %s\nserial %s, valid until %s\n", id, *out,
		chain[0].SerialNumber.Text(16), chain[0].NotAfter.UTC().Format(time.RFC3339))
	return nil
}

func runCARoot(args []string) error {
	fs := flag.NewFlagSet("ca root", flag.ContinueOnError)
	path := fs.String("config", "/etc/meshtun/mesh.yaml", "the mesh config `file`")
	ttl := fs.Duration("ttl", 0, "lifetime of a prepared root (default 10 years)")
	fs.Usage = func() {
		fmt.Fprint(fs.Output(), `usage: meshtun ca root prepare|activate|retire [flags]

A rotation in three steps; wait one ca.svidTTL after each step so that every
node has a certificate issued after it (nodes learn the roots with every
certificate):
  prepare    create the next root; it is trusted, but signs nothing yet
  activate   the next root signs; the old one stays trusted
  retire     drop the old root from the trust bundle
`)
		fs.PrintDefaults()
	}
	if len(args) == 0 {
		fs.Usage()
		return errors.New("missing step")
	}
	step := args[0]
	if err := fs.Parse(args[1:]); err != nil {
		return err
	}
	c, ca, err := loadCAConfig(*path, zerolog.Nop())
	if err != nil {
		return err
	}
	switch step {
	case "prepare":
		root, err := identity.PrepareRoot(c.CA.Dir, ca.TrustDomain(), *ttl)
		if err != nil {
			return err
		}
		fmt.Printf("next root prepared: serial %s, valid until %s\n", root.SerialNumber.Text(16), root.NotAfter.UTC().Format(time.RFC3339))
	case "activate":
		if err := identity.ActivateRoot(c.CA.Dir); err != nil {
			return err
		}
		fmt.Println("next root activated; the previous root stays trusted until `meshtun ca root retire`")
	case "retire":
		if err := identity.RetireRoots(c.CA.Dir); err != nil {
			return err
		}
		fmt.Println("previous roots retired")
	default:
		fs.Usage()
		return fmt.Errorf("unknown step %q", step)
	}
	return nil
}
