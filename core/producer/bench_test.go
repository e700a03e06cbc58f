package producer_test

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/node"
	"github.com/ecmooncake/ecmooncake/core/producer"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// tcpNamed is the in-memory data plane under the name the settings give
// (tcp), which the consumer's shard requires of the plane it is handed.
type tcpNamed struct{ *transport.Inmem }

func (tcpNamed) Name() string { return "tcp" }

// hotBench is one producer and a one-shard consumer over in-memory links
// and data plane, as the encoder's per-batch calls meet them.
type hotBench struct {
	prod     *producer.Producer
	consumer *node.Consumer
	shard    string // the consumer's control endpoint
	item     []byte
}

func newHotBench(tb testing.TB) *hotBench {
	tb.Helper()
	log := slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelWarn}))
	ctl, data := control.NewInmemNetwork(), transport.NewInmemNetwork()
	cfg := config.DefaultConsumer()
	cfg.Port, cfg.TPSize, cfg.TPRank, cfg.DataPort = 5000, 1, 0, 7000
	shard, err := node.OpenConsumer(cfg, make([]byte, 256<<20), node.Options{
		Log: log, Devices: gpu.Unavailable{Err: errors.New("no GPU in this benchmark")},
		Network: tcpNamed{transport.NewInmem(data)},
		Control: func() control.Links { return ctl.Links("shard-0") },
	})
	require.NoError(tb, err)
	tb.Cleanup(func() { require.NoError(tb, shard.Close()) })
	pcfg := config.DefaultProducer()
	prod, err := producer.Open(pcfg, producer.Options{Transport: tcpNamed{transport.NewInmem(data)}, Log: log, Links: ctl.Links("producer")})
	require.NoError(tb, err)
	tb.Cleanup(func() { require.NoError(tb, prod.Close()) })
	return &hotBench{prod: prod, consumer: shard, shard: shard.Info().Control, item: make([]byte, 4<<10)}
}

// batch is batch b's pushes and sources: n items, each a distinct mm_hash.
func (h *hotBench) batch(b, n int) ([]producer.Push, []producer.Source) {
	pushes := make([]producer.Push, n)
	srcs := make([]producer.Source, n)
	for i := range pushes {
		mm := fmt.Sprintf("%032x%032x", b, i)
		pushes[i] = producer.Push{TransferID: fmt.Sprintf("hb-%d-%d", b, i), MMHash: mm, NBytes: uint64(len(h.item)),
			Consumer: h.shard, Meta: `{"dtype":"uint8","shape":[1,4096]}`}
		srcs[i] = producer.Source{MMHash: mm, Mem: h.item}
	}
	return pushes, srcs
}

// finish waits until every push of a batch is done and its source
// released, so that no batch queues behind the one before; then the
// consumer loads and frees the items, as a PD does, so that the slab
// can evict them for later batches however many the benchmark runs.
func (h *hotBench) finish(tb testing.TB, srcs []producer.Source) {
	tb.Helper()
	n := len(srcs)
	done, released := 0, 0
	deadline := time.Now().Add(30 * time.Second)
	for done < n || released < n {
		require.True(tb, time.Now().Before(deadline), "batch not finished: %d of %d done, %d released", done, n, released)
		o := h.prod.Poll(time.Second)
		require.Empty(tb, o.Failed)
		done += len(o.Done)
		released += len(o.Released)
	}
	hashes := make([]string, n)
	for i, s := range srcs {
		hashes[i] = s.MMHash
	}
	for _, l := range h.consumer.Acquire(hashes) {
		require.Empty(tb, l.Error)
	}
	for _, err := range h.consumer.Release(hashes) {
		require.NoError(tb, err)
	}
}

// benchHot times one of the two per-batch calls (the other runs untimed)
// for batches of 8, each finished before the next.
func benchHot(b *testing.B, timeSubmit bool) {
	h := newHotBench(b)
	const n = 8
	run := func(k int, timed bool) {
		pushes, srcs := h.batch(k, n)
		if timed && timeSubmit {
			b.StartTimer()
		}
		for _, err := range h.prod.Submit(pushes) {
			require.NoError(b, err)
		}
		if timed && timeSubmit {
			b.StopTimer()
		}
		if timed && !timeSubmit {
			b.StartTimer()
		}
		_, errs := h.prod.Sources(srcs)
		if timed && !timeSubmit {
			b.StopTimer()
		}
		for _, err := range errs {
			require.NoError(b, err)
		}
		h.finish(b, srcs)
	}
	// The first batch looks the consumer up; later ones find it known.
	run(-1, false)
	b.ReportAllocs()
	b.ResetTimer()
	b.StopTimer()
	for k := 0; k < b.N; k++ {
		run(k, true)
	}
}

// BenchmarkSubmit8 is Submit of 8 pushes to a consumer already known, the
// call behind Python's submit.
func BenchmarkSubmit8(b *testing.B) { benchHot(b, true) }

// BenchmarkSources8 is Sources of 8 host sources whose pushes are
// waiting for them, the call behind Python's hand_over.
func BenchmarkSources8(b *testing.B) { benchHot(b, false) }
