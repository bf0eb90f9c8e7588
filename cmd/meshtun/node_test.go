package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestNodeProcs(t *testing.T) {
	for _, c := range []struct {
		flag    int
		envSet  bool
		runtime int
		want    int
	}{
		{0, false, 1, 1},
		{0, false, 2, 1},
		{0, false, 3, 1},
		{0, false, 8, 4},
		{0, false, 64, 32},
		{0, true, 2, 2}, // GOMAXPROCS=2 in the environment
		{3, false, 2, 3},
		{3, true, 8, 3}, // the flag wins
	} {
		if got := nodeProcs(c.flag, c.envSet, c.runtime); got != c.want {
			t.Errorf("nodeProcs(%d, %v, %d) = %d, want %d", c.flag, c.envSet, c.runtime, got, c.want)
		}
	}
}

// The CA token is read again for every request: a token the kubelet
// rotated is the one sent next; an empty file is an error, not an empty
// bearer.
func TestReadTokenRotates(t *testing.T) {
	path := filepath.Join(t.TempDir(), "token")
	for _, tok := range []string{"first", "second"} {
		if err := os.WriteFile(path, []byte(tok+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		got, err := readToken(path)
		if err != nil || got != tok {
			t.Fatalf("readToken = %q, %v; want %q", got, err, tok)
		}
	}
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := readToken(path); err == nil || !strings.Contains(err.Error(), "empty") {
		t.Fatalf("readToken of an empty file: %v, want an error saying it is empty", err)
	}
}
