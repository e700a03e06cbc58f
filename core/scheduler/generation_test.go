package scheduler

import (
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/sched"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// openIdle opens a scheduler whose shard never answers: the table is driven
// by Step and by events handed to apply directly.
func openIdle(t *testing.T) *Scheduler {
	t.Helper()
	cfg := config.DefaultScheduler()
	cfg.Shards = []string{"tcp://127.0.0.1:9"}
	s, err := Open(cfg, nil)
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

	s.apply(wire.Event{Shard: 0, TransferID: "t1", MMHash: "h1", Ready: true, NBytes: 8})
	require.Greater(t, read(&counter), registered, "the item arrived")
	require.Equal(t, s.Generation(), read(&counter))
	out = s.Step(StepIn{Ensure: []string{"r1"}, Has: []string{"h1"}})
	require.True(t, out.Ensure["r1"].Ready)
	require.Equal(t, read(&counter), out.Generation)
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
