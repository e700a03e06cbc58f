package due

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLoopStepsOnWakeAndDeadlineAndStopsAtStop(t *testing.T) {
	stop := make(chan struct{})
	l := NewLoop()
	steps := make(chan int, 16)
	n := 0
	done := make(chan struct{})
	go func() {
		defer close(done)
		l.Run(stop, func() (time.Time, bool) {
			n++
			steps <- n
			// The second step asks to run again at once: a deadline already
			// past still sleeps at least a millisecond, then steps.
			return time.Now().Add(-time.Second), n == 2
		})
	}()
	require.Equal(t, 1, <-steps)
	l.Wake()
	require.Equal(t, 2, <-steps)
	require.Equal(t, 3, <-steps) // the deadline of step 2 fell due
	close(stop)
	<-done
	select {
	case got := <-steps:
		t.Fatalf("step %d ran after stop", got)
	default:
	}
}

// sleepingUntil waits until the loop sleeps and returns when that sleep
// ends.
func sleepingUntil(t *testing.T, l *Loop) time.Time {
	t.Helper()
	var until time.Time
	require.Eventually(t, func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		until = l.until
		return l.sleeping
	}, 10*time.Second, time.Millisecond)
	return until
}

// stepped waits for the loop's next step, with a generous bound.
func stepped(t *testing.T, steps <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-steps:
	case <-time.After(10 * time.Second):
		t.Fatalf("no step: %s", what)
	}
}

// Due never hands off to the loop's goroutine: a deadline before the end
// of the sleep moves that end, and the loop steps then, not now; a later
// one changes nothing. The caller of Due (a producer's Submit, once a
// batch) so pays no thread wake-up for a deadline seconds away.
func TestDueMovesTheEndOfTheSleepWithoutAWake(t *testing.T) {
	stop := make(chan struct{})
	defer close(stop)
	l := NewLoop()
	steps := make(chan struct{}, 16)
	later := time.Now().Add(time.Hour)
	go l.Run(stop, func() (time.Time, bool) {
		steps <- struct{}{}
		return later, true
	})
	<-steps
	until := sleepingUntil(t, l)
	l.Due(later.Add(time.Minute))
	require.Equal(t, until, sleepingUntil(t, l), "a deadline after the sleep's end leaves it")
	require.Empty(t, l.wake)

	sooner := time.Now().Add(30 * time.Minute)
	l.Due(sooner)
	require.Empty(t, l.wake, "no hand-off for a deadline half an hour away")
	require.Equal(t, sooner, sleepingUntil(t, l), "the sleep ends at the earlier deadline")
	require.Empty(t, steps, "nor a step before it")

	l.Due(time.Now().Add(20 * time.Millisecond))
	stepped(t, steps, "the sleep should have ended at the deadline given to Due")
}

// A Due while a step runs is not lost, even though the step may have read
// its deadlines before the change: the sleep that follows the step ends
// by it.
func TestDueWhileAStepRunsBoundsTheNextSleep(t *testing.T) {
	stop := make(chan struct{})
	defer close(stop)
	l := NewLoop()
	inStep, release := make(chan struct{}), make(chan struct{})
	steps := make(chan struct{}, 16)
	first := true
	go l.Run(stop, func() (time.Time, bool) {
		if first {
			first = false
			inStep <- struct{}{}
			<-release
		}
		steps <- struct{}{}
		return time.Now().Add(time.Hour), true
	})
	<-inStep
	late, soon := time.Now().Add(2*time.Hour), time.Now().Add(30*time.Minute)
	l.Due(late)
	l.Due(soon)
	close(release)
	<-steps
	require.Equal(t, soon, sleepingUntil(t, l), "the earliest Due given during the step ends the sleep")

	// A Due given before the loop runs at all bounds its first sleep.
	l2 := NewLoop()
	l2.Due(soon)
	steps2 := make(chan struct{}, 16)
	go l2.Run(stop, func() (time.Time, bool) {
		steps2 <- struct{}{}
		return time.Time{}, false
	})
	<-steps2
	require.Equal(t, soon, sleepingUntil(t, l2))
}

func TestLifeEndsOnceAndEndsItsContext(t *testing.T) {
	l := NewLife()
	require.False(t, l.Ended())
	require.NoError(t, l.Err())
	require.True(t, l.End())
	require.False(t, l.End(), "a second End is a no-op")
	require.True(t, l.Ended())
	<-l.Done()
	require.ErrorIs(t, l.Err(), context.Canceled)
}

func TestSleep(t *testing.T) {
	open, closed := make(chan struct{}), make(chan struct{})
	close(closed)
	cases := []struct {
		name string
		stop chan struct{}
		d    time.Duration
		want bool
	}{
		{"the whole wait", open, time.Millisecond, true},
		{"no wait", open, 0, true},
		{"stopped before", closed, time.Hour, false},
		{"stopped, no wait", closed, 0, false},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			require.Equal(t, c.want, Sleep(c.stop, c.d))
		})
	}
	t.Run("stopped during", func(t *testing.T) {
		stop := make(chan struct{})
		got := make(chan bool)
		go func() { got <- Sleep(stop, time.Hour) }()
		close(stop)
		select {
		case ok := <-got:
			require.False(t, ok)
		case <-time.After(time.Minute):
			t.Fatal("Sleep did not return when stop closed")
		}
	})
}
