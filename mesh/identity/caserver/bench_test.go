package caserver

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/identity"
	"github.com/meshtun/meshtun/mesh/registry"
)

// benchFixture is a CA serving on loopback whose config puts 100 workloads
// on each of nodes n1 … n100.
func benchFixture(b *testing.B, nodes, perNode int) *fixture {
	f := &fixture{logs: &syncBuffer{}, dir: b.TempDir()}
	var err error
	f.ca, err = identity.OpenCA(identity.CAConfig{Dir: f.dir + "/ca", TrustDomain: td, SVIDTTL: time.Hour})
	if err != nil {
		b.Fatal(err)
	}
	f.file = NewFileMode(td, f.ca.Roots)
	var names []string
	var ws []*registry.Workload
	for n := 1; n <= nodes; n++ {
		node := fmt.Sprintf("n%d", n)
		names = append(names, node)
		for w := 1; w <= perNode; w++ {
			sa := fmt.Sprintf("w%d-%d", n, w)
			ws = append(ws, &registry.Workload{Name: sa, Node: node, InMesh: true, Identity: wid("default", sa)})
		}
	}
	f.file.Update(names, ws, nil)
	srv, err := New(Config{CA: f.ca, Authenticators: []Authenticator{f.file}, Authorizer: f.file, Logger: zerolog.Nop()})
	if err != nil {
		b.Fatal(err)
	}
	f.addr = serveLoopback(b, srv)
	return f
}

// BenchmarkIssuance measures `meshtun ca` issuing ECDSA P-256 certificates
// to 100 nodes at once, each on its own gRPC+TLS connection over loopback.
// Every request is a full issuance: the node makes a key and a CSR, the
// service authenticates the node credential, checks the CSR and the
// node's workloads, signs, and the node parses the chain. Client and
// service share the machine. Reports CSRs/s and the p99 latency.
func BenchmarkIssuance(b *testing.B) {
	const clients = 100
	f := benchFixture(b, clients, 1)
	issuers := make([]*identity.RemoteIssuer, clients)
	for i := range issuers {
		issuers[i] = benchClient(b, f, fmt.Sprintf("n%d", i+1))
		// Connect and warm up.
		if _, err := issuers[i].Issue(context.Background(), wid("default", fmt.Sprintf("w%d-1", i+1))); err != nil {
			b.Fatal(err)
		}
	}
	lat := make([][]time.Duration, clients)
	next := make(chan struct{}, b.N)
	for range b.N {
		next <- struct{}{}
	}
	close(next)
	b.ResetTimer()
	start := time.Now()
	var wg sync.WaitGroup
	for i := range clients {
		wg.Go(func() {
			id := wid("default", fmt.Sprintf("w%d-1", i+1))
			for range next {
				t0 := time.Now()
				if _, err := issuers[i].Issue(context.Background(), id); err != nil {
					b.Error(err)
					return
				}
				lat[i] = append(lat[i], time.Since(t0))
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)
	b.StopTimer()
	all := slices.Concat(lat...)
	slices.Sort(all)
	if len(all) > 0 {
		b.ReportMetric(float64(len(all))/elapsed.Seconds(), "CSRs/s")
		b.ReportMetric(float64(all[len(all)*99/100].Microseconds())/1000, "p99-ms")
		b.ReportMetric(float64(all[len(all)/2].Microseconds())/1000, "p50-ms")
	}
}

// BenchmarkNodeWith100Workloads measures how long a node that learns of
// 100 new workloads takes until it holds all their certificates (one
// Source.AddAll, as the node does at start and on a config change).
func BenchmarkNodeWith100Workloads(b *testing.B) {
	const workloads = 100
	f := benchFixture(b, 1, workloads)
	ids := make([]spiffeid.ID, workloads)
	for i := range ids {
		ids[i] = wid("default", fmt.Sprintf("w1-%d", i+1))
	}
	for b.Loop() {
		r := benchClient(b, f, "n1")
		src, err := identity.NewSource(identity.SourceConfig{Issuer: r, Bundle: r.Bundle(), TrustDomain: td})
		if err != nil {
			b.Fatal(err)
		}
		if err := src.AddAll(context.Background(), ids); err != nil {
			b.Fatal(err)
		}
		if st := src.Stats(); st.Valid != workloads {
			b.Fatalf("%d of %d valid", st.Valid, workloads)
		}
		src.Close()
		r.Close()
	}
}

func benchClient(b *testing.B, f *fixture, node string) *identity.RemoteIssuer {
	b.Helper()
	dir := f.credentialTB(b, node, time.Hour)
	cred, err := identity.OpenNodeCredential(dir)
	if err != nil {
		b.Fatal(err)
	}
	r, err := identity.DialCA(identity.RemoteConfig{Address: f.addr, TrustDomain: td,
		Bundle: identity.NewTrustBundle(td, f.ca.Roots()), Credential: cred.Get})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { r.Close() })
	return r
}

// BenchmarkIssuanceOne is one node asking one request at a time: the
// latency of an issuance without queueing.
func BenchmarkIssuanceOne(b *testing.B) {
	f := benchFixture(b, 1, 1)
	r := benchClient(b, f, "n1")
	id := wid("default", "w1-1")
	if _, err := r.Issue(context.Background(), id); err != nil {
		b.Fatal(err)
	}
	for b.Loop() {
		if _, err := r.Issue(context.Background(), id); err != nil {
			b.Fatal(err)
		}
	}
}
