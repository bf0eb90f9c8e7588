// Command ztunnel-config renders a ztunnel-shaped /config_dump the way
// `istioctl ztunnel-config all` does: it feeds the JSON on stdin to
// istioctl's own reader and table writer
// (istio.io/istio/istioctl/pkg/writer/ztunnel/configdump) and prints its
// summary of workloads, services, policies and certificates (`all`),
// then its policy dump (`policy -o json`), which carries the rules as
// istioctl's types read them. test/kube
// runs it on the dump of a meshtun node under istiod, so meshtun's
// ztunnel shape is checked by the code istioctl runs, not by field names.
//
// It lives in the interop module, which already requires istio.io/istio;
// istioctl itself needs a pod to port-forward to, which a test without a
// kubelet does not have, so the command reads the dump from stdin instead.
//
//	curl -s localhost:15000/config_dump?format=ztunnel | ztunnel-config
//
// It exits 1, with the reader's error on stderr, when istioctl's reader
// or writer refuses the dump.
package main

import (
	"io"
	"os"

	"github.com/rs/zerolog"
	"istio.io/istio/istioctl/pkg/writer/ztunnel/configdump"
)

func main() {
	log := zerolog.New(os.Stderr)
	dump, err := io.ReadAll(os.Stdin)
	if err != nil {
		log.Fatal().Err(err).Msg("read the config dump from stdin")
	}
	w := &configdump.ConfigWriter{Stdout: os.Stdout, FullDump: dump}
	if err := w.Prime(dump); err != nil {
		log.Fatal().Err(err).Msg("istioctl's reader refused the config dump")
	}
	if err := w.PrintFullSummary(true); err != nil {
		log.Fatal().Err(err).Msg("istioctl's writer refused the config dump")
	}
	os.Stdout.WriteString("\n------ POLICY DUMP ------\n\n")
	if err := w.PrintPolicyDump(configdump.PolicyFilter{}, "json"); err != nil {
		log.Fatal().Err(err).Msg("istioctl's writer refused the policies")
	}
}
