package gotests

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/consumer"
	"github.com/ecmooncake/ecmooncake/core/slab"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/shm"
)

// shmHost is the host identity both ends of the shm tests report.
const shmHost = "shm-test-host"

// shmPlane makes slabs as files under /dev/shm, mapped shared and removed
// at the end of the test, and the shm transports over them: consumerTr(i)
// serves the slab made by the i-th call of slab, whose file is path(i).
func shmPlane(t *testing.T, log *slog.Logger) (slab func(int) []byte, consumerTr func(int) transport.Transport, producerTr func() transport.Transport, path func(int) string) {
	var paths []string
	slab = func(n int) []byte {
		path := filepath.Join(shm.Dir, fmt.Sprintf("ecm-gotest-%d-%d-%d", os.Getpid(), time.Now().UnixNano(), len(paths)))
		f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
		require.NoError(t, err)
		defer f.Close()
		t.Cleanup(func() { os.Remove(path) })
		require.NoError(t, syscall.Fallocate(int(f.Fd()), 0, 0, int64(n)))
		mem, err := syscall.Mmap(int(f.Fd()), 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
		require.NoError(t, err)
		// Registered before the cluster's close, so it runs after it.
		t.Cleanup(func() { syscall.Munmap(mem) })
		paths = append(paths, path)
		return mem
	}
	consumerTr = func(r int) transport.Transport {
		return shm.New(shm.Config{Host: shmHost, SlabPath: paths[r], Logger: log})
	}
	producerTr = func() transport.Transport { return shm.New(shm.Config{Host: shmHost, Logger: log}) }
	path = func(r int) string { return paths[r] }
	return slab, consumerTr, producerTr, path
}

// The whole path over the shm data plane: two shards, several items per
// batch, duplicates, a resident copy answered without a write.
func TestShmPushToShardedConsumer(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2, shm: true})
	items := makeItems(21, 10, 1, 3<<20, 4)
	out := c.pushAll("req-shm", items)
	require.Empty(t, out.Failed)
	w := c.wait(tids(items), 10*time.Second)
	require.ElementsMatch(t, tids(items), w.Available)
	c.verify(items)

	again := []item{{tid: "tx-shm-again", hash: items[0].hash, data: items[0].data}}
	require.Empty(t, c.pushAll("req-shm-2", again).Failed)
	for _, s := range c.shards {
		st := s.Stats()
		require.Zero(t, st.Table.WritesInFlight, "every one-sided write was ended by its complete")
		require.Equal(t, "shm", s.Info().Transport)
	}
}

// A shard whose slab is not its slab file refuses to open, with the
// reason, and releases what it had started.
func TestShmShardRefusesASlabNotFromItsFile(t *testing.T) {
	slabOf, consumerTr, _, path := shmPlane(t, quietLog())
	slabOf(1 << 20)
	cfg := config.DefaultConsumer()
	cfg.Port, cfg.Transport, cfg.SlabPath = freeBase(t, 1), shm.Name, path(0)
	_, err := consumer.Open(cfg, slab.HostMemory(make([]byte, 1<<20)), consumer.Options{Transport: consumerTr(0), Log: quietLog()})
	require.ErrorContains(t, err, "not mapped from slab_path")
}
