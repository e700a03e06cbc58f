package shm

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/transport"
)

// shmDir is where the files the old, path-naming shm transport mapped
// lived; a hostile peer may still name them.
const shmDir = "/dev/shm"

// victimFile is a file the producer may write, holding known bytes.
type victimFile struct {
	path string
	was  []byte
	ino  uint64
}

func victim(t *testing.T, dir string) victimFile {
	t.Helper()
	content := pattern(3*4096, 9)
	f, err := os.CreateTemp(dir, "ecm-victim-")
	require.NoError(t, err)
	_, err = f.Write(content)
	require.NoError(t, err)
	require.NoError(t, f.Close())
	t.Cleanup(func() { os.Remove(f.Name()) })
	var st syscall.Stat_t
	require.NoError(t, syscall.Stat(f.Name(), &st))
	return victimFile{path: f.Name(), was: content, ino: st.Ino}
}

// requireUntouched checks that refused writes left both victims as they
// were and mapped nothing.
func requireUntouched(t *testing.T, w *Writer, outside, inShm victimFile) {
	t.Helper()
	for _, v := range []struct {
		f    victimFile
		what string
	}{{outside, "the file outside /dev/shm is unchanged"}, {inShm, "the file in /dev/shm is unchanged"}} {
		got, err := os.ReadFile(v.f.path)
		require.NoError(t, err)
		require.Equal(t, v.f.was, got, v.what)
	}
	require.Zero(t, w.Stats().Maps)
}

// A consumer's peers reply is its own to write: one that names a file of
// its choosing must not make the producer write into that file.
func TestWriteRefusesAPeerThatNamesAFile(t *testing.T) {
	outside, inShm := victim(t, ""), victim(t, shmDir)
	link := filepath.Join(shmDir, "ecm-test-link-"+randomHex(8))
	require.NoError(t, os.Symlink(outside.path, link))
	t.Cleanup(func() { os.Remove(link) })

	w := New(Config{Host: "h1"}).newWriter()
	defer w.Close()
	for _, tc := range []struct {
		name, path string
		ino        uint64
	}{
		{"a file outside /dev/shm", outside.path, outside.ino},
		{"a symlink in /dev/shm to a file", link, outside.ino},
		{"another file in /dev/shm", inShm.path, inShm.ino},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const base = 1 << 30
			addr := fmt.Sprintf("shm://%s?base=%d&len=%d&host=h1&ino=%d&epoch=e1&nonce=%032x", tc.path, base, 3*4096, tc.ino, 1)
			errs := w.Write(context.Background(), addr, []transport.WriteItem{{Src: pattern(4096, 1), Addr: base + 4096, Size: 4096}})
			require.Error(t, errs[0])
		})
	}
	requireUntouched(t, w, outside, inShm)
}

// fakeShard offers fd, whatever it is, as a slab of n bytes: a consumer
// that passes the handshake but hands over a descriptor of its choosing.
func fakeShard(t *testing.T, fd int, n uint64) string {
	t.Helper()
	dup, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	require.NoError(t, err)
	p := peer{Socket: socketPrefix + "fake-" + randomHex(8), Base: 1 << 30, Len: n, Host: "h1", Nonce: [16]byte{7}}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: "@" + p.Socket, Net: "unix"})
	require.NoError(t, err)
	r := newReceiver(p, dup, ln, 8, slog.Default())
	t.Cleanup(func() { r.Close() })
	return r.Addr()
}

// The descriptor a consumer hands over must be a sealed memfd of the size
// it announced, opened read-write; anything else is refused, counted, and
// left untouched.
func TestWriteRefusesADescriptorThatIsNotASlab(t *testing.T) {
	const n = 3 * 4096
	outside, inShm := victim(t, ""), victim(t, shmDir)
	onDisk, err := os.OpenFile(outside.path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer onDisk.Close()
	shmFile, err := os.OpenFile(inShm.path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer shmFile.Close()
	readOnly := memfd(t, n, true)
	roFD, err := unix.Open(fmt.Sprintf("/proc/self/fd/%d", readOnly), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(roFD)
	unsealed := memfd(t, n, false)
	small := memfd(t, n/3, true)
	var pipe [2]int
	require.NoError(t, unix.Pipe2(pipe[:], unix.O_CLOEXEC))
	defer unix.Close(pipe[0])
	defer unix.Close(pipe[1])

	w := New(Config{Host: "h1"}).newWriter()
	defer w.Close()
	for i, tc := range []struct {
		name string
		fd   int
		want string
	}{
		{"a file outside /dev/shm", int(onDisk.Fd()), "not a memfd"}, // or, on a tmpfs /tmp, "not sealed"
		{"a file in /dev/shm", int(shmFile.Fd()), "not sealed against shrinking"},
		{"an unsealed memfd", unsealed, "not sealed against shrinking"},
		{"a memfd smaller than announced", small, "less than"},
		{"a read-only memfd", roFD, "not open for reading and writing"},
		{"a pipe", pipe[1], "not a regular file"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			addr := fakeShard(t, tc.fd, n)
			errs := w.Write(context.Background(), addr, []transport.WriteItem{{Src: pattern(4096, 1), Addr: 1<<30 + 4096, Size: 4096}})
			require.ErrorIs(t, errs[0], ErrRefusedPeer)
			require.ErrorIs(t, errs[0], transport.ErrUnsupported, "a router may fall back to another data plane")
			if !strings.Contains(errs[0].Error(), "not sealed against shrinking") {
				require.ErrorContains(t, errs[0], tc.want)
			}
			require.Equal(t, uint64(i+1), w.Stats().Refused)
		})
	}
	requireUntouched(t, w, outside, inShm)
	require.Equal(t, make([]byte, n/3), must(os.ReadFile(fmt.Sprintf("/proc/self/fd/%d", small))))
}

func must[T any](v T, err error) T {
	if err != nil {
		panic(err)
	}
	return v
}

// A shard serves at most MaxConns producers at once; the rest are cut at
// once and counted, and a slot that frees up serves the next one.
func TestShardCapsItsConnections(t *testing.T) {
	fd := memfd(t, slabBytes, true)
	mem := mapFD(t, fd, slabBytes, syscall.MAP_SHARED)
	r, err := New(Config{Host: "h1", SlabFD: fd, MaxConns: 2}).Listen("127.0.0.1:0", memSink{mem: mem})
	require.NoError(t, err)
	defer r.Close()
	name := "@" + must(parsePeer(r.Addr())).Socket
	var idle []net.Conn
	for range 2 {
		c, err := net.Dial("unix", name)
		require.NoError(t, err)
		defer c.Close()
		idle = append(idle, c)
	}
	w := New(Config{Host: "h1"}).newWriter()
	defer w.Close()
	item := []transport.WriteItem{{Src: []byte{9}, Addr: r.(transport.Direct).RemoteAddr(0), Size: 1}}
	require.Eventually(t, func() bool {
		errs := w.Write(context.Background(), r.Addr(), item)
		return errors.Is(errs[0], transport.ErrUnreachable)
	}, 10*time.Second, time.Millisecond)
	require.Equal(t, uint64(1), r.Stats().Closed[closedLimit])
	require.Zero(t, mem[0])

	idle[0].Close()
	require.Eventually(t, func() bool { return w.Write(context.Background(), r.Addr(), item)[0] == nil }, 10*time.Second, time.Millisecond)
	require.Equal(t, byte(9), mem[0])
}
