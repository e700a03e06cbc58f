package gotests

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/producer"
)

// benchBatches pushes b.N batches of n items of size bytes to one shard and
// reports throughput and per-item time; the consumer drains between
// batches, off the clock.
func benchBatches(b *testing.B, n, size int) {
	t := &testing.T{}
	c := newCluster(t, clusterOpts{tp: 1, slabBytes: 2*n*size + 64<<20})
	defer c.close()
	runBatches(b, c, n, size, 0)
}

// runBatches is benchBatches over the cluster c, after warm batches off
// the clock.
func runBatches(b *testing.B, c *cluster, n, size, warm int) {
	src := make([]byte, size)
	for i := range src {
		src[i] = byte(i%255 + 1)
	}
	var total time.Duration
	var each []time.Duration
	for i := -warm; i < b.N; i++ {
		pushes := make([]producer.Push, n)
		srcs := make([]producer.Source, n)
		hashes := make([]string, n)
		for j := range pushes {
			h := fmt.Sprintf("b%d-%d", i, j)
			hashes[j] = h
			pushes[j] = producer.Push{TransferID: h, MMHash: h, NBytes: uint64(size), Consumer: c.consumer}
			srcs[j] = producer.Source{MMHash: h, Mem: src}
		}
		start := time.Now()
		c.prod.Submit(pushes)
		c.prod.Sources(srcs)
		out := c.drain(n, time.Minute)
		if i >= 0 {
			total += time.Since(start)
			each = append(each, time.Since(start))
		}
		require.Empty(b, out.Failed)
		c.shards[0].Acquire(hashes)
		c.shards[0].Release(hashes)
	}
	b.ReportMetric(float64(total.Microseconds())/float64(b.N*n), "us/item")
	b.ReportMetric(float64(total.Microseconds())/float64(b.N), "us/batch")
	slices.Sort(each)
	b.ReportMetric(float64(each[len(each)/2].Microseconds()), "p50-us/batch")
	b.ReportMetric(float64(each[0].Microseconds()), "min-us/batch")
	b.ReportMetric(float64(b.N*n*size)/total.Seconds()/1e9, "GB/s")
}

func BenchmarkBatch256x64KiB(b *testing.B) { benchBatches(b, 256, 64<<10) }
func BenchmarkBatch8x32MiB(b *testing.B)   { benchBatches(b, 8, 32<<20) }

// The one-sided path on this host (shm), reserve_batch + write +
// complete_batch against write + claim_batch from a standing credit window
// (credit_window_bytes): the same cluster but for the setting, so that
// alternating runs of the two show what the reserve round trip costs. The
// slab keeps no resident copies, so that a window always refills.
func benchShm(b *testing.B, n, size int, credit bool) {
	t := &testing.T{}
	o := clusterOpts{tp: 1, shm: true, slabBytes: 8*n*size + 64<<20, maxResident: 1}
	if credit {
		o.credit = uint64(2 * n * size)
	}
	c := newCluster(t, o)
	defer c.close()
	// Warm batches first: each touches slab pages the ones before did not
	// (a window moves through the slab), and a first touch is a page fault
	// in both processes' mappings, which is no part of either path.
	runBatches(b, c, n, size, int(o.slabBytes)/(n*size)+4)
	if credit {
		st := c.prod.Stats().Credit
		b.ReportMetric(float64(st.Batches)/float64(st.Batches+st.Fallbacks), "credit/batch")
	}
}

func BenchmarkShm8x4MiBReserve(b *testing.B)  { benchShm(b, 8, 4<<20, false) }
func BenchmarkShm8x4MiBCredit(b *testing.B)   { benchShm(b, 8, 4<<20, true) }
func BenchmarkShm8x64KiBReserve(b *testing.B) { benchShm(b, 8, 64<<10, false) }
func BenchmarkShm8x64KiBCredit(b *testing.B)  { benchShm(b, 8, 64<<10, true) }
