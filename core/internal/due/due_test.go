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

func TestDueWakesOnlyForAnEarlierDeadline(t *testing.T) {
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
	require.Eventually(t, func() bool {
		l.mu.Lock()
		defer l.mu.Unlock()
		return l.sleeping
	}, 10*time.Second, time.Millisecond)
	l.Due(later.Add(time.Minute))
	require.Empty(t, l.wake, "a deadline after the sleep's end leaves the loop asleep")
	l.Due(later.Add(-time.Minute))
	<-steps // an earlier one wakes it
}

func TestDueWhileAStepRunsStepsAgain(t *testing.T) {
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
	// The step may have read its deadlines already: a Due now, even a late
	// one, must not be lost.
	l.Due(time.Now().Add(2 * time.Hour))
	close(release)
	<-steps
	<-steps
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
