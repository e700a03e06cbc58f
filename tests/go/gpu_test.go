package gotests

import (
	"bytes"
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/node"
	"github.com/ecmooncake/ecmooncake/core/producer"
	"github.com/ecmooncake/ecmooncake/core/scheduler"
	"github.com/ecmooncake/ecmooncake/core/trace"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/cudaipc"
)

// gpuCluster is a consumer whose TP shards each hold their slab on a GPU of
// one fake host, a scheduler, and two producers on the same host: one
// free to use cuda_ipc, one told to use the network.
type gpuCluster struct {
	t        testing.TB
	host     *gpu.FakeHost
	windows  [][]byte // each shard's slab, as the test sees it
	shards   []*node.Consumer
	sched    *scheduler.Scheduler
	prods    map[string]*node.Producer
	consumer string
}

const gpuHostName = "gpu-host-0"

func newGPUCluster(t testing.TB, tp, slabBytes int) *gpuCluster {
	log := quietLog()
	c := &gpuCluster{t: t, host: gpu.NewFakeHost(tp), prods: map[string]*node.Producer{}}
	opts := node.Options{Log: log, Devices: c.host}
	base := freeBaseTB(t, tp)
	for r := 0; r < tp; r++ {
		addr, window := c.host.Alloc(r, slabBytes)
		cfg := config.DefaultConsumer()
		cfg.Port, cfg.TPSize, cfg.TPRank, cfg.Host = base, tp, r, gpuHostName
		s, err := node.OpenConsumerDevice(cfg, addr, uint64(slabBytes), r, opts)
		require.NoError(t, err)
		c.windows = append(c.windows, window)
		c.shards = append(c.shards, s)
	}
	c.consumer = c.shards[0].Info().Control
	scfg := config.DefaultScheduler()
	scfg.Port, scfg.TPSize = base, tp
	var err error
	c.sched, err = node.OpenScheduler(scfg, opts)
	require.NoError(t, err)
	for _, plane := range []string{cudaipc.Name, "tcp"} {
		pcfg := config.DefaultProducer()
		pcfg.ControlTimeoutS, pcfg.PushWaitS, pcfg.Host = 5, 20, gpuHostName
		if plane != cudaipc.Name {
			pcfg.LocalTransport = "none"
		}
		c.prods[plane], err = node.OpenProducer(pcfg, opts)
		require.NoError(t, err)
	}
	t.Cleanup(c.close)
	return c
}

func (c *gpuCluster) close() {
	for plane, p := range c.prods {
		require.NoError(c.t, p.Close())
		delete(c.prods, plane)
	}
	if c.sched != nil {
		require.NoError(c.t, c.sched.Close())
		c.sched = nil
	}
	for i, s := range c.shards {
		if s != nil {
			require.NoError(c.t, s.Close())
			c.shards[i] = nil
		}
	}
}

// freeBaseTB is freeBase for benchmarks too.
func freeBaseTB(t testing.TB, n int) int {
	if tt, ok := t.(*testing.T); ok {
		return freeBase(tt, n)
	}
	return freeBase(&testing.T{}, n)
}

// push expects, submits and hands over items whose outputs are in device
// memory of GPU 0, and waits until every push is done.
func (c *gpuCluster) push(plane, req string, items []item, stream uintptr) {
	c.t.Helper()
	p := c.prods[plane]
	exp := make([]sched.Expected, len(items))
	pushes := make([]producer.Push, len(items))
	for i, it := range items {
		exp[i] = sched.Expected{TransferID: it.tid, MMHash: it.hash}
		pushes[i] = producer.Push{TransferID: it.tid, MMHash: it.hash, NBytes: uint64(len(it.data)), Consumer: c.consumer}
	}
	require.Empty(c.t, c.sched.Step(scheduler.StepIn{Expect: []scheduler.ExpectIn{{RequestID: req, Items: exp}}}).ExpectErrors)
	for _, err := range p.Submit(pushes) {
		require.NoError(c.t, err)
	}
	dev, err := c.host.Device(0)
	require.NoError(c.t, err)
	seen := map[string]bool{}
	var srcs []producer.Source
	for _, it := range items {
		if seen[it.hash] {
			continue
		}
		seen[it.hash] = true
		addr, window := c.host.Alloc(0, len(it.data))
		copy(window, it.data)
		ready, err := dev.RecordEvent(stream)
		require.NoError(c.t, err)
		srcs = append(srcs, producer.Source{MMHash: it.hash, Dev: &transport.DeviceSrc{Addr: addr, Len: uint64(len(it.data)), Ready: ready}})
	}
	_, errs := p.Sources(srcs)
	for _, err := range errs {
		require.NoError(c.t, err)
	}
	decided := map[string]bool{}
	deadline := time.Now().Add(30 * time.Second)
	for len(decided) < len(items) && time.Now().Before(deadline) {
		o := p.Poll(200 * time.Millisecond)
		require.Empty(c.t, o.Failed)
		for _, id := range o.Done {
			decided[id] = true
		}
	}
	require.Len(c.t, decided, len(items))
}

// verify checks every item's bytes in every shard's slab.
func (c *gpuCluster) verify(items []item) {
	c.t.Helper()
	for r, s := range c.shards {
		for _, it := range items {
			got := s.Acquire([]string{it.hash})[0]
			require.Empty(c.t, got.Error, "shard %d acquire %s", r, it.hash)
			region := c.windows[r][got.Offset : got.Offset+got.NBytes]
			require.True(c.t, bytes.Equal(it.data, region), "shard %d item %s differs", r, it.tid)
			for _, err := range s.Release([]string{it.hash}) {
				require.NoError(c.t, err)
			}
		}
	}
}

func TestGPUSlabsOverEachPlane(t *testing.T) {
	c := newGPUCluster(t, 2, 64<<20)
	for i, plane := range []string{cudaipc.Name, "tcp"} {
		items := makeItems(uint64(40+i), 6, 1, 3<<20, 3)
		c.push(plane, "req-"+plane, items, 0)
		w := c.wait(tids(items), 10*time.Second)
		require.Len(t, w.Available, len(items), "every item is available on every shard")
		c.verify(items)
		for r, s := range c.shards {
			planes := s.Stats().Planes
			if plane == cudaipc.Name {
				// cuda_ipc writes straight into the slab: no frame passes
				// through a receiver.
				require.Zero(t, planes["tcp"].Frames, "shard %d: a producer on the same host uses cuda_ipc", r)
				require.Equal(t, len(c.shards), c.host.OpenMappings(), "the producer mapped every shard's slab")
				require.Equal(t, uint64(1), planes[cudaipc.Name].Attached, "shard %d handed its slab to the producer once", r)
				writes := map[string]bool{}
				for _, it := range items {
					writes[it.hash] = true
				}
				require.Equal(t, uint64(len(writes)), planes[cudaipc.Name].Completed, "shard %d completed every write (one per content) by its ready word", r)
				require.Empty(t, planes[cudaipc.Name].Rejected, "shard %d refused no announcement", r)
			} else {
				require.Positive(t, planes["tcp"].Frames, "shard %d: tcp carried the tcp pushes (%v)", r, planes)
			}
		}
	}
	require.Eventually(t, func() bool { return c.host.OpenEvents() == 0 }, hang, 10*time.Millisecond,
		"every source's readiness event is closed once the source is released")
	require.Positive(t, c.host.OpenMappings())
	c.close()
	require.Zero(t, c.host.OpenMappings(), "closing the producer closes its mappings of the shards' slabs")
}

// TestGPUBatchCostsOneRoundTripPerShard counts the producer's control
// round trips: over cuda_ipc a batch costs one reserve_batch per shard
// and nothing else: the grant names the region, the copy needs no
// exchange, and the item completes by the ready word its GPU stores after
// the copy (one one-way announcement on the data connection), so no
// complete_batch follows.
func TestGPUBatchCostsOneRoundTripPerShard(t *testing.T) {
	const tp = 2
	c := newGPUCluster(t, tp, 32<<20)
	p := c.prods[cudaipc.Name]
	c.push(cudaipc.Name, "req-warm", makeItems(60, 4, 1<<10, 64<<10, 0), 0)
	for b := range 3 {
		before := p.Stats().RoundTrips
		items := makeItems(uint64(61+b), 4, 1<<10, 64<<10, 0)
		c.push(cudaipc.Name, fmt.Sprintf("req-count-%d", b), items, 0)
		require.Len(t, c.wait(tids(items), 10*time.Second).Available, len(items))
		require.Equal(t, uint64(tp), p.Stats().RoundTrips-before, "batch %d: one reserve per shard, no complete", b)
	}
}

// TestGPUReadyPathIsTimedByPhase: a batch over cuda_ipc leaves one
// observation of every phase of its readiness path, on the side that can
// time it (the producer: copies and write, and no complete, which the
// ready words made needless; the scheduler: the event's delivery), for a
// benchmark to break down.
func TestGPUReadyPathIsTimedByPhase(t *testing.T) {
	c := newGPUCluster(t, 1, 32<<20)
	p := c.prods[cudaipc.Name]
	c.push(cudaipc.Name, "req-phase-warm", makeItems(70, 2, 1<<10, 64<<10, 0), 0)
	before := p.Stats().Phases
	items := makeItems(71, 4, 1<<10, 64<<10, 0)
	c.push(cudaipc.Name, "req-phase", items, 0)
	require.Len(t, c.wait(tids(items), 10*time.Second).Available, len(items))
	after := p.Stats().Phases
	for _, ph := range []string{metrics.PhaseReserveRTT, metrics.PhaseWriteHandoff, metrics.PhaseCopyQueue,
		metrics.PhaseCopyQueueWaits, metrics.PhaseCopyQueueCopies, metrics.PhaseWrite} {
		require.Equal(t, uint64(1), after[ph].Count-before[ph].Count, "phase %s: once per batch", ph)
	}
	for _, ph := range []string{metrics.PhaseCompleteHandoff, metrics.PhaseCompleteRTT} {
		require.Zero(t, after[ph].Count-before[ph].Count, "phase %s: no complete over cuda_ipc", ph)
	}
	require.Eventually(t, func() bool {
		return c.sched.Stats().Phases[metrics.PhaseEventDelivery].Count >= before[metrics.PhaseEventDelivery].Count+uint64(len(items))
	}, hang, time.Millisecond, "the scheduler timed each readiness event's delivery")
}

func (c *gpuCluster) wait(ids []string, within time.Duration) scheduler.WaitOut {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	return c.sched.Wait(ctx, ids)
}

// TestGPUSourceWaitsForItsStream hands over outputs whose stream is still
// busy: nothing may be published before the work completes and the bytes
// published are the final ones.
func TestGPUSourceWaitsForItsStream(t *testing.T) {
	c := newGPUCluster(t, 1, 32<<20)
	for _, plane := range []string{cudaipc.Name, "tcp"} {
		t.Run(plane, func(t *testing.T) {
			stream := c.host.NewStream()
			stream.Hold()
			items := makeItems(50, 2, 1<<20, 2<<20, 0)
			for i := range items {
				items[i].tid += plane
				items[i].hash += plane
			}
			done := make(chan struct{})
			go func() {
				defer close(done)
				c.push(plane, "req-wait-"+plane, items, stream.Handle())
			}()
			w := c.wait(tids(items), 50*time.Millisecond)
			require.Empty(t, w.Available, "nothing is published while the producing stream is busy")
			stream.Release()
			<-done
			require.Len(t, c.wait(tids(items), 10*time.Second).Available, len(items))
			c.verify(items)
		})
	}
}

// benchGPUBatches measures what an item costs beyond its bytes: batches
// of n small items over cuda_ipc between fake GPUs, whose copies are
// memcpy, so the control plane is all that is left.
func benchGPUBatches(b *testing.B, n int) {
	c := newGPUCluster(b, 1, 64<<20)
	const size = 64 << 10
	var total time.Duration
	before := metrics.Phases()
	for i := 0; i < b.N; i++ {
		items := make([]item, n)
		for j := range items {
			items[j] = item{tid: fmt.Sprintf("g%d-%d", i, j), hash: fmt.Sprintf("g%d-%d", i, j), data: make([]byte, size)}
		}
		start := time.Now()
		c.push(cudaipc.Name, fmt.Sprintf("req-%d", i), items, 0)
		total += time.Since(start)
		hashes := make([]string, n)
		for j, it := range items {
			hashes[j] = it.hash
		}
		c.shards[0].Acquire(hashes)
		c.shards[0].Release(hashes)
	}
	b.ReportMetric(float64(total.Microseconds())/float64(b.N*n), "us/item")
	b.ReportMetric(float64(total.Microseconds())/float64(b.N), "us/batch")
	// Where a batch's time went, phase by phase (mean µs per occurrence).
	after := metrics.Phases()
	for name, st := range after {
		if d := st.Count - before[name].Count; d > 0 {
			b.ReportMetric((st.Seconds-before[name].Seconds)/float64(d)*1e6, name+"_us")
		}
	}
}

func BenchmarkGPUBatch8(b *testing.B)  { benchGPUBatches(b, 8) }
func BenchmarkGPUBatch64(b *testing.B) { benchGPUBatches(b, 64) }

// TestGPUHandOverQueuesTheCopies: over cuda_ipc, to a shard the producer
// has written to before, a batch whose grants are in when its outputs are
// handed over has its copies (and their ready words) queued on the GPU by
// the hand-over itself, before Sources returns: the copy does not wait
// for a goroutine to be woken. The encoder's stream is held, so the
// queued batch cannot have completed; once it is let go, the items arrive
// whole.
func TestGPUHandOverQueuesTheCopies(t *testing.T) {
	c := newGPUCluster(t, 1, 32<<20)
	p := c.prods[cudaipc.Name]
	c.push(cudaipc.Name, "req-queue-warm", makeItems(80, 2, 1<<10, 64<<10, 0), 0)

	items := makeItems(81, 3, 1<<10, 64<<10, 0)
	exp := make([]sched.Expected, len(items))
	pushes := make([]producer.Push, len(items))
	for i, it := range items {
		exp[i] = sched.Expected{TransferID: it.tid, MMHash: it.hash}
		pushes[i] = producer.Push{TransferID: it.tid, MMHash: it.hash, NBytes: uint64(len(it.data)), Consumer: c.consumer}
	}
	require.Empty(t, c.sched.Step(scheduler.StepIn{Expect: []scheduler.ExpectIn{{RequestID: "req-queue", Items: exp}}}).ExpectErrors)
	before := p.Stats().RoundTrips
	for _, err := range p.Submit(pushes) {
		require.NoError(t, err)
	}
	require.Eventually(t, func() bool { return p.Stats().RoundTrips > before }, hang, time.Millisecond, "the reserve is answered")

	stream := c.host.NewStream()
	stream.Hold()
	// Let go before the cluster closes, so that a failing check below does
	// not leave the batch held (and the test hung until its timeout).
	t.Cleanup(stream.Release)
	dev, err := c.host.Device(0)
	require.NoError(t, err)
	var srcs []producer.Source
	for _, it := range items {
		addr, window := c.host.Alloc(0, len(it.data))
		copy(window, it.data)
		ready, err := dev.RecordEvent(stream.Handle())
		require.NoError(t, err)
		srcs = append(srcs, producer.Source{MMHash: it.hash, Dev: &transport.DeviceSrc{Addr: addr, Len: uint64(len(it.data)), Ready: ready}})
	}
	queuedBefore, _ := c.host.QueuedBatches()
	trace.Enable(1 << 12)
	t.Cleanup(func() { trace.Enable(0) })
	_, errs := p.Sources(srcs)
	queued, unwaited := c.host.QueuedBatches()
	stamps := trace.Drain().Entries
	for _, err := range errs {
		require.NoError(t, err)
	}
	require.Equal(t, queuedBefore+1, queued, "the hand-over queued the batch's copies itself")
	require.Equal(t, 1, unwaited, "the batch waits for the encoder's stream")
	stream.Release()
	// The hand-over stamps its start of the write once an item, after the
	// write was handed to the plane, before Sources returns.
	for _, it := range items {
		var enqueued, started []int64
		for _, e := range stamps {
			if e.Key != it.hash {
				continue
			}
			switch e.Hop {
			case trace.WriteEnqueued:
				enqueued = append(enqueued, e.NS)
			case trace.WriteStarted:
				started = append(started, e.NS)
			}
		}
		require.Len(t, enqueued, 1, "write_enqueued of %s", it.hash)
		require.Len(t, started, 1, "write_started of %s", it.hash)
		require.LessOrEqual(t, enqueued[0], started[0])
	}

	require.Len(t, c.wait(tids(items), 10*time.Second).Available, len(items))
	// The fake GPU's copies are Go writes, ordered before the reads below
	// (for the race detector) by the producer's Done, not by the ready
	// words, which reach the shard through another mapping of the region.
	done := 0
	for deadline := time.Now().Add(hang); done < len(items) && time.Now().Before(deadline); {
		o := p.Poll(200 * time.Millisecond)
		require.Empty(t, o.Failed)
		done += len(o.Done)
	}
	require.Equal(t, len(items), done)
	c.verify(items)
}

// A plane that cannot start a batch in the hand-over (TCP, staged) has
// its write stamped once, by the goroutine that writes it: the step does
// not stamp write_enqueued (nor spend the write hand-off's timing) for a
// batch it then gives to that goroutine.
func TestHandOverStampsAWriteOnce(t *testing.T) {
	c := newGPUCluster(t, 1, 32<<20)
	trace.Enable(1 << 12)
	t.Cleanup(func() { trace.Enable(0) })
	c.push("tcp", "req-stamp-warm", makeItems(90, 2, 1<<10, 64<<10, 0), 0)
	items := makeItems(91, 3, 1<<10, 64<<10, 0)
	c.push("tcp", "req-stamp", items, 0)
	c.verify(items)

	stamped := map[string]int{}
	for _, e := range trace.Drain().Entries {
		if e.Hop == trace.WriteEnqueued {
			stamped[e.Key]++
		}
	}
	for _, it := range items {
		require.Equal(t, 1, stamped[it.hash], "write_enqueued of %s", it.hash)
	}
}
