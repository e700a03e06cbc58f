package sched

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// A Gone event reaches the early events of its own content, and only
// those: an expected transfer whose early event came from the copy that
// went is not taken for available, and other content's are untouched.
func TestGoneReachesTheEarlyEventsOfItsContent(t *testing.T) {
	tb := New(Config{Shards: 1})
	now := time.Unix(1_700_000_000, 0)
	for i := range 100 {
		tb.OnEvent(Event{TransferID: fmt.Sprint("t", i), MMHash: fmt.Sprint("h", i%10), Ready: true, NBytes: 64}, now)
	}
	tb.OnEvent(Event{MMHash: "h3", Gone: true}, now)
	require.NoError(t, tb.CheckInvariants())
	require.NoError(t, tb.Expect("r3", []Expected{{TransferID: "t13", MMHash: "h3"}}, now))
	require.NoError(t, tb.Expect("r4", []Expected{{TransferID: "t14", MMHash: "h4"}}, now))
	st, _ := tb.Status("t13")
	require.NotEqual(t, Available, st, "its copy went")
	st, _ = tb.Status("t14")
	require.Equal(t, Available, st)
	require.NoError(t, tb.CheckInvariants())
}

// BenchmarkGoneAmongEarlyEvents: a Gone event while 50,000 early events
// of other content wait for their requests (pushes that came first, up to
// MaxEarlyEvents): what it costs the engine loop that applies it.
func BenchmarkGoneAmongEarlyEvents(b *testing.B) {
	tb := New(Config{Shards: 1})
	now := time.Unix(1_700_000_000, 0)
	for i := range 50_000 {
		tb.OnEvent(Event{TransferID: fmt.Sprint("t", i), MMHash: fmt.Sprintf("%064x", i), Ready: true, NBytes: 64}, now)
	}
	gone := Event{MMHash: fmt.Sprintf("%064x", 1<<40), Gone: true}
	for b.Loop() {
		tb.OnEvent(gone, now)
	}
}
