package bench

import (
	"fmt"
	"strconv"

	"github.com/meshtun/meshtun/bench/report"
)

// Metric IDs, in display order.
const (
	mTCPUp1     = "tcp_up_1"
	mTCPUp4     = "tcp_up_4"
	mTCPDown1   = "tcp_down_1"
	mTCPDown4   = "tcp_down_4"
	mRRp50      = "rr_p50"
	mRRp90      = "rr_p90"
	mRRp99      = "rr_p99"
	mCRRRate    = "crr_rate"
	mCRRp50     = "crr_p50"
	mCRRp90     = "crr_p90"
	mCRRp99     = "crr_p99"
	mUDPSent    = "udp_sent_kpps"
	mUDPMaxSent = "udp_max_sent_kpps"
	mUDPPPS     = "udp_pps"
	mUDPLoss    = "udp_loss"
	mUDPMaxPPS  = "udp_max_pps"
	mUDPMaxLoss = "udp_max_loss"
	mCPUPerGB   = "cpu_s_per_gb"
	mRSSIdle    = "rss_start_mib"
	mPeak       = "peak_mib"
)

// idleMetric returns the ID of the memory-per-idle-connection metric at n
// connections, e.g. "idle_conn_kib_10000".
func idleMetric(n int) string { return fmt.Sprintf("idle_conn_kib_%d", n) }

// thousands formats n with commas: 10000 → "10,000".
func thousands(n int) string {
	s := strconv.Itoa(n)
	for i := len(s) - 3; i > 0; i -= 3 {
		s = s[:i] + "," + s[i:]
	}
	return s
}

// Chart titles.
const (
	chThroughput = "TCP throughput"
	chRR         = "Request/response latency (64 B)"
	chCRR        = "Connect + request + close latency"
	chCRRRate    = "Connect + request + close rate"
	chUDP        = "UDP rate"
	chUDPLoss    = "UDP loss"
	chCPU        = "Proxy CPU per GB moved"
	chMem        = "Proxy memory"
	chIdle       = "Proxy memory per idle connection"
)

// metricDefs describes every metric of plan pl; a run fills in the
// values.
func metricDefs(pl plan) []report.Metric {
	udpSize := pl.udpSize
	offered := report.Num(pl.udpMbps) + " Mbit/s of " + report.Num(float64(udpSize)) + " B"
	ms := []report.Metric{
		{ID: mTCPUp1, Title: "TCP client→server, 1 stream", Label: "→ 1 stream", Unit: "Gbit/s", Better: report.Higher, Chart: chThroughput},
		{ID: mTCPUp4, Title: "TCP client→server, 4 streams", Label: "→ 4 streams", Unit: "Gbit/s", Better: report.Higher, Chart: chThroughput},
		{ID: mTCPDown1, Title: "TCP server→client, 1 stream", Label: "← 1 stream", Unit: "Gbit/s", Better: report.Higher, Chart: chThroughput},
		{ID: mTCPDown4, Title: "TCP server→client, 4 streams", Label: "← 4 streams", Unit: "Gbit/s", Better: report.Higher, Chart: chThroughput},
		{ID: mRRp50, Title: "request/response p50", Label: "p50", Unit: "µs", Better: report.Lower, Chart: chRR},
		{ID: mRRp90, Title: "request/response p90", Label: "p90", Unit: "µs", Better: report.Lower, Chart: chRR},
		{ID: mRRp99, Title: "request/response p99", Label: "p99", Unit: "µs", Better: report.Lower, Chart: chRR},
		{ID: mCRRRate, Title: "connect+request+close rate", Label: "rate", Unit: "conn/s", Better: report.Higher, Chart: chCRRRate},
		{ID: mCRRp50, Title: "connect+request+close p50", Label: "p50", Unit: "µs", Better: report.Lower, Chart: chCRR},
		{ID: mCRRp90, Title: "connect+request+close p90", Label: "p90", Unit: "µs", Better: report.Lower, Chart: chCRR},
		{ID: mCRRp99, Title: "connect+request+close p99", Label: "p99", Unit: "µs", Better: report.Lower, Chart: chCRR},
		{ID: mUDPSent, Title: "UDP sent, " + offered + " offered", Label: "sent, paced", Unit: "kpps", Better: report.Higher, Chart: chUDP},
		{ID: mUDPPPS, Title: "UDP received, " + offered + " offered", Label: "received, paced", Unit: "kpps", Better: report.Higher, Chart: chUDP},
		{ID: mUDPLoss, Title: "UDP loss of sent, " + offered + " offered", Label: offered, Unit: "%", Better: report.Lower, Chart: chUDPLoss},
		{ID: mUDPMaxSent, Title: "UDP sent, unpaced " + report.Num(float64(udpSize)) + " B", Label: "sent, unpaced", Unit: "kpps", Better: report.Higher, Chart: chUDP},
		{ID: mUDPMaxPPS, Title: "UDP received, unpaced " + report.Num(float64(udpSize)) + " B", Label: "received, unpaced", Unit: "kpps", Better: report.Higher, Chart: chUDP},
		{ID: mUDPMaxLoss, Title: "UDP loss of sent, unpaced", Label: "unpaced", Unit: "%", Better: report.Lower, Chart: chUDPLoss},
		{ID: mCPUPerGB, Title: "proxy CPU per GB (all TCP runs)", Label: "TCP runs", Unit: "CPU s/GB", Better: report.Lower, Chart: chCPU},
		{ID: mRSSIdle, Title: "proxy RSS at start (largest proxy)", Label: "RSS at start", Unit: "MiB", Better: report.Lower, Chart: chMem},
		{ID: mPeak, Title: "proxy peak VmHWM (largest proxy)", Label: "peak (VmHWM)", Unit: "MiB", Better: report.Lower, Chart: chMem},
	}
	for _, n := range pl.idle {
		ms = append(ms, report.Metric{ID: idleMetric(n), Title: "per idle connection, " + thousands(n) + " open (worst proxy)",
			Label: thousands(n) + " conns", Unit: "KiB", Better: report.Lower, Chart: chIdle})
	}
	return ms
}
