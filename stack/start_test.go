package stack

import (
	"net/netip"
	"testing"
	"time"

	"github.com/rs/zerolog"

	"github.com/meshtun/meshtun/stack/classify"
)

// startedConfig is Config with the handler Start takes, for the tests
// that build and start a stack in one step.
type startedConfig struct {
	Device     Device
	Classifier *classify.Classifier
	AckDelay   time.Duration
	Logger     zerolog.Logger
	HandleTCP  TCPHandler
}

// newStarted builds the stack and starts it with c.HandleTCP.
func newStarted(c startedConfig) (*Stack, error) {
	st, err := New(Config{Device: c.Device, Classifier: c.Classifier, AckDelay: c.AckDelay, Logger: c.Logger})
	if err != nil {
		return nil, err
	}
	if err := st.Start(c.HandleTCP); err != nil {
		st.Close()
		return nil, err
	}
	return st, nil
}

// TestStartOnce: a stack starts with a handler, once; one that was never
// started closes.
func TestStartOnce(t *testing.T) {
	cls := classify.New(classify.Config{Policy: classify.PolicyFunc(func(_, _ netip.AddrPort) bool { return true })})
	idle, err := New(Config{Device: newFakeDev(0), Classifier: cls, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	idle.Close()

	dev := newFakeDev(0)
	st, err := New(Config{Device: dev, Classifier: cls, Logger: zerolog.Nop()})
	if err != nil {
		t.Fatal(err)
	}
	defer func() { dev.close(); st.Close() }()
	if err := st.Start(nil); err == nil {
		t.Error("Start(nil): no error")
	}
	if err := st.Start(func(req *TCPRequest) { req.Reject() }); err != nil {
		t.Fatal(err)
	}
	if err := st.Start(func(req *TCPRequest) { req.Reject() }); err == nil {
		t.Error("second Start: no error")
	}
}
