package registry

import (
	"fmt"
	"net/netip"
	"testing"
)

func TestAddrTable(t *testing.T) {
	const n = 5000
	tb := newAddrTable[int](2 * n)
	for i := range n {
		tb.put(netip.MustParseAddr(fmt.Sprintf("10.0.%d.%d", i/256, i%256)), uint16(i%7), i)
		tb.put(netip.MustParseAddr(fmt.Sprintf("fd00::%x", i)), 80, -i)
	}
	for i := range n {
		if v, ok := tb.get(netip.MustParseAddr(fmt.Sprintf("10.0.%d.%d", i/256, i%256)), uint16(i%7)); !ok || v != i {
			t.Fatalf("get v4 %d = %d, %v", i, v, ok)
		}
		if v, ok := tb.get(netip.MustParseAddr(fmt.Sprintf("::ffff:10.0.%d.%d", i/256, i%256)), uint16(i%7)); !ok || v != i {
			t.Fatalf("get v4-mapped %d = %d, %v", i, v, ok)
		}
		if _, ok := tb.get(netip.MustParseAddr(fmt.Sprintf("10.0.%d.%d", i/256, i%256)), uint16(i%7)+1); ok {
			t.Fatalf("found v4 %d with another port", i)
		}
		if v, ok := tb.get(netip.MustParseAddr(fmt.Sprintf("fd00::%x", i)), 80); !ok || v != -i {
			t.Fatalf("get v6 %d = %d, %v", i, v, ok)
		}
	}
	if _, ok := tb.get(netip.MustParseAddr("10.1.0.0"), 0); ok {
		t.Error("found an address never put")
	}
	tb.put(netip.MustParseAddr("fd00::1"), 80, 42) // replace
	if v, _ := tb.get(netip.MustParseAddr("fd00::1"), 80); v != 42 {
		t.Errorf("replaced value = %d", v)
	}
	// The zero Addr never matches, even when "::" is a key.
	s := mustBuild(t, Model{Workloads: []*Workload{wl("d", "a", "", nil, "::")}})
	if w := s.Workload(netip.Addr{}); w != nil {
		t.Errorf("Workload(zero) = %v", w)
	}
	if svc, p := s.Service(netip.AddrPort{}); svc != nil || p != nil {
		t.Errorf("Service(zero) = %v %v", svc, p)
	}
}
