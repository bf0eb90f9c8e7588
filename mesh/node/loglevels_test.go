package node

import (
	"testing"

	"github.com/rs/zerolog"
)

// TestParseLogLevels: ?level= in meshtun's form and in ztunnel's, as
// `istioctl ztunnel-config log --level` sends it.
func TestParseLogLevels(t *testing.T) {
	for _, c := range []struct {
		arg    string
		lvl    zerolog.Level
		set    bool
		access string
		bad    bool
	}{
		{arg: "", lvl: zerolog.NoLevel},
		{arg: "debug", lvl: zerolog.DebugLevel, set: true},
		{arg: "warning", lvl: zerolog.WarnLevel, set: true},
		{arg: "access:debug", lvl: zerolog.NoLevel, access: "on"},
		{arg: "access=info", lvl: zerolog.NoLevel, access: "on"},
		{arg: "access:off", lvl: zerolog.NoLevel, access: "off"},
		{arg: "access:debug,info", lvl: zerolog.InfoLevel, set: true, access: "on"},
		{arg: "error,access:warn", lvl: zerolog.ErrorLevel, set: true, access: "off"},
		{arg: "off", bad: true},
		{arg: "proxy:debug", bad: true},
		{arg: "access:loud", bad: true},
		{arg: "access:", bad: true},
		{arg: "info,", bad: true},
	} {
		lvl, set, access, err := parseLogLevels(c.arg)
		if c.bad {
			if err == nil {
				t.Errorf("%q: accepted (%v %v %q), want an error", c.arg, lvl, set, access)
			}
			continue
		}
		if err != nil || lvl != c.lvl || set != c.set || access != c.access {
			t.Errorf("%q: %v %v %q %v, want %v %v %q", c.arg, lvl, set, access, err, c.lvl, c.set, c.access)
		}
	}
}
