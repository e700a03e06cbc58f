package gotests

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/fsm/reserve"
	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/node"
	"github.com/ecmooncake/ecmooncake/core/producer"
	"github.com/ecmooncake/ecmooncake/core/scheduler"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// The in-memory cluster: a producer, a consumer of inmemTP shards and its
// scheduler in one process, each opened by node as production opens it,
// but over in-memory links: the control plane on a control.InmemNetwork
// (named "producer", "scheduler", "shard-0", "shard-1"), the data plane on
// a transport.InmemNetwork. A test cuts, delays and heals any link while a
// batch is in flight, and the harness checks what must hold whatever the
// faults:
//   - every frame a shard accepts lands inside the region of the
//     reservation it names, in memory no later reservation was given
//     (writeGuard);
//   - every push ends, done or failed, and every item the scheduler calls
//     available is on every shard with the producer's bytes;
//   - once the links heal, every reservation is reclaimed: no write in
//     flight, no region still being written or waiting for its writer,
//     the producer holds no source, and each table checks out.
const inmemTP = 2

// inmemTimeouts are short, so that a lost message ends its push soon: a
// producer call gives up after controlTimeout, a reservation nobody
// completes expires after lease. They bound waiting; no test asserts on
// how long anything took.
const (
	inmemControlTimeout = 1.0 // seconds
	inmemPushWait       = 2.0
	inmemLease          = 2.0
	inmemSchedWait      = 3.0
)

type inmemCluster struct {
	t      *testing.T
	log    *slog.Logger
	ctl    *control.InmemNetwork
	data   *transport.InmemNetwork
	guard  *writeGuard
	slabs  [][]byte
	addrs  []string // each shard's data-plane address
	shards []*node.Consumer
	sched  *scheduler.Scheduler
	prod   *node.Producer
	// consumer is shard 0's control endpoint, where pushes are addressed.
	consumer string
}

func shardName(r int) string { return fmt.Sprintf("shard-%d", r) }

// inmemOption changes how the cluster's producer is opened.
type inmemOption struct {
	config func(*config.Producer)
	links  func(control.Links) control.Links // wraps the producer's control links
	// byMessage: the data plane completes items by complete_batch, as
	// cuda_ipc, shm and mooncake do, instead of in-band as TCP does.
	byMessage bool
}

func newInmemCluster(t *testing.T, opts ...inmemOption) *inmemCluster {
	t.Helper()
	c := &inmemCluster{
		t: t, log: quietLog(), ctl: control.NewInmemNetwork(), data: transport.NewInmemNetwork(),
		guard: newWriteGuard(inmemTP),
	}
	byMessage := false
	for _, o := range opts {
		byMessage = byMessage || o.byMessage
	}
	if !byMessage {
		c.data.SetInBand()
	}
	// No real socket is opened: any base port will do.
	const base = 5000
	noGPU := gpu.Unavailable{Err: errors.New("an in-memory cluster uses no GPU")}
	for r := range inmemTP {
		mem := make([]byte, 16<<20)
		cfg := config.DefaultConsumer()
		cfg.Port, cfg.TPSize, cfg.TPRank, cfg.LeaseS = base, inmemTP, r, inmemLease
		cfg.DataPort = 7000 + r
		c.addrs = append(c.addrs, fmt.Sprintf("127.0.0.1:%d", cfg.DataPort))
		shard, err := node.OpenConsumer(cfg, mem, node.Options{
			Log: c.log, Devices: noGPU,
			Network: inmemPlane{Inmem: transport.NewInmem(c.data), guard: c.guard, shard: r, slab: mem},
			Control: c.links(shardName(r), r),
		})
		require.NoError(t, err)
		c.slabs = append(c.slabs, mem)
		c.shards = append(c.shards, shard)
	}
	c.consumer = c.shards[0].Info().Control

	scfg := config.DefaultScheduler()
	scfg.Port, scfg.TPSize, scfg.PushWaitS, scfg.ControlTimeoutS = base, inmemTP, inmemSchedWait, inmemControlTimeout
	var err error
	c.sched, err = node.OpenScheduler(scfg, node.Options{Log: c.log, Control: c.links("scheduler", -1)})
	require.NoError(t, err)

	pcfg := config.DefaultProducer()
	pcfg.ControlTimeoutS, pcfg.PushWaitS = inmemControlTimeout, inmemPushWait
	prodLinks := c.links("producer", -1)
	for _, o := range opts {
		if o.config != nil {
			o.config(&pcfg)
		}
		if o.links != nil {
			open := prodLinks
			prodLinks = func() control.Links { return o.links(open()) }
		}
	}
	c.prod, err = node.OpenProducer(pcfg, node.Options{
		Log: c.log, Devices: noGPU, Network: inmemPlane{Inmem: transport.NewInmem(c.data)},
		Control: prodLinks,
	})
	require.NoError(t, err)
	t.Cleanup(c.close)
	return c
}

// links opens the control links of one object; a shard's (rank >= 0)
// tell the write guard what each grant reserved.
func (c *inmemCluster) links(name string, rank int) func() control.Links {
	return func() control.Links {
		l := c.ctl.Links(name)
		if rank < 0 {
			return l
		}
		return grantTap{InmemLinks: l, guard: c.guard, shard: rank}
	}
}

func (c *inmemCluster) close() {
	c.ctl.HealAll()
	require.NoError(c.t, c.prod.Close())
	require.NoError(c.t, c.sched.Close())
	for _, s := range c.shards {
		require.NoError(c.t, s.Close())
	}
	require.Empty(c.t, c.guard.violations(), "writes outside a live reservation")
}

// push expects the items as one request, submits them and hands over
// their sources; it does not wait.
func (c *inmemCluster) push(req string, items []item) {
	c.t.Helper()
	exp := make([]sched.Expected, len(items))
	pushes := make([]producer.Push, len(items))
	for i, it := range items {
		exp[i] = sched.Expected{TransferID: it.tid, MMHash: it.hash}
		pushes[i] = producer.Push{TransferID: it.tid, MMHash: it.hash, NBytes: uint64(len(it.data)), Consumer: c.consumer, Meta: metaOf(it)}
	}
	require.Empty(c.t, c.sched.Step(scheduler.StepIn{Expect: []scheduler.ExpectIn{{RequestID: req, Items: exp}}}).ExpectErrors)
	for _, err := range c.prod.Submit(pushes) {
		require.NoError(c.t, err)
	}
	var srcs []node.DeviceSource
	seen := map[string]bool{}
	for _, it := range items {
		if !seen[it.hash] {
			seen[it.hash] = true
			srcs = append(srcs, node.DeviceSource{MMHash: it.hash, Mem: it.data, Ordinal: -1})
		}
	}
	_, err := c.prod.SourcesDevice(srcs)
	require.NoError(c.t, err)
}

// outcome is how one batch ended, seen from both ends.
type outcome struct {
	done, failed []string // the producer's
	sched        scheduler.WaitOut
}

// settle waits until the producer has decided every push and the
// scheduler every transfer, and checks every item the scheduler calls
// available against every shard.
func (c *inmemCluster) settle(items []item) outcome {
	c.t.Helper()
	var out outcome
	decided := map[string]bool{}
	deadline := time.Now().Add(60 * time.Second) // a bound on waiting
	for len(decided) < len(items) && time.Now().Before(deadline) {
		o := c.prod.Poll(200 * time.Millisecond)
		for _, id := range o.Done {
			if !decided[id] {
				decided[id] = true
				out.done = append(out.done, id)
			}
		}
		for _, f := range o.Failed {
			if !decided[f.TransferID] {
				decided[f.TransferID] = true
				out.failed = append(out.failed, f.TransferID)
			}
		}
	}
	require.Len(c.t, decided, len(items), "every push ends, done or failed")
	out.sched = c.wait(tids(items), 60*time.Second)
	require.Empty(c.t, out.sched.Waiting, "every transfer is decided")
	byTid := map[string]item{}
	for _, it := range items {
		byTid[it.tid] = it
	}
	for _, id := range out.sched.Available {
		c.requireOnEveryShard(byTid[id])
	}
	return out
}

func (c *inmemCluster) wait(ids []string, within time.Duration) scheduler.WaitOut {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	return c.sched.Wait(ctx, ids)
}

// requireOnEveryShard checks that every shard holds it with its bytes.
func (c *inmemCluster) requireOnEveryShard(it item) {
	c.t.Helper()
	for r, s := range c.shards {
		got := s.Acquire([]string{it.hash})[0]
		require.Empty(c.t, got.Error, "the scheduler called %s available, so shard %d holds it", it.tid, r)
		require.Equal(c.t, metaOf(it), got.Meta)
		require.True(c.t, bytes.Equal(it.data, c.slabs[r][got.Offset:got.Offset+got.NBytes]), "shard %d: %s has the producer's bytes", r, it.tid)
		for _, err := range s.Release([]string{it.hash}) {
			require.NoError(c.t, err)
		}
	}
}

// requireReclaimed waits until nothing of the batches is left in flight:
// on the shards, no write and no region being written or waiting for its
// writer (only finished copies stay, unpinned); on the producer, no
// source held and nothing pending.
func (c *inmemCluster) requireReclaimed() {
	c.t.Helper()
	for r, s := range c.shards {
		require.Eventually(c.t, func() bool {
			st := s.Stats().Table
			for state, n := range st.Regions {
				if state != reserve.Ready && n > 0 {
					return false
				}
			}
			return st.WritesInFlight == 0 && st.Pending == 0 && st.Pinned == 0 && st.Residents == st.Regions[reserve.Ready]
		}, 60*time.Second, 5*time.Millisecond, "shard %d reclaims every reservation (%+v)", r, s.Stats().Table)
		require.NoError(c.t, s.CheckInvariants())
	}
	require.Eventually(c.t, func() bool {
		st := c.prod.Stats()
		c.prod.Poll(0) // collects released sources
		return st.Sources == 0 && !st.Pending
	}, 60*time.Second, 5*time.Millisecond, "the producer releases every source")
	require.Empty(c.t, c.guard.violations(), "writes outside a live reservation")
}

// inmemPlane is the in-memory data plane under the name of the one it
// stands in for (tcp), so that the node assembles it as it would TCP. On a
// shard it guards the slab: every frame goes through the write guard, and
// a cut shard refuses frames as a torn connection would lose them.
type inmemPlane struct {
	*transport.Inmem
	guard *writeGuard // nil on the producer
	shard int
	slab  []byte
}

func (p inmemPlane) Name() string { return "tcp" }

func (p inmemPlane) Listen(addr string, sink transport.Sink) (transport.Receiver, error) {
	if p.guard == nil {
		return p.Inmem.Listen(addr, sink)
	}
	return p.Inmem.Listen(addr, guardSink{Sink: sink, g: p.guard, shard: p.shard, slab: p.slab})
}

// guardSink is a shard's sink as the write guard sees it.
type guardSink struct {
	transport.Sink
	g     *writeGuard
	shard int
	slab  []byte
}

func (k guardSink) BeginWrite(res ids.ResID, tok ids.Token, off, n uint64) ([]byte, error) {
	if k.g.isCut(k.shard) {
		return nil, fmt.Errorf("%w: data link to shard %d is cut", transport.ErrConnLost, k.shard)
	}
	dst, err := k.Sink.BeginWrite(res, tok, off, n)
	if err != nil || len(dst) == 0 {
		return dst, err
	}
	at := uint64(uintptr(unsafe.Pointer(&dst[0])) - uintptr(unsafe.Pointer(&k.slab[0])))
	k.g.landed(k.shard, uint64(res), off, n, at)
	return dst, nil
}

// EndComplete passes a frame that carries its item's completion on to the
// shard, as TCP's receiver does.
func (k guardSink) EndComplete(res ids.ResID, tok ids.Token, off, n uint64) error {
	cs, ok := k.Sink.(transport.CompleteSink)
	if !ok {
		k.Sink.EndWrite(res, false)
		return transport.ErrNoInBand
	}
	return cs.EndComplete(res, tok, off, n)
}

// grantTap is a shard's control links that show the write guard every
// write grant the shard's handler makes.
type grantTap struct {
	*control.InmemLinks
	guard *writeGuard
	shard int
}

func (g grantTap) Serve(bind string, h control.Handler, log *slog.Logger) (control.Serving, error) {
	return g.InmemLinks.Serve(bind, control.HandlerFunc(func(req wire.Request) wire.Reply {
		rep := h.Handle(req)
		if req.Op == wire.OpReserveBatch && rep.Err == nil {
			var grants wire.ReserveBatchReply
			if err := wire.UnmarshalBody(rep.Body, &grants); err == nil {
				for _, gr := range grants.Grants {
					if gr.Kind == wire.KindWrite {
						g.guard.granted(g.shard, gr.Res, gr.NBytes)
					}
				}
			}
		}
		return rep
	}), log)
}

// writeGuard checks, from outside the shards, that no frame lands outside
// a live reservation. It learns each write grant's size from the control
// plane and each region's place in the slab from its first frame; a frame
// that reaches past its grant, moves its region, or lands in memory that a
// later reservation was given (the slab reuses memory only after a region
// ends, so an older reservation writing there wrote after its end) is a
// violation.
type writeGuard struct {
	mu      sync.Mutex
	grants  []map[uint64]uint64    // per shard: res -> granted bytes
	regions []map[uint64][2]uint64 // per shard: res -> [start, end) in the slab
	cut     []bool                 // per shard: the data link is cut
	onFrame func(shard int)        // called after each accepted frame, outside mu
	bad     []string
}

func newWriteGuard(shards int) *writeGuard {
	g := &writeGuard{cut: make([]bool, shards)}
	for range shards {
		g.grants = append(g.grants, map[uint64]uint64{})
		g.regions = append(g.regions, map[uint64][2]uint64{})
	}
	return g
}

func (g *writeGuard) granted(shard int, res, n uint64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.grants[shard][res] = n
}

func (g *writeGuard) landed(shard int, res, off, n, at uint64) {
	g.mu.Lock()
	bad := func(format string, args ...any) {
		g.bad = append(g.bad, fmt.Sprintf("shard %d res %d: ", shard, res)+fmt.Sprintf(format, args...))
	}
	size, ok := g.grants[shard][res]
	switch {
	case !ok:
		bad("a frame for a reservation never granted for writing")
	case off+n > size:
		bad("frame [%d, %d) reaches past the grant of %d bytes", off, off+n, size)
	}
	start := at - off
	if r, seen := g.regions[shard][res]; seen && r[0] != start {
		bad("region moved from %d to %d", r[0], start)
	}
	end := start + max(size, off+n)
	g.regions[shard][res] = [2]uint64{start, end}
	for other, r := range g.regions[shard] {
		if other > res && r[0] < end && start < r[1] {
			bad("frame landed in [%d, %d), given since to res %d", start+off, start+off+n, other)
		}
	}
	hook := g.onFrame
	g.mu.Unlock()
	if hook != nil {
		hook(shard)
	}
}

// setCut cuts (or heals) the data link to a shard.
func (g *writeGuard) setCut(shard int, cut bool) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.cut[shard] = cut
}

func (g *writeGuard) isCut(shard int) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.cut[shard]
}

// once sets the hook run after the first frame a shard accepts from now.
func (g *writeGuard) once(shard int, f func()) {
	var done sync.Once
	g.mu.Lock()
	defer g.mu.Unlock()
	g.onFrame = func(s int) {
		if s == shard {
			done.Do(f)
		}
	}
}

// off removes the hook.
func (g *writeGuard) off() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.onFrame = nil
}

func (g *writeGuard) violations() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return append([]string(nil), g.bad...)
}
