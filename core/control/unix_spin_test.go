package control

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/wire"
)

// TestUnixReaderAwakeForReplies: with a reply spin the client's reader
// polls for replies while calls are in flight and sleeps otherwise; every
// way a call can meet it is answered, each by its own reply: calls
// pipelined from many goroutines, a call made after the reader went to
// sleep (its kick), a reply that comes after the spin ran out (the reader
// asleep again, woken by the reply), and calls racing the reader's fall
// asleep.
func TestUnixReaderAwakeForReplies(t *testing.T) {
	var slow sync.Map // transfer ids whose reply the server holds back
	h := HandlerFunc(func(req wire.Request) wire.Reply {
		if body, err := wire.DecodeBody[wire.Status](req.Body); err == nil && len(body.TransferIDs) == 1 {
			if d, ok := slow.Load(body.TransferIDs[0]); ok {
				time.Sleep(d.(time.Duration))
			}
		}
		return statusEcho(req)
	})
	name := fmt.Sprintf("@ecmooncake/test/%d/spin", time.Now().UnixNano())
	opt := defaultUnixOptions()
	srv, err := listenUnix(name, h, Security{}, nil, opt)
	require.NoError(t, err)
	t.Cleanup(func() { _ = srv.Close() })
	opt.replySpin = 300 * time.Microsecond
	c, err := dialUnix(name, Security{}, nil, opt)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })

	// Pipelined: many calls in flight at once on the one connection.
	var wg sync.WaitGroup
	errs := make(chan error, 64)
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 8 {
				errs <- statusCall(c, fmt.Sprintf("p%d-%d", g, i))
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		require.NoError(t, err)
	}

	// After the reader fell asleep: the call's kick wakes it.
	for i := range 5 {
		time.Sleep(5 * time.Millisecond)
		require.NoError(t, statusCall(c, fmt.Sprintf("k%d", i)))
	}

	// A reply later than the spin: the reader sleeps, the reply wakes it.
	slow.Store("late", 5*time.Millisecond)
	require.NoError(t, statusCall(c, "late"))

	// Calls at every distance from the reader's fall asleep.
	for i := range 200 {
		time.Sleep(time.Duration(i%7) * 50 * time.Microsecond)
		require.NoError(t, statusCall(c, fmt.Sprintf("r%d", i)))
	}
	st := c.Stats()
	require.Equal(t, uint64(64+5+1+200), st.RoundTrips)
	require.Zero(t, st.LateReplies)
	require.Zero(t, st.BadReplies)
}

// TestDefaultReplySpinNeedsSpareCores: a small host's reader sleeps.
func TestDefaultReplySpinNeedsSpareCores(t *testing.T) {
	require.Zero(t, defaultReplySpin(2))
	require.Zero(t, defaultReplySpin(minSpinCPUs-1))
	require.Equal(t, unixReplySpin, defaultReplySpin(minSpinCPUs))
}
