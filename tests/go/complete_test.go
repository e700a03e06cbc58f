package gotests

import (
	"context"
	"log/slog"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// completeTap is a producer's control links whose callers hand each
// complete_batch (not an abandon) to touch before it is sent and, once the
// shard answered, hold the answer until answer is closed (nil: at once).
type completeTap struct {
	control.Links
	touch  func(*wire.CompleteBatch)
	answer <-chan struct{}
}

func (c completeTap) Dial(ep string, log *slog.Logger) (control.Caller, error) {
	inner, err := c.Links.Dial(ep, log)
	if err != nil {
		return nil, err
	}
	return tappedCaller{Caller: inner, tap: c}, nil
}

type tappedCaller struct {
	control.Caller
	tap completeTap
}

func (t tappedCaller) Call(ctx context.Context, op wire.Op, body, out any) error {
	b, ok := body.(wire.CompleteBatch)
	if op != wire.OpCompleteBatch || !ok || len(b.Items) == 0 || b.Items[0].Abandon {
		return t.Caller.Call(ctx, op, body, out)
	}
	if t.tap.touch != nil {
		b.Items = slices.Clone(b.Items)
		t.tap.touch(&b)
	}
	err := t.Caller.Call(ctx, op, b, out)
	if t.tap.answer != nil {
		<-t.tap.answer
	}
	return err
}

// The complete is one way on the producer's path: while every shard's
// answer to it is held back, the producer has already released each
// source, and the scheduler has every item available (the shard published
// readiness as it accepted the complete). Only the pushes' ends wait for
// the answers.
func TestCompleteAnswerIsOffTheProducersPath(t *testing.T) {
	answer := make(chan struct{})
	c := newInmemCluster(t, inmemOption{
		byMessage: true,
		// The answers are held for as long as the test needs: the
		// complete's deadline (control_timeout_s) is a hang bound here.
		config: func(p *config.Producer) { p.ControlTimeoutS = 60 },
		links:  func(l control.Links) control.Links { return completeTap{Links: l, answer: answer} },
	})
	items := makeItems(301, 4, 1<<10, 64<<10, 0)
	c.push("req-oneway", items)

	avail := c.wait(tids(items), 60*time.Second)
	require.ElementsMatch(t, tids(items), avail.Available, "readiness does not wait for the complete's answer")
	var early []string
	require.Eventually(t, func() bool {
		o := c.prod.Poll(0)
		early = append(early, o.Done...)
		for _, f := range o.Failed {
			early = append(early, "failed: "+f.TransferID+": "+f.Reason)
		}
		st := c.prod.Stats()
		return st.Sources == 0 && st.Push.CompletesOut == len(items)*inmemTP
	}, 60*time.Second, 5*time.Millisecond, "every source is released while every complete is out")
	require.Empty(t, early, "no push ends before its complete is answered")

	close(answer)
	out := c.settle(items)
	require.ElementsMatch(t, tids(items), out.done)
	require.Empty(t, out.failed)
	st := c.prod.Stats().Push
	require.Zero(t, st.CompletesOut)
	require.Zero(t, st.CompletesFailed)
	c.requireReclaimed()
}

// A complete the shard refuses (here: a token that is not the grant's)
// after the producer released the source still fails its push, reported
// and counted, and the region it names is given up: the shard checks every
// complete as before.
func TestRefusedCompleteFailsThePushAfterItsSourceWasReleased(t *testing.T) {
	var tamper atomic.Bool
	tamper.Store(true)
	c := newInmemCluster(t, inmemOption{
		byMessage: true,
		links: func(l control.Links) control.Links {
			return completeTap{Links: l, touch: func(b *wire.CompleteBatch) {
				if tamper.Load() {
					for i := range b.Items {
						b.Items[i].Token[0] ^= 0xff
					}
				}
			}}
		},
	})
	items := makeItems(302, 3, 1<<10, 64<<10, 0)
	c.push("req-refused", items)
	out := c.settle(items)
	require.Empty(t, out.done)
	require.ElementsMatch(t, tids(items), out.failed)
	require.ElementsMatch(t, tids(items), out.sched.Failed, "no item is available on a shard that refused its complete")
	// A push fails with its first refusal; the other shard's answer may
	// still be on its way.
	require.Eventually(t, func() bool {
		return c.prod.Stats().Push.CompletesFailed == uint64(len(items)*inmemTP)
	}, 60*time.Second, 5*time.Millisecond, "each refusal is counted, on every shard")
	c.requireReclaimed()

	tamper.Store(false)
	awaitHeartbeats(t, c.sched)
	next := makeItems(303, 3, 1<<10, 64<<10, 0)
	c.push("req-after", next)
	after := c.settle(next)
	require.ElementsMatch(t, tids(next), after.done)
	require.ElementsMatch(t, tids(next), after.sched.Available)
	c.requireReclaimed()
}

// At complete_window a shard's next completes wait, counted, until an
// answer frees a place; their sources are released all the same, and once
// the answers come every push ends done.
func TestCompletesBeyondTheWindowWaitForAnAnswer(t *testing.T) {
	const window = 2
	answer := make(chan struct{})
	c := newInmemCluster(t, inmemOption{
		byMessage: true,
		config:    func(p *config.Producer) { p.ControlTimeoutS, p.CompleteWindow = 60, window },
		links:     func(l control.Links) control.Links { return completeTap{Links: l, answer: answer} },
	})
	items := makeItems(304, 4, 1<<10, 64<<10, 0)
	c.push("req-window", items)
	require.Eventually(t, func() bool {
		c.prod.Poll(0)
		st := c.prod.Stats()
		return st.Sources == 0 && st.Push.CompletesOut == window*inmemTP && st.Push.WindowWaits == uint64((len(items)-window)*inmemTP)
	}, 60*time.Second, 5*time.Millisecond, "each shard has its window's completes out and the rest waiting")

	close(answer)
	out := c.settle(items)
	require.ElementsMatch(t, tids(items), out.done)
	require.ElementsMatch(t, tids(items), out.sched.Available)
	require.Zero(t, c.prod.Stats().Push.CompletesOut)
	c.requireReclaimed()
}

// Over a data plane that completes in-band (TCP, for which the in-memory
// plane stands in), the last frame of each item completes it at the shard:
// every item becomes available and every push ends done with no
// complete_batch sent, and every region is reclaimed.
func TestInBandCompleteSendsNoCompleteBatch(t *testing.T) {
	var completes atomic.Int64
	c := newInmemCluster(t, inmemOption{
		links: func(l control.Links) control.Links {
			return completeTap{Links: l, touch: func(b *wire.CompleteBatch) { completes.Add(int64(len(b.Items))) }}
		},
	})
	items := makeItems(305, 6, 1<<10, 64<<10, 0)
	c.push("req-inband", items)
	out := c.settle(items)
	require.ElementsMatch(t, tids(items), out.done)
	require.ElementsMatch(t, tids(items), out.sched.Available)
	require.Zero(t, completes.Load(), "no complete_batch follows an item completed in-band")
	for _, it := range items {
		c.requireOnEveryShard(it)
	}
	c.requireReclaimed()
}
