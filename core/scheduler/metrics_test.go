package scheduler

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/metrics"
)

// The wait clock forgets every transfer once it leaves WAITING_EVENT,
// whichever way it leaves, and never holds more than its bound.
func TestWaitClockForgetsSettledTransfers(t *testing.T) {
	now := time.Unix(1000, 0)
	tab := sched.New(sched.Config{Shards: 1, EventWait: time.Minute, LoadWait: time.Minute})
	w := waitClock{}
	items := []sched.Expected{{TransferID: "t1", MMHash: "h1"}, {TransferID: "t2", MMHash: "h2"}}
	require.NoError(t, tab.Expect("r1", items, now))
	w.expect(items, now)
	w.settleItems(tab, items, now)
	require.Len(t, w, 2, "both still wait for their events")

	tab.OnEvent(sched.Event{Shard: 0, TransferID: "t1", MMHash: "h1", Ready: true, NBytes: 8}, now.Add(time.Second))
	w.settle(tab, []string{"t1"}, now.Add(time.Second))
	require.NotContains(t, w, "t1", "available: observed and forgotten")

	tab.Finish("r1", now.Add(2*time.Second))
	cancelled := tab.Ready(now.Add(2 * time.Second)).Cancels
	w.settle(tab, cancelled, now.Add(2*time.Second))
	require.Empty(t, w, "cancelled with its request: forgotten")

	for i := 0; i <= maxWaiting+1; i++ {
		w.expect([]sched.Expected{{TransferID: string(rune(i)), MMHash: "h"}}, now)
	}
	require.LessOrEqual(t, len(w), maxWaiting+1)
}

// Items the engine encodes itself because their transfer failed on a vLLM
// that cannot fail the request reach ecm_local_encodes_total with the step
// that reports them, once each.
func TestStepCountsLocalEncodes(t *testing.T) {
	s := openIdle(t)
	before := localEncodes(t)
	s.Step(StepIn{LocalEncodes: []string{"h1", "h2"}})
	s.Step(StepIn{})
	require.Equal(t, before+2, localEncodes(t))
}

func localEncodes(t *testing.T) float64 {
	t.Helper()
	text, err := metrics.Text(nil)
	require.NoError(t, err)
	for _, line := range strings.Split(string(text), "\n") {
		if v, ok := strings.CutPrefix(line, "ecm_local_encodes_total "); ok {
			n, err := strconv.ParseFloat(v, 64)
			require.NoError(t, err)
			return n
		}
	}
	t.Fatalf("no ecm_local_encodes_total in\n%s", text)
	return 0
}
