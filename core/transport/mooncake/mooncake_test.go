package mooncake

import (
	"bytes"
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/metadata"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/mooncake/mooncaketest"
	"github.com/ecmooncake/ecmooncake/core/transport/transporttest"
)

func TestLoadFailuresNameWhatIsMissing(t *testing.T) {
	needDouble(t)
	cases := []struct {
		name, path string
		want       []string
	}{
		{"no library", "/nonexistent/libtransfer_engine.so", []string{"/nonexistent/libtransfer_engine.so", "cannot load", "mooncake_library"}},
		{"missing symbol", noFreePath, []string{noFreePath, "lacks freeBatchID"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(Config{Library: tc.path})
			require.ErrorIs(t, err, ErrUnavailable)
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
		})
	}
}

// The double aborts the process on an unknown metadata scheme, as Mooncake
// does: these reach it only if our check lets them through.
func TestMetadataCheckedBeforeMooncake(t *testing.T) {
	for _, md := range []string{"etcd://127.0.0.1", "etcd://u:p@127.0.0.1:2379", "redis://h:6379", "127.0.0.1:2379", "http://", "http://h:99999/metadata", "ftp://h/x"} {
		t.Run(md, func(t *testing.T) {
			_, err := New(testConfig(func(c *Config) { c.Metadata = md }))
			require.ErrorIs(t, err, config.ErrInvalid)
			require.Contains(t, err.Error(), "mooncake_metadata")
			lib, err := load(doublePath, enginePath)
			require.NoError(t, err)
			_, err = newEngine(lib, engineConfig{Metadata: md, Host: "127.0.0.1", Protocol: "rdma"})
			require.ErrorIs(t, err, config.ErrInvalid)
		})
	}
}

// etcd:// reaches only an engine that has Mooncake's etcd client: the
// double has none (and aborts the process on the scheme, as such a build
// of Mooncake does), every pip wheel has one.
func TestEtcdMetadataNeedsTheEtcdClient(t *testing.T) {
	lib, err := load(doublePath, enginePath)
	require.NoError(t, err)
	require.Equal(t, enginePath != "", lib.etcd, "a wheel's engine has the etcd client; the double has none")
	if lib.etcd {
		t.Skip("the engine has the etcd client: tests/go runs it against a real etcd")
	}
	const md = "etcd://127.0.0.1:2379"
	_, err = newEngine(lib, engineConfig{Metadata: md, Host: "127.0.0.1", Protocol: "tcp"})
	require.ErrorIs(t, err, ErrUnavailable)
	for _, w := range []string{md, "etcd client", "NewEtcdClient", doublePath, "-DUSE_ETCD=ON"} {
		require.Contains(t, err.Error(), w)
	}
	tr, err := New(testConfig(func(c *Config) { c.Metadata = md }))
	require.NoError(t, err, "the transport loads; its engine is what is refused")
	_, err = tr.Listen("127.0.0.1:0", slabSink{hostSlab(t, 1<<20)})
	require.ErrorIs(t, err, ErrUnavailable)
}

func TestWriteLandsEveryByte(t *testing.T) {
	cases := []struct {
		name  string
		sizes []int
	}{
		{"one byte", []int{1}},
		{"small items share submits", []int{4099, 64 << 10, 64 << 10, 3}},
		{"items cut into chunks", []int{3<<20 + 7, 1 << 20, 5}},
		{"batch larger than staging", []int{5 << 20, 5 << 20, 5<<20 + 1}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := newPair(t, 32<<20, testConfig(), testConfig())
			var before mooncaketest.Stats
			if double != nil {
				before = double.Stats()
			}
			var items []transport.WriteItem
			off := uint64(4096)
			for i, n := range tc.sizes {
				items = append(items, p.item(i+1, off, pattern(n, byte(i))))
				off += uint64(n+255) &^ 255
			}
			for i, err := range p.w.Write(context.Background(), p.recv.Addr(), items) {
				require.NoError(t, err, "item %d", i)
			}
			for i, it := range items {
				at := it.Addr - p.recv.p.Base
				require.True(t, bytes.Equal(it.Src, p.slab[at:at+uint64(len(it.Src))]), "item %d differs", i)
			}
			require.Equal(t, uint64(1), p.w.Stats().Batches)
			if double == nil {
				return
			}
			after := double.Stats()
			require.Equal(t, before.BatchesLive, after.BatchesLive, "the batch id is freed")
			require.Equal(t, before.BatchesAllocated+1, after.BatchesAllocated, "one batch per write")
			require.Zero(t, after.BusyFrees-before.BusyFrees, "never freed while a task ran")
		})
	}
}

// An item lands at Addr+Off: a transport may be handed part of a region.
func TestWriteHonoursOffsetInsideTheRegion(t *testing.T) {
	p := newPair(t, 1<<20, testConfig(), testConfig())
	data := pattern(1000, 9)
	it := p.item(1, 8192, data)
	it.Off = 300
	require.NoError(t, p.w.Write(context.Background(), p.recv.Addr(), []transport.WriteItem{it})[0])
	require.True(t, bytes.Equal(data, p.slab[8192+300:8192+300+1000]))
}

func TestConcurrentWritersShareStaging(t *testing.T) {
	small := func(c *Config) { c.StagingBytes, c.ChunkBytes = 2<<20, 512<<10 }
	p := newPair(t, 64<<20, testConfig(), testConfig(small))
	var wg sync.WaitGroup
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			base := uint64(g) * (16 << 20)
			items := []transport.WriteItem{p.item(1, base, pattern(3<<20, byte(g))), p.item(2, base+(8<<20), pattern(1<<20+3, byte(g+9)))}
			for i, err := range p.w.Write(context.Background(), p.recv.Addr(), items) {
				if err != nil {
					t.Errorf("writer %d item %d: %v", g, i, err)
				}
			}
		}()
	}
	wg.Wait()
	for g := 0; g < 4; g++ {
		base := uint64(g) * (16 << 20)
		require.True(t, bytes.Equal(pattern(3<<20, byte(g)), p.slab[base:base+3<<20]), "writer %d", g)
	}
}

func TestProtocolMismatchRefusedBeforeAnyWrite(t *testing.T) {
	needDouble(t)
	p := newPair(t, 1<<20, testConfig(func(c *Config) { c.Protocol = "tcp" }), testConfig())
	err := p.tr.CheckAddr(p.recv.Addr())
	require.ErrorIs(t, err, ErrProtocol)
	require.Contains(t, err.Error(), `runs "tcp"`)
	require.Contains(t, err.Error(), `runs "rdma"`)
	require.Contains(t, err.Error(), "mooncake_protocol")

	before := double.Stats()
	errs := p.w.Write(context.Background(), p.recv.Addr(), []transport.WriteItem{p.item(1, 0, pattern(10, 1))})
	require.ErrorIs(t, errs[0], ErrProtocol)
	require.Equal(t, before.TasksSubmitted, double.Stats().TasksSubmitted)
	require.Zero(t, p.w.Stats().Batches)
}

func TestTargetsOutsideTheSlabRefusedBeforeAnyWrite(t *testing.T) {
	needDouble(t)
	p := newPair(t, 1<<20, testConfig(), testConfig())
	good := p.item(9, 0, pattern(100, 1))
	cases := []struct {
		name string
		it   transport.WriteItem
		want string
	}{
		{"no remote address", transport.WriteItem{Res: 1, Src: pattern(10, 1)}, "no remote address"},
		{"past the end", p.item(2, 1<<20-5, pattern(10, 1)), "outside the consumer"},
		{"offset past the end", func() transport.WriteItem { it := p.item(3, 0, pattern(10, 1)); it.Off = 1 << 20; return it }(), "outside the consumer"},
		{"before the slab", transport.WriteItem{Res: 4, Src: pattern(10, 1), Addr: p.recv.p.Base - 64}, "outside the consumer"},
		{"device memory", transport.WriteItem{Res: 5, Dev: &transport.DeviceSrc{Len: 10}, Addr: p.recv.p.Base}, "device memory"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := double.Stats()
			errs := p.w.Write(context.Background(), p.recv.Addr(), []transport.WriteItem{tc.it, good})
			require.ErrorContains(t, errs[0], tc.want)
			require.NoError(t, errs[1], "a refused item costs only itself")
			require.Equal(t, before.TasksSubmitted+1, double.Stats().TasksSubmitted)
		})
	}
}

// The engine that owns the memory checks every write against what it
// registered: a producer told a larger slab than the consumer registered
// gets a failed task, not a write past the slab.
func TestEngineRefusesWritesOutsideRegisteredMemory(t *testing.T) {
	needDouble(t)
	p := newPair(t, 1<<20, testConfig(), testConfig())
	lie := p.recv.p
	lie.Len *= 4
	before := double.Stats()
	errs := p.w.Write(context.Background(), lie.String(), []transport.WriteItem{
		p.item(1, 2<<20, pattern(4096, 1)),
		p.item(2, 0, pattern(4096, 2)),
	})
	require.ErrorIs(t, errs[0], transport.ErrConnLost)
	require.ErrorContains(t, errs[0], "ended FAILED")
	require.NoError(t, errs[1])
	after := double.Stats()
	require.Equal(t, before.WritesRefused+1, after.WritesRefused)
	require.Equal(t, before.BatchesLive, after.BatchesLive)
}

func TestFailedTaskFailsItsItemAndTheSegmentIsReopened(t *testing.T) {
	needDouble(t)
	p := newPair(t, 4<<20, testConfig(), testConfig())
	items := []transport.WriteItem{p.item(1, 0, pattern(1000, 1)), p.item(2, 1<<20, pattern(1000, 2)), p.item(3, 2<<20, pattern(1000, 3))}
	double.FailNext(1)
	errs := p.w.Write(context.Background(), p.recv.Addr(), items)
	require.ErrorIs(t, errs[0], transport.ErrConnLost)
	require.NoError(t, errs[1])
	require.NoError(t, errs[2])
	require.Equal(t, uint64(1), p.w.Stats().FailedTasks)

	before := double.Stats()
	for _, err := range p.w.Write(context.Background(), p.recv.Addr(), items[:1]) {
		require.NoError(t, err)
	}
	require.Equal(t, before.OpenNoCacheCalls+1, double.Stats().OpenNoCacheCalls, "a failed segment is looked up again, bypassing the cache")
	require.Equal(t, uint64(1), p.w.Stats().Reopens)
}

func TestPeerVanishesMidBatch(t *testing.T) {
	needDouble(t)
	p := newPair(t, 8<<20, testConfig(), testConfig())
	// Held, no item can land before the peer vanishes, however slowly
	// this test gets to Kill.
	hold(t, p.recv.eng.segment)
	items := make([]transport.WriteItem, 4)
	for i := range items {
		items[i] = p.item(i+1, uint64(i)<<20, pattern(64<<10, byte(i)))
	}
	before := double.Stats()
	done := make(chan []error)
	go func() { done <- p.w.Write(context.Background(), p.recv.Addr(), items) }()
	require.Eventually(t, func() bool { return double.Stats().TasksSubmitted >= before.TasksSubmitted+4 }, testTimeout, time.Millisecond)
	require.NoError(t, double.Kill(p.recv.eng.segment))
	errs := <-done
	for i, err := range errs {
		require.ErrorIs(t, err, transport.ErrConnLost, "item %d cannot have landed before the peer vanished", i)
	}
	require.Equal(t, before.BatchesLive, double.Stats().BatchesLive, "the batch is drained and freed")
	require.Zero(t, p.w.Stats().LeakedBatches)
}

func TestDeadlineStopsSubmittingButDrainsWhatStarted(t *testing.T) {
	needDouble(t)
	tiny := func(c *Config) { c.StagingBytes, c.ChunkBytes = 1<<20, 256<<10 }
	p := newPair(t, 8<<20, testConfig(), testConfig(tiny))
	release := hold(t, p.recv.eng.segment)
	// The first item's four chunks fill the staging, and the held peer
	// keeps it full: the second item can only be staged once they land,
	// which is after the deadline.
	items := []transport.WriteItem{p.item(1, 0, pattern(1<<20, 1)), p.item(2, 2<<20, pattern(1<<20, 2))}
	before := double.Stats()
	ctx := transporttest.NewExpiring()
	done := make(chan []error)
	go func() { done <- p.w.Write(ctx, p.recv.Addr(), items) }()
	require.Eventually(t, func() bool { return double.Stats().TasksSubmitted >= before.TasksSubmitted+4 }, testTimeout, time.Millisecond)
	ctx.Expire()
	release()
	errs := <-done
	require.NoError(t, errs[0], "submitted before the deadline, drained after it")
	require.ErrorIs(t, errs[1], context.DeadlineExceeded)
	require.ErrorContains(t, errs[1], "not sent")
	after := double.Stats()
	require.Equal(t, before.TasksSubmitted+4, after.TasksSubmitted, "nothing submitted after the deadline")
	require.Equal(t, before.BatchesLive, after.BatchesLive)
	require.Zero(t, after.BusyFrees-before.BusyFrees, "freed only once drained")
	require.True(t, bytes.Equal(items[0].Src, p.slab[:1<<20]))
}

func TestTasksThatNeverFinishKeepTheirBatch(t *testing.T) {
	needDouble(t)
	short := func(c *Config) { c.DrainTimeout = 20 * time.Millisecond }
	p := newPair(t, 1<<20, testConfig(), testConfig(short))
	// Held until the test ends, the task cannot finish within any drain.
	hold(t, p.recv.eng.segment)
	before := double.Stats()
	ctx := transporttest.NewExpiring()
	done := make(chan []error)
	go func() { done <- p.w.Write(ctx, p.recv.Addr(), []transport.WriteItem{p.item(1, 0, pattern(100, 1))}) }()
	require.Eventually(t, func() bool { return double.Stats().TasksSubmitted >= before.TasksSubmitted+1 }, testTimeout, time.Millisecond)
	ctx.Expire()
	errs := <-done
	require.ErrorIs(t, errs[0], transport.ErrConnLost)
	require.ErrorContains(t, errs[0], "after draining")
	require.Equal(t, uint64(1), p.w.Stats().LeakedBatches)
	require.Equal(t, before.BatchesLive+1, double.Stats().BatchesLive, "never freed under a running task")
}

// hold leaves every write to segment unread until the returned release
// runs, or the test ends.
func hold(t *testing.T, segment string) (release func()) {
	t.Helper()
	require.NoError(t, double.Hold(segment, true))
	var once sync.Once
	release = func() { once.Do(func() { require.NoError(t, double.Hold(segment, false)) }) }
	t.Cleanup(release)
	return release
}

// A consumer that restarts under the same segment name (HTTP metadata
// mode) is a new incarnation: its old descriptor must not be used.
func TestRestartedPeerIsReopenedWithoutCache(t *testing.T) {
	store, err := metadata.Listen(metadata.Config{Addr: "127.0.0.1:0", Open: true})
	require.NoError(t, err)
	defer store.Close()
	http := func(c *Config) { c.Metadata = store.URL(); c.LocalServerName = "shard-restarts" }
	ctr, err := New(testConfig(http))
	require.NoError(t, err)
	ptr, err := New(testConfig(func(c *Config) { c.Metadata = store.URL() }))
	require.NoError(t, err)
	w := ptr.newWriter()
	defer w.Close()

	for round := 0; round < 2; round++ {
		slab := hostSlab(t, 1<<20)
		r, err := ctr.Listen("127.0.0.1:0", slabSink{slab})
		require.NoError(t, err)
		rc := r.(*receiver)
		require.Equal(t, "shard-restarts", rc.eng.segment)
		data := pattern(5000, byte(round))
		errs := w.Write(context.Background(), r.Addr(), []transport.WriteItem{{Res: 1, Src: data, Addr: rc.RemoteAddr(0)}})
		require.NoError(t, errs[0], "round %d", round)
		require.True(t, bytes.Equal(data, slab[:5000]))
		require.NoError(t, r.Close())
	}
	require.Equal(t, uint64(1), w.Stats().Reopens)
	require.GreaterOrEqual(t, store.Stats().Puts, uint64(2), "both incarnations published themselves")
}

func TestRegistrationOverlapAndUnregisterOnce(t *testing.T) {
	needDouble(t)
	lib, err := load(doublePath, enginePath)
	require.NoError(t, err)
	e, err := newEngine(lib, engineConfig{Host: "127.0.0.1", Protocol: "rdma"})
	require.NoError(t, err)
	slab := hostSlab(t, 1<<20)
	base := slabSink{slab}
	addr, _, _ := base.Memory()
	before := double.Stats()
	require.NoError(t, e.register([]region{{addr, 1 << 20}}, "*"))

	cases := []struct {
		name string
		regs []region
		code int
	}{
		{"overlap", []region{{addr + 4096, 4096}}, -7},
		{"zero length", []region{{addr + (2 << 20), 0}}, -1},
	}
	for _, tc := range cases {
		err := e.register(tc.regs, "*")
		var ce *CallError
		require.ErrorAs(t, err, &ce, tc.name)
		require.Equal(t, CallError{Func: "registerLocalMemoryBatch", Code: tc.code}, *ce, tc.name)
		require.ErrorIs(t, err, ErrEngine)
	}
	require.NoError(t, e.destroy())
	require.NoError(t, e.destroy())
	after := double.Stats()
	require.Equal(t, before.UnregisterCalls+1, after.UnregisterCalls, "unregistered exactly once")
	require.Equal(t, before.UnregisterUnknown, after.UnregisterUnknown)
	require.Equal(t, before.RegsLive, after.RegsLive)
}

func TestCloseUndoesEverythingOnce(t *testing.T) {
	needDouble(t)
	before := double.Stats()
	p := newPair(t, 1<<20, testConfig(), testConfig())
	require.NoError(t, p.w.Write(context.Background(), p.recv.Addr(), []transport.WriteItem{p.item(1, 0, pattern(10, 1))})[0])
	require.NoError(t, p.recv.Close())
	require.NoError(t, p.recv.Close())
	require.NoError(t, p.w.Close())
	require.NoError(t, p.w.Close())
	after := double.Stats()
	require.Equal(t, before.EnginesLive, after.EnginesLive)
	require.Equal(t, before.RegsLive, after.RegsLive)
	require.Equal(t, before.UnregisterCalls+2, after.UnregisterCalls, "slab and staging, once each")
	errs := p.w.Write(context.Background(), p.recv.Addr(), []transport.WriteItem{p.item(1, 0, pattern(10, 1))})
	require.ErrorIs(t, errs[0], transport.ErrClosed)
}

func TestFreeBatchIDBusyWhileATaskRuns(t *testing.T) {
	needDouble(t)
	p := newPair(t, 1<<20, testConfig(), testConfig())
	require.NoError(t, p.w.Write(context.Background(), p.recv.Addr(), []transport.WriteItem{p.item(1, 0, pattern(10, 1))})[0])
	require.NoError(t, double.SetDelay(p.recv.eng.segment, 100_000))
	e, stg := p.w.eng, p.w.stg
	seg := p.w.segs[p.recv.eng.segment].id
	id := e.lib.allocBatch(e.h, 1)
	require.NoError(t, statusCall("submitTransfer", e.lib.submit(e.h, id, []request{{src: stg.base, seg: seg, remote: p.recv.RemoteAddr(0), n: 64}})))
	err := statusCall("freeBatchID", e.lib.freeBatch(e.h, id))
	require.EqualError(t, err, "mooncake: freeBatchID returned 4 (batch busy)")
	require.Eventually(t, func() bool { return e.lib.freeBatch(e.h, id) == 0 }, 10*time.Second, time.Millisecond)
}

func TestCallErrorsNameFunctionAndCode(t *testing.T) {
	cases := []struct {
		err  error
		want string
	}{
		{statusCall("submitTransfer", 3), "mooncake: submitTransfer returned 3 (address not registered)"},
		{statusCall("getTransferStatus", 1), "mooncake: getTransferStatus returned 1 (invalid argument)"},
		{statusCall("submitTransfer", 8), "mooncake: submitTransfer returned 8 (transport not supported)"},
		{errnoCall("registerLocalMemoryBatch", -7), "mooncake: registerLocalMemoryBatch returned -7 (address overlapped)"},
		{errnoCall("openSegment", -200), "mooncake: openSegment returned -200 (metadata error)"},
		{errnoCall("unregisterLocalMemoryBatch", 3), "mooncake: unregisterLocalMemoryBatch returned 3 (address not registered; a sign this function does not use)"},
		{statusCall("freeBatchID", 77), "mooncake: freeBatchID returned 77 (unknown code)"},
	}
	for _, tc := range cases {
		require.EqualError(t, tc.err, tc.want)
		require.True(t, errors.Is(tc.err, ErrEngine))
	}
	require.NoError(t, statusCall("submitTransfer", 0))
	require.NoError(t, errnoCall("openSegment", 0))
}

func TestPeerAddressRoundTripAndRefusals(t *testing.T) {
	p := peer{Segment: "[fe80::1]:15432", Proto: "rdma", Base: 0x7f0000001000, Len: 1 << 30, Epoch: "0123456789abcdef"}
	got, err := parsePeer(p.String())
	require.NoError(t, err)
	require.Equal(t, p, got)
	for _, bad := range []string{
		"tcp://h:1",
		"mooncake://?proto=rdma&base=1&len=1&epoch=e",
		"mooncake://s?proto=rdma&base=0&len=1&epoch=e",
		"mooncake://s?proto=rdma&base=1&len=0&epoch=e",
		"mooncake://s?proto=rdma&base=18446744073709551615&len=2&epoch=e",
		"mooncake://s?base=1&len=1&epoch=e",
		"mooncake://s?proto=rdma&base=1&len=1",
		"mooncake://s%zz?proto=rdma&base=1&len=1&epoch=e",
	} {
		_, err := parsePeer(bad)
		require.Error(t, err, bad)
		require.Contains(t, err.Error(), "data-plane address", bad)
	}
}

// The descriptor comes from the network (a peers reply).
func FuzzParsePeer(f *testing.F) {
	f.Add(peer{Segment: "10.0.0.1:1", Proto: "rdma", Base: 4096, Len: 1 << 20, Epoch: "ab"}.String())
	f.Add("mooncake://x?base=1&len=2&proto=tcp&epoch=1")
	f.Fuzz(func(t *testing.T, s string) {
		p, err := parsePeer(s)
		if err != nil {
			return
		}
		again, err := parsePeer(p.String())
		if err != nil || again != p {
			t.Fatalf("%q parsed to %+v, which does not round-trip (%v)", s, p, err)
		}
		if p.Base == 0 || p.Len == 0 || p.Base+p.Len < p.Base {
			t.Fatalf("%q parsed to an impossible slab %+v", s, p)
		}
	})
}

func TestProbeSaysWhatIsMissing(t *testing.T) {
	needDouble(t)
	cases := []struct {
		name, path string
		available  bool
		want       string
	}{
		{"library with the C API", doublePath, true, ""},
		{"no library", "/nonexistent/libtransfer_engine.so", false, "cannot load"},
		{"missing symbol", noFreePath, false, "lacks freeBatchID"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got := Probe(tc.path, "")
			require.Equal(t, tc.path, got.Library)
			require.Equal(t, tc.available, got.Available, got.Reason)
			require.Contains(t, got.Reason, tc.want)
			require.Contains(t, got.Symbols, "submitTransfer")
		})
	}
	require.Equal(t, DefaultLibrary, Probe("", "").Library)
}
