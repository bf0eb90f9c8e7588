package hbone

import (
	"errors"
	"net/http"
	"net/netip"
	"strings"
	"testing"
)

func TestForwarded(t *testing.T) {
	tests := []struct {
		in   string
		want Forwarded
	}{
		{`for="10.1.2.3:4567"`, Forwarded{For: netip.MustParseAddrPort("10.1.2.3:4567")}},
		{`for=10.1.2.3:4567`, Forwarded{For: netip.MustParseAddrPort("10.1.2.3:4567")}},
		{`for=10.1.2.3`, Forwarded{For: netip.AddrPortFrom(netip.MustParseAddr("10.1.2.3"), 0)}},
		{`For="[2001:db8::1]:80";Host=reviews.default.svc.cluster.local`,
			Forwarded{For: netip.MustParseAddrPort("[2001:db8::1]:80"), Host: "reviews.default.svc.cluster.local"}},
		{`for="[2001:db8::1]"`, Forwarded{For: netip.AddrPortFrom(netip.MustParseAddr("2001:db8::1"), 0)}},
		{`for="[::ffff:10.0.0.1]:9"`, Forwarded{For: netip.MustParseAddrPort("10.0.0.1:9")}},
		{`host="svc.example";for="10.0.0.1:1", for=10.9.9.9`,
			Forwarded{For: netip.MustParseAddrPort("10.0.0.1:1"), Host: "svc.example"}},
		{`for=unknown;proto=tcp`, Forwarded{}},
		{`for=_hidden`, Forwarded{}},
	}
	for _, tt := range tests {
		got, err := ParseForwarded(tt.in)
		if err != nil || got != tt.want {
			t.Errorf("ParseForwarded(%q) = %+v, %v; want %+v", tt.in, got, err, tt.want)
		}
	}
	for _, bad := range []string{"", `for="10.0.0.1`, `for=`, `for=host.example`, `for="10.0.0.1:1" x`, `;for=1.2.3.4`, ` for = "10.0.0.1:1"`} {
		if got, err := ParseForwarded(bad); err == nil {
			t.Errorf("ParseForwarded(%q) = %+v, want an error", bad, got)
		} else if !strings.Contains(err.Error(), "forwarded") {
			t.Errorf("ParseForwarded(%q) error %q does not name the header", bad, err)
		}
	}
	for _, f := range []Forwarded{
		{For: netip.MustParseAddrPort("10.1.2.3:4567")},
		{For: netip.MustParseAddrPort("[2001:db8::1]:80"), Host: "a.b.svc.cluster.local"},
		{For: netip.AddrPortFrom(netip.MustParseAddr("2001:db8::2"), 0)},
		{Host: `odd "host"`},
	} {
		back, err := ParseForwarded(f.String())
		if err != nil || back != f {
			t.Errorf("round trip of %+v via %q: %+v, %v", f, f.String(), back, err)
		}
	}
	if got := (Forwarded{For: netip.MustParseAddrPort("10.1.2.3:4567")}).String(); got != `for="10.1.2.3:4567"` {
		t.Errorf("String = %s, want ztunnel's for=\"ip:port\" form", got)
	}
}

func TestBaggage(t *testing.T) {
	b, err := ParseBaggage("k8s.namespace.name=default, service.name = product%20page;prop=1,service.version=v1")
	if err != nil {
		t.Fatal(err)
	}
	want := Baggage{"k8s.namespace.name": "default", "service.name": "product page", "service.version": "v1"}
	if len(b) != len(want) {
		t.Fatalf("ParseBaggage = %v, want %v", b, want)
	}
	for k, v := range want {
		if b[k] != v {
			t.Errorf("%s = %q, want %q", k, b[k], v)
		}
	}
	if s := b.String(); s != "k8s.namespace.name=default,service.name=product%20page,service.version=v1" {
		t.Errorf("String = %s", s)
	}
	odd := Baggage{"k": `a,b;c "d" % é`}
	back, err := ParseBaggage(odd.String())
	if err != nil || back["k"] != odd["k"] {
		t.Errorf("round trip of %q via %q: %q, %v", odd["k"], odd.String(), back["k"], err)
	}
	if b, err := ParseBaggage(" "); err != nil || b != nil {
		t.Errorf("ParseBaggage of blank = %v, %v", b, err)
	}
	for _, bad := range []string{"novalue", "=v", "k=%zz", "bad key=v"} {
		if _, err := ParseBaggage(bad); err == nil {
			t.Errorf("ParseBaggage(%q): no error", bad)
		}
	}
	if err := (Baggage{"bad key": "v"}).validate(); err == nil {
		t.Error("validate accepted a key with a space")
	}
}

func TestStatus(t *testing.T) {
	wrap := func(e error) error { return errors.Join(errors.New("context"), e) }
	for _, tt := range []struct {
		err  error
		code int
	}{
		{nil, 200},
		{wrap(ErrBadRequest), 400},
		{wrap(ErrDenied), 401},
		{wrap(ErrUnreachable), 503},
		{errors.New("other"), 503},
	} {
		if got := Status(tt.err); got != tt.code {
			t.Errorf("Status(%v) = %d, want %d", tt.err, got, tt.code)
		}
		if tt.code == 200 {
			continue
		}
		se := &StatusError{Code: tt.code}
		// A StatusError matches the sentinel of its code only.
		for _, s := range []error{ErrBadRequest, ErrDenied, ErrUnreachable} {
			if errors.Is(se, s) != (Status(s) == tt.code) {
				t.Errorf("StatusError %d matches %v: %t", tt.code, s, errors.Is(se, s))
			}
		}
	}
	if errors.Is(&StatusError{Code: http.StatusForbidden}, ErrDenied) {
		t.Error("403 matches ErrDenied")
	}
}
