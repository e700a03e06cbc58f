package gotests

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"net"
	"os"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/node"
	"github.com/ecmooncake/ecmooncake/core/producer"
	"github.com/ecmooncake/ecmooncake/core/scheduler"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/shm"
)

// cluster is one consumer instance (TP shards + scheduler) and a producer.
type cluster struct {
	t        *testing.T
	o        clusterOpts
	log      *slog.Logger
	base     int
	made     int // slabs made so far: each shard incarnation gets its own
	slabFD   func(n int) int
	slabs    [][]byte
	shards   []*node.Consumer
	sched    *scheduler.Scheduler
	prod     *node.Producer
	consumer string // control endpoint of shard 0
	// closing, when set, runs as the cluster's cleanup begins, before any
	// node is closed.
	closing func()
}

type clusterOpts struct {
	tp        int
	slabBytes int
	lease     time.Duration
	pushWait  time.Duration
	// Network data planes in place of the ones the settings name (TCP)
	// and slabs (Go memory) when nil; the node wraps them as it wraps its
	// own. consumerTr gets the index of the slab made for the shard (slabs
	// are made in order, one per shard incarnation), so a plane can serve
	// that very slab.
	consumerTr func(slab int) transport.Transport
	producerTr func() transport.Transport
	slab       func(n int) []byte
	// shm puts each slab in a sealed memfd and moves the bytes over the
	// shm data plane (see shmPlane); it overrides the three above.
	shm bool
	// credit turns the standing credit on at both ends (credit_window_bytes).
	credit uint64
	// maxResident caps each shard's resident copies (max_resident_bytes).
	maxResident uint64
	// secret is every end's auth_secret; producerSecret, when set,
	// overrides the producer's.
	secret         string
	producerSecret *string
	// unix sets control_unix on every end.
	unix bool
	// quiet logs errors only: a run that fails requests on purpose would
	// bury a real error under thousands of expected warnings.
	quiet bool
}

func quietLog() *slog.Logger {
	lv := slog.LevelWarn
	if os.Getenv("ECM_TEST_LOG") != "" {
		lv = slog.LevelDebug
	}
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: lv}))
}

// freeBase finds n consecutive free TCP ports on loopback.
func freeBase(t *testing.T, n int) int {
	t.Helper()
	for try := 0; try < 200; try++ {
		base := 20000 + rand.IntN(30000)
		ok := true
		var ls []net.Listener
		for i := 0; i < n && ok; i++ {
			l, err := net.Listen("tcp", fmt.Sprintf("127.0.0.1:%d", base+i))
			if err != nil {
				ok = false
				break
			}
			ls = append(ls, l)
		}
		for _, l := range ls {
			l.Close()
		}
		if ok {
			return base
		}
	}
	t.Fatal("no free port range on loopback")
	return 0
}

func newCluster(t *testing.T, o clusterOpts) *cluster {
	t.Helper()
	if o.tp == 0 {
		o.tp = 2
	}
	if o.slabBytes == 0 {
		o.slabBytes = 64 << 20
	}
	if o.lease == 0 {
		o.lease = 30 * time.Second
	}
	if o.pushWait == 0 {
		o.pushWait = 20 * time.Second
	}
	c := &cluster{t: t, o: o, base: freeBase(t, o.tp), log: quietLog()}
	if o.quiet && os.Getenv("ECM_TEST_LOG") == "" {
		c.log = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
	}
	if c.o.shm {
		c.o.slab, c.slabFD = shmPlane(t)
		c.o.consumerTr, c.o.producerTr = nil, nil
	}
	if c.o.slab == nil {
		c.o.slab = func(n int) []byte { return make([]byte, n) }
	}
	o = c.o
	for r := 0; r < o.tp; r++ {
		mem, s := c.openShard(r)
		c.slabs = append(c.slabs, mem)
		c.shards = append(c.shards, s)
	}
	c.consumer = c.shards[0].Info().Control
	scfg := config.DefaultScheduler()
	scfg.Port, scfg.TPSize, scfg.PushWaitS = c.base, o.tp, o.pushWait.Seconds()
	scfg.Secret = config.Secret(o.secret)
	scfg.ControlUnix = o.unix
	var err error
	c.sched, err = node.OpenScheduler(scfg, c.nodeOpts(nil))
	require.NoError(t, err)
	pcfg := config.DefaultProducer()
	pcfg.PushWaitS = o.pushWait.Seconds()
	pcfg.ControlTimeoutS = 5
	pcfg.CreditWindowBytes = o.credit
	pcfg.Secret = config.Secret(o.secret)
	pcfg.ControlUnix = o.unix
	if o.producerSecret != nil {
		pcfg.Secret = config.Secret(*o.producerSecret)
	}
	var ptr transport.Transport
	if o.producerTr != nil {
		ptr = o.producerTr()
		pcfg.Transport = ptr.Name()
	}
	if o.shm {
		pcfg.Transport, pcfg.Host = shm.Name, shmHost
	}
	c.prod, err = node.OpenProducer(pcfg, c.nodeOpts(ptr))
	require.NoError(t, err)
	t.Cleanup(c.close)
	return c
}

// nodeOpts are the assembly options of every node of the cluster: its
// host-memory slabs need no GPU, and network (when not nil) replaces the
// data plane the settings name.
func (c *cluster) nodeOpts(network transport.Transport) node.Options {
	return node.Options{Log: c.log, Devices: gpu.Unavailable{Err: errors.New("a host-memory cluster uses no GPU")}, Network: network}
}

// openShard opens shard r over a slab of its own.
func (c *cluster) openShard(r int) ([]byte, *node.Consumer) {
	c.t.Helper()
	idx := c.made
	c.made++
	mem := c.o.slab(c.o.slabBytes)
	cfg := config.DefaultConsumer()
	cfg.Port, cfg.TPSize, cfg.TPRank, cfg.LeaseS = c.base, c.o.tp, r, c.o.lease.Seconds()
	cfg.CreditWindowBytes, cfg.MaxResidentBytes = c.o.credit, c.o.maxResident
	cfg.Secret = config.Secret(c.o.secret)
	cfg.ControlUnix = c.o.unix
	var tr transport.Transport
	if c.o.consumerTr != nil {
		tr = c.o.consumerTr(idx)
		cfg.Transport = tr.Name()
	}
	if c.o.shm {
		cfg.Transport, cfg.Host, cfg.SlabFD = shm.Name, shmHost, c.slabFD(idx)
	}
	s, err := node.OpenConsumer(cfg, mem, c.nodeOpts(tr))
	require.NoError(c.t, err)
	return mem, s
}

// restart closes shard r and opens it again on the same control port,
// over a fresh slab and data plane, as a restarted process would be.
func (c *cluster) restart(r int) {
	c.t.Helper()
	require.NoError(c.t, c.shards[r].Close())
	c.slabs[r], c.shards[r] = c.openShard(r)
}

func (c *cluster) close() {
	if c.closing != nil {
		c.closing()
	}
	if c.prod != nil {
		require.NoError(c.t, c.prod.Close())
	}
	if c.sched != nil {
		require.NoError(c.t, c.sched.Close())
	}
	for _, s := range c.shards {
		if s != nil {
			require.NoError(c.t, s.Close())
		}
	}
}

// item is one synthetic encoder output.
type item struct {
	tid, hash string
	data      []byte
}

func makeItems(seed uint64, n int, minB, maxB int, dupEvery int) []item {
	r := rand.New(rand.NewPCG(seed, seed^0x9e3779b97f4a7c15))
	var out []item
	byHash := map[string][]byte{}
	for i := 0; i < n; i++ {
		h := fmt.Sprintf("mm-%d-%d", seed, i)
		if dupEvery > 0 && i%dupEvery == dupEvery-1 && i > 0 {
			h = out[i-1].hash // the same image again under a new transfer id
		}
		data, ok := byHash[h]
		if !ok {
			data = make([]byte, minB+r.IntN(maxB-minB+1))
			for j := range data {
				data[j] = byte(1 + r.IntN(255))
			}
			byHash[h] = data
		}
		out = append(out, item{tid: fmt.Sprintf("tx-%d-%d", seed, i), hash: h, data: data})
	}
	return out
}

// pushAll expects, submits and sources every item, and waits for the
// producer to report them all done or failed.
func (c *cluster) pushAll(req string, items []item) producer.Outcomes {
	c.t.Helper()
	c.expect(req, items)
	c.send(items)
	return c.drain(len(items), 30*time.Second)
}

// expect registers the items as one request with the scheduler.
func (c *cluster) expect(req string, items []item) {
	c.t.Helper()
	exp := make([]sched.Expected, len(items))
	for i, it := range items {
		exp[i] = sched.Expected{TransferID: it.tid, MMHash: it.hash}
	}
	out := c.sched.Step(scheduler.StepIn{Expect: []scheduler.ExpectIn{{RequestID: req, Items: exp}}})
	require.Empty(c.t, out.ExpectErrors)
}

// send submits the pushes, then hands over each distinct source once.
func (c *cluster) send(items []item) {
	c.t.Helper()
	pushes := make([]producer.Push, len(items))
	for i, it := range items {
		pushes[i] = producer.Push{TransferID: it.tid, MMHash: it.hash, NBytes: uint64(len(it.data)), Consumer: c.consumer, Meta: metaOf(it)}
	}
	for _, err := range c.prod.Submit(pushes) {
		require.NoError(c.t, err)
	}
	seen := map[string]bool{}
	var srcs []producer.Source
	for _, it := range items {
		if !seen[it.hash] {
			seen[it.hash] = true
			srcs = append(srcs, producer.Source{MMHash: it.hash, Mem: it.data})
		}
	}
	_, errs := c.prod.Sources(srcs)
	for _, err := range errs {
		require.NoError(c.t, err)
	}
}

// drain polls the producer until n distinct pushes are done or failed (a
// push to several shards can fail on more than one).
func (c *cluster) drain(n int, within time.Duration) producer.Outcomes {
	c.t.Helper()
	var all producer.Outcomes
	decided := map[string]bool{}
	deadline := time.Now().Add(within)
	for len(decided) < n && time.Now().Before(deadline) {
		o := c.prod.Poll(200 * time.Millisecond)
		all.Done = append(all.Done, o.Done...)
		all.Failed = append(all.Failed, o.Failed...)
		all.Released = append(all.Released, o.Released...)
		for _, id := range o.Done {
			decided[id] = true
		}
		for _, f := range o.Failed {
			decided[f.TransferID] = true
		}
	}
	require.Len(c.t, decided, n, "pushes still outstanding after %s", within)
	return all
}

// deliver pushes items as request req and requires that none failed and
// that the scheduler sees every one available within ten seconds
// (msgAndArgs tell of a miss).
func (c *cluster) deliver(req string, items []item, msgAndArgs ...any) producer.Outcomes {
	c.t.Helper()
	out := c.pushAll(req, items)
	require.Empty(c.t, out.Failed)
	w := c.wait(tids(items), 10*time.Second)
	require.ElementsMatch(c.t, tids(items), w.Available, msgAndArgs...)
	return out
}

func (c *cluster) wait(ids []string, within time.Duration) scheduler.WaitOut {
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	return c.sched.Wait(ctx, ids)
}

// verify acquires every item on every shard, compares bytes and releases.
func (c *cluster) verify(items []item) {
	c.t.Helper()
	for r, s := range c.shards {
		for _, it := range items {
			got := s.Acquire([]string{it.hash})[0]
			require.Empty(c.t, got.Error, "shard %d acquire %s", r, it.hash)
			require.Equal(c.t, uint64(len(it.data)), got.NBytes)
			require.Equal(c.t, metaOf(it), got.Meta, "the producer's description travels with the bytes")
			region := c.slabs[r][got.Offset : got.Offset+got.NBytes]
			require.True(c.t, bytes.Equal(it.data, region), "shard %d item %s differs", r, it.tid)
			for _, err := range s.Release([]string{it.hash}) {
				require.NoError(c.t, err)
			}
		}
	}
}

func tids(items []item) []string {
	out := make([]string, len(items))
	for i, it := range items {
		out[i] = it.tid
	}
	return out
}

func metaOf(it item) string { return fmt.Sprintf(`{"dtype":"uint8","shape":[%d]}`, len(it.data)) }

// awaitHeartbeats waits until every shard has answered one more heartbeat
// than it had when called. After a fault has healed (a restart, a cut
// link), a probe sent during the fault can still time out and declare a
// shard lost, failing whatever was registered in the meantime; a
// scheduler follows each shard with one probe in flight at a time, so once
// every shard has answered a probe sent after the heal, none can.
func awaitHeartbeats(t *testing.T, s *scheduler.Scheduler) {
	t.Helper()
	before := s.Stats().HeartbeatsAnswered
	require.Eventually(t, func() bool {
		now := s.Stats().HeartbeatsAnswered
		for i := range before {
			if now[i] <= before[i] {
				return false
			}
		}
		return true
	}, 60*time.Second, 20*time.Millisecond, "every shard answers a heartbeat once the fault is over")
}
