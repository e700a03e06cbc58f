package mooncake

import (
	"fmt"
	"log/slog"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/mooncake/mooncaketest"
)

// testTimeout bounds waits for what normally takes milliseconds: a hang
// bound, not a claim about speed.
const testTimeout = 60 * time.Second

var (
	doublePath string // the C test double of the TransferEngine C API, or a real library
	enginePath string // a Mooncake wheel's engine.so behind doublePath (the shim); "" for none
	noFreePath string // the double, lacking freeBatchID
	double     *mooncaketest.Double
	protocol   string // installed by testConfig; "" for the default
)

// needDouble skips a test that injects faults or reads counters only the
// double has, when the run uses a real library (mooncaketest.Real).
func needDouble(t testing.TB) {
	t.Helper()
	if double == nil {
		t.Skipf("needs the Mooncake test double; running against %s", doublePath)
	}
}

// TestMain builds the double with the system C compiler for this run,
// and the variant without freeBatchID, unless the environment names a
// real library.
func TestMain(m *testing.M) {
	mooncaketest.Main(m, "ecm-mooncake-double-", func(s mooncaketest.Setup) (err error) {
		doublePath, enginePath, protocol, double = s.Library, s.Engine, s.Protocol, s.Double
		if s.Double != nil {
			noFreePath, err = mooncaketest.Build(s.Dir, "libtransfer_engine_nofree.so", true)
		}
		return err
	})
}

// hostSlab is memory outside the Go heap, as a consumer's slab is (Python
// owns it): the engine's threads write it behind Go's back.
func hostSlab(t testing.TB, n int) []byte {
	t.Helper()
	mem, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	require.NoError(t, err)
	t.Cleanup(func() { _ = syscall.Munmap(mem) })
	return mem
}

// slabSink exposes a slab to a one-sided receiver; the transport never
// asks it per frame.
type slabSink struct{ mem []byte }

func (s slabSink) Memory() (uintptr, uint64, string) {
	return uintptr(unsafe.Pointer(unsafe.SliceData(s.mem))), uint64(len(s.mem)), "cpu"
}
func (s slabSink) BeginWrite(ids.ResID, ids.Token, uint64, uint64) ([]byte, error) {
	return nil, fmt.Errorf("%w: one-sided transports never ask", transport.ErrRejected)
}
func (s slabSink) EndWrite(ids.ResID, bool) {}

var quiet = slog.New(slog.DiscardHandler)

// testConfig is the double with small staging and chunks, so that a few
// MiB already exercise chunking and staging reuse.
func testConfig(mod ...func(*Config)) Config {
	c := Config{Library: doublePath, Engine: enginePath, Protocol: protocol, Host: "127.0.0.1", StagingBytes: 8 << 20, ChunkBytes: 1 << 20, Logger: quiet}
	for _, f := range mod {
		f(&c)
	}
	return c
}

type pair struct {
	slab []byte
	recv *receiver
	tr   *Transport
	w    *Writer
}

// newPair is a consumer receiver over a fresh slab and a producer writer.
func newPair(t testing.TB, slabBytes int, consumer, producer Config) *pair {
	t.Helper()
	ctr, err := New(consumer)
	require.NoError(t, err)
	slab := hostSlab(t, slabBytes)
	r, err := ctr.Listen("127.0.0.1:0", slabSink{slab})
	require.NoError(t, err)
	ptr, err := New(producer)
	require.NoError(t, err)
	p := &pair{slab: slab, recv: r.(*receiver), tr: ptr, w: ptr.newWriter()}
	t.Cleanup(func() {
		require.NoError(t, p.w.Close())
		require.NoError(t, p.recv.Close())
	})
	return p
}

// item is a write of data into the region at slab offset off.
func (p *pair) item(res int, off uint64, data []byte) transport.WriteItem {
	return transport.WriteItem{Res: ids.ResID(res), Src: data, Addr: p.recv.RemoteAddr(off)}
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = byte(i*7) ^ seed | 1
	}
	return b
}
