package shm

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/ecmooncake/ecmooncake/core/transport"
)

// Name is the transport's name in settings and peers replies.
const Name = "shm"

// Dir is where slab files live: tmpfs, shared by every process of a host
// (and container) that mounts it.
const Dir = "/dev/shm"

// ErrOtherHost: the consumer is on another host; /dev/shm is not shared
// between hosts, so shm cannot reach it.
var ErrOtherHost = fmt.Errorf("%w: consumer on another host", transport.ErrUnsupported)

// Config configures the transport of one process object.
type Config struct {
	// Host is this process's host identity (the settings' host, else the
	// hostname): a consumer publishes it, a producer compares it.
	Host string
	// SlabPath is the consumer's slab file; producers leave it empty.
	SlabPath string
	Logger   *slog.Logger
}

// Transport moves bytes through a consumer's slab file in /dev/shm.
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

// New returns the transport; it touches no file until Listen or Write.
func New(cfg Config) *Transport {
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	return &Transport{cfg: cfg, log: cfg.Logger.With("transport", Name)}
}

// Name is "shm".
func (t *Transport) Name() string { return Name }

// CheckAddr refuses a consumer on another host before any write.
func (t *Transport) CheckAddr(addr string) error {
	p, err := parsePeer(addr)
	if err != nil {
		return err
	}
	return t.checkHost(p)
}

func (t *Transport) checkHost(p peer) error {
	if p.Host != t.cfg.Host {
		return fmt.Errorf("%w: its slab %s is on host %q and this process is on %q; different hosts cannot share %s (use tcp or mooncake, or set host the same on both if they really share it)",
			ErrOtherHost, p.Path, p.Host, t.cfg.Host, Dir)
	}
	return nil
}

// receiver is a consumer shard's slab file, offered to producers.
type receiver struct{ p peer }

// Listen checks that the sink's slab is the configured slab file, mapped
// shared, and offers it; addr only names the shard in errors. The sink
// must be a transport.DirectSink over host memory.
func (t *Transport) Listen(addr string, sink transport.Sink) (transport.Receiver, error) {
	ds, ok := sink.(transport.DirectSink)
	if !ok {
		return nil, fmt.Errorf("shm: listen %s: the sink does not expose its memory (transport.DirectSink)", addr)
	}
	base, n, device := ds.Memory()
	if device != "" && device != "cpu" {
		return nil, fmt.Errorf("shm: listen %s: the slab is on %s; shm carries host memory only", addr, device)
	}
	if base == 0 || n == 0 {
		return nil, fmt.Errorf("shm: listen %s: empty slab", addr)
	}
	ino, err := CheckSlabFile(t.cfg.SlabPath, n)
	if err != nil {
		return nil, fmt.Errorf("shm: listen %s: %w", addr, err)
	}
	if err := checkMapped(t.cfg.SlabPath, ino, uint64(base), n); err != nil {
		return nil, fmt.Errorf("shm: listen %s: %w", addr, err)
	}
	r := &receiver{p: peer{Path: t.cfg.SlabPath, Base: uint64(base), Len: n, Host: t.cfg.Host, Ino: ino, Epoch: newEpoch()}}
	t.log.Info("shm slab offered", "path", t.cfg.SlabPath, "bytes", n, "host", t.cfg.Host)
	return r, nil
}

// CheckSlabFile checks that path can back an n-byte slab and returns its
// inode: a fully allocated regular file of at least n bytes directly under
// Dir.
func CheckSlabFile(path string, n uint64) (uint64, error) {
	if path == "" {
		return 0, fmt.Errorf("slab_path is empty; the shm transport needs the slab's file under %s", Dir)
	}
	if filepath.Dir(filepath.Clean(path)) != Dir || !filepath.IsAbs(path) {
		return 0, fmt.Errorf("slab_path %q is not a file directly under %s", path, Dir)
	}
	var st syscall.Stat_t
	if err := syscall.Stat(path, &st); err != nil {
		return 0, fmt.Errorf("slab_path %q: %w", path, err)
	}
	switch {
	case st.Mode&syscall.S_IFMT != syscall.S_IFREG:
		return 0, fmt.Errorf("slab_path %q is not a regular file", path)
	case st.Size < 0 || uint64(st.Size) < n:
		return 0, fmt.Errorf("slab_path %q holds %d bytes, less than the %d-byte slab", path, st.Size, n)
	case uint64(st.Blocks)*512 < n:
		return 0, fmt.Errorf("slab_path %q is sparse (%d of %d bytes allocated): a write into an unallocated page of a full %s kills the writing process with SIGBUS; allocate the file up front (posix_fallocate, as shared_slab does)",
			path, uint64(st.Blocks)*512, n, Dir)
	}
	return st.Ino, nil
}

// checkMapped reads /proc/self/maps and checks that [base, base+n) is the
// file with inode ino, mapped shared, from file offset 0: a private or
// anonymous slab would take the shard's reads elsewhere than the
// producers' writes.
func checkMapped(path string, ino, base, n uint64) error {
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
		inode, err2 := strconv.ParseUint(fields[4], 10, 64)
		switch {
		case err1 != nil || err2 != nil:
			return fmt.Errorf("cannot parse /proc/self/maps line %q", sc.Text())
		case inode != ino:
			return fmt.Errorf("the slab at %#x is not mapped from slab_path %q (inode %d there, %d expected); allocate it with shared_slab", at, path, inode, ino)
		case len(fields[1]) < 4 || fields[1][3] != 's':
			return fmt.Errorf("the slab at %#x maps %q privately; map it MAP_SHARED so that producers' writes reach it", at, path)
		case fileOff+(at-lo) != at-base:
			return fmt.Errorf("the slab at %#x maps %q from file offset %d; want the slab to start at offset 0", at, path, fileOff+(at-lo)-(at-base))
		}
		at = hi
	}
	if err := sc.Err(); err != nil {
		return fmt.Errorf("reading /proc/self/maps: %w", err)
	}
	if at < end {
		return fmt.Errorf("the slab [%#x,%#x) is not all mapped from slab_path %q (checked up to %#x)", base, end, path, at)
	}
	return nil
}

func parseRange(s string) (lo, hi uint64, ok bool) {
	a, b, found := strings.Cut(s, "-")
	if !found {
		return 0, 0, false
	}
	lo, err1 := strconv.ParseUint(a, 16, 64)
	hi, err2 := strconv.ParseUint(b, 16, 64)
	return lo, hi, err1 == nil && err2 == nil
}

func newEpoch() string {
	b := make([]byte, 8)
	_, _ = rand.Read(b) // crypto/rand never fails on Linux
	return hex.EncodeToString(b)
}

func (r *receiver) Addr() string                     { return r.p.String() }
func (r *receiver) RemoteAddr(slabOff uint64) uint64 { return r.p.Base + slabOff }

// Stats is empty: writes never pass through the receiver.
func (r *receiver) Stats() transport.RecvStats {
	return transport.RecvStats{Rejected: map[string]uint64{}}
}

// Close has nothing to release: the slab file belongs to whoever
// allocated the slab, who may unmap and unlink it at once. A producer that
// still writes then writes into its own mapping of a file no one reads.
func (r *receiver) Close() error { return nil }

var errNoAddr = errors.New("the grant carries no slab address (is the consumer's transport shm?)")
