package metrics

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/common/expfmt"
)

// registry holds every series of this process. It is created with the
// package so that increments never wait for a setup call.
var registry = newRegistry()

func newRegistry() *prometheus.Registry {
	r := prometheus.NewRegistry()
	r.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		transferBytes, transferItems, itemBytes, writeSeconds,
		failures, fallbacks, roundTrips, roundTripSeconds, transferWait, localEncodes, phaseSeconds,
		probes,
	)
	return r
}

// Registry is the process-wide registry; a caller with its own series
// (the proxy) gathers it together with its own.
func Registry() *prometheus.Registry { return registry }

// Sizes of one encoder output run from kilobytes (a thumbnail) to about
// half a gigabyte (the largest video frames): powers of four from 64 KiB.
var sizeBuckets = prometheus.ExponentialBuckets(64<<10, 4, 9)

// Latencies run from tens of microseconds (a control round trip on one
// host) to tens of seconds (a push that waited for its deadline).
var latencyBuckets = prometheus.ExponentialBuckets(50e-6, 3, 13)

var (
	transferBytes    = Counters("ecm_transfer_bytes_total", "Bytes of encoder output written by this process's producers, by data-plane transport.", "transport")
	transferItems    = Counters("ecm_transfer_items_total", "Encoder outputs written by this process's producers, by data-plane transport.", "transport")
	itemBytes        = Histograms("ecm_transfer_item_bytes", "Size of each encoder output written, by transport.", sizeBuckets, "transport")
	writeSeconds     = Histograms("ecm_transfer_write_seconds", "Duration of each data-plane write batch (one per consumer shard and model step), by transport and outcome.", latencyBuckets, "transport", "outcome")
	failures         = Counters("ecm_failures_total", "Items that failed, by the component that gave up and a short reason.", "component", "reason")
	fallbacks        = Counters("ecm_fallbacks_total", "Times a path could not serve and an older one was used in its place, by component and a short reason.", "component", "reason")
	roundTrips       = Counters("ecm_control_round_trips_total", "Control-plane round trips, by op and outcome.", "op", "outcome")
	roundTripSeconds = Histograms("ecm_control_round_trip_seconds", "Duration of control-plane round trips, by op.", latencyBuckets, "op")
	localEncodes     = prometheus.NewCounter(prometheus.CounterOpts{
		Name: "ecm_local_encodes_total",
		Help: "Consumer scheduler: items whose transfer failed that the engine encoded itself (a vLLM without take_unavailable_requests, which cannot fail the request).",
	})
	transferWait = prometheus.NewHistogram(prometheus.HistogramOpts{
		Name:    "ecm_transfer_wait_seconds",
		Help:    "Consumer scheduler: time from a request expecting an item to the item being available on every shard.",
		Buckets: latencyBuckets,
	})
)

// Counters returns the counter family name, one series per value of labels.
func Counters(name, help string, labels ...string) *prometheus.CounterVec {
	return prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
}

// Histograms returns the histogram family name over buckets, one series per
// value of labels.
func Histograms(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
	return prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}, labels)
}

// Moved counts one encoder output of n bytes written over a transport.
func Moved(transport string, n uint64) {
	transferBytes.WithLabelValues(transport).Add(float64(n))
	transferItems.WithLabelValues(transport).Inc()
	itemBytes.WithLabelValues(transport).Observe(float64(n))
}

// WriteBatch observes the duration of one data-plane write batch.
func WriteBatch(transport string, d time.Duration, err error) {
	writeSeconds.WithLabelValues(transport, outcome(err)).Observe(d.Seconds())
}

// Failed counts one failed item. reason must come from a small fixed set
// (a label value per distinct text would grow without bound).
func Failed(component, reason string) {
	failures.WithLabelValues(component, reason).Inc()
}

// Fallback counts one use of an older path where the new one could not
// serve (cuda_ipc completing by message where ready words cannot be
// stored). reason must come from a small fixed set.
func Fallback(component, reason string) {
	fallbacks.WithLabelValues(component, reason).Inc()
}

// RoundTrip observes one control round trip.
func RoundTrip(op string, d time.Duration, err error) {
	roundTrips.WithLabelValues(op, outcome(err)).Inc()
	roundTripSeconds.WithLabelValues(op).Observe(d.Seconds())
}

// LocalEncodes counts n items the engine encodes itself after their
// transfer failed (see scheduler.StepIn.LocalEncodes).
func LocalEncodes(n int) { localEncodes.Add(float64(n)) }

// TransferWait observes how long an expected item took to become available.
func TransferWait(d time.Duration) { transferWait.Observe(d.Seconds()) }

func outcome(err error) string {
	if err != nil {
		return "error"
	}
	return "ok"
}

// Text renders every series of g in the Prometheus text format; a nil g
// means this process's registry.
func Text(g prometheus.Gatherer) ([]byte, error) {
	if g == nil {
		g = registry
	}
	mfs, err := g.Gather()
	var buf bytes.Buffer
	enc := expfmt.NewEncoder(&buf, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range mfs {
		if e := enc.Encode(mf); e != nil {
			err = errors.Join(err, e)
		}
	}
	if err != nil {
		// A gather error names one bad series; the rest are still worth
		// serving, so the caller gets both.
		return buf.Bytes(), fmt.Errorf("metrics: gather: %w", err)
	}
	return buf.Bytes(), nil
}

// Reason folds a failure's text into a small set of label values.
func Reason(text string) string {
	t := strings.ToLower(text)
	switch {
	case strings.Contains(t, "deadline") || strings.Contains(t, "timed out") || strings.Contains(t, "timeout"):
		return "timeout"
	case strings.Contains(t, "authentication") || strings.Contains(t, "auth_secret"):
		return "auth"
	case strings.Contains(t, "cancel") || strings.Contains(t, "abandon"):
		return "cancelled"
	case strings.Contains(t, "refused") || strings.Contains(t, "reset") || strings.Contains(t, "unreachable") || strings.Contains(t, "no route") || strings.Contains(t, "dial"):
		return "unreachable"
	case strings.Contains(t, "full") || strings.Contains(t, "no space") || strings.Contains(t, "too large"):
		return "no_space"
	case strings.Contains(t, "mismatch") || strings.Contains(t, "collision") || strings.Contains(t, "names mm_hash"):
		return "mismatch"
	default:
		return "other"
	}
}
