package caserver

import (
	"context"
	"crypto/tls"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/protobuf/types/known/structpb"
	pb "istio.io/api/security/v1alpha1"

	"github.com/meshtun/meshtun/mesh/identity"
)

// rawClient sends hand-made requests.
type rawClient struct {
	c pb.IstioCertificateServiceClient
}

func dialRaw(f *fixture, cred *identity.NodeCredential) (*rawClient, error) {
	tc := &tls.Config{MinVersion: tls.VersionTLS13, InsecureSkipVerify: true}
	if cred != nil {
		tc.GetClientCertificate = func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return cred.Get() }
	}
	conn, err := grpc.NewClient("passthrough:///"+f.addr, grpc.WithTransportCredentials(credentials.NewTLS(tc)))
	if err != nil {
		return nil, err
	}
	return &rawClient{c: pb.NewIstioCertificateServiceClient(conn)}, nil
}

func (r *rawClient) create(csr, impersonate string) ([]string, error) {
	req := &pb.IstioCertificateRequest{Csr: csr, ValidityDuration: 600}
	if impersonate != "" {
		req.Metadata, _ = structpb.NewStruct(map[string]any{identity.ImpersonatedIdentityKey: impersonate})
	}
	resp, err := r.c.CreateCertificate(context.Background(), req)
	if err != nil {
		return nil, err
	}
	return resp.GetCertChain(), nil
}
