package shm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

const slabBytes = 1 << 20

// memSink is a DirectSink over mem; the shm transport never asks it per
// frame.
type memSink struct {
	mem    []byte
	device string
}

func (s memSink) BeginWrite(ids.ResID, ids.Token, uint64, uint64) ([]byte, error) {
	return nil, errors.New("not used by shm")
}
func (s memSink) EndWrite(ids.ResID, bool) {}
func (s memSink) Memory() (uintptr, uint64, string) {
	return uintptr(unsafe.Pointer(&s.mem[0])), uint64(len(s.mem)), s.device
}

// slabFile makes an allocated n-byte file under /dev/shm, removed at the
// end of the test.
func slabFile(t testing.TB, n int64) string {
	t.Helper()
	path := filepath.Join(Dir, fmt.Sprintf("ecm-test-%d-%s", os.Getpid(), newEpoch()))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	require.NoError(t, err)
	defer f.Close()
	t.Cleanup(func() { os.Remove(path) })
	require.NoError(t, syscall.Fallocate(int(f.Fd()), 0, 0, n))
	return path
}

// mapSlab maps path as a consumer would (flags MAP_SHARED or MAP_PRIVATE).
func mapSlab(t testing.TB, path string, n, flags int) []byte {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	mem, err := syscall.Mmap(int(f.Fd()), 0, n, syscall.PROT_READ|syscall.PROT_WRITE, flags)
	require.NoError(t, err)
	t.Cleanup(func() { syscall.Munmap(mem) })
	return mem
}

// shard is a consumer's slab file, mapped and offered.
type shard struct {
	path string
	mem  []byte
	recv transport.Direct
	addr string
}

func listen(t *testing.T, host string) shard {
	t.Helper()
	path := slabFile(t, slabBytes)
	mem := mapSlab(t, path, slabBytes, syscall.MAP_SHARED)
	r, err := New(Config{Host: host, SlabPath: path}).Listen("127.0.0.1:0", memSink{mem: mem, device: "cpu"})
	require.NoError(t, err)
	t.Cleanup(func() { r.Close() })
	return shard{path: path, mem: mem, recv: r.(transport.Direct), addr: r.Addr()}
}

func pattern(n int, seed byte) []byte {
	b := make([]byte, n)
	for i := range b {
		b[i] = seed + byte(i*7)
	}
	return b
}

func TestWriteLandsInTheConsumersSlab(t *testing.T) {
	sh := listen(t, "h1")
	w := New(Config{Host: "h1"}).newWriter()
	defer w.Close()
	src := pattern(4096, 3)
	items := []transport.WriteItem{
		{Res: 1, Src: src, Addr: sh.recv.RemoteAddr(0), Size: 4096},
		{Res: 2, Src: src[:100], Off: 28, Addr: sh.recv.RemoteAddr(8192), Size: 128},
	}
	for i, err := range w.Write(context.Background(), sh.addr, items) {
		require.NoError(t, err, "item %d", i)
	}
	require.Equal(t, src, sh.mem[:4096])
	require.Equal(t, src[:100], sh.mem[8192+28:8192+128])
	require.Zero(t, sh.mem[8192+27])
	require.Equal(t, WriterStats{Items: 2, Bytes: 4196, Maps: 1}, w.Stats())
}

func TestWriteRefusesWhatLiesOutsideTheGrantOrSlab(t *testing.T) {
	sh := listen(t, "h1")
	w := New(Config{Host: "h1"}).newWriter()
	defer w.Close()
	base := sh.recv.RemoteAddr(0)
	cases := []struct {
		name string
		it   transport.WriteItem
		want error
	}{
		{"past the grant", transport.WriteItem{Src: make([]byte, 65), Addr: base, Size: 64}, transport.ErrWriteBounds},
		{"offset past the grant", transport.WriteItem{Src: make([]byte, 8), Off: 60, Addr: base, Size: 64}, transport.ErrWriteBounds},
		{"offset overflows", transport.WriteItem{Src: make([]byte, 8), Off: ^uint64(0), Addr: base, Size: 64}, transport.ErrWriteBounds},
		{"region past the slab", transport.WriteItem{Src: make([]byte, 8), Addr: base + slabBytes - 4, Size: 8}, transport.ErrStaleAddr},
		{"region before the slab", transport.WriteItem{Src: make([]byte, 8), Addr: base - 8, Size: 8}, transport.ErrStaleAddr},
		{"region huge", transport.WriteItem{Src: make([]byte, 8), Addr: base, Size: ^uint64(0)}, transport.ErrStaleAddr},
		{"no address", transport.WriteItem{Src: make([]byte, 8), Size: 8}, errNoAddr},
		{"device memory", transport.WriteItem{Dev: &transport.DeviceSrc{Len: 8}, Addr: base, Size: 8}, transport.ErrDeviceMemory},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			errs := w.Write(context.Background(), sh.addr, []transport.WriteItem{tc.it})
			require.ErrorIs(t, errs[0], tc.want)
			if errors.Is(tc.want, transport.ErrRefusedByWriter) {
				require.NotErrorIs(t, errs[0], transport.ErrRejected, "the writer's own check does not blame the receiver")
			}
		})
	}
	require.Equal(t, make([]byte, slabBytes), sh.mem, "a refused item writes nothing")
}

func TestWriteRefusesAnotherHost(t *testing.T) {
	sh := listen(t, "h1")
	tr := New(Config{Host: "h2"})
	w := tr.newWriter()
	defer w.Close()
	errs := w.Write(context.Background(), sh.addr, []transport.WriteItem{{Src: []byte{1}, Addr: sh.recv.RemoteAddr(0), Size: 1}})
	require.ErrorIs(t, errs[0], ErrOtherHost)
	require.ErrorIs(t, errs[0], transport.ErrUnsupported)
	require.Contains(t, errs[0].Error(), "different hosts cannot share /dev/shm")
	require.ErrorIs(t, tr.CheckAddr(sh.addr), ErrOtherHost)
	require.Zero(t, w.Stats().Maps, "nothing is mapped for another host")
}

func TestWriteRemapsWhenTheShardRestarts(t *testing.T) {
	sh := listen(t, "h1")
	w := New(Config{Host: "h1"}).newWriter()
	defer w.Close()
	write := func(addr string, base uint64, b byte) error {
		return w.Write(context.Background(), addr, []transport.WriteItem{{Src: []byte{b}, Addr: base, Size: 1}})[0]
	}
	require.NoError(t, write(sh.addr, sh.recv.RemoteAddr(0), 1))
	require.NoError(t, write(sh.addr, sh.recv.RemoteAddr(0), 2))
	require.Equal(t, uint64(1), w.Stats().Maps, "one mapping per incarnation")

	// The shard restarts over a new file under the same name.
	require.NoError(t, os.Remove(sh.path))
	f, err := os.OpenFile(sh.path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	require.NoError(t, err)
	require.NoError(t, syscall.Fallocate(int(f.Fd()), 0, 0, slabBytes))
	f.Close()
	mem := mapSlab(t, sh.path, slabBytes, syscall.MAP_SHARED)
	r, err := New(Config{Host: "h1", SlabPath: sh.path}).Listen("127.0.0.1:0", memSink{mem: mem})
	require.NoError(t, err)
	require.NotEqual(t, sh.addr, r.Addr())

	require.NoError(t, write(r.Addr(), r.(transport.Direct).RemoteAddr(0), 3))
	require.Equal(t, byte(3), mem[0], "the new incarnation's file got the byte")
	require.Equal(t, byte(2), sh.mem[0], "the old one's did not")
	require.Equal(t, WriterStats{Items: 3, Bytes: 3, Maps: 2, Unmaps: 1}, w.Stats())

	require.ErrorIs(t, write(sh.addr, sh.recv.RemoteAddr(0), 4), transport.ErrUnreachable, "the old incarnation's file is gone")
	require.NoError(t, write(r.Addr(), r.(transport.Direct).RemoteAddr(0), 5))
	require.Equal(t, uint64(2), w.Stats().Maps, "a stale address does not cost the live incarnation its mapping")
}

func TestWriteToAMissingFile(t *testing.T) {
	sh := listen(t, "h1")
	require.NoError(t, os.Remove(sh.path))
	w := New(Config{Host: "h1"}).newWriter()
	defer w.Close()
	errs := w.Write(context.Background(), sh.addr, []transport.WriteItem{{Src: []byte{1}, Addr: sh.recv.RemoteAddr(0), Size: 1}})
	require.ErrorIs(t, errs[0], transport.ErrUnreachable)
	require.ErrorIs(t, errs[0], os.ErrNotExist)
}

func TestWriteAfterClose(t *testing.T) {
	sh := listen(t, "h1")
	w := New(Config{Host: "h1"}).newWriter()
	it := transport.WriteItem{Src: []byte{1}, Addr: sh.recv.RemoteAddr(0), Size: 1}
	require.NoError(t, w.Write(context.Background(), sh.addr, []transport.WriteItem{it})[0])
	require.NoError(t, w.Close())
	require.NoError(t, w.Close())
	require.ErrorIs(t, w.Write(context.Background(), sh.addr, []transport.WriteItem{it})[0], transport.ErrClosed)
	require.Equal(t, uint64(1), w.Stats().Unmaps)
}

func TestWriteHonoursCancel(t *testing.T) {
	sh := listen(t, "h1")
	w := New(Config{Host: "h1"}).newWriter()
	defer w.Close()
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	errs := w.Write(ctx, sh.addr, []transport.WriteItem{{Src: []byte{1}, Addr: sh.recv.RemoteAddr(0), Size: 1}})
	require.ErrorIs(t, errs[0], context.Canceled)
	require.Zero(t, sh.mem[0])
}

func TestListenChecksTheSlabFile(t *testing.T) {
	shared := slabFile(t, slabBytes)
	sharedMem := mapSlab(t, shared, slabBytes, syscall.MAP_SHARED)
	private := slabFile(t, slabBytes)
	privateMem := mapSlab(t, private, slabBytes, syscall.MAP_PRIVATE)
	sparse := filepath.Join(Dir, "ecm-test-sparse-"+newEpoch())
	require.NoError(t, os.WriteFile(sparse, nil, 0o600))
	t.Cleanup(func() { os.Remove(sparse) })
	require.NoError(t, os.Truncate(sparse, slabBytes))
	small := slabFile(t, slabBytes/2)
	notShm, err := os.CreateTemp("", "ecm-slab")
	require.NoError(t, err)
	notShm.Close()
	t.Cleanup(func() { os.Remove(notShm.Name()) })
	heap := make([]byte, slabBytes)

	cases := []struct {
		name string
		path string
		sink memSink
		want string
	}{
		{"no path", "", memSink{mem: sharedMem}, "slab_path is empty"},
		{"missing file", filepath.Join(Dir, "ecm-test-missing-"+newEpoch()), memSink{mem: sharedMem}, "no such file"},
		{"outside /dev/shm", notShm.Name(), memSink{mem: sharedMem}, "not a file directly under /dev/shm"},
		{"file smaller than the slab", small, memSink{mem: sharedMem}, "less than the 1048576-byte slab"},
		{"sparse file", sparse, memSink{mem: sharedMem}, "sparse"},
		{"slab not from the file", shared, memSink{mem: heap}, "not mapped from slab_path"},
		{"slab of another file", private, memSink{mem: sharedMem}, "not mapped from slab_path"},
		{"private mapping", private, memSink{mem: privateMem}, "privately"},
		{"not at offset 0", shared, memSink{mem: sharedMem[4096:]}, "file offset 4096"},
		{"gpu slab", shared, memSink{mem: sharedMem, device: "cuda:0"}, "host memory only"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(Config{Host: "h1", SlabPath: tc.path}).Listen("127.0.0.1:0", tc.sink)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

func TestPeerAddressRoundTrip(t *testing.T) {
	p := peer{Path: "/dev/shm/ecm slab?1", Base: 1 << 40, Len: 4096, Host: "node-1", Ino: 77, Epoch: "ab"}
	got, err := parsePeer(p.String())
	require.NoError(t, err)
	require.Equal(t, p, got)
	for _, bad := range []string{
		"tcp://x", "shm://rel?base=1&len=1&host=h&ino=1&epoch=e", "shm:///dev/shm/x?base=0&len=1&host=h&ino=1&epoch=e",
		"shm:///dev/shm/x?base=1&len=0&host=h&ino=1&epoch=e", "shm:///dev/shm/x?base=1&len=1&ino=1&epoch=e",
		"shm:///dev/shm/x?base=1&len=1&host=h&ino=1", "shm:///dev/shm/x?base=1&len=1&host=h&epoch=e",
	} {
		_, err := parsePeer(bad)
		require.Error(t, err, bad)
	}
}

func TestParallelCopyCopiesEveryByte(t *testing.T) {
	for _, n := range []int{0, 1, copyShare - 1, 2 * copyShare, 2*copyShare + 3, 5*copyShare + 7} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			src := pattern(n, 5)
			dst := make([]byte, n+1)
			dst[n] = 0xee
			parallelCopy(dst[:n], src)
			require.Equal(t, src, dst[:n])
			require.Equal(t, byte(0xee), dst[n], "nothing past the end")
		})
	}
}
