package gotests

import (
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/producer"
	"github.com/ecmooncake/ecmooncake/core/scheduler"
)

func schedulerStepExpect(req, tid, hash string) scheduler.StepIn {
	return scheduler.StepIn{Expect: []scheduler.ExpectIn{{RequestID: req, Items: []sched.Expected{{TransferID: tid, MMHash: hash}}}}}
}

// The producer dies with writes in flight: the consumer's lease reclaims
// the region (slab back to zero bytes in use) and the scheduler fails the
// item within its deadline instead of waiting forever.
func TestProducerDiesMidWrite(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2, lease: 2 * time.Second, pushWait: 3 * time.Second, slabBytes: 256 << 20})
	items := makeItems(6, 4, 32<<20, 32<<20, 0)
	c.expect("req", items)
	c.send(items)
	// Kill the producer as soon as bytes start to land.
	require.Eventually(t, func() bool { return c.shards[0].Stats().Data.Bytes > 0 }, hang, time.Millisecond)
	require.NoError(t, c.prod.Close())
	c.prod = nil

	w := c.wait(tids(items), 30*time.Second)
	require.Empty(t, w.Waiting, "every item must be decided within the deadline")
	// An item whose every byte landed before the producer died may be
	// published (on a loaded machine the kill can come that late); one
	// that is must hold every byte on every shard, and the rest failed.
	var landed []item
	for _, it := range items {
		if slices.Contains(w.Available, it.tid) {
			landed = append(landed, it)
		}
	}
	t.Logf("%d of %d items were published before the producer died", len(landed), len(items))
	c.verify(landed)
	require.Len(t, w.Failed, len(items)-len(landed), "every item not published failed")
	var kept uint64
	for _, it := range landed {
		kept += uint64(len(it.data))
	}
	for r, s := range c.shards {
		require.Eventually(t, func() bool { return s.Stats().InUse == kept }, 30*time.Second, 20*time.Millisecond,
			"shard %d slab must drain to the %d bytes of the items published", r, kept)
	}
}

// A shard dies with writes in flight: the producer reports every push
// failed within its deadline and releases every source.
func TestConsumerDiesMidWrite(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2, pushWait: 3 * time.Second, slabBytes: 256 << 20})
	items := makeItems(7, 4, 32<<20, 32<<20, 0)
	c.send(items)
	require.Eventually(t, func() bool { return c.shards[1].Stats().Data.Bytes > 0 }, hang, time.Millisecond)
	require.NoError(t, c.shards[1].Close())
	c.shards[1] = nil

	out := c.drain(len(items), 15*time.Second)
	require.NotEmpty(t, out.Failed, "pushes to a dead shard must fail")
	// The cancels for the dead shard's grants leave on the driver's next
	// turn; until then the producer rightly reports work pending.
	require.Eventually(t, func() bool { st := c.prod.Stats(); return st.Sources == 0 && !st.Pending }, hang, 20*time.Millisecond)
}

// A push that never comes: the scheduler's next step reports the request's
// item failed, once, as retryable, after push_wait_timeout_s.
func TestMissingPushFailsTheRequestInAStep(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2, pushWait: time.Second})
	items := makeItems(8, 1, 1024, 1024, 0)
	c.expect("req-lost", items)
	var got []sched.Failure
	require.Eventually(t, func() bool {
		got = append(got, c.sched.Step(scheduler.StepIn{}).Failures...)
		return len(got) > 0
	}, hang, 50*time.Millisecond)
	require.Len(t, got, 1)
	require.Equal(t, "req-lost", got[0].RequestID)
	require.Equal(t, items[0].tid, got[0].TransferID)
	require.True(t, got[0].Retryable)
	require.Empty(t, c.sched.Step(scheduler.StepIn{}).Failures, "a failure is reported once")
}

// A reservation the shard cannot make room for fails the waiting request
// at once, as retryable, rather than when its push wait runs out.
func TestRefusedReservationFailsTheRequestAtOnce(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2, slabBytes: 1 << 20, pushWait: time.Hour})
	items := makeItems(10, 1, 2<<20, 2<<20, 0)
	c.expect("req-big", items)
	c.send(items)
	out := c.drain(1, 30*time.Second)
	require.NotEmpty(t, out.Failed)
	require.Contains(t, out.Failed[0].Reason, "pool full")

	w := c.wait(tids(items), time.Minute)
	require.Equal(t, tids(items), w.Failed, "decided by the refusal: the push wait is an hour")
	var got []sched.Failure
	require.Eventually(t, func() bool {
		got = append(got, c.sched.Step(scheduler.StepIn{}).Failures...)
		return len(got) > 0
	}, hang, 10*time.Millisecond)
	require.Equal(t, "req-big", got[0].RequestID)
	require.True(t, got[0].Retryable)
	require.Contains(t, got[0].Reason, "refused")
	require.Contains(t, got[0].Reason, "pool full")
}

// A shard that dies takes its items with it: has_cache_item stops saying
// yes, a load of them fails cleanly, and a restarted shard is followed
// anew, so what it receives afterwards is available again.
func TestDeadShardItemsStopBeingAvailable(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2})
	items := makeItems(11, 2, 4096, 4096, 0)
	c.deliver("req-dead", items)
	require.True(t, c.sched.Has(items[0].hash))

	require.NoError(t, c.shards[1].Close())
	require.Eventually(t, func() bool { return !c.sched.Has(items[0].hash) && !c.sched.Has(items[1].hash) },
		30*time.Second, 20*time.Millisecond, "items held by a dead shard are no longer available")
	load := c.sched.Step(scheduler.StepIn{Load: []string{items[0].hash}}).Load
	require.Len(t, load, 1)
	require.Empty(t, load[0].TransferID)
	require.Contains(t, load[0].Error, "not available")

	c.slabs[1], c.shards[1] = c.openShard(1)
	after := makeItems(12, 1, 4096, 4096, 0)
	require.Empty(t, c.pushAll("req-back", after).Failed)
	w := c.wait(tids(after), 20*time.Second)
	require.ElementsMatch(t, tids(after), w.Available)
}

// A shard that restarts while its items are available: they stop being
// available (the new incarnation does not hold them).
func TestRestartedShardItemsStopBeingAvailable(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2})
	items := makeItems(13, 1, 4096, 4096, 0)
	c.deliver("req-rs", items)
	c.restart(0)
	require.Eventually(t, func() bool { return !c.sched.Has(items[0].hash) }, hang, 20*time.Millisecond)
}

// Two requests show one image, so their pushes share one write: the
// shard grants the first a write and follows it with the second. The
// first request is aborted before the encoder output exists; the second
// still gets its image once the encoder computes it for the second.
func TestAbortedRequestSparesOneSharingItsImage(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2})
	data := makeItems(52, 1, 64<<10, 64<<10, 0)[0].data
	a := item{tid: "tx-share-a", hash: "mm-share", data: data}
	b := item{tid: "tx-share-b", hash: "mm-share", data: data}
	c.expect("req-share-a", []item{a})
	c.expect("req-share-b", []item{b})
	for _, err := range c.prod.Submit([]producer.Push{
		{TransferID: a.tid, MMHash: a.hash, NBytes: uint64(len(data)), Consumer: c.consumer, Meta: metaOf(a)},
		{TransferID: b.tid, MMHash: b.hash, NBytes: uint64(len(data)), Consumer: c.consumer, Meta: metaOf(b)},
	}) {
		require.NoError(t, err)
	}
	for r, s := range c.shards {
		require.Eventually(t, func() bool { return s.Stats().Table.Transfers == 2 }, hang, 5*time.Millisecond,
			"shard %d: a writer and its follower", r)
	}

	// The encoder drops the aborted request's push; the consumer finishes it.
	c.prod.Cancel([]string{a.tid})
	c.sched.Step(scheduler.StepIn{Finished: []string{"req-share-a"}})
	_, errs := c.prod.Sources([]producer.Source{{MMHash: b.hash, Mem: b.data}})
	require.NoError(t, errs[0])

	w := c.wait([]string{b.tid}, 15*time.Second)
	require.Equal(t, []string{b.tid}, w.Available, "the request that was not aborted gets its image")
	c.verify([]item{b})
}
