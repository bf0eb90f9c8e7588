package config

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"github.com/fsnotify/fsnotify"
)

// Debounce is how long Watch waits after the last change event before it
// reads the file: editors and config management write a file in several
// steps (truncate and write, or write a temporary file and rename it).
const Debounce = 100 * time.Millisecond

// Watch watches the config file at path until ctx is done. Once the watch
// is in place it loads the file and calls onChange with it (or onError),
// so that a change made between an earlier Load and Watch is not lost;
// after that, each time the file's content changes, it reloads it and
// calls onChange with the new Config, or onError when the new content is
// invalid or unreadable, in which case the caller keeps its last good
// config. A content identical to the last one read is not reported again.
//
// Watch watches the file's directory, not the file, because editors and
// Kubernetes ConfigMap volumes replace files by renaming (a ConfigMap swaps
// its "..data" symlink). Callbacks run on Watch's goroutine, one at a time.
// Watch returns an error if the watch cannot be set up, and ctx's error
// once ctx is done.
func Watch(ctx context.Context, path string, onChange func(*Config), onError func(error)) error {
	w, err := fsnotify.NewWatcher()
	if err != nil {
		return fmt.Errorf("config: watch %s: %w", path, err)
	}
	defer w.Close()
	dir, base := filepath.Dir(path), filepath.Base(path)
	if err := w.Add(dir); err != nil {
		return fmt.Errorf("config: watch %s: %w", dir, err)
	}

	var (
		last    []byte // the content read last
		read    bool   // last is valid
		lastErr string // the last read error reported
	)
	load := func() {
		data, err := readFile(path)
		if err != nil {
			if err.Error() != lastErr {
				onError(fmt.Errorf("config: %w", err))
			}
			lastErr, read = err.Error(), false
			return
		}
		lastErr = ""
		if read && bytes.Equal(data, last) {
			return
		}
		last, read = data, true
		c, err := Parse(path, data)
		if err != nil {
			onError(err)
			return
		}
		onChange(c)
	}
	load()

	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case ev, ok := <-w.Events:
			if !ok {
				return errors.New("config: watcher closed")
			}
			name := filepath.Base(ev.Name)
			if name == base || strings.HasPrefix(name, "..") {
				timer.Reset(Debounce)
			}
		case err, ok := <-w.Errors:
			if !ok {
				return errors.New("config: watcher closed")
			}
			onError(fmt.Errorf("config: watch %s: %w", dir, err))
		case <-timer.C:
			load()
		}
	}
}
