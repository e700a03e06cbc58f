package gotests

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// creditItems is a batch of n distinct items of the given size.
func creditItems(tag string, n, size int) []item {
	out := make([]item, n)
	for i := range out {
		data := make([]byte, size)
		for k := range data {
			data[k] = byte(i*7 + k + len(tag))
		}
		out[i] = item{tid: fmt.Sprintf("%s-t%d", tag, i), hash: fmt.Sprintf("%s-h%d", tag, i), data: data}
	}
	return out
}

// With credit on over shm, the first batch to each shard reserves (and
// brings the window), the next ones take their regions from the window
// with no reserve and name them in one claim per shard: every byte lands,
// every item is available, and a duplicate is still deduplicated.
func TestCreditBatchesSkipTheReserve(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2, shm: true, credit: 16 << 20})
	first := creditItems("first", 4, 256<<10)
	c.deliver("req-first", first)
	for b := range 3 {
		items := creditItems(fmt.Sprintf("b%d", b), 8, 256<<10)
		c.deliver(fmt.Sprintf("req-b%d", b), items)
		c.verify(items)
	}
	st := c.prod.Stats().Credit
	require.EqualValues(t, 6, st.Batches, "three batches to each of two shards took credit")
	require.EqualValues(t, 2, st.Fallbacks, "the first batch to each shard reserved")
	require.Zero(t, st.Refused)
	for _, s := range c.shards {
		ts := s.Stats().Table
		require.EqualValues(t, 24, ts.Credit.Claimed)
		require.Zero(t, ts.WritesInFlight)
		require.Equal(t, 1, ts.Credit.Windows)
	}

	// A push of content a shard holds is answered cached from the table:
	// the write into the window was for nothing, and counted.
	dup := []item{{tid: "dup-t0", hash: first[0].hash, data: first[0].data}}
	c.deliver("req-dup", dup)
	require.EqualValues(t, 2, c.prod.Stats().Credit.Wasted)
}

// A shard restarted under a live window: the producer's next batch to it
// finds its window gone (the write or the claim is refused), drops it,
// reserves the items again from the sources it still holds, and every push
// succeeds.
func TestCreditShardRestartFallsBackToReserve(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2, shm: true, credit: 16 << 20})
	c.deliver("req-1", creditItems("one", 4, 64<<10))
	c.deliver("req-2", creditItems("two", 4, 64<<10))
	require.Positive(t, c.prod.Stats().Credit.Batches)

	c.restart(0)
	items := creditItems("three", 4, 64<<10)
	c.deliver("req-3", items)
	c.verify(items)
	st := c.prod.Stats().Credit
	require.Positive(t, st.Refused, "the restarted shard refused the old window")
	require.Empty(t, c.pushAll("req-4", creditItems("four", 4, 64<<10)).Failed)
}

// A producer that goes away with credit outstanding leaves nothing behind:
// its window returns to the slab at the end of its lease (here the
// reservation lease, one second, which also ends the items nobody loads),
// and the slab is clean.
func TestCreditWindowOfAGoneProducerReturns(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 1, shm: true, credit: 8 << 20, lease: time.Second})
	c.deliver("req-1", creditItems("one", 2, 64<<10))
	c.deliver("req-2", creditItems("two", 2, 64<<10))
	s := c.shards[0]
	require.Equal(t, 1, s.Stats().Table.Credit.Windows)
	require.NoError(t, c.prod.Close())
	c.prod = nil
	require.Eventually(t, func() bool {
		ts := s.Stats().Table
		return ts.Credit.Windows == 0 && ts.Credit.WindowBytes == 0 && ts.BytesInUse == 0
	}, 20*time.Second, 10*time.Millisecond, "the window returns at its lease's end, and with the unloaded items every slab byte")
	require.EqualValues(t, 1, s.Stats().Table.Credit.Expired)
}
