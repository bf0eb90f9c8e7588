package caserver

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/meshtun/meshtun/mesh/identity"
)

// RootStore is what KubeRoot calls on the API server: one Secret and one
// ConfigMap (kubeapi.Client).
type RootStore interface {
	GetSecret(ctx context.Context, namespace, name string) (*corev1.Secret, error)
	CreateSecret(ctx context.Context, s *corev1.Secret) (*corev1.Secret, error)
	GetConfigMap(ctx context.Context, namespace, name string) (*corev1.ConfigMap, error)
	CreateConfigMap(ctx context.Context, cm *corev1.ConfigMap) (*corev1.ConfigMap, error)
	UpdateConfigMap(ctx context.Context, cm *corev1.ConfigMap) (*corev1.ConfigMap, error)
}

// KubeRoot keeps the CA root in a Kubernetes Secret, as istiod's
// self-signed CA does: the first `meshtun ca serve` to start makes one;
// every start copies it into the CA directory and publishes its
// certificate (never the key) in a ConfigMap, the one the node proxies
// mount to verify `meshtun ca`.
//
// Its RBAC (deploy/kubernetes/ca.yaml) is a Role in the Secret's
// namespace: get on that Secret and get, update on that ConfigMap, by
// resourceNames, and create on secrets and configmaps without
// resourceNames: the authorizer cannot restrict a create by name (the
// name is in the body, not the URL), so a create rule with resourceNames
// never matches.
type KubeRoot struct {
	Store RootStore
	// Namespace holds both objects; Secret and ConfigMap are their names.
	Namespace, Secret, ConfigMap string
	// Dir is the CA directory (identity.CAConfig.Dir).
	Dir         string
	TrustDomain spiffeid.TrustDomain
	Logger      zerolog.Logger
}

// Ensure makes sure the Secret holds a root (creating one if it does not
// exist; if another replica creates it first, that one is used), writes it
// into Dir, and publishes its certificate in the ConfigMap under
// identity.RootCertFile.
func (k KubeRoot) Ensure(ctx context.Context) error {
	sec, err := k.Store.GetSecret(ctx, k.Namespace, k.Secret)
	if apierrors.IsNotFound(err) {
		sec, err = k.create(ctx)
	} else if err != nil {
		err = fmt.Errorf("ca: read Secret %s/%s: %w", k.Namespace, k.Secret, err)
	}
	if err != nil {
		return err
	}
	key, cert := sec.Data[identity.RootKeyFile], sec.Data[identity.RootCertFile]
	if len(key) == 0 || len(cert) == 0 {
		return fmt.Errorf("ca: Secret %s/%s lacks %s or %s", k.Namespace, k.Secret, identity.RootKeyFile, identity.RootCertFile)
	}
	if err := k.install(key, cert); err != nil {
		return err
	}
	return k.publish(ctx, cert)
}

// create makes a root in a directory of its own under Dir and creates the
// Secret with it; on a conflict (another replica was first) it reads the
// Secret that won.
func (k KubeRoot) create(ctx context.Context) (*corev1.Secret, error) {
	if err := os.MkdirAll(k.Dir, 0o700); err != nil {
		return nil, err
	}
	tmp, err := os.MkdirTemp(k.Dir, ".new-root-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(tmp)
	if _, err := identity.OpenCA(identity.CAConfig{Dir: tmp, TrustDomain: k.TrustDomain, Logger: zerolog.Nop()}); err != nil {
		return nil, err
	}
	data := map[string][]byte{}
	for _, f := range []string{identity.RootKeyFile, identity.RootCertFile} {
		if data[f], err = os.ReadFile(filepath.Join(tmp, f)); err != nil {
			return nil, err
		}
	}
	s := &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Namespace: k.Namespace, Name: k.Secret, Labels: map[string]string{"app.kubernetes.io/name": "meshtun-ca"}},
		Type:       corev1.SecretTypeOpaque,
		Data:       data,
	}
	out, err := k.Store.CreateSecret(ctx, s)
	if apierrors.IsAlreadyExists(err) {
		k.Logger.Info().Str("secret", k.Namespace+"/"+k.Secret).Msg("another CA replica created the root first; using that one")
		if out, err = k.Store.GetSecret(ctx, k.Namespace, k.Secret); err != nil {
			return nil, fmt.Errorf("ca: read Secret %s/%s after a create conflict: %w", k.Namespace, k.Secret, err)
		}
		return out, nil
	}
	if err != nil {
		return nil, fmt.Errorf("ca: create Secret %s/%s with a new root: %w", k.Namespace, k.Secret, err)
	}
	k.Logger.Info().Str("secret", k.Namespace+"/"+k.Secret).Str("trust_domain", k.TrustDomain.String()).Msg("no CA root yet: created a self-signed root and stored it in the Secret")
	return out, nil
}

// install writes the root into Dir unless the same root is there already.
// The Secret is the root: a different one in Dir is replaced.
func (k KubeRoot) install(key, cert []byte) error {
	if err := os.MkdirAll(k.Dir, 0o700); err != nil {
		return err
	}
	oldKey, kerr := os.ReadFile(filepath.Join(k.Dir, identity.RootKeyFile))
	oldCert, cerr := os.ReadFile(filepath.Join(k.Dir, identity.RootCertFile))
	if kerr == nil && cerr == nil && bytes.Equal(oldKey, key) && bytes.Equal(oldCert, cert) {
		return nil
	}
	if kerr == nil {
		k.Logger.Warn().Str("dir", k.Dir).Str("secret", k.Namespace+"/"+k.Secret).Msg("the CA directory held another root; replaced by the Secret's")
	}
	for _, f := range []struct {
		name string
		data []byte
	}{{identity.RootCertFile, cert}, {identity.RootKeyFile, key}} {
		if err := os.WriteFile(filepath.Join(k.Dir, f.name), f.data, 0o600); err != nil {
			return err
		}
	}
	return nil
}

// publish puts cert into the ConfigMap: created if missing, updated if it
// holds something else, a concurrent change re-read (a few times).
func (k KubeRoot) publish(ctx context.Context, cert []byte) error {
	name := k.Namespace + "/" + k.ConfigMap
	var last error
	for range 5 {
		cm, err := k.Store.GetConfigMap(ctx, k.Namespace, k.ConfigMap)
		if apierrors.IsNotFound(err) {
			_, err = k.Store.CreateConfigMap(ctx, &corev1.ConfigMap{
				ObjectMeta: metav1.ObjectMeta{Namespace: k.Namespace, Name: k.ConfigMap, Labels: map[string]string{"app.kubernetes.io/name": "meshtun-ca"}},
				Data:       map[string]string{identity.RootCertFile: string(cert)},
			})
			if err == nil {
				k.Logger.Info().Str("configmap", name).Msg("published the CA root certificate")
				return nil
			}
			if last = err; apierrors.IsAlreadyExists(err) {
				continue
			}
			return fmt.Errorf("ca: create ConfigMap %s: %w", name, err)
		}
		if err != nil {
			return fmt.Errorf("ca: read ConfigMap %s: %w", name, err)
		}
		if cm.Data[identity.RootCertFile] == string(cert) {
			return nil
		}
		if cm.Data == nil {
			cm.Data = map[string]string{}
		}
		cm.Data[identity.RootCertFile] = string(cert)
		if _, err = k.Store.UpdateConfigMap(ctx, cm); err == nil {
			k.Logger.Info().Str("configmap", name).Msg("published the CA root certificate (replacing another)")
			return nil
		}
		if last = err; !apierrors.IsConflict(err) {
			return fmt.Errorf("ca: update ConfigMap %s: %w", name, err)
		}
	}
	return errors.Join(fmt.Errorf("ca: publish the root certificate in ConfigMap %s: kept changing", name), last)
}
