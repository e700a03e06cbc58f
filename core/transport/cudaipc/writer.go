package cudaipc

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"net"
	"slices"
	"sync"
	"syscall"
	"time"

	"go.uber.org/atomic"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/serve"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/unixfd"
)

// WriterStats counts what a writer did since it was made.
type WriterStats struct {
	// InBand and ByMessage count attachments (shard incarnations
	// greeted): those whose items complete through ready words, and those
	// that fell back to a complete message (no region offered, or the
	// device cannot store words from a stream).
	InBand, ByMessage uint64
	// Announced counts items announced; HostWords the ready words the
	// writer stored from the host after the copy's event, because the
	// device of the item could not store them itself; LostSlots the slots
	// left unused after a failed write, whose word may still come.
	Announced, HostWords, LostSlots uint64
	// Regions counts the ready-word regions mapped now.
	Regions uint64
}

// writer is the producer side. Safe for concurrent use: writes to one
// shard copy at the same time (each its own batch, its own event), and
// only replacing or closing a shard's mapping waits for them.
type writer struct {
	cfg  Config
	log  *slog.Logger
	warn serve.WarnOnce

	mu     sync.Mutex // guards closed and dests
	closed bool
	dests  map[string]*dest // by socket name
	wg     sync.WaitGroup   // watchers

	inBand, byMessage, announced, hostWords, lostSlots, regions atomic.Uint64
}

// dest is one shard socket as a writer knows it.
type dest struct {
	socket   string
	attachMu sync.Mutex   // one hello at a time
	mu       sync.RWMutex // copies hold it read-locked; replacing cur holds it locked
	cur      *attachment  // the incarnation mapped now; nil when none
}

// attachment is one incarnation of a shard: its hello, the connection
// whose end says it is gone and that carries the announcements, its slab
// mapped in each device's context, and the ready-word region it gave.
type attachment struct {
	hello  hello
	conn   *net.UnixConn
	words  words // nil mem: the shard offered none
	inBand bool  // items complete through ready words (decided at the hello)

	mapMu sync.Mutex
	maps  map[int]gpu.Mapping          // by device ordinal
	regs  map[int]gpu.HostRegistration // the region registered, by device ordinal
	noReg map[int]error                // devices whose registration failed

	// sendMu orders announcements: slots and sequences are taken and sent
	// under it, so that sequences reach the shard increasing.
	sendMu  sync.Mutex
	seq     uint32
	cursor  uint32
	pending [wordSlots]bool // a write of ours may still store into it
	lost    [wordSlots]bool // its write failed: the shard may watch it still

	once sync.Once
}

func (t *Transport) newWriter() *writer {
	return &writer{cfg: t.cfg, log: t.cfg.Logger.With("transport", Name), dests: map[string]*dest{}}
}

// Stats returns a snapshot of the writer's counters.
func (w *writer) Stats() WriterStats {
	return WriterStats{InBand: w.inBand.Load(), ByMessage: w.byMessage.Load(), Announced: w.announced.Load(),
		HostWords: w.hostWords.Load(), LostSlots: w.lostSlots.Load(), Regions: w.regions.Load()}
}

func (w *writer) dest(socket string) (*dest, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, transport.ErrClosed
	}
	d := w.dests[socket]
	if d == nil {
		d = &dest{socket: socket}
		w.dests[socket] = d
	}
	return d, nil
}

func (w *writer) isClosed() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.closed
}

// InBand implements transport.InBandWriter: true when the incarnation
// that addr names gave this writer a ready-word region and the device
// that copies host sources can store words into it. It greets the shard
// first when the writer has not yet (the write that follows would).
func (w *writer) InBand(addr string) bool {
	p, err := parseAddr(addr)
	if err != nil {
		return false
	}
	d, err := w.dest(p.socket)
	if err != nil {
		return false
	}
	ctx, cancel := context.WithTimeout(context.Background(), w.cfg.DialTimeout)
	defer cancel()
	a, err := w.attach(ctx, d, p.nonce, true)
	if err != nil {
		return false
	}
	defer d.mu.RUnlock()
	return a.inBand
}

// Write copies every item into the region its grant names, through the
// writer's mapping of the shard's slab, and returns once the copies have
// completed. Items that ask to complete in-band (WriteItem.Complete, on
// an attachment InBand said yes to) are first announced to the shard in
// one message, then their copies are queued with a ready word each after
// them; the shard completes each when its word appears. Each item is
// refused, with nothing copied, unless it lies inside the region its
// grant reserved and that region inside the slab this incarnation
// exported.
func (w *writer) Write(ctx context.Context, addr string, items []transport.WriteItem) []error {
	finish, _ := w.start(ctx, addr, items, true)
	return finish()
}

// CanStart implements transport.Starter: the incarnation that addr names
// is greeted (its attachment is current), so Start need not wait.
func (w *writer) CanStart(addr string) bool {
	p, err := parseAddr(addr)
	if err != nil {
		return false
	}
	w.mu.Lock()
	d := w.dests[p.socket]
	w.mu.Unlock()
	if d == nil {
		return false
	}
	d.mu.RLock()
	defer d.mu.RUnlock()
	return d.cur != nil && d.cur.hello.Nonce == p.nonce
}

// Start implements transport.Starter: Write's work up to the copies
// queued on the GPU (announcement, placement, copies and words queued),
// on the caller's thread, and finish for the rest (the wait for the
// copies' event, then the slots settled). ok is false, with nothing
// done, when the shard that addr names is not greeted yet: greeting it
// waits for the shard, which Write does.
func (w *writer) Start(ctx context.Context, addr string, items []transport.WriteItem) (finish func() []error, ok bool) {
	return w.start(ctx, addr, items, false)
}

// start is Write up to its wait; greet says whether it may greet the
// shard first. d.mu stays read-locked from the attachment until finish
// returns, so that the mapping under the copies stays.
func (w *writer) start(ctx context.Context, addr string, items []transport.WriteItem, greet bool) (finish func() []error, ok bool) {
	errs := make([]error, len(items))
	fail := func(i int, cause error) {
		it := items[i]
		errs[i] = transport.ItemErr(Name, addr, it.Res, it.Off, it.Off+it.Len(), cause)
	}
	failAll := func(cause error) {
		for i := range items {
			if errs[i] == nil {
				fail(i, cause)
			}
		}
	}
	done := func() []error { return errs }
	if len(items) == 0 {
		return done, true
	}
	p, err := parseAddr(addr)
	if err != nil {
		failAll(err)
		return done, true
	}
	d, err := w.dest(p.socket)
	if err != nil {
		failAll(err)
		return done, true
	}
	locked := false
	defer func() {
		if r := recover(); r != nil {
			serve.LogPanic(w.log, r, "cudaipc: panic in write", "dest", addr)
			if locked {
				d.mu.RUnlock()
			}
			failAll(fmt.Errorf("%w: panic: %v", transport.ErrConnLost, r))
			finish, ok = done, true
		}
	}()
	a, err := w.attach(ctx, d, p.nonce, greet)
	if errors.Is(err, errNotGreeted) {
		return nil, false
	}
	if err != nil {
		failAll(err)
		return done, true
	}
	locked = true

	// Place every item, then copy them grouped by the device whose
	// context runs the copy: one batch, one event per device.
	byDev := map[int][]int{}
	dsts := make([]uint64, len(items))
	var inBand []int
	for i, it := range items {
		off, err := place(a.hello, it)
		if err == nil && it.Complete && !a.inBand {
			err = errNotInBand
		}
		if err != nil {
			fail(i, err)
			continue
		}
		dsts[i] = off
		if it.Complete {
			inBand = append(inBand, i)
		}
	}
	bound := w.cfg.DialTimeout
	if !greet {
		// Start runs on the caller's thread (the encoder's, in a
		// hand-over): a shard whose socket is full does not hold it for
		// the dial timeout.
		bound = min(bound, startAnnounceBound)
	}
	slots := w.announce(ctx, a, items, inBand, bound, fail)
	for i, it := range items {
		if errs[i] != nil {
			continue
		}
		ord := w.cfg.HostOrdinal
		if it.Dev != nil {
			ord = it.Dev.Ordinal
		}
		byDev[ord] = append(byDev[ord], i)
	}
	var waits []func()
	for ord, idx := range byDev {
		if err := ctx.Err(); err != nil {
			for _, i := range idx {
				fail(i, fmt.Errorf("not copied: %w", err))
			}
			continue
		}
		m, dev, err := w.mapping(a, d.socket, ord)
		if err != nil {
			for _, i := range idx {
				fail(i, err)
			}
			continue
		}
		if wait := w.copyGroup(a, dev, m.Addr()+uintptr(a.hello.Export.Offset), items, idx, dsts, slots, fail); wait != nil {
			waits = append(waits, wait)
		}
	}
	locked = false
	return func() (out []error) {
		defer d.mu.RUnlock()
		defer func() {
			if r := recover(); r != nil {
				serve.LogPanic(w.log, r, "cudaipc: panic waiting for a write", "dest", addr)
				failAll(fmt.Errorf("%w: panic: %v", transport.ErrConnLost, r))
				out = errs
			}
		}()
		for _, wait := range waits {
			wait()
		}
		w.settle(a, slots, errs)
		return errs
	}, true
}

// startAnnounceBound bounds Start's announcement write: an announcement
// is ~40 bytes an item, so a socket that takes none of it for this long
// belongs to a shard that stopped reading thousands of items ago.
const startAnnounceBound = 20 * time.Millisecond

// errNotGreeted: Start found the shard not greeted (Write greets it).
var errNotGreeted = errors.New("cudaipc: the shard is not greeted yet")

var errNotInBand = fmt.Errorf("%w: asked to complete in-band on a shard attachment that completes by message", transport.ErrRefusedByWriter)

// slot is where an announced item's word goes, and its value.
type slot struct {
	on    bool
	index uint32
	value uint64
}

// announce takes a slot for each in-band item and sends their
// announcement, one message, before any of their copies is queued, so
// that the shard's wake overlaps the copy. An item that gets no slot, or
// whose announcement cannot be sent, fails.
func (w *writer) announce(ctx context.Context, a *attachment, items []transport.WriteItem, idx []int, bound time.Duration, fail func(int, error)) []slot {
	slots := make([]slot, len(items))
	if len(idx) == 0 {
		return slots
	}
	a.sendMu.Lock()
	defer a.sendMu.Unlock()
	var msg []announcement
	var sent []int
	for _, i := range idx {
		s, ok := a.takeSlotLocked()
		if !ok {
			fail(i, fmt.Errorf("%w: no free ready-word slot (%d slots, sequence %d)", transport.ErrRefusedByWriter, wordSlots, a.seq))
			if a.seq == maxSequence {
				// Sequences are spent: ending the connection makes the
				// next write greet the shard again for a fresh region
				// (once in 2^32 items; items still in flight then fail
				// by their deadline, retryably).
				_ = a.conn.CloseRead()
			}
			continue
		}
		slots[i] = s
		sent = append(sent, i)
		msg = append(msg, announcement{Res: uint64(items[i].Res), Token: items[i].Token, Slot: s.index, Value: s.value})
	}
	if len(msg) == 0 {
		return slots
	}
	// A shard that stops reading must not hold this write, and every later
	// one to it, for ever: the write's deadline, or bound (the dial
	// timeout; less in Start) where that is later, bounds it.
	deadline := time.Now().Add(bound)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	_ = a.conn.SetWriteDeadline(deadline)
	_, err := a.conn.Write(appendAnnounce(nil, msg))
	_ = a.conn.SetWriteDeadline(time.Time{})
	if err != nil {
		// A write cut mid-message leaves the stream unparseable: ending
		// the connection makes the next write greet the shard again.
		_ = a.conn.CloseRead()
		for _, i := range sent {
			a.pending[slots[i].index] = false
			a.lost[slots[i].index] = true
			slots[i].on = false
			fail(i, fmt.Errorf("%w: announcing the items' ready words: %w", transport.ErrConnLost, err))
		}
		w.lostSlots.Add(uint64(len(sent)))
		return slots
	}
	w.announced.Add(uint64(len(msg)))
	return slots
}

// takeSlotLocked takes the next slot that is free on both sides: no write
// of ours pending on it, none failed there, and 0 in it (the shard took
// its last value). The caller holds a.sendMu.
func (a *attachment) takeSlotLocked() (slot, bool) {
	if a.seq == maxSequence {
		return slot{}, false
	}
	for range wordSlots {
		i := a.cursor
		a.cursor = (a.cursor + 1) % wordSlots
		if a.pending[i] || a.lost[i] || a.words.load(i) != 0 {
			continue
		}
		a.pending[i] = true
		a.seq++
		return slot{on: true, index: i, value: word(a.hello.Generation, a.seq)}, true
	}
	return slot{}, false
}

// settle frees the slots of the items that landed (their word is stored;
// the shard zeroes it when it takes it) and keeps those of failed items
// out of use, since their word may still be stored and the shard may
// still watch them.
func (w *writer) settle(a *attachment, slots []slot, errs []error) {
	a.sendMu.Lock()
	defer a.sendMu.Unlock()
	for i, s := range slots {
		if !s.on {
			continue
		}
		a.pending[s.index] = false
		if errs[i] != nil {
			a.lost[s.index] = true
			w.lostSlots.Add(1)
		}
	}
}

// copyGroup copies the items idx of one device. Device sources go in one
// batch whose ready words the device stores after the copies; where it
// cannot, and for host sources, the writer stores each word itself once
// the copy's completion was seen, which keeps the word's promise. On a
// device that queues (gpu.ValueWriter) it returns once the batch is
// queued, with the wait for it (nil when nothing waits).
func (w *writer) copyGroup(a *attachment, dev gpu.Device, base uintptr, items []transport.WriteItem, idx []int, dsts []uint64, slots []slot, fail func(int, error)) (wait func()) {
	var ops []gpu.DeviceCopy
	var opItems []int
	for _, i := range idx {
		it := items[i]
		dst := base + uintptr(dsts[i])
		if it.Dev == nil {
			if err := dev.CopyFromHost(dst, it.Src); err != nil {
				fail(i, err)
				continue
			}
			w.storeWord(a, slots[i])
			continue
		}
		ops = append(ops, gpu.DeviceCopy{Dst: dst, Src: it.Dev.Addr, N: it.Dev.Len, After: it.Dev.Ready})
		opItems = append(opItems, i)
	}
	if len(ops) == 0 {
		return nil
	}
	failOps := func(err error) {
		for _, i := range opItems {
			fail(i, err)
		}
	}
	hostWords := func() {
		for _, i := range opItems {
			w.storeWord(a, slots[i])
		}
	}
	vw, ok := dev.(gpu.ValueWriter)
	if !ok {
		if err := copyTimed(dev, ops); err != nil {
			failOps(err)
			return nil
		}
		hostWords()
		return nil
	}
	var then []gpu.ValueWrite
	reg := w.registration(a, dev)
	if reg != nil {
		for _, i := range opItems {
			if s := slots[i]; s.on {
				then = append(then, gpu.ValueWrite{Addr: reg.DevAddr() + uintptr(s.index)*wordSize, Value: s.value})
			}
		}
	}
	pend, err := vw.QueueCopyThen(ops, then)
	if err != nil {
		failOps(err)
		return nil
	}
	return func() {
		tm, err := pend.Wait()
		if err != nil {
			failOps(err)
			return
		}
		observeCopy(tm)
		if reg == nil {
			hostWords()
		}
	}
}

// storeWord stores an item's ready word from the host, after its copy
// completed: for host sources, and for a device that cannot store words.
func (w *writer) storeWord(a *attachment, s slot) {
	if !s.on {
		return
	}
	a.words.store(s.index, s.value)
	w.hostWords.Add(1)
}

// registration is a's region registered with dev, registering it once;
// nil when dev cannot store words (logged once, counted).
func (w *writer) registration(a *attachment, dev gpu.Device) gpu.HostRegistration {
	if a.words.mem == nil {
		return nil
	}
	ord := dev.Ordinal()
	a.mapMu.Lock()
	defer a.mapMu.Unlock()
	if r := a.regs[ord]; r != nil {
		return r
	}
	if a.noReg[ord] != nil {
		return nil
	}
	vw, ok := dev.(gpu.ValueWriter)
	var err error = fmt.Errorf("%s cannot store words from a stream", dev.Name())
	var r gpu.HostRegistration
	if ok {
		r, err = vw.RegisterHost(a.words.mem)
		if err == nil {
			if err = probe(vw, r, a.words, a.hello.Generation); err != nil {
				_ = r.Close()
			}
		}
	}
	if err != nil {
		a.noReg[ord] = err
		metrics.Fallback(Name, "no_device_words")
		w.warn.Log(w.log, "no_ready_words", "cudaipc: the device cannot store ready words; the writer stores them after each copy's event", "on", dev.Name(), "cause", err)
		return nil
	}
	a.regs[ord] = r
	return r
}

// probe has the device store one word into probeSlot through r and reads
// it back once the stream passed it: a driver that takes the calls but
// whose stores do not reach the region would otherwise leave every item
// waiting for its word until the shard gives up on the write. The slot is
// zero again afterwards.
func probe(vw gpu.ValueWriter, r gpu.HostRegistration, ws words, gen uint32) error {
	want := word(gen, 0) // sequence 0 is never announced
	_, err := gpu.CopyThen(vw, nil, []gpu.ValueWrite{{Addr: r.DevAddr() + probeSlot*wordSize, Value: want}})
	got := ws.load(probeSlot)
	ws.store(probeSlot, 0)
	switch {
	case err != nil:
		return fmt.Errorf("storing a probe word: %w", err)
	case got != want:
		return fmt.Errorf("a probe word stored from the stream did not reach the region (read %#x, want %#x)", got, want)
	}
	return nil
}

// copyTimed runs one batch of device copies on a device that cannot queue
// words (no gpu.ValueWriter), and observes its phases.
func copyTimed(dev gpu.Device, ops []gpu.DeviceCopy) error {
	tc, ok := dev.(gpu.TimedCopier)
	if !ok {
		return dev.CopyDevice(ops)
	}
	tm, err := tc.CopyDeviceTimed(ops)
	if err != nil {
		return err
	}
	observeCopy(tm)
	return nil
}

// observeCopy records a batch's phases: its queueing, its time on the
// GPU and the host's wait beyond that.
func observeCopy(tm gpu.CopyTiming) {
	metrics.Phase(metrics.PhaseCopyQueue, tm.Queue)
	metrics.Phase(metrics.PhaseCopyQueueWaits, tm.QueueWaits)
	metrics.Phase(metrics.PhaseCopyQueueCopies, tm.QueueCopies)
	if tm.GPU > 0 {
		metrics.Phase(metrics.PhaseCopy, tm.GPU)
		metrics.Phase(metrics.PhaseEventWait, max(0, tm.Wait-tm.GPU))
	}
}

// place is where item it lands, as an offset into the slab, after every
// bounds check: inside the region its grant reserved ([Addr, Addr+Size)),
// and that region inside the slab that h describes.
func place(h hello, it transport.WriteItem) (uint64, error) {
	if it.Addr == 0 {
		return 0, errNoAddr
	}
	return transport.PlaceInSlab(it, h.Base, h.Size, "shard")
}

var errNoAddr = fmt.Errorf("%w: the grant carries no slab address (is the shard's cuda_ipc plane of this version?)", transport.ErrRefusedByWriter)

// attach returns the attachment for nonce with d.mu read-locked, greeting
// the shard first when the writer has none for that incarnation.
func (w *writer) attach(ctx context.Context, d *dest, nonce [nonceLen]byte, greet bool) (*attachment, error) {
	for tries := 0; ; tries++ {
		d.mu.RLock()
		if a := d.cur; a != nil && a.hello.Nonce == nonce {
			return a, nil
		}
		d.mu.RUnlock()
		if !greet {
			return nil, errNotGreeted
		}
		if tries > 0 {
			return nil, fmt.Errorf("%w: the shard at @%s went while this write began", transport.ErrUnreachable, d.socket)
		}
		if err := w.connect(ctx, d, nonce); err != nil {
			return nil, err
		}
	}
}

// connect greets the incarnation of the shard that nonce names and makes
// it d's current one, closing the one before (the shard restarted).
func (w *writer) connect(ctx context.Context, d *dest, nonce [nonceLen]byte) error {
	d.attachMu.Lock()
	defer d.attachMu.Unlock()
	d.mu.RLock()
	done := d.cur != nil && d.cur.hello.Nonce == nonce
	d.mu.RUnlock()
	if done {
		return nil // another write greeted it meanwhile
	}
	h, conn, fd, err := w.greet(ctx, d.socket, nonce)
	if err != nil {
		return err
	}
	a := &attachment{hello: h, conn: conn, maps: map[int]gpu.Mapping{}, regs: map[int]gpu.HostRegistration{}, noReg: map[int]error{}}
	a.lost[probeSlot] = true // registration's probe word goes there, never an item's
	w.decideInBand(a, d.socket, fd)
	d.mu.Lock()
	if w.isClosed() {
		d.mu.Unlock()
		w.release(d.socket, a)
		return transport.ErrClosed
	}
	old := d.cur
	d.cur = a
	w.wg.Add(1)
	d.mu.Unlock()
	if old != nil {
		// No copy uses old any more: they hold d.mu read-locked, and the
		// lock above waited for them.
		w.log.Info("cudaipc: the shard restarted; its new slab replaces the old mapping", "dest", "@"+d.socket)
		w.release(d.socket, old)
	}
	go w.watch(d, a)
	return nil
}

// decideInBand maps the ready-word region the hello brought (fd, or -1)
// and decides whether a's items complete through it: only when the
// region maps and the device that copies host sources can store words
// into it. Otherwise they complete by message, logged once and counted.
func (w *writer) decideInBand(a *attachment, socket string, fd int) {
	why := "the shard offers no ready-word region (its sink cannot complete in-band)"
	if fd >= 0 {
		ws, err := mapWords(fd)
		syscall.Close(fd) // the mapping outlives the descriptor
		if err != nil {
			why = "its ready-word region does not map: " + err.Error()
		} else {
			a.words = ws
			w.regions.Add(1)
			why = ""
			if dev, err := w.cfg.Devices.Device(w.cfg.HostOrdinal); err != nil {
				why = "no device to store ready words: " + err.Error()
			} else if w.registration(a, dev) == nil {
				why = fmt.Sprintf("%s cannot store ready words: %v", dev.Name(), a.noReg[dev.Ordinal()])
			}
		}
	}
	if a.inBand = why == ""; a.inBand {
		w.inBand.Add(1)
		return
	}
	w.byMessage.Add(1)
	metrics.Fallback(Name, "complete_by_message")
	w.warn.Log(w.log, "by_message", "cudaipc: items to this shard complete by message, not through ready words", "dest", "@"+socket, "why", why)
}

// greet dials the shard's socket and exchanges the hello, bounded by ctx
// and the dial timeout. fd is the ready-word region's memfd, -1 when the
// shard offered none.
func (w *writer) greet(ctx context.Context, socket string, nonce [nonceLen]byte) (hello, *net.UnixConn, int, error) {
	dialer := net.Dialer{Timeout: w.cfg.DialTimeout}
	c0, err := dialer.DialContext(ctx, "unix", "@"+socket)
	if err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return hello{}, nil, -1, fmt.Errorf("dial: %w", ctxErr)
		}
		return hello{}, nil, -1, fmt.Errorf("%w: %w", transport.ErrUnreachable, err)
	}
	c := c0.(*net.UnixConn)
	if err := unixfd.SameUser(c); err != nil {
		_ = c.Close()
		return hello{}, nil, -1, fmt.Errorf("%w: the shard's socket @%s: %w", transport.ErrUnsupported, socket, err)
	}
	deadline := time.Now().Add(w.cfg.DialTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	_ = c.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	fd := -1
	h, err := func() (hello, error) {
		if _, err := c.Write(appendHello(nil, nonce)); err != nil {
			return hello{}, err
		}
		// The region's descriptor comes with the reply's first bytes.
		buf := make([]byte, headerLen+maxMsg+helloLen)
		oob := make([]byte, syscall.CmsgSpace(4))
		n, oobn, flags, _, err := c.ReadMsgUnix(buf, oob)
		var rightsErr error
		if oobn > 0 {
			fd, rightsErr = unixfd.TakeRights(oob[:oobn], flags)
		}
		if err != nil {
			return hello{}, err
		}
		if n == 0 {
			return hello{}, io.EOF
		}
		rep, err := readHelloReply(io.MultiReader(bytes.NewReader(buf[:n]), c))
		switch {
		case err != nil:
			return hello{}, err
		case rep.status == statusBadNonce:
			return hello{}, fmt.Errorf("the shard at @%s does not know this address (it restarted since the grant): %s", socket, rep.msg)
		case rep.status != statusOK:
			return hello{}, fmt.Errorf("the shard at @%s refused the hello (status %d): %s", socket, rep.status, rep.msg)
		case rep.hello.Nonce != nonce || rep.hello.Size == 0 || rep.hello.Base == 0 || rep.hello.Base+rep.hello.Size < rep.hello.Base:
			return hello{}, fmt.Errorf("%w: the shard at @%s answered with another nonce or an empty slab", errBadMessage, socket)
		case rightsErr != nil:
			return hello{}, fmt.Errorf("%w: the ready-word region: %w", errBadMessage, rightsErr)
		case (rep.hello.Slots != 0) != (fd >= 0):
			return hello{}, fmt.Errorf("%w: the hello names %d ready-word slots, and a descriptor came with it: %t", errBadMessage, rep.hello.Slots, fd >= 0)
		}
		return rep.hello, nil
	}()
	if err != nil {
		if fd >= 0 {
			syscall.Close(fd)
		}
		_ = c.Close()
		if ctxErr := ctx.Err(); ctxErr != nil {
			return hello{}, nil, -1, fmt.Errorf("hello: %w", ctxErr)
		}
		return hello{}, nil, -1, fmt.Errorf("%w: hello: %w", transport.ErrUnreachable, err)
	}
	_ = c.SetDeadline(time.Time{})
	return h, c, fd, nil
}

// watch releases a once its connection ends: the shard closed or died,
// and a mapping would keep its memory alive.
func (w *writer) watch(d *dest, a *attachment) {
	defer w.wg.Done()
	var b [1]byte
	_, _ = a.conn.Read(b[:])
	d.mu.Lock()
	gone := d.cur == a
	if gone {
		d.cur = nil
	}
	d.mu.Unlock()
	if gone {
		w.log.Info("cudaipc: the shard is gone (or its ready words are spent); its slab is unmapped", "dest", "@"+d.socket)
	}
	w.release(d.socket, a)
}

// mapping opens a's slab in the context of device ord, once.
func (w *writer) mapping(a *attachment, socket string, ord int) (gpu.Mapping, gpu.Device, error) {
	dev, err := w.cfg.Devices.Device(ord)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", transport.ErrUnsupported, err)
	}
	a.mapMu.Lock()
	defer a.mapMu.Unlock()
	if m := a.maps[ord]; m != nil {
		return m, dev, nil
	}
	m, err := dev.OpenIPC(a.hello.Export.Handle)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: the slab of @%s (its cuda:%d) does not open on %s: %w", transport.ErrUnsupported, socket, a.hello.Ordinal, dev.Name(), err)
	}
	w.log.Info("cudaipc: opened a shard's slab", "dest", "@"+socket, "slab_bytes", a.hello.Size, "on", dev.Name())
	a.maps[ord] = m
	return m, dev, nil
}

// release closes a's connection, registrations, region and mappings,
// once. The caller has made sure that no copy uses a.
func (w *writer) release(socket string, a *attachment) {
	a.once.Do(func() {
		_ = a.conn.Close()
		a.mapMu.Lock()
		defer a.mapMu.Unlock()
		for ord, r := range a.regs {
			if err := r.Close(); err != nil {
				w.log.Warn("cudaipc: unregistering a ready-word region failed", "dest", "@"+socket, "on", gpu.Name(ord), "cause", err)
			}
			delete(a.regs, ord)
		}
		if a.words.mem != nil {
			if err := a.words.unmap(); err != nil {
				w.log.Warn("cudaipc: unmapping a ready-word region failed", "dest", "@"+socket, "cause", err)
			}
			a.words = words{}
			w.regions.Sub(1)
		}
		for ord, m := range a.maps {
			if err := m.Close(); err != nil {
				w.log.Warn("cudaipc: closing a mapping failed", "dest", "@"+socket, "on", gpu.Name(ord), "cause", err)
			}
			delete(a.maps, ord)
		}
	})
}

// Close fails later writes, waits for the copies in flight, and closes
// every connection and mapping; idempotent.
func (w *writer) Close() error {
	dests, first := w.markClosed()
	if !first {
		return nil
	}
	for _, d := range dests {
		d.mu.Lock()
		a := d.cur
		d.cur = nil
		d.mu.Unlock()
		if a != nil {
			w.release(d.socket, a)
		}
	}
	w.wg.Wait()
	return nil
}

// markClosed fails later writes and returns the destinations to release;
// first is false when the writer was closed already.
func (w *writer) markClosed() (dests []*dest, first bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, false
	}
	w.closed = true
	return slices.Collect(maps.Values(w.dests)), true
}
