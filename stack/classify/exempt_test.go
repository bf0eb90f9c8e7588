package classify

import (
	"net/netip"
	"testing"
)

// TestExempt: a segment from an exempt connection (its exact four) or
// listener (its address and port; an unspecified address: any local one)
// is verbatim where the policy would intercept it; released, it is
// intercepted again; nothing else is exempt (another port of the same
// addresses, the reverse direction of a listener's reply, a listener's
// port on an address that is not local).
func TestExempt(t *testing.T) {
	node := netip.MustParseAddr("10.0.0.1")
	pod := netip.MustParseAddr("10.1.0.1")
	other := netip.MustParseAddr("10.9.0.1")
	ex := NewExempt(func(a netip.Addr) bool { return a == node })
	c := New(Config{Policy: PolicyFunc(func(src, dst netip.AddrPort) bool { return true }), Exempt: ex})
	syn := func(src, dst netip.AddrPort) Verdict {
		v, _ := c.Inbound(tcp(src, dst, tcpSYN))
		return v
	}
	ack := func(src, dst netip.AddrPort) Verdict {
		v, _ := c.Inbound(tcp(src, dst, tcpACK))
		return v
	}
	dialled := netip.AddrPortFrom(node, 40001)
	target := netip.AddrPortFrom(pod, 8080)
	if v := syn(dialled, target); v != Intercept {
		t.Fatalf("before registration: SYN %s → %s %v, want intercept", dialled, target, v)
	}
	c = New(Config{Policy: PolicyFunc(func(src, dst netip.AddrPort) bool { return true }), Exempt: ex})
	release := ex.AddConn(dialled, target)
	if v := syn(dialled, target); v != Verbatim {
		t.Errorf("registered connection: SYN %v, want verbatim", v)
	}
	if v := ack(dialled, target); v != Verbatim {
		t.Errorf("registered connection: ACK %v, want verbatim", v)
	}
	if v := syn(netip.AddrPortFrom(node, 40002), target); v != Intercept {
		t.Errorf("another port of the node to the same target: %v, want intercept", v)
	}
	release()
	release() // idempotent
	if v := syn(netip.AddrPortFrom(node, 40001), netip.AddrPortFrom(pod, 8081)); v != Intercept {
		t.Errorf("after release, another connection: %v, want intercept", v)
	}
	if ex.Has(dialled, target) {
		t.Errorf("released connection still exempt")
	}

	done := ex.AddListener(netip.MustParseAddrPort("[::]:15020"))
	client := netip.AddrPortFrom(pod, 51000)
	if v := ack(netip.AddrPortFrom(node, 15020), client); v != Verbatim {
		t.Errorf("reply of a wildcard listener from a node address: %v, want verbatim", v)
	}
	if v := ack(netip.AddrPortFrom(other, 15020), client); v != Intercept {
		t.Errorf("port 15020 of an address that is not the node's: %v, want intercept", v)
	}
	if v := ack(client, netip.AddrPortFrom(other, 15020)); v != Intercept {
		t.Errorf("towards a listener's port from elsewhere: %v, want intercept", v)
	}
	done()
	if v := ack(netip.AddrPortFrom(node, 15020), client); v != Intercept {
		t.Errorf("after the listener's release: %v, want intercept", v)
	}
	exact := ex.AddListener(netip.MustParseAddrPort("10.0.0.1:15021"))
	defer exact()
	if !ex.Has(netip.MustParseAddrPort("10.0.0.1:15021"), client) || ex.Has(netip.MustParseAddrPort("10.0.0.2:15021"), client) {
		t.Errorf("a listener on one address exempts that address only")
	}
	if n := testing.AllocsPerRun(100, func() { ex.Has(netip.AddrPortFrom(node, 15021), client) }); n != 0 {
		t.Errorf("Has allocates %v times", n)
	}
}

// BenchmarkExempt: a segment of one of meshtun's own connections (the
// policy selects it, the registry of 1,024 connections exempts it) against
// one the policy does not select (the verbatim path the registry is kept
// off), in one run.
func BenchmarkExempt(b *testing.B) {
	node := netip.MustParseAddr("10.0.0.1")
	target := netip.MustParseAddrPort("10.1.0.1:8080")
	all := PolicyFunc(func(src, dst netip.AddrPort) bool { return true })
	none := PolicyFunc(func(src, dst netip.AddrPort) bool { return false })
	ex := NewExempt(func(a netip.Addr) bool { return a == node })
	for i := range 1024 {
		ex.AddConn(netip.AddrPortFrom(node, uint16(30000+i)), target)
	}
	p := tcpPayload(netip.AddrPortFrom(node, 30500), target, tcpACK, 1400)
	for _, c := range []struct {
		name string
		cls  *Classifier
	}{
		{"policy-no", New(Config{Policy: none})},
		{"exempt-conn", New(Config{Policy: all, Exempt: ex})},
	} {
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if v, _ := c.cls.Inbound(p); v != Verbatim {
					b.Fatal("not verbatim")
				}
			}
		})
	}
}
