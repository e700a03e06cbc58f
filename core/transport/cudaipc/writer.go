package cudaipc

import (
	"context"
	"fmt"
	"log/slog"
	"maps"
	"net"
	"slices"
	"sync"
	"time"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/transport/internal/serve"
)

// writer is the producer side. Safe for concurrent use: writes to one
// shard copy at the same time (each its own batch, its own event), and
// only replacing or closing a shard's mapping waits for them.
type writer struct {
	cfg Config
	log *slog.Logger

	mu     sync.Mutex // guards closed and dests
	closed bool
	dests  map[string]*dest // by host:port
	wg     sync.WaitGroup   // watchers
}

// dest is one shard socket as a writer knows it.
type dest struct {
	hostPort string
	attachMu sync.Mutex   // one hello at a time
	mu       sync.RWMutex // copies hold it read-locked; replacing cur holds it locked
	cur      *attachment  // the incarnation mapped now; nil when none
}

// attachment is one incarnation of a shard: its hello, the connection
// whose end says it is gone, and its slab mapped in each device's context.
type attachment struct {
	hello hello
	conn  net.Conn

	mapMu sync.Mutex
	maps  map[int]gpu.Mapping // by device ordinal

	once sync.Once
}

func (t *Transport) newWriter() *writer {
	return &writer{cfg: t.cfg, log: t.cfg.Logger.With("transport", Name), dests: map[string]*dest{}}
}

func (w *writer) dest(hostPort string) (*dest, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, transport.ErrClosed
	}
	d := w.dests[hostPort]
	if d == nil {
		d = &dest{hostPort: hostPort}
		w.dests[hostPort] = d
	}
	return d, nil
}

func (w *writer) isClosed() bool {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.closed
}

// Write copies every item into the region its grant names, through the
// writer's mapping of the shard's slab, and returns once the copies have
// completed. No exchange with the shard happens per batch: the grant
// already says where the bytes go, and the producer's complete, sent only
// after Write returned, tells the shard they are there. Each item is
// refused, with nothing copied, unless it lies inside the region its grant
// reserved and that region inside the slab this incarnation exported.
func (w *writer) Write(ctx context.Context, addr string, items []transport.WriteItem) (errs []error) {
	errs = make([]error, len(items))
	fail := func(i int, cause error) {
		it := items[i]
		errs[i] = transport.ItemErr(Name, addr, it.Res, it.Off, it.Off+it.Len(), cause)
	}
	failAll := func(cause error) []error {
		for i := range items {
			if errs[i] == nil {
				fail(i, cause)
			}
		}
		return errs
	}
	if len(items) == 0 {
		return errs
	}
	p, err := parseAddr(addr)
	if err != nil {
		return failAll(err)
	}
	d, err := w.dest(p.hostPort)
	if err != nil {
		return failAll(err)
	}
	defer func() {
		if r := recover(); r != nil {
			serve.LogPanic(w.log, r, "cudaipc: panic in write", "dest", addr)
			errs = failAll(fmt.Errorf("%w: panic: %v", transport.ErrConnLost, r))
		}
	}()
	a, err := w.attach(ctx, d, p.nonce)
	if err != nil {
		return failAll(err)
	}
	defer d.mu.RUnlock()

	// Place every item, then copy them grouped by the device whose
	// context runs the copy: one batch, one event per device.
	byDev := map[int][]int{}
	dsts := make([]uint64, len(items))
	for i, it := range items {
		off, err := place(a.hello, it)
		if err != nil {
			fail(i, err)
			continue
		}
		dsts[i] = off
		ord := w.cfg.HostOrdinal
		if it.Dev != nil {
			ord = it.Dev.Ordinal
		}
		byDev[ord] = append(byDev[ord], i)
	}
	for ord, idx := range byDev {
		if err := ctx.Err(); err != nil {
			for _, i := range idx {
				fail(i, fmt.Errorf("not copied: %w", err))
			}
			continue
		}
		m, dev, err := w.mapping(a, d.hostPort, ord)
		if err != nil {
			for _, i := range idx {
				fail(i, err)
			}
			continue
		}
		base := m.Addr() + uintptr(a.hello.Export.Offset)
		var ops []gpu.DeviceCopy
		var opItems []int
		for _, i := range idx {
			it := items[i]
			dst := base + uintptr(dsts[i])
			if it.Dev == nil {
				if err := dev.CopyFromHost(dst, it.Src); err != nil {
					fail(i, err)
				}
				continue
			}
			ops = append(ops, gpu.DeviceCopy{Dst: dst, Src: it.Dev.Addr, N: it.Dev.Len, After: it.Dev.Ready})
			opItems = append(opItems, i)
		}
		if err := copyTimed(dev, ops); err != nil {
			for _, i := range opItems {
				fail(i, err)
			}
		}
	}
	return errs
}

// copyTimed runs one batch of device copies and observes its phases.
func copyTimed(dev gpu.Device, ops []gpu.DeviceCopy) error {
	if len(ops) == 0 {
		return nil
	}
	tc, ok := dev.(gpu.TimedCopier)
	if !ok {
		return dev.CopyDevice(ops)
	}
	tm, err := tc.CopyDeviceTimed(ops)
	if err != nil {
		return err
	}
	metrics.Phase(metrics.PhaseCopyQueue, tm.Queue)
	if tm.GPU > 0 {
		metrics.Phase(metrics.PhaseCopy, tm.GPU)
		metrics.Phase(metrics.PhaseEventWait, max(0, tm.Wait-tm.GPU))
	}
	return nil
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
func (w *writer) attach(ctx context.Context, d *dest, nonce [nonceLen]byte) (*attachment, error) {
	for tries := 0; ; tries++ {
		d.mu.RLock()
		if a := d.cur; a != nil && a.hello.Nonce == nonce {
			return a, nil
		}
		d.mu.RUnlock()
		if tries > 0 {
			return nil, fmt.Errorf("%w: the shard at %s went while this write began", transport.ErrUnreachable, d.hostPort)
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
	h, conn, err := w.greet(ctx, d.hostPort, nonce)
	if err != nil {
		return err
	}
	a := &attachment{hello: h, conn: conn, maps: map[int]gpu.Mapping{}}
	d.mu.Lock()
	if w.isClosed() {
		d.mu.Unlock()
		w.release(d.hostPort, a)
		return transport.ErrClosed
	}
	old := d.cur
	d.cur = a
	w.wg.Add(1)
	d.mu.Unlock()
	if old != nil {
		// No copy uses old any more: they hold d.mu read-locked, and the
		// lock above waited for them.
		w.log.Info("cudaipc: the shard restarted; its new slab replaces the old mapping", "dest", d.hostPort)
		w.release(d.hostPort, old)
	}
	go w.watch(d, a)
	return nil
}

// greet dials the shard and exchanges the hello, bounded by ctx and the
// dial timeout.
func (w *writer) greet(ctx context.Context, hostPort string, nonce [nonceLen]byte) (hello, net.Conn, error) {
	dialer := net.Dialer{Timeout: w.cfg.DialTimeout}
	c, err := dialer.DialContext(ctx, "tcp", hostPort)
	if err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return hello{}, nil, fmt.Errorf("dial: %w", ctxErr)
		}
		return hello{}, nil, fmt.Errorf("%w: %w", transport.ErrUnreachable, err)
	}
	deadline := time.Now().Add(w.cfg.DialTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	_ = c.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	h, err := func() (hello, error) {
		if _, err := c.Write(appendHello(nil, nonce)); err != nil {
			return hello{}, err
		}
		rep, err := readHelloReply(c)
		switch {
		case err != nil:
			return hello{}, err
		case rep.status == statusBadNonce:
			return hello{}, fmt.Errorf("the shard at %s does not know this address (it restarted since the grant): %s", hostPort, rep.msg)
		case rep.status != statusOK:
			return hello{}, fmt.Errorf("the shard at %s refused the hello (status %d): %s", hostPort, rep.status, rep.msg)
		case rep.hello.Nonce != nonce || rep.hello.Size == 0 || rep.hello.Base == 0 || rep.hello.Base+rep.hello.Size < rep.hello.Base:
			return hello{}, fmt.Errorf("%w: the shard at %s answered with another nonce or an empty slab", errBadMessage, hostPort)
		}
		return rep.hello, nil
	}()
	if err != nil {
		_ = c.Close()
		if ctxErr := ctx.Err(); ctxErr != nil {
			return hello{}, nil, fmt.Errorf("hello: %w", ctxErr)
		}
		return hello{}, nil, fmt.Errorf("%w: hello: %w", transport.ErrUnreachable, err)
	}
	_ = c.SetDeadline(time.Time{})
	return h, c, nil
}

// watch closes a's mappings once its connection ends: the shard closed or
// died, and a mapping would keep its memory alive.
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
		w.log.Info("cudaipc: the shard is gone; its slab is unmapped", "dest", d.hostPort)
	}
	w.release(d.hostPort, a)
}

// mapping opens a's slab in the context of device ord, once.
func (w *writer) mapping(a *attachment, hostPort string, ord int) (gpu.Mapping, gpu.Device, error) {
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
		return nil, nil, fmt.Errorf("%w: the slab of %s (its cuda:%d) does not open on %s: %w", transport.ErrUnsupported, hostPort, a.hello.Ordinal, dev.Name(), err)
	}
	w.log.Info("cudaipc: opened a shard's slab", "dest", hostPort, "slab_bytes", a.hello.Size, "on", dev.Name())
	a.maps[ord] = m
	return m, dev, nil
}

// release closes a's connection and mappings, once. The caller has made
// sure that no copy uses a.
func (w *writer) release(hostPort string, a *attachment) {
	a.once.Do(func() {
		_ = a.conn.Close()
		a.mapMu.Lock()
		defer a.mapMu.Unlock()
		for ord, m := range a.maps {
			if err := m.Close(); err != nil {
				w.log.Warn("cudaipc: closing a mapping failed", "dest", hostPort, "on", gpu.Name(ord), "cause", err)
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
			w.release(d.hostPort, a)
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
