package gotests

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/fsm/reserve"
	"github.com/ecmooncake/ecmooncake/core/transport"
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

// oneSided is a one-sided data plane for one shard over in-memory links:
// the shard's receiver names slab offset o as remoteBase+o (as shm and
// cuda_ipc do), and the writer copies each item straight into the slab of
// the shard's current incarnation at its address, asking the shard
// nothing. A restarted shard keeps the address space, so a window of the
// old incarnation lands in the new one's slab: its claim is what must
// refuse it.
type oneSided struct {
	*transport.Inmem
	slab func() []byte
}

type oneSidedRecv struct{ transport.Receiver }

const remoteBase = 1 << 40

func (oneSided) Name() string                     { return "tcp" }
func (oneSidedRecv) RemoteAddr(off uint64) uint64 { return remoteBase + off }
func (o oneSided) NewWriter() transport.Writer    { return oneSidedWriter{slab: o.slab} }
func (o oneSided) Listen(addr string, sink transport.Sink) (transport.Receiver, error) {
	r, err := o.Inmem.Listen(addr, sink)
	return oneSidedRecv{r}, err
}

type oneSidedWriter struct{ slab func() []byte }

func (w oneSidedWriter) Write(_ context.Context, _ string, items []transport.WriteItem) []error {
	errs := make([]error, len(items))
	mem := w.slab()
	for i, it := range items {
		off := it.Addr - remoteBase + it.Off
		if it.Addr < remoteBase || off+uint64(len(it.Src)) > uint64(len(mem)) || it.Off+uint64(len(it.Src)) > it.Size {
			errs[i] = fmt.Errorf("one-sided write to %#x+%d: %w", it.Addr, it.Off, transport.ErrOutOfBounds)
			continue
		}
		copy(mem[off:], it.Src)
	}
	return errs
}

func (oneSidedWriter) Close() error { return nil }

// A shard restarted under a live window, on a data plane that still takes
// the old window's writes: the claim is refused (the new incarnation holds
// no window), the producer drops its window, reserves, writes and
// completes the items again from the sources the write still holds, and
// every push succeeds; its next batch brings a new window.
func TestRefusedClaimReservesAndThePushSucceeds(t *testing.T) {
	var c *cluster
	network := transport.NewInmemNetwork()
	tr := func() transport.Transport {
		return oneSided{Inmem: transport.NewInmem(network), slab: func() []byte { return c.slabs[0] }}
	}
	c = newCluster(t, clusterOpts{tp: 1, slabBytes: 16 << 20, credit: 4 << 20,
		consumerTr: func(int) transport.Transport { return tr() }, producerTr: tr})
	c.deliver("req-1", creditItems("one", 4, 64<<10))
	two := creditItems("two", 4, 64<<10)
	c.deliver("req-2", two)
	c.verify(two)
	require.EqualValues(t, 1, c.prod.Stats().Credit.Batches)

	c.restart(0)
	three := creditItems("three", 4, 64<<10)
	c.deliver("req-3", three)
	c.verify(three)
	st := c.prod.Stats().Credit
	require.EqualValues(t, 4, st.Refused, "every claim of the old window was refused, and reserved")
	require.EqualValues(t, 2, st.Batches)
	ts := c.shards[0].Stats().Table
	require.EqualValues(t, 4, ts.Credit.Refused[reserve.ClaimNoCredit])
	require.Zero(t, ts.Credit.Claimed)

	c.deliver("req-4", creditItems("four", 4, 64<<10)) // reserves: the window was dropped
	five := creditItems("five", 4, 64<<10)
	c.deliver("req-5", five)
	c.verify(five)
	st = c.prod.Stats().Credit
	require.EqualValues(t, 3, st.Batches, "a new window serves the batch after")
	require.EqualValues(t, 4, c.shards[0].Stats().Table.Credit.Claimed)
}
