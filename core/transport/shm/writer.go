package shm

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"sync"
	"sync/atomic"
	"syscall"

	"github.com/ecmooncake/ecmooncake/core/transport"
)

// WriterStats counts a Writer's work since it was made.
type WriterStats struct {
	Items  uint64 `json:"items"`
	Bytes  uint64 `json:"bytes"`
	Maps   uint64 `json:"maps"`
	Unmaps uint64 `json:"unmaps"`
}

// Writer is the producer side: the consumers' slab files it has mapped.
// Safe for concurrent use; copies run under mu read-locked, so that an
// unmap (Close, a remap) waits for every copy into that mapping to end.
type Writer struct {
	t *Transport

	mu     sync.RWMutex
	closed bool
	maps   map[string]*mapping // by file path

	items, bytes, nmaps, unmaps atomic.Uint64
}

// mapping is one consumer's slab file mapped into this process.
type mapping struct {
	epoch string
	ino   uint64
	mem   []byte
}

// NewWriter returns the producer's writer.
func (t *Transport) NewWriter() transport.Writer { return t.newWriter() }

func (t *Transport) newWriter() *Writer {
	return &Writer{t: t, maps: map[string]*mapping{}}
}

// Stats returns a snapshot of the counters.
func (w *Writer) Stats() WriterStats {
	return WriterStats{Items: w.items.Load(), Bytes: w.bytes.Load(), Maps: w.nmaps.Load(), Unmaps: w.unmaps.Load()}
}

// Write copies every item into the consumer's slab file at Addr+Off. An
// item is refused, and nothing of it copied, unless it lies inside both
// the region its grant reserved ([Addr, Addr+Size)) and the slab the
// consumer advertised. The copy cannot be interrupted: ctx is checked
// before each item.
func (w *Writer) Write(ctx context.Context, dest string, items []transport.WriteItem) []error {
	errs := make([]error, len(items))
	fail := func(where string, i int, cause error) {
		it := items[i]
		errs[i] = transport.ItemErr(Name, where, it.Res, it.Off, it.Off+it.Len(), cause)
	}
	failAll := func(where string, cause error) []error {
		for i := range items {
			fail(where, i, cause)
		}
		return errs
	}
	p, err := parsePeer(dest)
	if err != nil {
		return failAll(dest, err)
	}
	if err := w.t.checkHost(p); err != nil {
		return failAll(p.Path, err)
	}
	w.mu.RLock()
	defer w.mu.RUnlock()
	if w.closed {
		return failAll(p.Path, transport.ErrClosed)
	}
	m := w.maps[p.Path]
	if m == nil || m.epoch != p.Epoch || m.ino != p.Ino {
		w.mu.RUnlock()
		err := w.remap(p)
		w.mu.RLock()
		if err != nil {
			return failAll(p.Path, err)
		}
		if w.closed {
			return failAll(p.Path, transport.ErrClosed)
		}
		if m = w.maps[p.Path]; m == nil || m.epoch != p.Epoch {
			// Another write mapped a newer incarnation meanwhile.
			return failAll(p.Path, fmt.Errorf("%w: the shard restarted while this write began", transport.ErrGone))
		}
	}
	for i, it := range items {
		off, err := w.place(p, m, it)
		if err == nil {
			err = ctx.Err()
		}
		if err != nil {
			fail(p.Path, i, err)
			continue
		}
		parallelCopy(m.mem[off:off+uint64(len(it.Src))], it.Src)
		w.items.Add(1)
		w.bytes.Add(uint64(len(it.Src)))
	}
	return errs
}

// place is where item it goes in m, after every bounds check.
func (w *Writer) place(p peer, m *mapping, it transport.WriteItem) (uint64, error) {
	n := uint64(len(it.Src))
	switch {
	case it.Dev != nil:
		return 0, transport.ErrDeviceMemory
	case it.Addr == 0:
		return 0, errNoAddr
	case it.Off > it.Size || n > it.Size-it.Off:
		return 0, fmt.Errorf("%w: bytes [%d,%d) reach past the %d-byte region the grant reserved", transport.ErrWriteBounds, it.Off, it.Off+n, it.Size)
	case it.Addr < p.Base || it.Addr-p.Base > p.Len || it.Size > p.Len-(it.Addr-p.Base):
		return 0, fmt.Errorf("%w: region [%#x,+%d) is outside the consumer's %d-byte slab at %#x", transport.ErrStaleAddr, it.Addr, it.Size, p.Len, p.Base)
	}
	off := it.Addr - p.Base + it.Off
	if off > uint64(len(m.mem)) || n > uint64(len(m.mem))-off {
		return 0, fmt.Errorf("%w: bytes [%d,%d) of the slab file are outside its %d-byte mapping", transport.ErrStaleAddr, off, off+n, len(m.mem))
	}
	return off, nil
}

// remap maps p's file afresh, replacing an older incarnation's mapping,
// and drops mappings of files that are gone (their shards closed): each
// keeps a whole slab of tmpfs alive for as long as it is mapped.
func (w *Writer) remap(p peer) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return transport.ErrClosed
	}
	if m := w.maps[p.Path]; m != nil && m.epoch == p.Epoch && m.ino == p.Ino {
		return nil
	}
	mem, err := mapFile(p)
	if err != nil {
		// A stale address must not cost the live incarnation its mapping.
		return err
	}
	for path, m := range w.maps {
		var st syscall.Stat_t
		if path == p.Path || syscall.Stat(path, &st) != nil || st.Ino != m.ino {
			w.unmapLocked(path)
		}
	}
	w.maps[p.Path] = &mapping{epoch: p.Epoch, ino: p.Ino, mem: mem}
	w.nmaps.Add(1)
	w.t.log.Info("shm slab mapped", "path", p.Path, "bytes", p.Len, "epoch", p.Epoch)
	return nil
}

// mapFile maps p.Len bytes of p's file shared and read-write, after
// checking that it is the file the consumer advertised and large enough.
func mapFile(p peer) ([]byte, error) {
	f, err := os.OpenFile(p.Path, os.O_RDWR, 0)
	if err != nil {
		return nil, fmt.Errorf("%w: open the consumer's slab file: %w", transport.ErrUnreachable, err)
	}
	defer f.Close() // the mapping outlives the descriptor
	var st syscall.Stat_t
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		return nil, fmt.Errorf("%w: stat %s: %w", transport.ErrUnreachable, p.Path, err)
	}
	switch {
	case st.Ino != p.Ino:
		return nil, fmt.Errorf("%w: %s is inode %d, not the consumer's %d: another file under that name (a different %s, or the shard is gone)",
			transport.ErrUnreachable, p.Path, st.Ino, p.Ino, Dir)
	case st.Size < 0 || uint64(st.Size) < p.Len:
		return nil, fmt.Errorf("%w: %s holds %d bytes, less than the %d-byte slab advertised", transport.ErrUnreachable, p.Path, st.Size, p.Len)
	}
	// MAP_POPULATE fills the page tables now, once: otherwise every first
	// write to each page of the slab pays a page fault, which at 4 KiB a
	// page costs more than the copy itself.
	mem, err := syscall.Mmap(int(f.Fd()), 0, int(p.Len), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED|syscall.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("%w: mmap %d bytes of %s: %w", transport.ErrUnreachable, p.Len, p.Path, err)
	}
	return mem, nil
}

func (w *Writer) unmapLocked(path string) {
	m := w.maps[path]
	delete(w.maps, path)
	if err := syscall.Munmap(m.mem); err != nil {
		w.t.log.Warn("shm: munmap failed", "path", path, "cause", err)
		return
	}
	w.unmaps.Add(1)
}

// Close waits for the copies in progress, unmaps every slab file and fails
// later writes with ErrClosed; idempotent.
func (w *Writer) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.closed = true
	for path := range w.maps {
		w.unmapLocked(path)
	}
	return nil
}

// copyShare is the smallest share of an item that a goroutine of its own
// copies: below it, starting one costs more than the copy it saves.
const copyShare = 4 << 20

// parallelCopy copies src into dst (of the same length) on up to
// GOMAXPROCS goroutines: one core does not saturate memory bandwidth, and
// an item's copy is the whole transfer.
func parallelCopy(dst, src []byte) {
	k := min(runtime.GOMAXPROCS(0), len(src)/copyShare)
	if k <= 1 {
		copy(dst, src)
		return
	}
	share := (len(src) + k - 1) / k
	var wg sync.WaitGroup
	for lo := share; lo < len(src); lo += share {
		hi := min(lo+share, len(src))
		wg.Go(func() { copy(dst[lo:hi], src[lo:hi]) })
	}
	copy(dst[:share], src[:share])
	wg.Wait()
}
