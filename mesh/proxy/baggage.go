package proxy

import (
	"errors"
	"fmt"
	"strings"
	"unicode/utf8"

	"github.com/rs/zerolog"
	"github.com/spiffe/go-spiffe/v2/spiffeid"

	"github.com/meshtun/meshtun/mesh/metrics"
	"github.com/meshtun/meshtun/mesh/registry"
	"github.com/meshtun/meshtun/protocols/hbone"
)

// Baggage keys ztunnel sends about the source workload of an HBONE
// request (and reads back on its inbound side).
const (
	baggageCluster   = "k8s.cluster.name"
	baggageNamespace = "k8s.namespace.name"
	baggageService   = "service.name"    // canonical service
	baggageRevision  = "service.version" // canonical revision
	baggageRegion    = "cloud.region"
	baggageZone      = "cloud.availability_zone"
)

// workloadKinds are the k8s.<kind>.name keys ztunnel reads as the
// workload's name (istiod's workload types).
var workloadKinds = []string{"deployment", "cronjob", "pod", "job"}

// baggage is the W3C baggage ztunnel sends about the source workload:
// its cluster, namespace, workload (k8s.<type>.name: the owner istiod
// names, a Deployment's for its pods; the pod's own name under
// k8s.pod.name when the model knows no owner), canonical service and
// revision, and its region and zone when known. Empty values are left
// out, as ztunnel leaves them.
func baggage(w *registry.Workload) hbone.Baggage {
	b := make(hbone.Baggage, 7)
	set := func(k, v string) {
		if v != "" {
			b[k] = v
		}
	}
	set(baggageCluster, w.Cluster)
	set(baggageNamespace, w.Namespace)
	kind, name := w.WorkloadType, w.WorkloadName
	if kind == "" || name == "" || !tokenOnly(kind) {
		kind, name = "pod", w.Name
	}
	set("k8s."+kind+".name", name)
	svc, rev := w.Canonical()
	set(baggageService, svc)
	set(baggageRevision, rev)
	set(baggageRegion, w.Locality.Region)
	set(baggageZone, w.Locality.Zone)
	return b
}

func tokenOnly(s string) bool {
	for i := 0; i < len(s); i++ {
		c := s[i]
		if (c < 'a' || c > 'z') && (c < '0' || c > '9') && c != '-' && c != '_' {
			return false
		}
	}
	return s != ""
}

// derivedPeer is the source of an inbound connection as its peer's
// baggage describes it: ztunnel's "derived source", used for the metric
// labels and the access log when the model does not know the source
// workload (a peer of another cluster, or behind an address the model
// does not have). Its principal is always the verified peer's.
type derivedPeer struct {
	peer metrics.Peer
}

// maxBaggageValue bounds each value taken from a peer's baggage into
// labels and logs: a DNS name's length.
const maxBaggageValue = 253

// deriveSource reads the source's description from a peer's baggage.
// The peer controls it, so it is checked before it becomes metric labels:
// every value printable UTF-8 of at most maxBaggageValue bytes, and the
// namespace, when the peer's SPIFFE ID names one, that namespace (a peer
// cannot claim to be another namespace's). Baggage that says nothing of
// the source is no derived source (nil, nil).
func deriveSource(b hbone.Baggage, id spiffeid.ID) (*derivedPeer, error) {
	var d derivedPeer
	get := func(k string) (string, error) {
		v := b[k]
		if len(v) > maxBaggageValue {
			return "", fmt.Errorf("baggage %s: %d bytes, over %d", k, len(v), maxBaggageValue)
		}
		if !utf8.ValidString(v) || strings.ContainsFunc(v, func(r rune) bool { return r < 0x20 || r == 0x7f }) {
			return "", fmt.Errorf("baggage %s = %q: not printable UTF-8", k, v)
		}
		return v, nil
	}
	var errs []error
	for _, f := range []struct {
		key string
		dst *string
	}{
		{baggageCluster, &d.peer.Cluster}, {baggageNamespace, &d.peer.Namespace},
		{baggageService, &d.peer.CanonicalService}, {baggageRevision, &d.peer.CanonicalRevision},
		{baggageRegion, &d.peer.Region}, {baggageZone, &d.peer.Zone},
	} {
		v, err := get(f.key)
		errs = append(errs, err)
		*f.dst = v
	}
	for _, kind := range workloadKinds {
		if v, err := get("k8s." + kind + ".name"); err != nil || v != "" {
			errs = append(errs, err)
			d.peer.Workload = v
			break
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	if ns := idNamespace(id); ns != "" && d.peer.Namespace != "" && d.peer.Namespace != ns {
		return nil, fmt.Errorf("baggage %s = %q, but the peer %s is of namespace %q", baggageNamespace, d.peer.Namespace, id, ns)
	}
	if d.peer == (metrics.Peer{}) {
		return nil, nil
	}
	if d.peer.Namespace == "" {
		d.peer.Namespace = idNamespace(id)
	}
	return &d, nil
}

// idNamespace is the namespace of an Istio SPIFFE ID
// (spiffe://<td>/ns/<namespace>/sa/<sa>), "" for any other form.
func idNamespace(id spiffeid.ID) string {
	parts := strings.Split(id.Path(), "/")
	if len(parts) == 5 && parts[0] == "" && parts[1] == "ns" && parts[3] == "sa" {
		return parts[2]
	}
	return ""
}

// fields adds the derived source to an access-log line, as ztunnel logs
// its derived source.
func (d *derivedPeer) fields(ev *zerolog.Event) {
	if d.peer.Workload != "" {
		ev.Str("src.workload", d.peer.Workload)
	}
	if d.peer.Namespace != "" {
		ev.Str("src.namespace", d.peer.Namespace)
	}
	if d.peer.Cluster != "" {
		ev.Str("src.cluster", d.peer.Cluster)
	}
}
