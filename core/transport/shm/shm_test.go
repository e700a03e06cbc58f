package shm

import (
	"context"
	"errors"
	"fmt"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

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

// memfd makes an n-byte memfd as shared_slab does (allocated, sealed
// against shrinking and growing unless seal is false), closed at the end
// of the test.
func memfd(t testing.TB, n int64, seal bool) int {
	t.Helper()
	fd, err := unix.MemfdCreate("ecm-test-slab", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	require.NoError(t, err)
	t.Cleanup(func() { unix.Close(fd) })
	require.NoError(t, unix.Fallocate(fd, 0, 0, n))
	if seal {
		_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK|unix.F_SEAL_GROW|unix.F_SEAL_SEAL)
		require.NoError(t, err)
	}
	return fd
}

// mapFD maps fd as a consumer would (flags MAP_SHARED or MAP_PRIVATE).
func mapFD(t testing.TB, fd, n, flags int) []byte {
	t.Helper()
	mem, err := syscall.Mmap(fd, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, flags)
	require.NoError(t, err)
	t.Cleanup(func() { syscall.Munmap(mem) })
	return mem
}

// shard is a consumer's slab memfd, mapped and offered.
type shard struct {
	fd   int
	mem  []byte
	recv transport.Direct
	addr string
}

func listen(t *testing.T, host string) shard {
	t.Helper()
	fd := memfd(t, slabBytes, true)
	mem := mapFD(t, fd, slabBytes, syscall.MAP_SHARED)
	r, err := New(Config{Host: host, SlabFD: fd}).Listen("127.0.0.1:0", memSink{mem: mem, device: "cpu"})
	require.NoError(t, err)
	t.Cleanup(func() { r.Close() })
	return shard{fd: fd, mem: mem, recv: r.(transport.Direct), addr: r.Addr()}
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
	require.Contains(t, errs[0].Error(), "different hosts cannot share memory")
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
	require.Equal(t, uint64(1), sh.recv.(*receiver).Handed())

	// The shard restarts: its socket and the connection it kept go, so the
	// writer lets go of the old slab's memory.
	require.NoError(t, sh.recv.Close())
	require.Eventually(t, func() bool { return w.Stats().Unmaps == 1 }, 10*time.Second, time.Millisecond,
		"the writer unmaps a slab whose shard is gone")
	fd := memfd(t, slabBytes, true)
	mem := mapFD(t, fd, slabBytes, syscall.MAP_SHARED)
	r, err := New(Config{Host: "h1", SlabFD: fd}).Listen("127.0.0.1:0", memSink{mem: mem})
	require.NoError(t, err)
	defer r.Close()
	require.NotEqual(t, sh.addr, r.Addr())

	require.NoError(t, write(r.Addr(), r.(transport.Direct).RemoteAddr(0), 3))
	require.Equal(t, byte(3), mem[0], "the new incarnation's slab got the byte")
	require.Equal(t, byte(2), sh.mem[0], "the old one's did not")
	require.Equal(t, WriterStats{Items: 3, Bytes: 3, Maps: 2, Unmaps: 1}, w.Stats())

	require.ErrorIs(t, write(sh.addr, sh.recv.RemoteAddr(0), 4), transport.ErrUnreachable, "the old incarnation is gone")
	require.NoError(t, write(r.Addr(), r.(transport.Direct).RemoteAddr(0), 5))
	require.Equal(t, uint64(2), w.Stats().Maps, "a stale address does not cost the live incarnation its mapping")
}

// An address whose nonce is not the shard's (a stale or forged one) gets
// nothing: the shard refuses it and counts it.
func TestWriteWithAnotherNonce(t *testing.T) {
	sh := listen(t, "h1")
	p, err := parsePeer(sh.addr)
	require.NoError(t, err)
	p.Nonce[0] ^= 1
	w := New(Config{Host: "h1"}).newWriter()
	defer w.Close()
	errs := w.Write(context.Background(), p.String(), []transport.WriteItem{{Src: []byte{1}, Addr: sh.recv.RemoteAddr(0), Size: 1}})
	require.ErrorIs(t, errs[0], transport.ErrUnreachable)
	require.ErrorContains(t, errs[0], "nonce")
	require.Zero(t, sh.mem[0])
	require.Equal(t, map[string]uint64{closedBadNonce: 1}, sh.recv.Stats().Closed)
	require.Zero(t, sh.recv.(*receiver).Handed())
}

func TestWriteToAClosedShard(t *testing.T) {
	sh := listen(t, "h1")
	require.NoError(t, sh.recv.Close())
	w := New(Config{Host: "h1"}).newWriter()
	defer w.Close()
	errs := w.Write(context.Background(), sh.addr, []transport.WriteItem{{Src: []byte{1}, Addr: sh.recv.RemoteAddr(0), Size: 1}})
	require.ErrorIs(t, errs[0], transport.ErrUnreachable)
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

func TestListenChecksTheSlab(t *testing.T) {
	shared := memfd(t, slabBytes, true)
	sharedMem := mapFD(t, shared, slabBytes, syscall.MAP_SHARED)
	private := memfd(t, slabBytes, true)
	privateMem := mapFD(t, private, slabBytes, syscall.MAP_PRIVATE)
	unsealed := memfd(t, slabBytes, false)
	unsealedMem := mapFD(t, unsealed, slabBytes, syscall.MAP_SHARED)
	small := memfd(t, slabBytes/2, true)
	sparse, err := unix.MemfdCreate("ecm-test-sparse", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	require.NoError(t, err)
	defer unix.Close(sparse)
	require.NoError(t, unix.Ftruncate(sparse, slabBytes))
	_, err = unix.FcntlInt(uintptr(sparse), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK)
	require.NoError(t, err)
	onDisk, err := os.CreateTemp("", "ecm-slab")
	require.NoError(t, err)
	defer onDisk.Close()
	t.Cleanup(func() { os.Remove(onDisk.Name()) })
	require.NoError(t, unix.Fallocate(int(onDisk.Fd()), 0, 0, slabBytes))
	inShm, err := os.CreateTemp(shmDir, "ecm-slab")
	require.NoError(t, err)
	defer inShm.Close()
	t.Cleanup(func() { os.Remove(inShm.Name()) })
	require.NoError(t, unix.Fallocate(int(inShm.Fd()), 0, 0, slabBytes))
	var pipe [2]int
	require.NoError(t, unix.Pipe2(pipe[:], unix.O_CLOEXEC))
	defer unix.Close(pipe[0])
	defer unix.Close(pipe[1])
	heap := make([]byte, slabBytes)

	cases := []struct {
		name string
		fd   int
		sink memSink
		want string
	}{
		{"no descriptor", -1, memSink{mem: sharedMem}, "slab_fd is not set"},
		{"closed descriptor", 1 << 20, memSink{mem: sharedMem}, "bad file descriptor"},
		{"a pipe", pipe[0], memSink{mem: sharedMem}, "not a regular file"},
		{"a file on disk", int(onDisk.Fd()), memSink{mem: sharedMem}, "not a memfd"},
		{"a file in /dev/shm", int(inShm.Fd()), memSink{mem: sharedMem}, "not sealed against shrinking"},
		{"an unsealed memfd", unsealed, memSink{mem: unsealedMem}, "not sealed against shrinking"},
		{"memfd smaller than the slab", small, memSink{mem: sharedMem}, "less than the 1048576-byte slab"},
		{"sparse memfd", sparse, memSink{mem: sharedMem}, "sparse"},
		{"slab not from the memfd", shared, memSink{mem: heap}, "not mapped from slab_fd"},
		{"slab of another memfd", private, memSink{mem: sharedMem}, "not mapped from slab_fd"},
		{"private mapping", private, memSink{mem: privateMem}, "privately"},
		{"not at offset 0", shared, memSink{mem: sharedMem[4096:]}, "file offset 4096"},
		{"gpu slab", shared, memSink{mem: sharedMem, device: "cuda:0"}, "host memory only"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(Config{Host: "h1", SlabFD: tc.fd}).Listen("127.0.0.1:0", tc.sink)
			require.ErrorContains(t, err, tc.want)
		})
	}
}

// Listen holds a duplicate: the caller may close its own descriptor.
func TestListenKeepsItsOwnDescriptor(t *testing.T) {
	fd, err := unix.MemfdCreate("ecm-test-slab", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	require.NoError(t, err)
	require.NoError(t, unix.Fallocate(fd, 0, 0, slabBytes))
	_, err = unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, unix.F_SEAL_SHRINK)
	require.NoError(t, err)
	mem := mapFD(t, fd, slabBytes, syscall.MAP_SHARED)
	r, err := New(Config{Host: "h1", SlabFD: fd}).Listen("127.0.0.1:0", memSink{mem: mem})
	require.NoError(t, err)
	defer r.Close()
	require.NoError(t, unix.Close(fd))

	w := New(Config{Host: "h1"}).newWriter()
	defer w.Close()
	src := pattern(8192, 4)
	require.NoError(t, w.Write(context.Background(), r.Addr(), []transport.WriteItem{{Src: src, Addr: r.(transport.Direct).RemoteAddr(4096), Size: 8192}})[0])
	require.Equal(t, src, mem[4096:4096+8192])
}

func TestPeerAddressRoundTrip(t *testing.T) {
	p := peer{Socket: "ecmooncake-shm-12-ab01", Base: 1 << 40, Len: 4096, Host: "node 1?&", Nonce: [16]byte{1, 2, 0xff}}
	got, err := parsePeer(p.String())
	require.NoError(t, err)
	require.Equal(t, p, got)
	const nonce = "&nonce=0102ff00000000000000000000000000"
	for _, bad := range []string{
		"tcp://x",
		"shm:///dev/shm/x?base=1&len=1&host=h" + nonce,
		"shm:///tmp/x?base=1&len=1&host=h" + nonce,
		"shm://@/tmp/x?base=1&len=1&host=h" + nonce,
		"shm://@other-socket?base=1&len=1&host=h" + nonce,
		"shm://@ecmooncake-shm-?base=1&len=1&host=h" + nonce,
		"shm://@ecmooncake-shm-../x?base=1&len=1&host=h" + nonce,
		"shm://@ecmooncake-shm-A?base=1&len=1&host=h" + nonce,
		"shm://@ecmooncake-shm-x%00?base=1&len=1&host=h" + nonce,
		"shm://@ecmooncake-shm-" + strings.Repeat("x", 100) + "?base=1&len=1&host=h" + nonce,
		"shm://@ecmooncake-shm-x?base=0&len=1&host=h" + nonce,
		"shm://@ecmooncake-shm-x?base=1&len=0&host=h" + nonce,
		"shm://@ecmooncake-shm-x?base=18446744073709551615&len=2&host=h" + nonce,
		"shm://@ecmooncake-shm-x?base=1&len=1" + nonce,
		"shm://@ecmooncake-shm-x?base=1&len=1&host=h",
		"shm://@ecmooncake-shm-x?base=1&len=1&host=h&nonce=0102",
		"shm://@ecmooncake-shm-x?base=1&len=1&host=h&nonce=zz02ff00000000000000000000000000",
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
