package caserver

import (
	"context"
	"crypto/x509"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/meshtun/meshtun/mesh/identity"
)

// memStore is a RootStore in memory with the API server's create and
// update semantics (AlreadyExists, Conflict on a stale resourceVersion).
type memStore struct {
	mu      sync.Mutex
	secrets map[string]*corev1.Secret
	cms     map[string]*corev1.ConfigMap
	version int
	// beforeCreate, if set, runs (unlocked) before each Secret create:
	// the race window between a replica's read and its create.
	beforeCreate func()
	creates      int
}

func newMemStore() *memStore {
	return &memStore{secrets: map[string]*corev1.Secret{}, cms: map[string]*corev1.ConfigMap{}}
}

var gr = schema.GroupResource{Resource: "secrets"}

func (m *memStore) GetSecret(_ context.Context, ns, name string) (*corev1.Secret, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if s, ok := m.secrets[ns+"/"+name]; ok {
		return s.DeepCopy(), nil
	}
	return nil, apierrors.NewNotFound(gr, name)
}

func (m *memStore) CreateSecret(_ context.Context, s *corev1.Secret) (*corev1.Secret, error) {
	if m.beforeCreate != nil {
		m.beforeCreate()
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	m.creates++
	k := s.Namespace + "/" + s.Name
	if _, ok := m.secrets[k]; ok {
		return nil, apierrors.NewAlreadyExists(gr, s.Name)
	}
	m.secrets[k] = s.DeepCopy()
	return s, nil
}

func (m *memStore) GetConfigMap(_ context.Context, ns, name string) (*corev1.ConfigMap, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if c, ok := m.cms[ns+"/"+name]; ok {
		return c.DeepCopy(), nil
	}
	return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "configmaps"}, name)
}

func (m *memStore) CreateConfigMap(_ context.Context, c *corev1.ConfigMap) (*corev1.ConfigMap, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := c.Namespace + "/" + c.Name
	if _, ok := m.cms[k]; ok {
		return nil, apierrors.NewAlreadyExists(schema.GroupResource{Resource: "configmaps"}, c.Name)
	}
	m.version++
	c = c.DeepCopy()
	c.ResourceVersion = string(rune('a' + m.version))
	m.cms[k] = c
	return c, nil
}

func (m *memStore) UpdateConfigMap(_ context.Context, c *corev1.ConfigMap) (*corev1.ConfigMap, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := c.Namespace + "/" + c.Name
	old, ok := m.cms[k]
	if !ok {
		return nil, apierrors.NewNotFound(schema.GroupResource{Resource: "configmaps"}, c.Name)
	}
	if old.ResourceVersion != c.ResourceVersion {
		return nil, apierrors.NewConflict(schema.GroupResource{Resource: "configmaps"}, c.Name, nil)
	}
	m.version++
	c = c.DeepCopy()
	c.ResourceVersion = string(rune('a' + m.version))
	m.cms[k] = c
	return c, nil
}

func kubeRoot(store RootStore, dir string) KubeRoot {
	return KubeRoot{Store: store, Namespace: "meshtun-system", Secret: "meshtun-ca", ConfigMap: "meshtun-ca-root",
		Dir: dir, TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local"), Logger: zerolog.Nop()}
}

// TestKubeRootCreatesOnce: the first start creates the root into the
// Secret, the CA directory and the ConfigMap (certificate only); a second
// start (a new pod: an empty directory) reuses the Secret's root.
func TestKubeRootCreatesOnce(t *testing.T) {
	store := newMemStore()
	dir1 := t.TempDir()
	if err := kubeRoot(store, dir1).Ensure(t.Context()); err != nil {
		t.Fatal(err)
	}
	sec := store.secrets["meshtun-system/meshtun-ca"]
	if sec == nil || len(sec.Data[identity.RootKeyFile]) == 0 || len(sec.Data[identity.RootCertFile]) == 0 {
		t.Fatalf("Secret after the first start: %v", sec)
	}
	cm := store.cms["meshtun-system/meshtun-ca-root"]
	if cm == nil || cm.Data[identity.RootCertFile] != string(sec.Data[identity.RootCertFile]) || len(cm.Data) != 1 {
		t.Fatalf("ConfigMap after the first start: %v, want the root certificate only", cm)
	}
	ca, err := identity.OpenCA(identity.CAConfig{Dir: dir1, TrustDomain: spiffeid.RequireTrustDomainFromString("cluster.local"), Logger: zerolog.Nop()})
	if err != nil {
		t.Fatalf("the CA directory does not open: %v", err)
	}
	if !ca.Roots()[0].Equal(mustParse(t, sec.Data[identity.RootCertFile])) {
		t.Error("the CA directory's root is not the Secret's")
	}
	entries, _ := os.ReadDir(dir1)
	for _, e := range entries {
		if e.IsDir() {
			t.Errorf("left behind in the CA directory: %s", e.Name())
		}
	}

	dir2 := t.TempDir()
	if err := kubeRoot(store, dir2).Ensure(t.Context()); err != nil {
		t.Fatal(err)
	}
	if store.creates != 1 {
		t.Errorf("%d Secret creates, want 1", store.creates)
	}
	if !sameFile(t, filepath.Join(dir2, identity.RootKeyFile), sec.Data[identity.RootKeyFile]) {
		t.Error("the second start has another root key than the Secret's")
	}
	if st, err := os.Stat(filepath.Join(dir2, identity.RootKeyFile)); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("root key mode: %v %v, want 0600", st, err)
	}
}

func sameFile(t *testing.T, path string, want []byte) bool {
	t.Helper()
	got, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(got) == string(want)
}

// TestKubeRootRace: two replicas start together, both find no Secret and
// both create one; the loser re-reads the winner's, and both end up with
// the same root in their directories and in the ConfigMap.
func TestKubeRootRace(t *testing.T) {
	store := newMemStore()
	var both sync.WaitGroup
	both.Add(2)
	store.beforeCreate = func() { both.Done(); both.Wait() } // both have read "not found"
	dirs := []string{t.TempDir(), t.TempDir()}
	errs := make(chan error, 2)
	for _, d := range dirs {
		go func() { errs <- kubeRoot(store, d).Ensure(t.Context()) }()
	}
	for range dirs {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if store.creates != 2 {
		t.Fatalf("%d creates: the race was not run", store.creates)
	}
	sec := store.secrets["meshtun-system/meshtun-ca"]
	for _, d := range dirs {
		if !sameFile(t, filepath.Join(d, identity.RootKeyFile), sec.Data[identity.RootKeyFile]) {
			t.Errorf("%s holds another root than the Secret's", d)
		}
	}
	if got := store.cms["meshtun-system/meshtun-ca-root"].Data[identity.RootCertFile]; got != string(sec.Data[identity.RootCertFile]) {
		t.Error("the ConfigMap holds another certificate than the Secret's")
	}
}

// TestKubeRootRepublishes: a ConfigMap holding something else (an old
// root) is updated; a Secret without the root's files is an error naming
// it.
func TestKubeRootRepublishes(t *testing.T) {
	store := newMemStore()
	old := &corev1.ConfigMap{Data: map[string]string{identity.RootCertFile: "old"}}
	old.Namespace, old.Name = "meshtun-system", "meshtun-ca-root"
	if _, err := store.CreateConfigMap(t.Context(), old); err != nil {
		t.Fatal(err)
	}
	if err := kubeRoot(store, t.TempDir()).Ensure(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := store.cms["meshtun-system/meshtun-ca-root"].Data[identity.RootCertFile]; got == "old" {
		t.Error("the ConfigMap still holds the old certificate")
	}

	bad := newMemStore()
	bad.secrets["meshtun-system/meshtun-ca"] = &corev1.Secret{Data: map[string][]byte{identity.RootCertFile: []byte("x")}}
	err := kubeRoot(bad, t.TempDir()).Ensure(t.Context())
	if err == nil || !strings.Contains(err.Error(), "meshtun-system/meshtun-ca") || !strings.Contains(err.Error(), identity.RootKeyFile) {
		t.Errorf("a Secret without a key: %v, want an error naming it and %s", err, identity.RootKeyFile)
	}
}

func mustParse(t *testing.T, pem []byte) *x509.Certificate {
	t.Helper()
	certs, err := identity.ParseCertsPEM(pem)
	if err != nil || len(certs) != 1 {
		t.Fatalf("root certificate of the Secret: %d, %v", len(certs), err)
	}
	return certs[0]
}
