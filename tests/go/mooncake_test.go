package gotests

import (
	"context"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	zmq "github.com/pebbe/zmq4"
	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/metadata"
	"github.com/ecmooncake/ecmooncake/core/node"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/mooncake"
	"github.com/ecmooncake/ecmooncake/core/transport/mooncake/mooncaketest"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// The Mooncake TransferEngine test double, built for this run, or a real
// library when mooncaketest.EnvLibrary names one (then mcDouble is nil and
// mcProtocol the transport to install).
var (
	mcLibrary  string
	mcProtocol string
	mcDouble   *mooncaketest.Double
	mcEngine   string             // a Mooncake wheel's engine.so behind mcLibrary (the shim); "" for none
	mcShim     *mooncaketest.Shim // the shim's counters when mcEngine is set
)

// needDouble skips a test that injects faults or reads counters only the
// double has.
func needDouble(t *testing.T) {
	t.Helper()
	if mcDouble == nil {
		t.Skipf("needs the Mooncake test double's fault injection; running against %s", mcLibrary)
	}
}

func TestMain(m *testing.M) {
	rc := withMooncake(m.Run)
	stopEtcd()
	os.Exit(rc)
}

// withMooncake runs the tests against the library mooncaketest.Real
// names, else against the double, built for this run in a directory
// removed after it.
func withMooncake(run func() int) int {
	if lib, proto, ok := mooncaketest.Real(); ok {
		mcLibrary, mcProtocol, mcEngine = lib, proto, mooncaketest.RealEngine()
		if mcEngine != "" {
			err := mooncaketest.PreloadPython()
			if err == nil {
				mcShim, err = mooncaketest.OpenShim(mcLibrary)
			}
			if err != nil {
				fmt.Fprintln(os.Stderr, err)
				return 1
			}
		}
		return run()
	}
	dir, err := os.MkdirTemp("", "ecm-gotests-mooncake-")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	if mcLibrary, err = mooncaketest.Build(dir, "libtransfer_engine.so", false); err == nil {
		mcDouble, err = mooncaketest.Open(mcLibrary)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return run()
}

// offHeap is slab memory outside the Go heap, as Python's is: the
// engine's threads write it.
func offHeap(t *testing.T) func(n int) []byte {
	return func(n int) []byte {
		mem, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
		require.NoError(t, err)
		// After the caller's deferred close of its shard; a cluster's
		// slabs are clusterSlabs'.
		t.Cleanup(func() { _ = syscall.Munmap(mem) })
		return mem
	}
}

// A shard's slab stays mapped until the cluster has closed every node,
// its engine's too: the engine writes whatever address a peer names, and a
// write still landing as the test ends (one that failed part way, say)
// must find the memory there. A restarted shard's slab is made after the
// cluster registered its cleanup, and so once was unmapped before it: the
// real engine then logged ServerSession::readBody ... Bad address.
func TestMooncakeSlabsOutliveTheClusterClose(t *testing.T) {
	var unmapped []string
	t.Run("cluster", func(t *testing.T) {
		c := mooncakeCluster(t, clusterOpts{tp: 2}, nil, nil)
		c.restart(1)
		c.restart(1)
		c.closing = func() {
			for r, mem := range c.slabs {
				if !mapped(mem) {
					unmapped = append(unmapped, fmt.Sprintf("shard %d's slab at %p", r, unsafe.SliceData(mem)))
				}
			}
		}
	})
	require.Empty(t, unmapped, "slabs unmapped while the cluster's engines were still open")
}

// mapped says whether every page of mem is mapped: mincore fails with
// ENOMEM on a range that is not.
func mapped(mem []byte) bool {
	vec := make([]byte, (len(mem)+os.Getpagesize()-1)/os.Getpagesize())
	_, _, errno := syscall.Syscall(syscall.SYS_MINCORE, uintptr(unsafe.Pointer(unsafe.SliceData(mem))), uintptr(len(mem)), uintptr(unsafe.Pointer(unsafe.SliceData(vec))))
	return errno == 0
}

func mooncakeTr(t *testing.T, mod func(*mooncake.Config)) transport.Transport {
	c := mooncake.Config{Library: mcLibrary, Engine: mcEngine, Protocol: mcProtocol, Host: "127.0.0.1", StagingBytes: 16 << 20, ChunkBytes: 1 << 20, Logger: quietLog()}
	if mod != nil {
		mod(&c)
	}
	tr, err := mooncake.New(c)
	require.NoError(t, err)
	return tr
}

// clusterSlabs is offHeap for a cluster: its cleanup, registered before
// the cluster registers its own and so run after it, unmaps every slab the
// cluster made, a restarted shard's too, once every engine that might still
// write one is closed.
func clusterSlabs(t *testing.T) func(n int) []byte {
	var maps [][]byte
	t.Cleanup(func() {
		for _, mem := range maps {
			_ = syscall.Munmap(mem)
		}
	})
	return func(n int) []byte {
		mem, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
		require.NoError(t, err)
		maps = append(maps, mem)
		return mem
	}
}

func mooncakeCluster(t *testing.T, o clusterOpts, consumerMod, producerMod func(*mooncake.Config)) *cluster {
	o.slab = clusterSlabs(t)
	o.consumerTr = func(int) transport.Transport { return mooncakeTr(t, consumerMod) }
	o.producerTr = func() transport.Transport { return mooncakeTr(t, producerMod) }
	return newCluster(t, o)
}

// The whole path over the mooncake data plane: two shards, several items
// per batch, duplicates, a resident copy answered without a write.
func TestMooncakePushToShardedConsumer(t *testing.T) {
	var before mooncaketest.Stats
	if mcDouble != nil {
		before = mcDouble.Stats()
	}
	c := mooncakeCluster(t, clusterOpts{tp: 2}, nil, nil)
	items := makeItems(11, 10, 1, 3<<20, 4)
	c.deliver("req-mc", items)
	c.verify(items)

	var landed int64
	if mcDouble != nil {
		landed = mcDouble.Stats().BytesLanded
	}
	again := []item{{tid: "tx-mc-again", hash: items[0].hash, data: items[0].data}}
	require.Empty(t, c.pushAll("req-mc-2", again).Failed)
	for _, s := range c.shards {
		st := s.Stats()
		require.Zero(t, st.Table.WritesInFlight, "every one-sided write was ended by its complete")
	}
	if mcDouble != nil {
		require.Equal(t, landed, mcDouble.Stats().BytesLanded, "a cached item is not written again")
		require.Equal(t, before.BatchesLive, mcDouble.Stats().BatchesLive)
	}
}

func TestMooncakeOverHTTPMetadata(t *testing.T) {
	store, err := metadata.Listen(metadata.Config{Addr: "127.0.0.1:0", Open: true, Logger: quietLog()})
	require.NoError(t, err)
	defer store.Close()
	http := func(c *mooncake.Config) { c.Metadata = store.URL() }
	c := mooncakeCluster(t, clusterOpts{tp: 2}, http, http)
	items := makeItems(12, 4, 1000, 100_000, 0)
	require.Empty(t, c.pushAll("req-http", items).Failed)
	c.verify(items)
	require.GreaterOrEqual(t, store.Stats().Keys, 3, "each engine published itself")
}

// The metadata store stops before the engines: closing them still
// succeeds (the refused unregister is logged), so a deployment that shuts
// its store down first does not report a failure for every shard.
func TestMooncakeCloseAfterTheMetadataStoreHasGone(t *testing.T) {
	store, err := metadata.Listen(metadata.Config{Addr: "127.0.0.1:0", Open: true, Logger: quietLog()})
	require.NoError(t, err)
	http := func(c *mooncake.Config) { c.Metadata = store.URL() }
	c := mooncakeCluster(t, clusterOpts{tp: 1}, http, http)
	items := makeItems(15, 2, 1000, 100_000, 0)
	require.Empty(t, c.pushAll("req-store-gone", items).Failed)
	require.NoError(t, store.Close())
	// The cluster's cleanup closes producer and shards and requires no error.
}

// Both ends must install the same protocol; a mismatch fails the push at
// lookup, before anything is reserved or written.
func TestMooncakeProtocolMismatchFailsThePush(t *testing.T) {
	needDouble(t) // a real engine may not install the other protocol at all
	tcp := func(c *mooncake.Config) { c.Protocol = "tcp" }
	c := mooncakeCluster(t, clusterOpts{tp: 1}, tcp, nil)
	before := mcDouble.Stats()
	items := makeItems(13, 2, 100, 100, 0)
	out := c.pushAll("req-proto", items)
	require.Len(t, out.Failed, 2)
	for _, f := range out.Failed {
		require.Contains(t, f.Reason, "mooncake_protocol")
	}
	require.Equal(t, before.TasksSubmitted, mcDouble.Stats().TasksSubmitted)
	require.Zero(t, c.shards[0].Stats().InUse, "nothing was reserved")
}

// A write that fails makes the producer abandon the region; the shard ends
// the one-sided write and returns the memory at once.
func TestMooncakeFailedWriteAbandonsTheRegion(t *testing.T) {
	needDouble(t)
	c := mooncakeCluster(t, clusterOpts{tp: 1}, nil, nil)
	items := makeItems(14, 1, 4096, 4096, 0)
	c.expect("req-fail", items)
	mcDouble.FailNext(1)
	c.send(items)
	out := c.drain(1, 30*time.Second)
	require.Len(t, out.Failed, 1)
	require.Contains(t, out.Failed[0].Reason, "FAILED")
	require.Eventually(t, func() bool {
		st := c.shards[0].Stats()
		return st.InUse == 0 && st.Table.WritesInFlight == 0
	}, hang, 5*time.Millisecond)
	w := c.wait(tids(items), 10*time.Second)
	require.Equal(t, tids(items), w.Failed)
}

// A producer that reserves and vanishes never completes nor abandons: the
// shard ends the one-sided write itself after two leases, and the region's
// memory comes back.
func TestMooncakeVanishedWriterReleasedAfterTwoLeases(t *testing.T) {
	base := freeBase(t, 1)
	mem := offHeap(t)(1 << 20)
	cfg := config.DefaultConsumer()
	cfg.Port, cfg.LeaseS, cfg.Transport = base, 0.2, mooncake.Name
	s, err := node.OpenConsumer(cfg, mem, node.Options{Log: quietLog(), Network: mooncakeTr(t, nil)})
	require.NoError(t, err)
	defer s.Close()

	zctx, err := zmq.NewContext()
	require.NoError(t, err)
	defer zctx.Term()
	cl, err := control.Dial(zctx, s.Info().Control, quietLog())
	require.NoError(t, err)
	defer cl.Close()
	ctx, cancel := context.WithTimeout(context.Background(), hang)
	defer cancel()
	var rep wire.ReserveBatchReply
	require.NoError(t, cl.Call(ctx, wire.OpReserveBatch, wire.ReserveBatch{Requester: victimID, Items: []wire.ReserveItem{{TransferID: "t-gone", MMHash: "h-gone", NBytes: 4096}}}, &rep))
	require.Equal(t, wire.KindWrite, rep.Grants[0].Kind)
	require.NotZero(t, rep.Grants[0].Addr, "a one-sided grant says where to write")
	require.True(t, strings.HasPrefix(s.Info().Data, "mooncake://"))

	st := s.Stats()
	require.Equal(t, 1, st.Table.WritesInFlight, "the writer is admitted from the grant on")
	require.Eventually(t, func() bool {
		st := s.Stats()
		return st.InUse == 0 && st.Table.WritesInFlight == 0
	}, hang, 10*time.Millisecond)
}
