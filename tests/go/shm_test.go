package gotests

import (
	"syscall"
	"testing"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/node"
	"github.com/ecmooncake/ecmooncake/core/transport/shm"
)

// shmHost is the host identity both ends of the shm tests report.
const shmHost = "shm-test-host"

// shmPlane makes slabs as sealed memfds, mapped shared and closed at the
// end of the test, for the shm data plane: fd(i) is the descriptor of the
// slab made by the i-th call of slab.
func shmPlane(t *testing.T) (slab func(int) []byte, fd func(int) int) {
	var fds []int
	slab = func(n int) []byte {
		f, err := unix.MemfdCreate("ecm-gotest-slab", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
		require.NoError(t, err)
		t.Cleanup(func() { unix.Close(f) })
		require.NoError(t, unix.Fallocate(f, 0, 0, int64(n)))
		_, err = unix.FcntlInt(uintptr(f), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW)
		require.NoError(t, err)
		mem, err := syscall.Mmap(f, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
		require.NoError(t, err)
		// Registered before the cluster's close, so it runs after it.
		t.Cleanup(func() { syscall.Munmap(mem) })
		fds = append(fds, f)
		return mem
	}
	fd = func(r int) int { return fds[r] }
	return slab, fd
}

// The whole path over the shm data plane: two shards, several items per
// batch, duplicates, a resident copy answered without a write.
func TestShmPushToShardedConsumer(t *testing.T) {
	c := newCluster(t, clusterOpts{tp: 2, shm: true})
	items := makeItems(21, 10, 1, 3<<20, 4)
	c.deliver("req-shm", items)
	c.verify(items)

	again := []item{{tid: "tx-shm-again", hash: items[0].hash, data: items[0].data}}
	require.Empty(t, c.pushAll("req-shm-2", again).Failed)
	for _, s := range c.shards {
		st := s.Stats()
		require.Zero(t, st.Table.WritesInFlight, "every one-sided write was ended by its complete")
		require.Equal(t, "shm", s.Info().Transport)
	}
}

// A shard whose slab is not mapped from its memfd refuses to open, with
// the reason, and releases what it had started.
func TestShmShardRefusesASlabNotFromItsMemfd(t *testing.T) {
	slabOf, fd := shmPlane(t)
	slabOf(1 << 20)
	cfg := config.DefaultConsumer()
	cfg.Port, cfg.Transport, cfg.Host, cfg.SlabFD = freeBase(t, 1), shm.Name, shmHost, fd(0)
	_, err := node.OpenConsumer(cfg, make([]byte, 1<<20), node.Options{Log: quietLog()})
	require.ErrorContains(t, err, "not mapped from slab_fd")
}
