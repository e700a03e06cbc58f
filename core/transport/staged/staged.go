package staged

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"runtime/debug"
	"sync"

	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/internal/defaults"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// Defaults for zero fields of Config.
const (
	DefaultStagingBytes = 64 << 20
	DefaultChunkBytes   = 8 << 20
	// receiveRound keeps receive buffers reusable across frames of
	// slightly different sizes.
	receiveRound = 1 << 20
)

// Config wires a staged transport.
type Config struct {
	// Inner moves host memory (TCP).
	Inner transport.Transport
	// Devices resolves the device of each device source (producer side).
	Devices gpu.Devices
	// Slab and SlabDevice describe the receive slab when it is device
	// memory (consumer side); a host slab needs no staging and leaves
	// Listen to Inner alone.
	Slab       slab.Memory
	SlabDevice gpu.Device
	// StagingBytes bounds the page-locked memory of each side.
	StagingBytes int
	// ChunkBytes is the size of a staged chunk on the producer side; it
	// should match Inner's frame size so that one chunk is one frame.
	ChunkBytes int
	Logger     *slog.Logger
}

// Transport is Inner with device memory staged through host buffers.
type Transport struct {
	cfg Config
}

var _ transport.Transport = (*Transport)(nil)

// New returns a staged transport; zero fields take the defaults.
func New(cfg Config) *Transport {
	defaults.Positive(&cfg.StagingBytes, DefaultStagingBytes)
	defaults.Positive(&cfg.ChunkBytes, DefaultChunkBytes)
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	cfg.Devices = gpu.Configured(cfg.Devices, "staging")
	return &Transport{cfg: cfg}
}

// Name is the inner transport's: staging is invisible on the wire.
func (t *Transport) Name() string { return t.cfg.Inner.Name() }

var _ transport.AddrChecker = (*Transport)(nil)

// CheckAddr is the inner transport's check, when it has one: staging
// changes where bytes are read from, not which peers the plane can reach
// (a mooncake engine of another protocol is refused at lookup, before
// anything is reserved, wrapped or not).
func (t *Transport) CheckAddr(addr string) error {
	if c, ok := t.cfg.Inner.(transport.AddrChecker); ok {
		return c.CheckAddr(addr)
	}
	return nil
}

// Listen listens on Inner; over a device slab the sink is wrapped so that
// frames stage through host buffers. sink must then be a RegionSink.
func (t *Transport) Listen(addr string, sink transport.Sink) (transport.Receiver, error) {
	if t.cfg.SlabDevice == nil {
		return t.cfg.Inner.Listen(addr, sink)
	}
	rs, ok := sink.(transport.RegionSink)
	if !ok {
		return nil, fmt.Errorf("staged: listen %s: a %T cannot place frames in device memory (it is no RegionSink)", addr, sink)
	}
	s := &stagingSink{
		inner: rs, dev: t.cfg.SlabDevice, slab: t.cfg.Slab,
		pool: newPool(t.cfg.StagingBytes, receiveRound),
		log:  t.cfg.Logger.With("transport", t.Name(), "staging", t.cfg.SlabDevice.Name()),
	}
	r, err := t.cfg.Inner.Listen(addr, s)
	if err != nil {
		s.pool.close()
		return nil, err
	}
	return &receiver{Receiver: r, sink: s}, nil
}

// NewWriter wraps Inner's writer so that device sources are staged.
func (t *Transport) NewWriter() transport.Writer {
	return &writer{
		inner: t.cfg.Inner.NewWriter(), devs: t.cfg.Devices, chunk: t.cfg.ChunkBytes,
		pool: newPool(max(t.cfg.StagingBytes, t.cfg.ChunkBytes), t.cfg.ChunkBytes),
		kind: "staged " + t.Name(),
	}
}

// receiver frees the staging buffers once the inner receiver is closed.
type receiver struct {
	transport.Receiver
	sink *stagingSink
}

func (r *receiver) Close() error {
	err := r.Receiver.Close()
	r.sink.pool.close()
	return err
}

// stagingSink admits frames into a device slab through host buffers.
type stagingSink struct {
	inner     transport.RegionSink
	dev       gpu.Device
	slab      slab.Memory
	pool      *pool
	log       *slog.Logger
	fallbacks atomic.Uint64
}

var _ transport.FrameSink = (*stagingSink)(nil)

func (s *stagingSink) BeginWrite(ids.ResID, ids.Token, uint64, uint64) ([]byte, error) {
	return nil, errors.New("staged: a device slab takes frames only through BeginFrame")
}

func (s *stagingSink) EndWrite(res ids.ResID, ok bool) { s.inner.EndWrite(res, ok) }

// Flush publishes what the frames staged so far completed, as the shard's
// sink holds it (transport.FlushSink).
func (s *stagingSink) Flush() { transport.Flush(s.inner) }

func (s *stagingSink) BeginFrame(res ids.ResID, tok ids.Token, off, n uint64) (transport.Frame, error) {
	at, err := s.inner.BeginRegion(res, tok, off, n)
	if err != nil {
		return nil, err
	}
	if at > s.slab.Len || n > s.slab.Len-at {
		// The shard granted a region past its own slab: a broken
		// invariant, and a GPU write there would land in someone else's
		// memory.
		s.inner.EndWrite(res, false)
		return nil, fmt.Errorf("staged: reservation %d maps to [%d,+%d), outside the %d-byte slab", res, at, n, s.slab.Len)
	}
	f := &stagedFrame{s: s, res: res, tok: tok, off: off, dst: s.slab.Addr + uintptr(at)}
	m, err := s.pool.get(context.Background(), s.dev, int(n), false)
	switch {
	case m != nil:
		f.host, f.buf = m, m.Bytes()[:n]
	default:
		if s.fallbacks.Add(1) == 1 {
			s.log.Warn("staging budget spent; staging through pageable memory", "frame_bytes", n, "pinned_bytes", s.pool.bytes(), "cause", err)
		}
		f.buf = make([]byte, n)
	}
	return f, nil
}

type stagedFrame struct {
	s    *stagingSink
	res  ids.ResID
	tok  ids.Token
	off  uint64 // in the reservation
	dst  uintptr
	host gpu.HostMem // nil when buf is pageable
	buf  []byte
}

func (f *stagedFrame) Bytes() []byte { return f.buf }

var _ transport.CompleteFrame = (*stagedFrame)(nil)

// End copies a complete frame to the GPU before the shard hears of it, so
// that nothing is published before its bytes are there.
func (f *stagedFrame) End(ok bool) error {
	ok, err := f.copyOut(ok)
	f.s.inner.EndWrite(f.res, ok)
	return err
}

// EndComplete is End(true) for a frame that carries its item's
// completion: once its bytes are on the GPU, the shard counts them and
// completes the item when it has every byte.
func (f *stagedFrame) EndComplete() error {
	n := uint64(len(f.buf))
	ok, err := f.copyOut(true)
	cs, inBand := f.s.inner.(transport.CompleteSink)
	switch {
	case !ok:
		f.s.inner.EndWrite(f.res, false)
		return err
	case !inBand:
		f.s.inner.EndWrite(f.res, false)
		return transport.ErrNoInBand
	}
	return cs.EndComplete(f.res, f.tok, f.off, n)
}

// copyOut copies a frame that arrived whole to the GPU and gives its
// staging buffer back; ok is false when it did not arrive or the copy
// failed (the frame is torn).
func (f *stagedFrame) copyOut(ok bool) (bool, error) {
	var err error
	if ok {
		if err = f.s.dev.CopyFromHost(f.dst, f.buf); err != nil {
			err = fmt.Errorf("staged: copy of %d bytes to the slab on %s: %w", len(f.buf), f.s.dev.Name(), err)
			f.s.log.Error("staged: frame torn", "res", f.res, "cause", err)
			ok = false
		}
	}
	if f.host != nil {
		f.s.pool.put(f.host)
	}
	f.host, f.buf = nil, nil
	return ok, err
}

// writer stages device sources and passes host ones straight through.
type writer struct {
	inner transport.Writer
	devs  gpu.Devices
	chunk int
	pool  *pool
	kind  string
}

// InBand implements transport.InBandWriter: staged chunks keep their
// item's Complete, so the inner writer's answer holds.
func (w *writer) InBand(dest string) bool { return transport.InBand(w.inner, dest) }

func (w *writer) Write(ctx context.Context, dest string, items []transport.WriteItem) []error {
	errs := make([]error, len(items))
	var mu sync.Mutex
	fail := func(i int, err error) {
		mu.Lock()
		if errs[i] == nil {
			errs[i] = err
		}
		mu.Unlock()
	}
	var wg sync.WaitGroup
	// Host items go out as one batch, alongside the staging below.
	var host []int
	for i, it := range items {
		if it.Dev == nil {
			host = append(host, i)
		}
	}
	if len(host) > 0 {
		batch := make([]transport.WriteItem, len(host))
		for j, i := range host {
			batch[j] = items[i]
		}
		w.send(ctx, dest, &wg, batch, host, fail, func() {})
	}
	// Device items of up to a chunk are packed into shared buffers, the
	// rest cut into chunks.
	packs := map[int]*pack{}
	var order []*pack
	for i, it := range items {
		switch {
		case it.Dev == nil:
		case it.Dev.Len > uint64(w.chunk):
			w.stage(ctx, dest, &wg, it, func(err error) { fail(i, err) })
		default:
			p := packs[it.Dev.Ordinal]
			if p == nil {
				p = &pack{ordinal: it.Dev.Ordinal}
				packs[it.Dev.Ordinal] = p
				order = append(order, p)
			}
			if !p.fits(it.Dev.Len, w.chunk) {
				w.stagePack(ctx, dest, &wg, items, p, fail)
				*p = pack{ordinal: p.ordinal}
			}
			p.add(i, it.Dev.Len)
		}
	}
	for _, p := range order {
		w.stagePack(ctx, dest, &wg, items, p, fail)
	}
	wg.Wait()
	return errs
}

// packAlign aligns each item of a pack in its buffer.
const packAlign = 64

// pack is device items of one device that share one staging buffer: at
// most a chunk of bytes, each at its own aligned offset.
type pack struct {
	ordinal int
	idx     []int
	at      []uint64
	end     uint64
}

func (p *pack) fits(n uint64, chunk int) bool {
	return len(p.idx) == 0 || alignUp(p.end)+n <= uint64(chunk)
}

func (p *pack) add(i int, n uint64) {
	at := alignUp(p.end)
	p.idx, p.at, p.end = append(p.idx, i), append(p.at, at), at+n
}

func alignUp(n uint64) uint64 { return (n + packAlign - 1) &^ (packAlign - 1) }

// stagePack copies a pack's items into one buffer, in one batch of copies
// waited for once, and sends them in one inner Write, so that a plane that groups the frames of a call (TCP's
// writev) groups them, and the staging budget holds a chunk of small
// items per buffer, not one item. An item whose copy fails fails alone.
func (w *writer) stagePack(ctx context.Context, dest string, wg *sync.WaitGroup, items []transport.WriteItem, p *pack, fail func(int, error)) {
	if len(p.idx) == 0 {
		return
	}
	failAll := func(err error) {
		for _, i := range p.idx {
			it := items[i]
			fail(i, transport.ItemErr(w.kind, dest, it.Res, it.Off, it.Off+it.Dev.Len, err))
		}
	}
	dev, err := w.devs.Device(p.ordinal)
	if err != nil {
		failAll(err)
		return
	}
	m, err := w.pool.get(ctx, dev, int(p.end), true)
	if err != nil {
		failAll(err)
		return
	}
	// One batch of copies, waited for once, for the whole pack.
	ops := make([]gpu.HostCopy, len(p.idx))
	for j, i := range p.idx {
		it := items[i]
		ops[j] = gpu.HostCopy{Dst: m.Bytes()[p.at[j] : p.at[j]+it.Dev.Len : p.at[j]+it.Dev.Len], Src: it.Dev.Addr, After: it.Dev.Ready}
	}
	frames := make([]transport.WriteItem, 0, len(p.idx))
	owners := make([]int, 0, len(p.idx))
	for j, err := range dev.CopyToHostBatch(ops) {
		i := p.idx[j]
		it := items[i]
		if err != nil {
			fail(i, transport.ItemErr(w.kind, dest, it.Res, it.Off, it.Off+it.Dev.Len, err))
			continue
		}
		frame := it
		frame.Dev, frame.Src = nil, ops[j].Dst
		frames, owners = append(frames, frame), append(owners, i)
	}
	if len(frames) == 0 {
		w.pool.put(m)
		return
	}
	w.send(ctx, dest, wg, frames, owners, fail, func() { w.pool.put(m) })
}

// send writes frames through the inner writer on a goroutine under wg,
// failing owners[j] with frame j's error (all of them on a panic), then
// runs done.
func (w *writer) send(ctx context.Context, dest string, wg *sync.WaitGroup, frames []transport.WriteItem, owners []int, fail func(int, error), done func()) {
	w.spawn(wg, func() {
		defer done()
		for j, err := range w.inner.Write(ctx, dest, frames) {
			if err != nil {
				fail(owners[j], err)
			}
		}
	}, func(err error) {
		for _, i := range owners {
			fail(i, err)
		}
	})
}

// stage copies one device item chunk by chunk and sends each chunk while
// the next is being copied; it returns once every chunk is copied or the
// item failed, with the sends still running under wg.
func (w *writer) stage(ctx context.Context, dest string, wg *sync.WaitGroup, it transport.WriteItem, fail func(error)) {
	src := it.Dev
	errAt := func(off, end uint64, err error) error {
		return transport.ItemErr(w.kind, dest, it.Res, it.Off+off, it.Off+end, err)
	}
	dev, err := w.devs.Device(src.Ordinal)
	if err != nil {
		fail(errAt(0, src.Len, err))
		return
	}
	for off := uint64(0); off < src.Len; {
		n := min(uint64(w.chunk), src.Len-off)
		m, err := w.pool.get(ctx, dev, int(n), true)
		if err != nil {
			fail(errAt(off, off+n, err))
			return
		}
		buf := m.Bytes()[:n]
		if err := dev.CopyToHost(buf, src.Addr+uintptr(off), src.Ready); err != nil {
			w.pool.put(m)
			fail(errAt(off, off+n, err))
			return
		}
		// The chunk keeps the grant's Addr and Size: one-sided inner
		// transports (mooncake, shm) place it by them.
		frame := it
		frame.Dev, frame.Src, frame.Off = nil, buf, it.Off+off
		w.spawn(wg, func() {
			defer w.pool.put(m)
			if errs := w.inner.Write(ctx, dest, []transport.WriteItem{frame}); errs[0] != nil {
				fail(errs[0])
			}
		}, fail)
		off += n
	}
}

// spawn runs f on a goroutine under wg; a panic becomes onPanic's error.
func (w *writer) spawn(wg *sync.WaitGroup, f func(), onPanic func(error)) {
	wg.Add(1)
	go func() {
		defer wg.Done()
		defer func() {
			if p := recover(); p != nil {
				onPanic(fmt.Errorf("staged: panic: %v\n%s", p, debug.Stack()))
			}
		}()
		f()
	}()
}

func (w *writer) Close() error {
	err := w.inner.Close()
	w.pool.close()
	return err
}
