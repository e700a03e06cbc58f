package sched

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// The log keeps at most maxChanges generations: a caller that holds an
// older one, or one the table never gave, is told to take a Snapshot.
func TestChangesAfterTheLogWraps(t *testing.T) {
	tb := New(Config{Shards: 1})
	for i := 0; tb.Generation() <= maxChanges; i++ {
		rid := fmt.Sprint("r", i)
		require.NoError(t, tb.Expect(rid, []Expected{{TransferID: fmt.Sprint("t", i), MMHash: fmt.Sprint("h", i%7)}}, base))
		tb.Finish(rid, base)
	}
	require.NoError(t, tb.CheckInvariants())
	gen := tb.Generation()
	_, _, ok := tb.Changes(0, base)
	require.False(t, ok, "generation 0 is older than the log")
	_, _, ok = tb.Changes(gen+1, base)
	require.False(t, ok, "a generation the table never gave")
	has, failures, ok := tb.Changes(gen, base)
	require.True(t, ok)
	require.Empty(t, has)
	require.Empty(t, failures)

	// One item arrives for a live request: only its content and its
	// request are answered.
	require.NoError(t, tb.Expect("live", []Expected{{TransferID: "x1", MMHash: "hx"}, {TransferID: "y1", MMHash: "hy"}}, base))
	gen = tb.Generation()
	tb.OnEvent(Event{Shard: 0, TransferID: "x1", MMHash: "hx", Ready: true}, base)
	has, failures, ok = tb.Changes(gen, base)
	require.True(t, ok)
	require.Equal(t, map[string]bool{"hx": true}, has)
	require.Equal(t, map[string][]Failure{"live": nil}, failures)
	require.NoError(t, tb.CheckInvariants())
}

// BenchmarkCatchUp is what the engine loop pays to bring its answers up to
// date after one item arrived, among 300 live requests: a Snapshot against
// Changes.
func BenchmarkCatchUp(b *testing.B) {
	const live = 300
	setup := func() *Table {
		tb := New(Config{Shards: 1, EventWait: time.Hour, AvailableTTL: time.Hour})
		for i := range live {
			require.NoError(b, tb.Expect(fmt.Sprint("req-", i), []Expected{{TransferID: fmt.Sprint("tid-", i), MMHash: fmt.Sprintf("%064x", i)}}, base))
		}
		return tb
	}
	for _, mode := range []string{"snapshot", "changes"} {
		b.Run(mode, func(b *testing.B) {
			tb := setup()
			i := 0
			for b.Loop() {
				gen := tb.Generation()
				id := i % live
				i++
				tb.OnEvent(Event{Shard: 0, TransferID: fmt.Sprint("tid-", id), MMHash: fmt.Sprintf("%064x", id), Ready: true}, base)
				if mode == "snapshot" {
					tb.Snapshot(base)
				} else if _, _, ok := tb.Changes(gen, base); !ok {
					b.Fatal("changes not kept")
				}
			}
		})
	}
}
