// Package interop holds interoperability tests between meshtun's HBONE
// implementation (protocols/hbone with certificates from mesh/identity) and
// Istio's own Go HBONE implementation, istio.io/istio/pkg/hbone: a peer we
// did not write.
//
// It is a module of its own so that Istio's large module graph stays out of
// the product's go.mod; `make test` runs it. Everything runs over loopback
// with real TLS 1.3 and SPIFFE X509-SVIDs issued by meshtun's built-in CA
// (identity.OpenCA in a temporary directory). The Istio side verifies our
// certificates with Istio's own SPIFFE verifier (pkg/spiffe.PeerCertVerifier,
// loaded from the CA's root-cert.pem as Istio loads a root file) and reads
// identities with Istio's SAN parser (security/pkg/pki/util.ExtractIDs).
//
// cmd/istio-hbone-peer is the same Istio side as a program: test/kube's
// TestIstiod runs it inside its test cluster's network namespaces, with
// certificates from a real istiod's CA, against meshtun nodes.
//
// What this Istio version's pkg/hbone does on the wire, as the tests pin it
// (ztunnel, the Rust node proxy, behaves differently where noted):
//
//   - Its server (NewServer) flushes the 200 response before it dials the
//     target, so an unreachable target is not answered with 503: the client
//     sees 200 and a stream that ends at once without data. Its later
//     WriteHeader(503) is dropped by net/http as superfluous. ztunnel, and
//     meshtun's server, answer 200 only after the upstream connected.
//   - Its server maps the client's END_STREAM to a TCP half-close of the
//     upstream (CloseWrite), so client-first half-close is exact. When the
//     upstream sends its FIN first, it closes the request body and returns:
//     the upstream's write side is shut too (the upstream reads EOF although
//     the client never ended its half), the response ends with END_STREAM,
//     and net/http resets the client's open half (RST_STREAM NO_ERROR), so
//     what the client writes afterwards is lost.
//   - Its dialer sends no forwarded, baggage or traceparent headers:
//     Config.Headers is ignored. It sends user-agent Go-http-client/2.0 and
//     accept-encoding gzip, which meshtun's client does not. Both send the
//     same pseudo-headers for CONNECT (:method, :authority = ip:port, no
//     :scheme or :path). Its HTTP/2 settings are x/net's defaults: frames
//     up to 16 KiB and a 1 GiB connection window, where meshtun advertises
//     ztunnel's 1 MiB and 16 MiB (stream window 4 MiB on both).
//   - Neither end carries a reset. Its server half-closes the upstream
//     when the client resets the stream (RST_STREAM), and ends the stream
//     normally when the upstream resets (TCP RST); its dialer gives its
//     application an orderly EOF when the server resets the stream.
//     meshtun maps RST_STREAM and TCP RST onto each other.
//   - Its dialer returns one end of a net.Pipe: the application cannot
//     half-close; closing it sends END_STREAM.
package interop
