package scheduler

import (
	"encoding/json"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// openIdle opens a scheduler whose shard never answers: the table is driven
// by Step and by events handed to apply directly.
func openIdle(t testing.TB) *Scheduler {
	t.Helper()
	cfg := config.DefaultScheduler()
	cfg.Shards = []string{"tcp://127.0.0.1:9"}
	s, err := Open(cfg, Options{})
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

// read loads the counter as a caller in another language would: the
// library's goroutines store it atomically.
func read(p *uint64) uint64 { return atomic.LoadUint64(p) }

// The watched counter follows the table's generation: a step that only
// asks leaves it alone, registrations and events move it, and every step
// names the generation its answers were given at.
func TestWatchedGenerationFollowsTheTable(t *testing.T) {
	s := openIdle(t)
	var counter uint64
	s.Watch(&counter)
	require.Equal(t, s.Generation(), read(&counter), "Watch publishes at once")

	items := []sched.Expected{{TransferID: "t1", MMHash: "h1"}}
	out := s.Step(StepIn{Expect: []ExpectIn{{RequestID: "r1", Items: items}}, Ensure: []string{"r1"}, Has: []string{"h1"}})
	require.False(t, out.Ensure["r1"].Ready)
	registered := s.Generation()
	require.NotZero(t, registered)
	require.Equal(t, registered, out.Generation)
	require.Equal(t, registered, read(&counter))

	out = s.Step(StepIn{Ensure: []string{"r1"}, Has: []string{"h1"}})
	require.Equal(t, registered, out.Generation, "questions change nothing")
	require.Equal(t, registered, read(&counter))

	out = s.Step(StepIn{Expect: []ExpectIn{{RequestID: "r2", Items: []sched.Expected{{TransferID: "t2", MMHash: "h2"}}}}})
	require.Greater(t, out.Generation, registered)
	registered = out.Generation

	s.apply(wire.Event{Shard: 0, TransferID: "t1", MMHash: "h1", Ready: true, NBytes: 8})
	require.Greater(t, read(&counter), registered, "the item arrived")
	require.Equal(t, s.Generation(), read(&counter))
	out = s.Step(StepIn{Ensure: []string{"r1"}, Has: []string{"h1"}})
	require.True(t, out.Ensure["r1"].Ready)
	require.Equal(t, read(&counter), out.Generation)
}

// A snapshot answers for every registered request without naming one.
func TestSnapshotAnswersEveryRequest(t *testing.T) {
	s := openIdle(t)
	s.Step(StepIn{Expect: []ExpectIn{
		{RequestID: "r1", Items: []sched.Expected{{TransferID: "t1", MMHash: "h1"}, {TransferID: "t2", MMHash: "h2"}}},
		{RequestID: "r2", Items: []sched.Expected{{TransferID: "t3", MMHash: "h3"}}},
	}})
	out := s.Step(StepIn{Snapshot: true})
	require.Empty(t, out.Covered)
	require.Empty(t, out.Failed)
	s.apply(wire.Event{Shard: 0, TransferID: "t2", MMHash: "h2", Ready: true, NBytes: 8},
		wire.Event{Shard: 0, TransferID: "t3", MMHash: "h3", Reason: "slab full"})
	out = s.Step(StepIn{Snapshot: true})
	require.Equal(t, []string{"h2"}, out.Covered)
	require.Len(t, out.Failed["r2"], 1)
	require.Equal(t, "t3", out.Failed["r2"][0].TransferID)
	require.NotContains(t, out.Failed, "r1")
	require.Equal(t, s.Generation(), out.Generation)
}

// Once Close returns the library no longer writes the caller's memory.
func TestWatchStopsAtClose(t *testing.T) {
	s := openIdle(t)
	var counter uint64
	s.Watch(&counter)
	require.NoError(t, s.Close())
	before := read(&counter)
	s.mu.Lock()
	s.changedLocked()
	s.mu.Unlock()
	require.Equal(t, before, read(&counter))
}

// A step asked for the changes since the generation of the answers the
// caller holds names only what moved: the contents of items that arrived
// or failed, and the requests whose failures may have moved, in JSON as
// the connector reads it.
func TestStepAnswersChangesSince(t *testing.T) {
	s := openIdle(t)
	out := s.Step(StepIn{Expect: []ExpectIn{
		{RequestID: "r1", Items: []sched.Expected{{TransferID: "t1", MMHash: "h1"}, {TransferID: "t2", MMHash: "h2"}}},
		{RequestID: "r2", Items: []sched.Expected{{TransferID: "t3", MMHash: "h3"}}},
		{RequestID: "r3", Items: []sched.Expected{{TransferID: "t4", MMHash: "h4"}}},
	}, Snapshot: true})
	at := out.Generation
	s.apply(wire.Event{Shard: 0, TransferID: "t2", MMHash: "h2", Ready: true, NBytes: 8},
		wire.Event{Shard: 0, TransferID: "t3", MMHash: "h3", Reason: "slab full"})
	out = s.Step(StepIn{ChangesSince: &at})
	require.True(t, out.Incremental)
	require.Empty(t, out.Covered, "no snapshot")
	require.Equal(t, map[string]bool{"h2": true, "h3": false}, out.Changed)
	require.Len(t, out.ChangedFailed["r2"], 1)
	require.Equal(t, "t3", out.ChangedFailed["r2"][0].TransferID)
	require.Contains(t, out.ChangedFailed, "r1", "its item arrived: failures named, as none")
	require.Empty(t, out.ChangedFailed["r1"])
	require.NotContains(t, out.ChangedFailed, "r3", "nothing of it moved")
	require.Equal(t, s.Generation(), out.Generation)

	wireOut, err := json.Marshal(out)
	require.NoError(t, err)
	require.Contains(t, string(wireOut), `"incremental":true`)
	require.Contains(t, string(wireOut), `"changed":{`)

	// A generation the table never gave is answered with a snapshot.
	future := out.Generation + 10
	out = s.Step(StepIn{ChangesSince: &future})
	require.False(t, out.Incremental)
	require.Equal(t, []string{"h2"}, out.Covered)
	require.Len(t, out.Failed["r2"], 1)
}

// A step that changes nothing (the engine loop asking again) wakes no
// waiter and no ticker: on a host of few cores each wake is a thread the
// engine loop then competes with.
func TestAStepThatChangesNothingWakesNobody(t *testing.T) {
	s := openIdle(t)
	out := s.Step(StepIn{Expect: []ExpectIn{{RequestID: "r1", Items: []sched.Expected{{TransferID: "t1", MMHash: "h1"}}}}})
	at := out.Generation
	s.mu.Lock()
	changed := s.changed
	s.mu.Unlock()
	s.Step(StepIn{ChangesSince: &at, Ensure: []string{"r1"}, Has: []string{"h1"}})
	select {
	case <-changed:
		t.Fatal("a step that changed nothing woke the waiters")
	default:
	}
	s.Step(StepIn{Finished: []string{"r1"}})
	select {
	case <-changed:
	default:
		t.Fatal("a step that finished a request woke nobody")
	}
}
