package metrics

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/atomic"
)

// The readiness path of one batch, from its copies to the consumer's
// scheduler seeing its items, cut into the phases that each side can time
// on its own clock. Each is observed once per batch (event delivery once
// per event) where it happens.
const (
	// PhaseReserveRTT: the reserve_batch round trip.
	PhaseReserveRTT = "reserve_rtt"
	// PhaseWriteHandoff: from a reserve reply's arrival to the write batch
	// of its grants starting: the producer's driver taking the grants and
	// launching the write, plus any wait for the sources.
	PhaseWriteHandoff = "write_handoff"
	// PhaseCopyQueue: host time to queue a batch's device copies.
	PhaseCopyQueue = "copy_queue"
	// PhaseCopyQueueWaits and PhaseCopyQueueCopies are parts of
	// PhaseCopyQueue: the stream's waits for the sources' events, and the
	// copies' own driver calls with their start event.
	PhaseCopyQueueWaits  = "copy_queue_waits"
	PhaseCopyQueueCopies = "copy_queue_copies"
	// PhaseCopy: the copies' own time on the GPU (timing events).
	PhaseCopy = "copy"
	// PhaseEventWait: host time from the last copy queued to its event
	// seen complete, less the GPU's copy time: what waking for it cost.
	PhaseEventWait = "event_wait"
	// PhaseWrite: a data-plane write batch, whole, on the producer.
	PhaseWrite = "write"
	// PhaseCompleteHandoff: from a write batch's end to its complete_batch
	// leaving (the producer's driver taking the outcome and launching it).
	PhaseCompleteHandoff = "complete_handoff"
	// PhaseCompleteRTT: the complete_batch round trip.
	PhaseCompleteRTT = "complete_rtt"
	// PhaseEventDelivery: from a shard publishing a readiness event to the
	// scheduler applying it (wall clocks of two processes: meaningful on
	// one host, or between hosts whose clocks agree).
	PhaseEventDelivery = "event_delivery"
)

// Phases of microseconds to seconds: doubling from 5 µs.
var phaseBuckets = prometheus.ExponentialBuckets(5e-6, 2, 20)

var phaseSeconds = Histograms("ecm_ready_path_phase_seconds",
	"Time of each phase of the path from a batch's copies to the consumer's scheduler seeing its items, by phase.", phaseBuckets, "phase")

// PhaseStat is how often a phase was observed and its total time.
type PhaseStat struct {
	Count   uint64  `json:"count"`
	Seconds float64 `json:"seconds"`
}

type phaseSum struct{ count, nanos atomic.Uint64 }

// phaseSums mirrors phaseSeconds so that Stats calls read totals without
// gathering the registry.
var phaseSums sync.Map // phase name -> *phaseSum

// Phase observes one occurrence of a phase. A negative duration (clocks
// of two processes that disagree) is dropped.
func Phase(name string, d time.Duration) {
	if d < 0 {
		return
	}
	phaseSeconds.WithLabelValues(name).Observe(d.Seconds())
	v, ok := phaseSums.Load(name)
	if !ok {
		v, _ = phaseSums.LoadOrStore(name, &phaseSum{})
	}
	s := v.(*phaseSum)
	s.count.Add(1)
	s.nanos.Add(uint64(d))
}

// Phases returns every phase observed in this process so far. A caller
// that wants one interval's figures subtracts two snapshots.
func Phases() map[string]PhaseStat {
	out := map[string]PhaseStat{}
	phaseSums.Range(func(k, v any) bool {
		s := v.(*phaseSum)
		out[k.(string)] = PhaseStat{Count: s.count.Load(), Seconds: float64(s.nanos.Load()) / 1e9}
		return true
	})
	return out
}
