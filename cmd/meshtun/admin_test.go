package main

import (
	"context"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
)

// meshtun admin sends the method and path to the socket and prints the
// answer; a refusal is an error with the node's message.
func TestAdminCommand(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "admin.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/logging", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost || r.URL.Query().Get("level") != "debug" {
			http.Error(w, "bad level", http.StatusBadRequest)
			return
		}
		w.Write([]byte(`{"level":"debug"}`))
	})
	srv := &http.Server{Handler: mux}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	var out strings.Builder
	if err := runAdmin(context.Background(), []string{"-socket", sock, "-X", "post", "/logging?level=debug"}, &out); err != nil {
		t.Fatal(err)
	}
	if out.String() != `{"level":"debug"}` {
		t.Errorf("output %q", out.String())
	}
	err = runAdmin(context.Background(), []string{"-socket", sock, "-X", "POST", "/logging?level=loud"}, &out)
	if err == nil || !strings.Contains(err.Error(), "400 Bad Request: bad level") {
		t.Errorf("refused request: %v", err)
	}
	if err := runAdmin(context.Background(), []string{"-socket", sock + ".none", "/logging"}, &out); err == nil || !strings.Contains(err.Error(), ".none") {
		t.Errorf("missing socket: %v, want an error naming it", err)
	}
}
