package cudaipc

import (
	"bufio"
	"context"
	"encoding/hex"
	"fmt"
	"os"
	"os/exec"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/ecmooncake/ecmooncake/core/cuda"
	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/transporttest"
)

// The real-GPU test runs a shard in a child process of the test binary
// (CUDA IPC opens only in another process) over the real driver, and the
// producer here: ready words stored by cuStreamWriteValue64 into the
// shard's memfd complete every item, with its bytes in the slab. It runs
// only where ECM_TEST_REAL_GPU=1 and a driver loads.
const (
	realGPUEnv   = "ECM_TEST_REAL_GPU"
	realShardEnv = "ECM_TEST_REAL_GPU_SHARD"
	realItems    = 64
	realItemLen  = 4 << 20
)

func monoNS() int64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts)
	return ts.Nano()
}

func realDevice(t *testing.T) gpu.Device {
	t.Helper()
	if os.Getenv(realGPUEnv) != "1" {
		t.Skipf("set %s=1 on a GPU host", realGPUEnv)
	}
	drv, err := cuda.Default()
	if err != nil {
		t.Skipf("no GPU here: %v", err)
	}
	dev, err := drv.Device(0)
	require.NoError(t, err)
	return dev
}

// timedSink stamps CLOCK_MONOTONIC when each write completes.
type timedSink struct {
	*transporttest.Regions
	mu   sync.Mutex
	seen map[ids.ResID]int64
}

func (s *timedSink) CompleteRemote(res ids.ResID, tok ids.Token) error {
	now := monoNS()
	err := s.Regions.CompleteRemote(res, tok)
	s.mu.Lock()
	s.seen[res] = now
	s.mu.Unlock()
	return err
}

// TestRealGPUShard is the child: it prints its address and grants, waits
// for every item to complete, checks the bytes and prints when it saw
// each word.
func TestRealGPUShard(t *testing.T) {
	if os.Getenv(realShardEnv) != "1" {
		t.Skip("the child half of TestRealGPUReadyWords")
	}
	dev := realDevice(t)
	mem, err := dev.(gpu.DeviceAllocator).AllocDevice(realItems * realItemLen)
	require.NoError(t, err)
	sink := &timedSink{Regions: transporttest.NewDevice(mem.Len()), seen: map[ids.ResID]int64{}}
	r, err := New(Config{Slab: slab.DeviceMemory(mem.Addr(), mem.Len(), dev.Name()), SlabDevice: dev, Logger: transporttest.Quiet()}).Listen("", sink)
	require.NoError(t, err)
	defer r.Close()
	out := bufio.NewWriter(os.Stdout)
	fmt.Fprintf(out, "ADDR %s\n", r.Addr())
	var grants []ids.ResID
	for range realItems {
		res, tok := sink.Reserve(realItemLen)
		grants = append(grants, res)
		fmt.Fprintf(out, "GRANT %d %s %d\n", res, hex.EncodeToString(tok[:]), r.(transport.Direct).RemoteAddr(sink.Offset(res)))
	}
	out.Flush()
	deadline := time.Now().Add(60 * time.Second)
	for sink.Completions() < realItems && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	require.Equal(t, realItems, sink.Completions())
	for i, res := range grants {
		got := make([]byte, realItemLen)
		require.NoError(t, dev.CopyToHost(got, mem.Addr()+uintptr(sink.Offset(res)), nil))
		require.Equal(t, transporttest.RandBytes(uint64(i), realItemLen), got, "item %d", i)
		fmt.Fprintf(out, "SEEN %d %d\n", res, sink.seen[res])
	}
	fmt.Fprintf(out, "STATS %+v\n", r.Stats())
	out.Flush()
}

func TestRealGPUReadyWords(t *testing.T) {
	dev := realDevice(t)
	cmd := exec.Command(os.Args[0], "-test.run=^TestRealGPUShard$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), realShardEnv+"=1")
	cmd.Stderr = os.Stderr
	stdout, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	defer func() { _ = cmd.Process.Kill() }()
	lines := bufio.NewScanner(stdout)
	var addr string
	var items []transport.WriteItem
	for len(items) < realItems && lines.Scan() {
		f := strings.Fields(lines.Text())
		switch {
		case len(f) == 2 && f[0] == "ADDR":
			addr = f[1]
		case len(f) == 4 && f[0] == "GRANT":
			var it transport.WriteItem
			var res uint64
			fmt.Sscan(f[1], &res)
			fmt.Sscan(f[3], &it.Addr)
			tok, err := hex.DecodeString(f[2])
			require.NoError(t, err)
			it.Res, it.Size, it.Complete = ids.ResID(res), realItemLen, true
			copy(it.Token[:], tok)
			items = append(items, it)
		}
	}
	require.Len(t, items, realItems)
	for i := range items {
		src, err := dev.(gpu.DeviceAllocator).AllocDevice(realItemLen)
		require.NoError(t, err)
		defer src.Free()
		require.NoError(t, dev.CopyFromHost(src.Addr(), transporttest.RandBytes(uint64(i), realItemLen)))
		items[i].Dev = &transport.DeviceSrc{Addr: src.Addr(), Len: realItemLen, Ordinal: 0}
	}
	w := New(Config{Devices: realDevices{dev}, Logger: transporttest.Quiet()}).NewWriter()
	defer w.Close()
	require.True(t, transport.InBand(w, addr), "the driver stores ready words")
	ended := map[ids.ResID]int64{}
	started := map[ids.ResID]int64{}
	for _, it := range items { // one item a batch, as one image a step
		start := monoNS()
		errs := w.Write(context.Background(), addr, []transport.WriteItem{it})
		require.NoError(t, errs[0])
		started[it.Res], ended[it.Res] = start, monoNS()
	}
	var afterEnd, afterStart []float64
	for lines.Scan() {
		t.Log("shard: " + lines.Text())
		f := strings.Fields(lines.Text())
		if len(f) == 3 && f[0] == "SEEN" {
			var res uint64
			var ns int64
			fmt.Sscan(f[1], &res)
			fmt.Sscan(f[2], &ns)
			afterEnd = append(afterEnd, float64(ns-ended[ids.ResID(res)])/1e3)
			afterStart = append(afterStart, float64(ns-started[ids.ResID(res)])/1e3)
		}
	}
	require.NoError(t, cmd.Wait())
	require.Len(t, afterEnd, realItems, "the shard saw every word")
	st := w.(*writer).Stats()
	require.Zero(t, st.HostWords, "the GPU stored every word")
	t.Logf("writer stats %+v", st)
	t.Logf("ready (word seen at the shard) minus Write's return, µs: %s", quantiles(afterEnd))
	t.Logf("ready minus Write's start, µs: %s", quantiles(afterStart))
}

type realDevices struct{ dev gpu.Device }

func (r realDevices) Device(int) (gpu.Device, error) { return r.dev, nil }

func quantiles(v []float64) string {
	sort.Float64s(v)
	q := func(p float64) float64 { return v[int(p*float64(len(v)-1))] }
	return fmt.Sprintf("p10 %.1f p50 %.1f p90 %.1f max %.1f (n=%d)", q(0.1), q(0.5), q(0.9), v[len(v)-1], len(v))
}
