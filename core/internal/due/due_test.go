package due

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestLoopStepsOnWakeAndDeadlineAndStopsAtStop(t *testing.T) {
	stop, wake := make(chan struct{}), make(chan struct{})
	steps := make(chan int, 16)
	n := 0
	done := make(chan struct{})
	go func() {
		defer close(done)
		Loop(stop, wake, func() (time.Time, bool) {
			n++
			steps <- n
			// The second step asks to run again at once: a deadline already
			// past still sleeps at least a millisecond, then steps.
			return time.Now().Add(-time.Second), n == 2
		})
	}()
	require.Equal(t, 1, <-steps)
	wake <- struct{}{}
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
