package scheduler

import (
	"fmt"
	"go.uber.org/atomic"
	"time"

	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// maxWaiting bounds waitClock: an item that never becomes available is
// forgotten at the latest when this many others wait, so the clock cannot
// grow without bound whatever the engine does.
const maxWaiting = 1 << 16

// waitClock measures, per transfer, the time from the first request that
// expected it to the moment every shard holds it (the transfer wait a PD
// request spends before its prefill can start). The caller holds s.mu.
type waitClock map[string]time.Time

func (w waitClock) expect(items []sched.Expected, now time.Time) {
	if len(w) > maxWaiting {
		clear(w)
	}
	for _, it := range items {
		if _, ok := w[it.TransferID]; !ok {
			w[it.TransferID] = now
		}
	}
}

func (w waitClock) settleItems(t *sched.Table, items []sched.Expected, now time.Time) {
	ids := make([]string, len(items))
	for i, it := range items {
		ids[i] = it.TransferID
	}
	w.settle(t, ids, now)
}

// settle observes transfers that have left WAITING_EVENT.
func (w waitClock) settle(t *sched.Table, ids []string, now time.Time) {
	for _, id := range ids {
		since, ok := w[id]
		if !ok {
			continue
		}
		st, known := t.Status(id)
		switch {
		case known && st == sched.WaitingEvent:
			continue
		case known && st != sched.Unavailable && st != sched.Cancelled && st != sched.Expired && st != sched.Failed:
			metrics.TransferWait(now.Sub(since))
		}
		delete(w, id)
	}
}

var schedulers atomic.Uint64

func (s *Scheduler) metricsName() string {
	return fmt.Sprintf("scheduler:%s#%d", s.shards[0], schedulers.Add(1))
}

// probe reports the transfer table at scrape time.
func (s *Scheduler) probe(e *metrics.Emitter) {
	s.mu.Lock()
	st := s.table.Stats()
	resynced := s.resynced
	s.mu.Unlock()
	for state, n := range st.Records {
		e.Set(metrics.Transfers, float64(n), state.String())
	}
	for state, n := range st.Ended {
		e.Set(metrics.TransfersEnded, float64(n), state.String())
	}
	e.Set(metrics.SchedulerResynced, float64(resynced))
}
