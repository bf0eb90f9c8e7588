package xds

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"slices"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	discoveryv3 "github.com/envoyproxy/go-control-plane/envoy/service/discovery/v3"
	statuspb "google.golang.org/genproto/googleapis/rpc/status"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/types/known/structpb"
)

// stream opens one delta ADS stream, subscribes to every type (wildcard)
// and answers each response with an ACK or a NACK until the stream breaks.
func (s *Source) stream(ctx context.Context) error {
	roots, err := os.ReadFile(s.cfg.RootCertFile)
	if err != nil {
		return fmt.Errorf("istiod root certificate: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(roots) {
		return fmt.Errorf("istiod root certificate %s: no PEM certificate in it", s.cfg.RootCertFile)
	}
	opts := []grpc.DialOption{
		// A full state is one message: gRPC's default limit (4 MiB,
		// ~13k workloads) would make a large mesh undeliverable.
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(s.cfg.MaxMessageSize)),
		grpc.WithTransportCredentials(credentials.NewTLS(&tls.Config{
			RootCAs: pool, ServerName: s.cfg.ServerName, MinVersion: tls.VersionTLS12,
		})),
	}
	if s.cfg.TokenFile != "" {
		opts = append(opts, grpc.WithPerRPCCredentials(tokenFile(s.cfg.TokenFile)))
	}
	if s.cfg.Dial != nil {
		opts = append(opts, grpc.WithContextDialer(s.cfg.Dial))
	}
	conn, err := grpc.NewClient("passthrough:///"+s.cfg.Address, opts...)
	if err != nil {
		return fmt.Errorf("istiod %s: %w", s.cfg.Address, err)
	}
	defer conn.Close()
	sctx, cancel := context.WithCancel(ctx)
	defer cancel()
	st, err := discoveryv3.NewAggregatedDiscoveryServiceClient(conn).DeltaAggregatedResources(sctx)
	if err != nil {
		return fmt.Errorf("istiod %s: open stream: %w", s.cfg.Address, err)
	}
	node := s.node()
	for i, t := range Types {
		// An initial request without names subscribes to every resource
		// of the type (a wildcard subscription).
		req := &discoveryv3.DeltaDiscoveryRequest{TypeUrl: t}
		if i == 0 {
			req.Node = node
		}
		if err := st.Send(req); err != nil {
			return fmt.Errorf("istiod %s: subscribe: %w", s.cfg.Address, err)
		}
	}
	s.mu.Lock()
	s.status.Connects++
	s.mu.Unlock()
	seen := map[string]bool{}
	for {
		resp, err := st.Recv()
		if err != nil {
			return fmt.Errorf("istiod %s: %w", s.cfg.Address, err)
		}
		s.mu.Lock()
		s.status.Connected = true
		s.mu.Unlock()
		var nack string
		if !slices.Contains(Types, resp.TypeUrl) {
			nack = "type " + resp.TypeUrl + " was not subscribed to"
		} else {
			nack = s.apply(response{
				typeURL: resp.TypeUrl, full: !seen[resp.TypeUrl],
				resources: resp.Resources, removed: resp.RemovedResources,
			})
			seen[resp.TypeUrl] = true
		}
		req := &discoveryv3.DeltaDiscoveryRequest{TypeUrl: resp.TypeUrl, ResponseNonce: resp.Nonce}
		s.mu.Lock()
		if nack != "" {
			req.ErrorDetail = &statuspb.Status{Code: int32(codes.InvalidArgument), Message: nack}
			s.status.NACKs++
			s.status.LastNACK = nack
		} else {
			s.status.ACKs++
		}
		if slices.Contains(Types, resp.TypeUrl) { // bounded: no label for a type istiod made up
			s.count(resp.TypeUrl, resourceBytes(resp.Resources), nack != "", time.Now())
		}
		s.mu.Unlock()
		if nack != "" {
			s.log.Warn().Str("type", resp.TypeUrl).Str("nonce", resp.Nonce).Str("error", nack).Msg("NACK")
		} else {
			s.log.Debug().Str("type", resp.TypeUrl).Str("nonce", resp.Nonce).Msg("ACK")
		}
		if err := st.Send(req); err != nil {
			return fmt.Errorf("istiod %s: ack: %w", s.cfg.Address, err)
		}
	}
}

// resourceBytes is the size of the resources' bodies, as ztunnel counts
// istio_xds_message_bytes_total.
func resourceBytes(rs []*discoveryv3.Resource) int {
	n := 0
	for _, r := range rs {
		n += len(r.GetResource().GetValue())
	}
	return n
}

// node is the node ztunnel presents: its ID names the proxy type
// (ztunnel), its address, its pod and namespace; the metadata gives the
// pod, namespace, service account, Kubernetes node and cluster, which
// istiod checks against the token's identity.
func (s *Source) node() *corev3.Node {
	n := s.cfg.Node
	md := map[string]any{
		"NAME":            n.PodName,
		"NAMESPACE":       n.Namespace,
		"SERVICE_ACCOUNT": n.ServiceAccount,
		"NODE_NAME":       n.NodeName,
		"CLUSTER_ID":      n.ClusterID,
		"INSTANCE_IPS":    n.IP.String(),
	}
	if n.Network != "" {
		md["NETWORK"] = n.Network
	}
	st, err := structpb.NewStruct(md)
	if err != nil { // only strings: cannot fail
		panic(err)
	}
	return &corev3.Node{Id: n.ID(s.cfg.DomainSuffix), Metadata: st}
}

// tokenFile sends the token in a file as "authorization: Bearer", read
// on every stream (projected tokens are rotated by the kubelet).
type tokenFile string

func (t tokenFile) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	b, err := os.ReadFile(string(t))
	if err != nil {
		return nil, fmt.Errorf("service-account token: %w", err)
	}
	tok := strings.TrimSpace(string(b))
	if tok == "" {
		return nil, errors.New("service-account token: " + string(t) + " is empty")
	}
	return map[string]string{"authorization": "Bearer " + tok}, nil
}

func (tokenFile) RequireTransportSecurity() bool { return true }
