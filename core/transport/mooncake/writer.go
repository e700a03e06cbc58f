package mooncake

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"time"

	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// Polling backs off from pollMin to pollMax while no task changes, and
// starts over when one does: small batches finish in microseconds, large
// ones in tens of milliseconds, and neither should burn a core.
const (
	pollMin = 20 * time.Microsecond
	pollMax = 250 * time.Microsecond
)

// WriterStats counts a Writer's work since it was made.
type WriterStats struct {
	Batches       uint64 `json:"batches"`
	Tasks         uint64 `json:"tasks"`
	Bytes         uint64 `json:"bytes"`
	FailedTasks   uint64 `json:"failed_tasks"`
	SubmitErrors  uint64 `json:"submit_errors"`
	LeakedBatches uint64 `json:"leaked_batches"`
	Reopens       uint64 `json:"segment_reopens"`
	// DeviceBytes counts the bytes of device sources, which leave from
	// GPU staging (a CUDA build of the engine).
	DeviceBytes uint64 `json:"device_bytes"`
}

// Writer is the producer side: one engine, one registered host staging
// slab, one registered staging slab on each GPU its device sources came
// from (an engine that can register GPU memory only), the segments it
// opened. Safe for concurrent use; each Write is one batch.
type Writer struct {
	t   *Transport
	log *slog.Logger

	initMu sync.Mutex // guards eng, stg and devStg while they are made
	eng    *engine
	stg    *staging
	devStg map[int]*staging // by device ordinal

	segMu sync.Mutex
	segs  map[string]*segState // by segment name

	mu       sync.Mutex
	closing  chan struct{} // closed, under mu, when Close begins
	inflight sync.WaitGroup

	batches, tasks, bytes, failedTasks, submitErrors, leaked, reopens, devBytes atomic.Uint64
}

var _ transport.Writer = (*Writer)(nil)

// segState is an opened segment and the incarnation of the peer it was
// opened for.
type segState struct {
	id    int32
	epoch string
	stale bool // a task to it failed: its cached descriptor may be wrong
}

// NewWriter returns the producer's writer; its engine is created by the
// first Write.
func (t *Transport) NewWriter() transport.Writer { return t.newWriter() }

func (t *Transport) newWriter() *Writer {
	return &Writer{t: t, log: t.log, segs: map[string]*segState{}, devStg: map[int]*staging{}, closing: make(chan struct{})}
}

// Stats returns a snapshot of the counters.
func (w *Writer) Stats() WriterStats {
	return WriterStats{
		Batches: w.batches.Load(), Tasks: w.tasks.Load(), Bytes: w.bytes.Load(), FailedTasks: w.failedTasks.Load(),
		SubmitErrors: w.submitErrors.Load(), LeakedBatches: w.leaked.Load(), Reopens: w.reopens.Load(),
		DeviceBytes: w.devBytes.Load(),
	}
}

// Write copies every item into staging and writes it to Addr+Off on the
// consumer's segment, as one batch: a host source into host staging, a
// device source, after its Ready event, into staging on its own GPU by a
// device-to-device copy (only an engine that registers GPU memory takes
// device sources; see Transport.RegistersGPU). Unlike the transports that
// ask the sink per frame, it returns only once the engine has finished
// every task it started, even past ctx's deadline (by at most
// Config.DrainTimeout): the engine has no cancel, and returning earlier
// would let the producer abandon a region that an RDMA write may still
// land in.
func (w *Writer) Write(ctx context.Context, dest string, items []transport.WriteItem) []error {
	errs := make([]error, len(items))
	failAll := func(seg string, cause error) []error {
		for i, it := range items {
			if errs[i] == nil {
				errs[i] = transport.ItemErr(Name, seg, it.Res, it.Off, it.Off+it.Len(), cause)
			}
		}
		return errs
	}
	w.mu.Lock()
	select {
	case <-w.closing:
		w.mu.Unlock()
		return failAll(dest, transport.ErrClosed)
	default:
	}
	w.inflight.Add(1)
	w.mu.Unlock()
	defer w.inflight.Done()

	p, err := parsePeer(dest)
	if err != nil {
		return failAll(dest, err)
	}
	if err := w.t.checkProto(p); err != nil {
		return failAll(p.Segment, err)
	}
	valid := 0
	for i, it := range items {
		var cause error
		switch {
		case it.Dev != nil && !w.t.gpu:
			cause = fmt.Errorf("%w (this engine cannot register GPU memory: %s)", transport.ErrDeviceMemory, w.t.gpuWhy)
		case it.Addr == 0:
			cause = errors.New("the grant carries no remote address (is the consumer's transport mooncake?)")
		case it.Addr+it.Off < it.Addr || !p.contains(it.Addr+it.Off, it.Len()):
			cause = fmt.Errorf("%w: [%#x,+%d) is outside the consumer's %d-byte slab at %#x",
				transport.ErrStaleAddr, it.Addr+it.Off, it.Len(), p.Len, p.Base)
		default:
			valid++
			continue
		}
		errs[i] = transport.ItemErr(Name, p.Segment, it.Res, it.Off, it.Off+it.Len(), cause)
	}
	if valid == 0 {
		return errs
	}
	eng, err := w.ensure(p.Segment)
	if err != nil {
		return failAll(p.Segment, err)
	}
	seg, err := w.segment(eng, p)
	if err != nil {
		return failAll(p.Segment, fmt.Errorf("%w: %w", transport.ErrUnreachable, err))
	}
	stgs := make([]*staging, len(items))
	for i, it := range items {
		if errs[i] != nil {
			continue
		}
		if it.Dev == nil {
			stgs[i], err = w.hostStaging(eng)
		} else {
			stgs[i], err = w.deviceStaging(eng, it.Dev.Ordinal)
		}
		if err != nil {
			errs[i] = transport.ItemErr(Name, p.Segment, it.Res, it.Off, it.Off+it.Len(), err)
		}
	}
	b := &batch{w: w, eng: eng, stgs: stgs, p: p, seg: seg, items: items, errs: errs}
	b.run(ctx)
	return errs
}

// checkProto refuses a consumer whose engine runs another protocol than
// ours: Write runs it on every destination, CheckAddr ahead of any write.
func (t *Transport) checkProto(p peer) error {
	if p.Proto != t.cfg.Protocol {
		return fmt.Errorf("%w: the consumer's engine at %s runs %q and this producer's runs %q; set mooncake_protocol the same on both",
			ErrProtocol, p.Segment, p.Proto, t.cfg.Protocol)
	}
	return nil
}

// ensure makes the engine on first use. A failure is not remembered: the
// next Write tries again (the metadata server may be up by then).
//
// With no mooncake_host set, the engine advertises the source address of
// the route towards the first segment written (towards).
func (w *Writer) ensure(towards string) (*engine, error) {
	w.initMu.Lock()
	defer w.initMu.Unlock()
	if w.eng != nil {
		return w.eng, nil
	}
	cfg := w.t.cfg
	host := cfg.Host
	if host == "" {
		host = outboundHostTowards(towards)
	}
	eng, err := newEngine(w.t.lib, engineConfig{Metadata: cfg.Metadata, ServerName: cfg.LocalServerName, Host: host, Protocol: cfg.Protocol, Log: w.log})
	if err != nil {
		return nil, err
	}
	w.eng = eng
	w.log.Info("mooncake engine ready", "segment", eng.segment, "protocol", cfg.Protocol, "gpu_memory", w.t.gpu)
	return eng, nil
}

// hostStaging is the registered host staging slab, made and registered on
// the first host source: a producer whose outputs are all on the GPU never
// pins it. A failure is not remembered.
func (w *Writer) hostStaging(eng *engine) (*staging, error) {
	w.initMu.Lock()
	defer w.initMu.Unlock()
	if w.stg != nil {
		return w.stg, nil
	}
	stg, err := newStaging(w.t.cfg.StagingBytes)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	if err := eng.register([]region{stg.region()}, location("cpu")); err != nil {
		_ = stg.close()
		return nil, err
	}
	w.stg = stg
	w.log.Info("mooncake host staging registered", "bytes", w.t.cfg.StagingBytes, "register_ms", time.Since(start).Milliseconds())
	return stg, nil
}

// deviceStaging is the registered staging slab on the GPU of ordinal,
// made and registered on its first use: registering costs milliseconds
// and grows with what the engine holds registered already, so it happens
// once per GPU for the writer's life, and every device source is copied
// there on its own GPU. A failure is not remembered.
func (w *Writer) deviceStaging(eng *engine, ordinal int) (*staging, error) {
	w.initMu.Lock()
	defer w.initMu.Unlock()
	if s := w.devStg[ordinal]; s != nil {
		return s, nil
	}
	dev, err := w.t.cfg.Devices.Device(ordinal)
	if err != nil {
		return nil, err
	}
	s, err := newDeviceStaging(dev, w.t.cfg.StagingBytes)
	if err != nil {
		return nil, err
	}
	start := time.Now()
	if err := eng.register([]region{s.region()}, location(s.where)); err != nil {
		_ = s.close()
		return nil, err
	}
	w.devStg[ordinal] = s
	w.log.Info("mooncake GPU staging registered", "device", s.where, "bytes", s.n, "register_ms", time.Since(start).Milliseconds())
	return s, nil
}

// segment opens p's segment once, and again without the engine's cache
// when p is a new incarnation of the peer (it restarted) or a task to it
// failed: a stale descriptor would send bytes to the old addresses.
func (w *Writer) segment(eng *engine, p peer) (int32, error) {
	w.segMu.Lock()
	defer w.segMu.Unlock()
	st := w.segs[p.Segment]
	if st != nil && st.epoch == p.Epoch && !st.stale {
		return st.id, nil
	}
	noCache := st != nil
	id, err := eng.openSegment(p.Segment, noCache)
	if err != nil {
		if st != nil {
			st.stale = true
		}
		return 0, err
	}
	if noCache {
		w.reopens.Add(1)
	}
	w.segs[p.Segment] = &segState{id: id, epoch: p.Epoch}
	return id, nil
}

func (w *Writer) markStale(name string) {
	w.segMu.Lock()
	defer w.segMu.Unlock()
	if st := w.segs[name]; st != nil {
		st.stale = true
	}
}

// markClosed fails writes that have not started; it is false when the
// writer was closed already.
func (w *Writer) markClosed() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	select {
	case <-w.closing:
		return false
	default:
		close(w.closing)
		return true
	}
}

// Close fails writes that have not started, waits for those in flight to
// drain, then unregisters the staging slab and destroys the engine;
// idempotent.
func (w *Writer) Close() error {
	if !w.markClosed() {
		return nil
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		defer func() {
			if r := recover(); r != nil {
				w.log.Error("mooncake: recovered panic while closing", "panic", r)
			}
		}()
		w.inflight.Wait()
	}()
	select {
	case <-done:
	case <-time.After(w.t.cfg.DrainTimeout + 5*time.Second):
		// A write whose tasks never finish still has the engine reading
		// staging: destroying either could corrupt memory. Keep both.
		return fmt.Errorf("mooncake: close: writes still draining after %s; the engine and its staging are left as they are", w.t.cfg.DrainTimeout)
	}
	w.initMu.Lock()
	defer w.initMu.Unlock()
	if w.eng == nil {
		return nil
	}
	err := w.eng.destroy()
	if w.leaked.Load() == 0 && w.stg != nil {
		err = errors.Join(err, w.stg.close())
		w.stg = nil
	}
	w.eng = nil
	if w.leaked.Load() == 0 {
		for ord, s := range w.devStg {
			err = errors.Join(err, s.close())
			delete(w.devStg, ord)
		}
	}
	if err != nil {
		return fmt.Errorf("mooncake: close writer: %w", err)
	}
	return nil
}

// piece is one task of a batch: n bytes of item from offset off.
type piece struct {
	item   int
	off, n uint64
	stg    uint64 // offset in the item's staging, valid while held
	task   uint64
	held   bool // staging is held for it
	state  int  // the task's last state
	lost   bool // the engine could not report it: its staging is never freed
}

// batch is one Write in progress.
type batch struct {
	w     *Writer
	eng   *engine
	stgs  []*staging // each item's staging
	p     peer
	seg   int32
	items []transport.WriteItem
	errs  []error

	id       uint64
	pieces   []piece
	next     int // next piece to stage
	nextTask uint64
	live     []int // pieces submitted and not yet finished
	stop     error // why no more pieces are submitted
}

func (b *batch) fail(i int, cause error) {
	if b.errs[i] == nil {
		it := b.items[i]
		b.errs[i] = transport.ItemErr(Name, b.p.Segment, it.Res, it.Off, it.Off+it.Len(), cause)
	}
}

func (b *batch) run(ctx context.Context) {
	chunk := b.w.t.cfg.ChunkBytes
	for i, it := range b.items {
		if b.errs[i] != nil {
			continue
		}
		for off := uint64(0); off < it.Len(); off += chunk {
			b.pieces = append(b.pieces, piece{item: i, off: off, n: min(chunk, it.Len()-off)})
		}
	}
	if len(b.pieces) == 0 {
		return
	}
	b.id = b.eng.lib.allocBatch(b.eng.h, len(b.pieces))
	if b.id == 0 || b.id == math.MaxUint64 {
		for _, pc := range b.pieces {
			b.fail(pc.item, fmt.Errorf("%w: allocateBatchID(%d) returned no batch", ErrEngine, len(b.pieces)))
		}
		return
	}
	b.w.batches.Add(1)
	var drainBy time.Time
	wait := pollMin
	for {
		b.stageAndSubmit(ctx)
		if len(b.live) == 0 && (b.next == len(b.pieces) || b.stop != nil) {
			break
		}
		progressed := b.poll()
		if ctx.Err() != nil || b.stopping() {
			if drainBy.IsZero() {
				drainBy = time.Now().Add(b.w.t.cfg.DrainTimeout)
			} else if time.Now().After(drainBy) {
				break
			}
		}
		if progressed {
			wait = pollMin
			continue
		}
		time.Sleep(wait)
		wait = min(2*wait, pollMax)
	}
	b.finish()
}

func (b *batch) stopping() bool {
	select {
	case <-b.w.closing:
		return true
	default:
		return false
	}
}

// stageAndSubmit copies pieces into staging while it has room and submits
// them as they are copied: the first at once, then in groups of about one
// chunk, so that the engine starts early, small items share a call, and a
// large item's chunks leave one by one while the next is copied.
func (b *batch) stageAndSubmit(ctx context.Context) {
	var group []int
	var groupBytes uint64
	for b.stop == nil && b.next < len(b.pieces) {
		if err := ctx.Err(); err != nil {
			b.stop = err
			break
		}
		if b.stopping() {
			b.stop = transport.ErrClosed
			break
		}
		pc := &b.pieces[b.next]
		if b.errs[pc.item] != nil {
			b.next++ // an earlier piece of its item failed: the rest stay here
			continue
		}
		stg := b.stgs[pc.item]
		off, ok, freed := stg.tryAlloc(pc.n)
		if !ok {
			if len(b.live)+len(group) > 0 {
				break // our own tasks will free room; poll them first
			}
			// Other writers hold the staging; this one holds nothing, so
			// waiting cannot deadlock.
			select {
			case <-freed:
			case <-ctx.Done():
			case <-b.w.closing:
			}
			continue
		}
		if err := b.fill(stg, off, pc); err != nil {
			stg.free(off)
			b.fail(pc.item, err)
			b.next++
			continue
		}
		pc.stg, pc.held = off, true
		group = append(group, b.next)
		groupBytes += pc.n
		b.next++
		// An idle engine gets work at once; a busy one gets it a chunk
		// at a time, so that small items share a submit call.
		if len(b.live) == 0 || groupBytes >= b.w.t.cfg.ChunkBytes {
			b.submit(group)
			group, groupBytes = nil, 0
		}
	}
	b.submit(group)
}

func (b *batch) submit(group []int) {
	if len(group) == 0 {
		return
	}
	if b.stop != nil {
		// Staged before the write was stopped: they go nowhere.
		for _, idx := range group {
			b.release(idx)
			b.fail(b.pieces[idx].item, fmt.Errorf("not sent: %w", b.stop))
		}
		return
	}
	reqs := make([]request, len(group))
	for k, idx := range group {
		pc := b.pieces[idx]
		it := b.items[pc.item]
		reqs[k] = request{src: b.stgs[pc.item].base + uintptr(pc.stg), seg: b.seg, remote: it.Addr + it.Off + pc.off, n: pc.n}
	}
	err := statusCall("submitTransfer", b.eng.lib.submit(b.eng.h, b.id, reqs))
	if err == nil {
		for k, idx := range group {
			b.pieces[idx].task = b.nextTask + uint64(k)
			b.live = append(b.live, idx)
		}
		b.nextTask += uint64(len(group))
		b.w.tasks.Add(uint64(len(group)))
		return
	}
	b.w.submitErrors.Add(1)
	b.stop = err
	// The API does not say whether a failed call kept some of its tasks.
	// Ask for each: one the engine knows must still be drained before the
	// batch is freed; one it does not know frees its staging now.
	ids := make([]uint64, len(group))
	for k := range group {
		ids[k] = b.nextTask + uint64(k)
	}
	rcs, sts := b.statuses(ids)
	for k, idx := range group {
		b.fail(b.pieces[idx].item, err)
		if rcs[k] == 0 {
			b.pieces[idx].task, b.pieces[idx].state = ids[k], int(sts[k])
			b.live = append(b.live, idx)
		} else {
			b.release(idx)
		}
	}
}

func (b *batch) release(idx int) {
	if pc := &b.pieces[idx]; pc.held {
		pc.held = false
		b.stgs[pc.item].free(pc.stg)
	}
}

// fill copies a piece into its staging at off: a memcpy from host memory,
// a device-to-device copy ordered after the source's Ready event on the
// GPU (the host waits for the copy, never for the encoder's stream).
func (b *batch) fill(stg *staging, off uint64, pc *piece) error {
	it := b.items[pc.item]
	if it.Dev == nil {
		copy(stg.bytes(off, pc.n), it.Src[pc.off:pc.off+pc.n])
		return nil
	}
	op := gpu.DeviceCopy{Dst: stg.base + uintptr(off), Src: it.Dev.Addr + uintptr(pc.off), N: pc.n, After: it.Dev.Ready}
	if err := stg.dev.CopyDevice([]gpu.DeviceCopy{op}); err != nil {
		return fmt.Errorf("copy bytes [%d,%d) into staging on %s: %w", pc.off, pc.off+pc.n, stg.where, err)
	}
	return nil
}

func (b *batch) statuses(ids []uint64) (rcs, sts []int32) {
	rcs, sts = make([]int32, len(ids)), make([]int32, len(ids))
	b.eng.lib.poll(b.eng.h, b.id, ids, rcs, sts)
	return rcs, sts
}

// poll asks for every live task once and retires the finished ones.
func (b *batch) poll() (progressed bool) {
	if len(b.live) == 0 {
		return false
	}
	ids := make([]uint64, len(b.live))
	for k, idx := range b.live {
		ids[k] = b.pieces[idx].task
	}
	rcs, sts := b.statuses(ids)
	still := b.live[:0]
	for k, idx := range b.live {
		pc := &b.pieces[idx]
		switch {
		case rcs[k] != 0:
			// The engine cannot say what became of the task; it may still
			// read the staging, which therefore stays held.
			b.fail(pc.item, fmt.Errorf("task %d: %w", pc.task, statusCall("getTransferStatus", int(rcs[k]))))
			pc.lost = true
			progressed = true
		case taskDone(int(sts[k])):
			pc.state = int(sts[k])
			b.release(idx)
			progressed = true
			if pc.state != taskCompleted {
				b.w.failedTasks.Add(1)
				b.w.markStale(b.p.Segment)
				b.fail(pc.item, fmt.Errorf("%w: task %d (bytes [%d,%d) of the item) ended %s",
					transport.ErrConnLost, pc.task, pc.off, pc.off+pc.n, taskStateName(pc.state)))
			}
		default:
			still = append(still, idx)
		}
	}
	b.live = still
	return progressed
}

// finish settles every item and frees the batch id, or, when tasks never
// finished, gives the batch and their staging up for lost: freeing either
// while the engine may still use them would be worse than the leak.
func (b *batch) finish() {
	for idx := b.next; idx < len(b.pieces); idx++ {
		cause := b.stop
		if cause == nil {
			cause = errors.New("the batch ended first")
		}
		b.fail(b.pieces[idx].item, fmt.Errorf("not sent: %w", cause))
	}
	lost := len(b.live)
	for _, idx := range b.live {
		pc := b.pieces[idx]
		b.fail(pc.item, fmt.Errorf("%w: task %d still %s after draining for %s; its batch and staging are kept",
			transport.ErrConnLost, pc.task, taskStateName(pc.state), b.w.t.cfg.DrainTimeout))
	}
	for _, pc := range b.pieces {
		if pc.lost {
			lost++
		}
	}
	for i, it := range b.items {
		if b.errs[i] == nil {
			b.w.bytes.Add(it.Len())
			if it.Dev != nil {
				b.w.devBytes.Add(it.Len())
			}
		}
	}
	if lost > 0 {
		// Their staging stays held and the batch id stays allocated.
		b.w.leaked.Add(1)
		b.w.log.Error("mooncake batch abandoned with tasks in an unknown state", "segment", b.p.Segment, "tasks", lost)
		return
	}
	rc := b.eng.lib.freeBatch(b.eng.h, b.id)
	for tries := 0; rc == codeBusy && tries < 1000; tries++ {
		// Every task reported a final state, so the engine is only
		// catching up with its own bookkeeping.
		time.Sleep(pollMax)
		rc = b.eng.lib.freeBatch(b.eng.h, b.id)
	}
	if err := statusCall("freeBatchID", rc); err != nil {
		b.w.leaked.Add(1)
		b.w.log.Error("mooncake batch not freed", "segment", b.p.Segment, "cause", err)
	}
}
