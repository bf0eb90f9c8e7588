package identity

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	delegated "github.com/spiffe/spire-api-sdk/proto/spire/api/agent/delegatedidentity/v1"
	"github.com/spiffe/spire-api-sdk/proto/spire/api/types"
	"google.golang.org/grpc"
)

// fakeAgent serves the Delegated Identity API from a CA: the SVIDs of the
// workload identities it has an entry for, selected by k8s:ns and k8s:sa.
type fakeAgent struct {
	delegated.UnimplementedDelegatedIdentityServer
	ca      *CA
	entries map[string]bool // "ns/sa"
}

func (f *fakeAgent) SubscribeToX509SVIDs(req *delegated.SubscribeToX509SVIDsRequest, stream delegated.DelegatedIdentity_SubscribeToX509SVIDsServer) error {
	var ns, sa string
	for _, s := range req.GetSelectors() {
		if s.GetType() != "k8s" {
			continue
		}
		if v, ok := strings.CutPrefix(s.GetValue(), "ns:"); ok {
			ns = v
		}
		if v, ok := strings.CutPrefix(s.GetValue(), "sa:"); ok {
			sa = v
		}
	}
	resp := &delegated.SubscribeToX509SVIDsResponse{}
	if f.entries[ns+"/"+sa] {
		id, _ := WorkloadID(f.ca.TrustDomain(), ns, sa)
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		chain, err := f.ca.Sign(&key.PublicKey, id, time.Hour)
		if err != nil {
			return err
		}
		der, _ := x509.MarshalPKCS8PrivateKey(key)
		resp.X509Svids = []*delegated.X509SVIDWithKey{{
			X509Svid:    &types.X509SVID{Id: &types.SPIFFEID{TrustDomain: id.TrustDomain().Name(), Path: id.Path()}, CertChain: [][]byte{chain[0].Raw}, ExpiresAt: chain[0].NotAfter.Unix()},
			X509SvidKey: der,
		}}
	}
	if err := stream.Send(resp); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

func (f *fakeAgent) SubscribeToX509Bundles(_ *delegated.SubscribeToX509BundlesRequest, stream delegated.DelegatedIdentity_SubscribeToX509BundlesServer) error {
	var raw []byte
	for _, r := range f.ca.Roots() {
		raw = append(raw, r.Raw...)
	}
	if err := stream.Send(&delegated.SubscribeToX509BundlesResponse{CaCertificates: map[string][]byte{f.ca.TrustDomain().IDString(): raw}}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

func TestSpireIssuer(t *testing.T) {
	ca := openCA(t, t.TempDir(), testTD, time.Hour)
	sock := filepath.Join(t.TempDir(), "admin.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer()
	delegated.RegisterDelegatedIdentityServer(g, &fakeAgent{ca: ca, entries: map[string]bool{"default/a": true}})
	go g.Serve(lis)
	defer g.Stop()

	sp, err := DialSpire(context.Background(), SpireConfig{AdminSocket: sock, TrustDomain: testTD, Timeout: time.Second, Logger: testLogger(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer sp.Close()
	if roots := sp.Bundle().Roots(); len(roots) != 1 || !roots[0].Equal(ca.Root()) {
		t.Fatalf("bundle %v, want the agent's root", roots)
	}
	a := mustID(t, testTD, "default", "a")
	svid, err := sp.Issue(context.Background(), a)
	if err != nil || svid.ID != a {
		t.Fatalf("Issue(%s) = %v, %v", a, svid, err)
	}
	if _, err := svid.Certificates[0].Verify(x509.VerifyOptions{Roots: sp.Bundle().Pool(), KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}}); err != nil {
		t.Errorf("SVID does not verify against the bundle: %v", err)
	}
	b := mustID(t, testTD, "default", "b")
	if svid, err := sp.Issue(context.Background(), b); err == nil {
		t.Fatalf("Issue(%s) without an entry = %s, want an error", b, svid.ID)
	} else if !strings.Contains(err.Error(), "k8s:ns:default, k8s:sa:b") {
		t.Errorf("error %q does not name the selectors", err)
	}
	if _, err := sp.Issue(context.Background(), mustID(t, testTD, "x", "y")); err == nil {
		t.Error("Issue for a workload without entry: no error")
	}
}
