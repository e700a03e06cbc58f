package shm

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"
	"sync"
	"syscall"
	"time"

	"go.uber.org/atomic"
	"golang.org/x/sys/unix"

	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/serve"
)

// WriterStats counts a Writer's work since it was made. Refused counts
// consumers whose slab failed a check (ErrRefusedPeer).
type WriterStats struct {
	Items   uint64 `json:"items"`
	Bytes   uint64 `json:"bytes"`
	Maps    uint64 `json:"maps"`
	Unmaps  uint64 `json:"unmaps"`
	Refused uint64 `json:"refused"`
}

// Writer is the producer side: the consumers' slabs it has mapped.
// Safe for concurrent use; copies run under mu read-locked, so that an
// unmap (Close, a remap, a shard's end) waits for every copy into that
// mapping to end.
type Writer struct {
	t    *Transport
	once serve.WarnOnce

	mu     sync.RWMutex
	closed bool
	maps   map[string]*mapping // by socket name
	wg     sync.WaitGroup      // watchers

	items, bytes, nmaps, unmaps, refused atomic.Uint64
}

// mapping is one consumer's slab mapped into this process, and the
// connection whose end says that the shard is gone.
type mapping struct {
	nonce [nonceLen]byte
	mem   []byte
	conn  *net.UnixConn
}

// NewWriter returns the producer's writer.
func (t *Transport) NewWriter() transport.Writer { return t.newWriter() }

func (t *Transport) newWriter() *Writer {
	return &Writer{t: t, maps: map[string]*mapping{}}
}

// Stats returns a snapshot of the counters.
func (w *Writer) Stats() WriterStats {
	return WriterStats{Items: w.items.Load(), Bytes: w.bytes.Load(), Maps: w.nmaps.Load(), Unmaps: w.unmaps.Load(), Refused: w.refused.Load()}
}

// Write copies every item into the consumer's slab at Addr+Off. An item
// is refused, and nothing of it copied, unless it lies inside both the
// region its grant reserved ([Addr, Addr+Size)) and the slab the consumer
// advertised. The copy cannot be interrupted: ctx is checked before each
// item, and bounds the handshake of a first write to a shard.
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
		w.refuse("address", err)
		return failAll(dest, fmt.Errorf("%w: %w", ErrRefusedPeer, err))
	}
	where := "@" + p.Socket
	if err := w.t.checkHost(p); err != nil {
		return failAll(where, err)
	}
	w.mu.RLock()
	defer w.mu.RUnlock()
	if w.closed {
		return failAll(where, transport.ErrClosed)
	}
	m := w.maps[p.Socket]
	if !m.serves(p) {
		w.mu.RUnlock()
		err := w.attach(ctx, p)
		w.mu.RLock()
		if err != nil {
			return failAll(where, err)
		}
		if w.closed {
			return failAll(where, transport.ErrClosed)
		}
		if m = w.maps[p.Socket]; !m.serves(p) {
			return failAll(where, fmt.Errorf("%w: the shard went while this write began", transport.ErrUnreachable))
		}
	}
	for i, it := range items {
		off, err := place(p, m, it)
		if err == nil {
			err = ctx.Err()
		}
		if err != nil {
			fail(where, i, err)
			continue
		}
		parallelCopy(m.mem[off:off+uint64(len(it.Src))], it.Src)
		w.items.Add(1)
		w.bytes.Add(uint64(len(it.Src)))
	}
	return errs
}

func (m *mapping) serves(p peer) bool {
	return m != nil && m.nonce == p.Nonce && uint64(len(m.mem)) == p.Len
}

// place is where item it goes in m, after every bounds check.
func place(p peer, m *mapping, it transport.WriteItem) (uint64, error) {
	switch {
	case it.Dev != nil:
		return 0, transport.ErrDeviceMemory
	case it.Addr == 0:
		return 0, errNoAddr
	}
	off, err := transport.PlaceInSlab(it, p.Base, p.Len, "consumer")
	if err != nil {
		return 0, err
	}
	n := uint64(len(it.Src))
	if off > uint64(len(m.mem)) || n > uint64(len(m.mem))-off {
		return 0, fmt.Errorf("%w: bytes [%d,%d) of the slab are outside its %d-byte mapping", transport.ErrStaleAddr, off, off+n, len(m.mem))
	}
	return off, nil
}

func (w *Writer) refuse(reason string, cause error) {
	w.refused.Add(1)
	w.once.Log(w.t.log, reason, "shm: refused a consumer's slab", "cause", cause)
}

// attach fetches p's slab descriptor, checks it and maps it, then
// installs the mapping in place of an older one. The handshake and the
// mapping run unlocked: they may take a while (MAP_POPULATE of a large
// slab) and writes to other shards must not wait for them.
func (w *Writer) attach(ctx context.Context, p peer) error {
	conn, fd, err := w.fetch(ctx, p)
	if err != nil {
		return err
	}
	mem, err := mapGranted(fd, p)
	syscall.Close(fd) // the mapping outlives the descriptor
	if err != nil {
		conn.Close()
		if errors.Is(err, ErrRefusedPeer) {
			w.refuse("slab", err)
		}
		return err
	}
	m := &mapping{nonce: p.Nonce, mem: mem, conn: conn}
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		w.release(m)
		return transport.ErrClosed
	}
	if cur := w.maps[p.Socket]; cur != nil {
		if cur.serves(p) {
			w.release(m) // another write attached first
			return nil
		}
		w.unmapLocked(p.Socket)
	}
	w.maps[p.Socket] = m
	w.nmaps.Add(1)
	w.wg.Add(1)
	go w.watch(p.Socket, m)
	w.t.log.Info("shm slab mapped", "socket", "@"+p.Socket, "bytes", p.Len)
	return nil
}

// fetch runs the handshake with p's shard and returns the connection,
// which the shard keeps open while it offers the slab, and the slab's
// descriptor.
func (w *Writer) fetch(ctx context.Context, p peer) (*net.UnixConn, int, error) {
	d := net.Dialer{Timeout: handshakeTimeout}
	c, err := d.DialContext(ctx, "unix", "@"+p.Socket)
	if err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return nil, -1, fmt.Errorf("connect to the shard's socket: %w", ctxErr)
		}
		return nil, -1, fmt.Errorf("%w: connect to the shard's socket: %w", transport.ErrUnreachable, err)
	}
	conn := c.(*net.UnixConn)
	fd, err := w.handshake(ctx, conn, p)
	if err != nil {
		conn.Close()
		return nil, -1, err
	}
	return conn, fd, nil
}

func (w *Writer) handshake(ctx context.Context, conn *net.UnixConn, p peer) (int, error) {
	if err := sameUser(conn); err != nil {
		w.refuse("peer_uid", err)
		return -1, fmt.Errorf("%w: the shard's socket: %w", ErrRefusedPeer, err)
	}
	deadline := time.Now().Add(handshakeTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	_ = conn.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	if _, err := conn.Write(appendHello(nil, hello{Nonce: p.Nonce})); err != nil {
		return -1, fmt.Errorf("%w: send hello: %w", transport.ErrUnreachable, err)
	}
	buf := make([]byte, grantLen+1)
	oob := make([]byte, syscall.CmsgSpace(4))
	n, oobn, flags, _, err := conn.ReadMsgUnix(buf, oob)
	fd, rightsErr := -1, error(nil)
	if oobn > 0 {
		fd, rightsErr = takeRights(oob[:oobn], flags)
	}
	closeFD := func() {
		if fd >= 0 {
			syscall.Close(fd)
		}
	}
	if err != nil {
		closeFD()
		if ctxErr := ctx.Err(); ctxErr != nil {
			return -1, fmt.Errorf("read the grant: %w", ctxErr)
		}
		return -1, fmt.Errorf("%w: read the grant: %w", transport.ErrUnreachable, err)
	}
	g, err := decodeGrant(buf[:n])
	switch {
	case err != nil:
	case g.Status == grantBadNonce:
		// The shard restarted under the same name, or the address is stale.
		closeFD()
		return -1, fmt.Errorf("%w: the shard does not know this address's nonce (restarted?)", transport.ErrUnreachable)
	case g.Status != grantOK:
		err = fmt.Errorf("the shard answered %s", g.Status)
	case rightsErr != nil:
		err = rightsErr
	case fd < 0:
		err = fmt.Errorf("the grant carries no descriptor: %w", errBadHandshake)
	case g.Len != p.Len:
		err = fmt.Errorf("the grant offers %d bytes, the address %d", g.Len, p.Len)
	}
	if err != nil {
		closeFD()
		w.refuse("handshake", err)
		return -1, fmt.Errorf("%w: handshake with @%s: %w", ErrRefusedPeer, p.Socket, err)
	}
	return fd, nil
}

// mapGranted checks that fd is a slab a consumer may offer (see checkSlabFD),
// opened for writing, and maps p.Len bytes of it shared and read-write.
func mapGranted(fd int, p peer) ([]byte, error) {
	if _, err := checkSlabFD(fd, p.Len); err != nil {
		return nil, fmt.Errorf("%w: the descriptor @%s handed over: %w", ErrRefusedPeer, p.Socket, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil || st.Uid != uint32(os.Getuid()) {
		return nil, fmt.Errorf("%w: the descriptor @%s handed over belongs to uid %d, not %d", ErrRefusedPeer, p.Socket, st.Uid, os.Getuid())
	}
	fl, err := unix.FcntlInt(uintptr(fd), unix.F_GETFL, 0)
	if err != nil || fl&unix.O_ACCMODE != unix.O_RDWR {
		return nil, fmt.Errorf("%w: the descriptor @%s handed over is not open for reading and writing", ErrRefusedPeer, p.Socket)
	}
	// MAP_POPULATE fills the page tables now, once: otherwise every first
	// write to each page of the slab pays a page fault, which at 4 KiB a
	// page costs more than the copy itself.
	mem, err := syscall.Mmap(fd, 0, int(p.Len), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED|syscall.MAP_POPULATE)
	if err != nil {
		return nil, fmt.Errorf("%w: mmap %d bytes of @%s's slab: %w", transport.ErrUnreachable, p.Len, p.Socket, err)
	}
	return mem, nil
}

// watch unmaps m once its shard's connection ends (the shard closed or
// died): otherwise the mapping would keep a whole slab of memory alive.
func (w *Writer) watch(name string, m *mapping) {
	defer w.wg.Done()
	var b [1]byte
	_, _ = m.conn.Read(b[:])
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.maps[name] == m {
		w.unmapLocked(name)
		w.t.log.Info("shm slab unmapped: its shard is gone", "socket", "@"+name)
	}
}

// release undoes a mapping that was never installed.
func (w *Writer) release(m *mapping) {
	_ = m.conn.Close()
	_ = syscall.Munmap(m.mem)
}

func (w *Writer) unmapLocked(name string) {
	m := w.maps[name]
	delete(w.maps, name)
	_ = m.conn.Close()
	if err := syscall.Munmap(m.mem); err != nil {
		w.t.log.Warn("shm: munmap failed", "socket", "@"+name, "cause", err)
		return
	}
	w.unmaps.Add(1)
}

// Close waits for the copies in progress, unmaps every slab and fails
// later writes with ErrClosed; idempotent.
func (w *Writer) Close() error {
	w.mu.Lock()
	w.closed = true
	for name := range w.maps {
		w.unmapLocked(name)
	}
	w.mu.Unlock()
	w.wg.Wait()
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
