package gotests

import (
	"fmt"
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
	src := make([]byte, size)
	for i := range src {
		src[i] = byte(i%255 + 1)
	}
	var total time.Duration
	for i := 0; i < b.N; i++ {
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
		total += time.Since(start)
		require.Empty(b, out.Failed)
		c.shards[0].Acquire(hashes)
		c.shards[0].Release(hashes)
	}
	b.ReportMetric(float64(total.Microseconds())/float64(b.N*n), "us/item")
	b.ReportMetric(float64(b.N*n*size)/total.Seconds()/1e9, "GB/s")
}

func BenchmarkBatch256x64KiB(b *testing.B) { benchBatches(b, 256, 64<<10) }
func BenchmarkBatch8x32MiB(b *testing.B)   { benchBatches(b, 8, 32<<20) }
