package shm

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/ecmooncake/ecmooncake/core/internal/defaults"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// Name is the transport's name in settings and peers replies.
const Name = "shm"

// DefaultMaxConns caps the producer connections one shard's socket
// serves at once: each producer process holds one per shard it writes to.
const DefaultMaxConns = 256

// ErrOtherHost: the consumer is on another host; shared memory is not
// shared between hosts, so shm cannot reach it.
var ErrOtherHost = fmt.Errorf("%w: consumer on another host", transport.ErrUnsupported)

// ErrRefusedPeer: the consumer's slab failed the producer's checks (its
// socket runs as another user, its descriptor is not a sealed memfd of the
// advertised size, its handshake is malformed). The producer writes
// nothing there; a router falls back to another data plane.
var ErrRefusedPeer = fmt.Errorf("%w: shm peer refused", transport.ErrUnsupported)

// Config configures the transport of one process object.
type Config struct {
	// Host is this process's host identity (the settings' host, else the
	// hostname): a consumer publishes it, a producer compares it.
	Host string
	// SlabFD is the consumer's slab: a descriptor of the sealed memfd the
	// slab is mapped from (Python: ecmooncake.native.shared_slab). Listen
	// duplicates it, so the caller may close its own afterwards; negative
	// means none. Producers leave it alone.
	SlabFD int
	// MaxConns caps the producer connections a shard serves at once; zero
	// means DefaultMaxConns.
	MaxConns int
	Logger   *slog.Logger
}

// Transport moves bytes through a consumer's slab memfd.
type Transport struct {
	cfg Config
	log *slog.Logger
}

var (
	_ transport.Transport   = (*Transport)(nil)
	_ transport.AddrChecker = (*Transport)(nil)
	_ transport.Direct      = (*receiver)(nil)
	_ transport.Writer      = (*Writer)(nil)
)

// New returns the transport; it touches no descriptor until Listen or Write.
func New(cfg Config) *Transport {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	defaults.Positive(&cfg.MaxConns, DefaultMaxConns)
	return &Transport{cfg: cfg, log: cfg.Logger.With("transport", Name)}
}

// Name is "shm".
func (t *Transport) Name() string { return Name }

// CheckAddr refuses a consumer on another host before any write.
func (t *Transport) CheckAddr(addr string) error {
	return transport.CheckParsed(addr, parsePeer, t.checkHost)
}

func (t *Transport) checkHost(p peer) error {
	if p.Host != t.cfg.Host {
		return fmt.Errorf("%w: its slab @%s is on host %q and this process is on %q; different hosts cannot share memory (use tcp or mooncake, or set host the same on both if they really share it)",
			ErrOtherHost, p.Socket, p.Host, t.cfg.Host)
	}
	return nil
}

// Listen checks that the sink's slab is mapped shared from the configured
// memfd and offers that memfd on a new abstract socket; addr only names
// the shard in errors. The sink must be a transport.DirectSink over host
// memory.
func (t *Transport) Listen(addr string, sink transport.Sink) (transport.Receiver, error) {
	base, n, device, err := transport.DirectMemory(sink)
	if err != nil {
		return nil, fmt.Errorf("shm: listen %s: %w", addr, err)
	}
	if device != "" && device != "cpu" {
		return nil, fmt.Errorf("shm: listen %s: the slab is on %s; shm carries host memory only", addr, device)
	}
	if t.cfg.SlabFD < 0 {
		return nil, fmt.Errorf("shm: listen %s: slab_fd is not set; the shm transport needs the descriptor of the slab's memfd (allocate the slab with shared_slab)", addr)
	}
	// Our own descriptor: the caller may close theirs, and the number
	// cannot come to name another file under us.
	fd, err := unix.FcntlInt(uintptr(t.cfg.SlabFD), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("shm: listen %s: slab_fd %d: %w", addr, t.cfg.SlabFD, err)
	}
	r, err := t.offer(fd, uint64(base), n)
	if err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("shm: listen %s: %w", addr, err)
	}
	t.log.Info("shm slab offered", "socket", "@"+r.p.Socket, "bytes", n, "host", t.cfg.Host)
	return r, nil
}

func (t *Transport) offer(fd int, base, n uint64) (*receiver, error) {
	st, err := checkSlabFD(fd, n)
	if err != nil {
		return nil, fmt.Errorf("slab_fd: %w", err)
	}
	if uint64(st.Blocks)*512 < n {
		return nil, fmt.Errorf("slab_fd: the memfd is sparse (%d of %d bytes allocated): allocate it up front (posix_fallocate, as shared_slab does), so that running out of memory fails here and not in a producer's copy",
			uint64(st.Blocks)*512, n)
	}
	if err := checkMapped(st, base, n); err != nil {
		return nil, err
	}
	p := peer{Socket: socketPrefix + strconv.Itoa(os.Getpid()) + "-" + randomHex(8), Base: base, Len: n, Host: t.cfg.Host}
	_, _ = rand.Read(p.Nonce[:]) // crypto/rand never fails on Linux
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: "@" + p.Socket, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("abstract socket @%s: %w", p.Socket, err)
	}
	return newReceiver(p, fd, ln, t.cfg.MaxConns, t.log), nil
}

// checkSlabFD checks that fd can back an n-byte slab that another process
// may map and write without risk: a regular shared-memory file sealed
// against shrinking (so that no page under a mapping can vanish and turn a
// copy into SIGBUS), of at least n bytes. Only memfds created with
// MFD_ALLOW_SEALING can carry that seal: files on disks refuse
// F_GET_SEALS, and files under /dev/shm are sealed against new seals.
func checkSlabFD(fd int, n uint64) (unix.Stat_t, error) {
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return st, fmt.Errorf("fstat: %w", err)
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG {
		return st, fmt.Errorf("not a regular file (mode %#o)", st.Mode)
	}
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return st, fmt.Errorf("not a memfd (F_GET_SEALS: %w)", err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return st, fmt.Errorf("the memfd is not sealed against shrinking (seals %#x); create it with MFD_ALLOW_SEALING and add F_SEAL_SHRINK, as shared_slab does", seals)
	}
	if st.Size < 0 || uint64(st.Size) < n {
		return st, fmt.Errorf("the memfd holds %d bytes, less than the %d-byte slab", st.Size, n)
	}
	return st, nil
}

// checkMapped reads /proc/self/maps and checks that [base, base+n) is the
// file st describes, mapped shared, from file offset 0: a private or
// anonymous slab would take the shard's reads elsewhere than the
// producers' writes.
func checkMapped(st unix.Stat_t, base, n uint64) error {
	f, err := os.Open("/proc/self/maps")
	if err != nil {
		return fmt.Errorf("cannot check how the slab is mapped: %w", err)
	}
	defer f.Close()
	at, end := base, base+n
	sc := bufio.NewScanner(f)
	for sc.Scan() && at < end {
		// start-end perms offset dev inode path
		fields := strings.Fields(sc.Text())
		if len(fields) < 5 {
			continue
		}
		lo, hi, ok := parseRange(fields[0])
		if !ok || hi <= at || lo > at {
			continue
		}
		fileOff, err1 := strconv.ParseUint(fields[2], 16, 64)
		major, minor, ok := parseDev(fields[3])
		inode, err2 := strconv.ParseUint(fields[4], 10, 64)
		switch {
		case err1 != nil || err2 != nil || !ok:
			return fmt.Errorf("cannot parse /proc/self/maps line %q", sc.Text())
		case inode != st.Ino || major != uint64(unix.Major(st.Dev)) || minor != uint64(unix.Minor(st.Dev)):
			return fmt.Errorf("the slab at %#x is not mapped from slab_fd (inode %d on %s there, %d on %d:%d expected); allocate it with shared_slab",
				at, inode, fields[3], st.Ino, unix.Major(st.Dev), unix.Minor(st.Dev))
		case len(fields[1]) < 4 || fields[1][3] != 's':
			return fmt.Errorf("the slab at %#x maps slab_fd privately; map it MAP_SHARED so that producers' writes reach it", at)
		case fileOff+(at-lo) != at-base:
			return fmt.Errorf("the slab at %#x maps slab_fd from file offset %d; want the slab to start at offset 0", at, fileOff+(at-lo)-(at-base))
		}
		at = hi
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("reading /proc/self/maps: %w", err)
	}
	if at < end {
		return fmt.Errorf("the slab [%#x,%#x) is not all mapped from slab_fd (checked up to %#x)", base, end, at)
	}
	return nil
}

// parseRange parses /proc/self/maps's "lo-hi" (hex).
func parseRange(s string) (lo, hi uint64, ok bool) {
	lo, hi, ok = parseHexPair(s, "-", 64)
	return lo, hi, ok && lo <= hi
}

// parseDev parses /proc/self/maps's "major:minor" (hex).
func parseDev(s string) (major, minor uint64, ok bool) { return parseHexPair(s, ":", 32) }

// parseHexPair parses two hex numbers of at most bits bits around sep.
func parseHexPair(s, sep string, bits int) (a, b uint64, ok bool) {
	x, y, found := strings.Cut(s, sep)
	if !found {
		return 0, 0, false
	}
	a, err1 := strconv.ParseUint(x, 16, bits)
	b, err2 := strconv.ParseUint(y, 16, bits)
	return a, b, err1 == nil && err2 == nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b) // crypto/rand never fails on Linux
	return hex.EncodeToString(b)
}

var errNoAddr = errors.New("the grant carries no slab address (is the consumer's transport shm?)")
