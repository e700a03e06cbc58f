package scheduler

import (
	"context"
	"time"

	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// ExpectIn registers one request's items.
type ExpectIn struct {
	RequestID string           `json:"request_id"`
	Items     []sched.Expected `json:"items"`
}

// LoadedIn reports one worker load.
type LoadedIn struct {
	TransferID string `json:"transfer_id"`
	OK         bool   `json:"ok"`
	Reason     string `json:"reason"`
}

// StepIn is everything one scheduler step tells the table, in the order it
// is applied: expectations, load outcomes, frees, finished requests, new
// loads, then the questions (ensure, has).
type StepIn struct {
	Expect   []ExpectIn `json:"expect"`
	Loaded   []LoadedIn `json:"loaded"`
	Freed    []string   `json:"freed"`
	Finished []string   `json:"finished"`
	Load     []string   `json:"load"`
	Ensure   []string   `json:"ensure"`
	Has      []string   `json:"has"`
	// LocalEncodes are the contents of items whose transfer failed and
	// that the engine encodes itself: on a vLLM without
	// take_unavailable_requests the connector cannot fail their request,
	// so it lets the engine encode them. Only counted here
	// (ecm_local_encodes_total): the table already gave them up.
	LocalEncodes []string `json:"local_encodes"`
	// Snapshot asks for every request's answer at once (StepOut.Covered
	// and Failed): far less to encode than naming each.
	Snapshot bool `json:"snapshot"`
	// ChangesSince asks for what moved since the generation of answers
	// the caller holds (StepOut.Changed and ChangedFailed, Incremental):
	// in proportion to what moved, not to the live requests. Where the
	// table no longer logs that far back, the step answers a Snapshot.
	ChangesSince *uint64 `json:"changes_since"`
}

// LoadOut names the transfer a load reads, or why it cannot.
type LoadOut struct {
	MMHash     string `json:"mm_hash"`
	TransferID string `json:"transfer_id,omitempty"`
	Error      string `json:"error,omitempty"`
}

// EnsureOut answers ensure_cache_available for one request.
type EnsureOut struct {
	Ready  bool            `json:"ready"`
	Failed []sched.Failure `json:"failed,omitempty"`
}

// StepOut is the answer to one step.
type StepOut struct {
	ExpectErrors map[string]string    `json:"expect_errors,omitempty"`
	Load         []LoadOut            `json:"load,omitempty"`
	Ensure       map[string]EnsureOut `json:"ensure,omitempty"`
	Has          map[string]bool      `json:"has,omitempty"`
	Cancelled    []string             `json:"cancelled,omitempty"`
	// Failures are requests' items that will not arrive, reported once
	// each: deadlines that passed and failures the shards reported.
	Failures []sched.Failure `json:"failures,omitempty"`
	// Covered and Failed answer a snapshot: the contents of every
	// registered request's items that are on every shard, and the failures
	// of each request that has any (absent: none).
	Covered []string                   `json:"covered,omitempty"`
	Failed  map[string][]sched.Failure `json:"failed,omitempty"`
	// Incremental says that Changed and ChangedFailed answer ChangesSince:
	// Has of each content whose answer may have moved, and the failures of
	// each live request whose failures may have moved (null: none now). False after ChangesSince: the step
	// answered a Snapshot instead.
	Incremental   bool                       `json:"incremental,omitempty"`
	Changed       map[string]bool            `json:"changed,omitempty"`
	ChangedFailed map[string][]sched.Failure `json:"changed_failed,omitempty"`
	// Generation is the table's generation when the questions were
	// answered: the answers stand for as long as it does not move.
	Generation uint64 `json:"generation"`
}

// Step applies the events that have arrived (Poll), then one scheduler
// step's worth of changes, and answers its questions under one lock
// acquisition, with no other I/O: cancels for finished requests are queued
// for the shard goroutines.
func (s *Scheduler) Step(in StepIn) StepOut {
	s.Poll()
	now := time.Now()
	var out StepOut
	s.mu.Lock()
	before := s.table.Generation()
	out.Cancelled = s.applyLocked(s.table.Ready(now))
	for _, e := range in.Expect {
		s.waits.expect(e.Items, now)
		if err := s.table.Expect(e.RequestID, e.Items, now); err != nil {
			if out.ExpectErrors == nil {
				out.ExpectErrors = map[string]string{}
			}
			out.ExpectErrors[e.RequestID] = err.Error()
			s.log.Warn("request refused", "request_id", e.RequestID, "cause", err)
		}
	}
	// An item whose bytes came before its request was available at once;
	// one cancelled by a finished request is forgotten below.
	for _, e := range in.Expect {
		s.waits.settleItems(s.table, e.Items, now)
	}
	for _, l := range in.Loaded {
		s.table.Loaded(l.TransferID, l.OK, l.Reason, now)
	}
	for _, h := range in.Freed {
		s.table.Freed(h, now)
	}
	// The table cancels what finished requests alone waited for, and the
	// other pushes of content a load served; the Ready below hands both out.
	for _, r := range in.Finished {
		s.table.Finish(r, now)
	}
	for _, h := range in.Load {
		id, err := s.table.StartLoad(h, now)
		lo := LoadOut{MMHash: h, TransferID: id}
		if err != nil {
			lo.Error = err.Error()
		}
		out.Load = append(out.Load, lo)
	}
	for _, r := range in.Ensure {
		if out.Ensure == nil {
			out.Ensure = map[string]EnsureOut{}
		}
		ready, failed := s.table.Ensure(r, now)
		out.Ensure[r] = EnsureOut{Ready: ready, Failed: failed}
	}
	for _, h := range in.Has {
		if out.Has == nil {
			out.Has = map[string]bool{}
		}
		out.Has[h] = s.table.Has(h)
	}
	if in.ChangesSince != nil {
		out.Changed, out.ChangedFailed, out.Incremental = s.table.Changes(*in.ChangesSince, now)
	}
	if in.Snapshot || (in.ChangesSince != nil && !out.Incremental) {
		out.Covered, out.Failed = s.table.Snapshot(now)
	}
	metrics.LocalEncodes(len(in.LocalEncodes))
	out.Generation = s.table.Generation()
	out.Cancelled = append(out.Cancelled, s.applyLocked(s.table.Ready(now))...)
	s.waits.settle(s.table, out.Cancelled, now)
	out.Failures, s.failures = s.failures, nil
	// Every change that can alter an answer, a deadline or a failure
	// moves the generation (sched.Generation): a step that moved nothing
	// (the engine loop asking again) wakes no waiter and no ticker.
	if s.table.Generation() != before || len(out.Cancelled) > 0 {
		s.changedLocked()
	}
	s.mu.Unlock()
	if len(out.Cancelled) > 0 {
		s.queueCancels(out.Cancelled)
	}
	return out
}

// queueCancels hands cancels to every shard goroutine without waiting; a
// full queue drops them, which the shards' leases make harmless.
func (s *Scheduler) queueCancels(ids []string) {
	for i, ch := range s.cancels {
		select {
		case ch <- ids:
		default:
			s.log.Warn("cancel queue full; the shard's lease will reclaim the items", "shard", i, "items", len(ids))
		}
	}
}

// WaitOut sorts transfers by outcome.
type WaitOut struct {
	Available []string `json:"available"`
	Failed    []string `json:"failed"`
	Waiting   []string `json:"waiting"`
}

// Wait blocks until every transfer is available or failed, or ctx ends.
// For tools and tests: the engine never calls it.
func (s *Scheduler) Wait(ctx context.Context, transferIDs []string) WaitOut {
	for {
		s.mu.Lock()
		var out WaitOut
		for _, id := range transferIDs {
			st, ok := s.table.Status(id)
			switch {
			case !ok:
				out.Waiting = append(out.Waiting, id)
			case st == sched.Available || st == sched.Loading || st == sched.Ready || st == sched.Resident:
				out.Available = append(out.Available, id)
			case st == sched.WaitingEvent:
				out.Waiting = append(out.Waiting, id)
			default:
				out.Failed = append(out.Failed, id)
			}
		}
		ch := s.changed
		s.mu.Unlock()
		if len(out.Waiting) == 0 {
			return out
		}
		select {
		case <-ctx.Done():
			return out
		case <-ch:
		}
	}
}

// Stats are the scheduler's counters.
type Stats struct {
	Table    sched.Stats      `json:"table"`
	Resynced uint64           `json:"resynced_events"`
	Events   control.SubStats `json:"events"`
	Shards   []string         `json:"shards"`
	// ControlRefused counts the shards' refusals of the scheduler's
	// security handshakes (control calls and event subscriptions), by
	// reason.
	ControlRefused map[string]uint64 `json:"control_refused,omitempty"`
	// Phases are this process's timings of the readiness path (package
	// metrics); event_delivery is the scheduler's part.
	Phases map[string]metrics.PhaseStat `json:"phases,omitempty"`
	// HeartbeatsAnswered counts, per shard (TP rank), the liveness probes
	// it answered.
	HeartbeatsAnswered []uint64 `json:"heartbeats_answered"`
}

// Stats returns a snapshot.
func (s *Scheduler) Stats() Stats {
	s.mu.Lock()
	defer s.mu.Unlock()
	st := Stats{Table: s.table.Stats(), Resynced: s.resynced, Events: s.sub.Stats(), Shards: s.Shards(), Phases: metrics.Phases()}
	for i := range s.answered {
		st.HeartbeatsAnswered = append(st.HeartbeatsAnswered, s.answered[i].Load())
	}
	if rc, ok := s.links.(control.RefusalCounter); ok {
		st.ControlRefused = rc.Refused()
	}
	return st
}
