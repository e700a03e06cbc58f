package cudaipc

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"runtime/debug"
	"sync"
	"time"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/slab"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// Name is the transport's name in the shards' peers reply and in config.
const Name = "cuda_ipc"

// DefaultDialTimeout bounds one connection attempt when Config leaves it 0.
const DefaultDialTimeout = 5 * time.Second

// Config wires the transport. A consumer shard sets Slab and SlabDevice; a
// producer sets Devices.
type Config struct {
	Slab       slab.Memory
	SlabDevice gpu.Device
	// Devices opens the device a source lives on; the mapping of a shard's
	// slab is opened in that device's context.
	Devices gpu.Devices
	// HostOrdinal is the device whose context copies host sources (a
	// producer whose outputs are in host memory); 0 by default.
	HostOrdinal int
	DialTimeout time.Duration
	Logger      *slog.Logger
}

// Transport is the CUDA IPC data plane.
type Transport struct {
	cfg Config
}

var _ transport.Transport = (*Transport)(nil)

// New returns the transport; zero fields take defaults.
func New(cfg Config) *Transport {
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = DefaultDialTimeout
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	if cfg.Devices == nil {
		cfg.Devices = gpu.Unavailable{Err: errors.New("no GPU devices configured for cuda_ipc")}
	}
	return &Transport{cfg: cfg}
}

// Name implements transport.Transport.
func (t *Transport) Name() string { return Name }

// Listen exports the slab once and serves producers at addr (a loopback
// or host address; port 0 picks one). sink must be a RegionSink.
func (t *Transport) Listen(addr string, sink transport.Sink) (transport.Receiver, error) {
	if t.cfg.SlabDevice == nil {
		return nil, errors.New("cudaipc: listen needs a slab in GPU memory")
	}
	rs, ok := sink.(transport.RegionSink)
	if !ok {
		return nil, fmt.Errorf("cudaipc: listen %s: a %T cannot place frames in device memory (it is no RegionSink)", addr, sink)
	}
	return t.listen(addr, rs)
}

// NewWriter returns a writer with its own connections and mappings.
func (t *Transport) NewWriter() transport.Writer {
	return &writer{cfg: t.cfg, log: t.cfg.Logger.With("transport", Name), dests: map[string]*dest{}}
}

type writer struct {
	cfg    Config
	log    *slog.Logger
	mu     sync.Mutex
	closed bool
	dests  map[string]*dest
}

// dest is one shard as a writer knows it. sem admits one Write at a time:
// the connection carries one exchange at a time, and the producer sends
// one batch per shard at a time anyway.
type dest struct {
	addr  string
	sem   chan struct{}
	conn  net.Conn
	br    *bufio.Reader
	hello hello
	maps  map[int]gpu.Mapping // by device ordinal
	buf   []byte
}

func (w *writer) dest(addr string) (*dest, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.closed {
		return nil, transport.ErrClosed
	}
	d := w.dests[addr]
	if d == nil {
		d = &dest{addr: addr, sem: make(chan struct{}, 1), maps: map[int]gpu.Mapping{}}
		w.dests[addr] = d
	}
	return d, nil
}

// Write implements transport.Writer.
func (w *writer) Write(ctx context.Context, addr string, items []transport.WriteItem) (errs []error) {
	errs = make([]error, len(items))
	failAll := func(err error) []error {
		for i, it := range items {
			if errs[i] == nil {
				errs[i] = transport.ItemErr(Name, addr, it.Res, it.Off, it.Off+it.Len(), err)
			}
		}
		return errs
	}
	if len(items) == 0 {
		return errs
	}
	d, err := w.dest(addr)
	if err != nil {
		return failAll(err)
	}
	select {
	case d.sem <- struct{}{}:
	case <-ctx.Done():
		return failAll(ctx.Err())
	}
	defer func() { <-d.sem }()
	defer func() {
		if p := recover(); p != nil {
			w.log.Error("cudaipc: panic in write", "dest", addr, "panic", p, "stack", string(debug.Stack()))
			w.reset(d)
			errs = failAll(fmt.Errorf("%w: panic: %v", transport.ErrConnLost, p))
		}
	}()
	return w.write(ctx, d, items, errs, failAll)
}

func (w *writer) write(ctx context.Context, d *dest, items []transport.WriteItem, errs []error, failAll func(error) []error) []error {
	req := request{Op: opBegin, Begin: make([]frameReq, len(items))}
	for i, it := range items {
		req.Begin[i] = frameReq{Res: it.Res, Token: it.Token, Off: it.Off, N: it.Len()}
	}
	var rep reply
	for attempt := 0; ; attempt++ {
		fresh, err := w.connect(ctx, d)
		if err != nil {
			return failAll(err)
		}
		rep, err = w.exchange(ctx, d, req)
		if err == nil {
			break
		}
		w.reset(d)
		// An idle connection may have died with the shard (a restart): try
		// once on a new one. Nothing was admitted on the dead one.
		if fresh || attempt > 0 || ctx.Err() != nil {
			return failAll(err)
		}
	}
	if len(rep.Grants) != len(items) {
		w.reset(d)
		return failAll(fmt.Errorf("%w: %d grants for %d frames", errBadMessage, len(rep.Grants), len(items)))
	}

	// Copy every admitted item, grouped by the device whose context runs
	// the copy, then end every admitted frame with its outcome.
	type job struct {
		i   int
		dst uintptr
	}
	byDev := map[int][]job{}
	for i, g := range rep.Grants {
		if g.Status != transport.StatusOK {
			errs[i] = transport.ItemErr(Name, d.addr, items[i].Res, items[i].Off, items[i].Off+items[i].Len(),
				fmt.Errorf("%w (receiver: %q)", g.Status.Err(), g.Msg))
			continue
		}
		ord := w.cfg.HostOrdinal
		if items[i].Dev != nil {
			ord = items[i].Dev.Ordinal
		}
		byDev[ord] = append(byDev[ord], job{i: i})
	}
	for ord, jobs := range byDev {
		m, dev, err := w.mapping(d, ord)
		if err != nil {
			for _, j := range jobs {
				errs[j.i] = err
			}
			continue
		}
		base := m.Addr() + uintptr(d.hello.Export.Offset)
		var ops []gpu.DeviceCopy
		var opItems []int
		for _, j := range jobs {
			it, at := items[j.i], rep.Grants[j.i].At
			dst := base + uintptr(at)
			if it.Dev == nil {
				if err := dev.CopyFromHost(dst, it.Src); err != nil {
					errs[j.i] = err
				}
				continue
			}
			ops = append(ops, gpu.DeviceCopy{Dst: dst, Src: it.Dev.Addr, N: it.Dev.Len, After: it.Dev.Ready})
			opItems = append(opItems, j.i)
		}
		if err := dev.CopyDevice(ops); err != nil {
			for _, i := range opItems {
				errs[i] = err
			}
		}
	}
	end := request{Op: opEnd}
	for i, g := range rep.Grants {
		if g.Status == transport.StatusOK {
			end.End = append(end.End, endReq{Frame: g.Frame, OK: errs[i] == nil})
			if errs[i] != nil {
				errs[i] = transport.ItemErr(Name, d.addr, items[i].Res, items[i].Off, items[i].Off+items[i].Len(), errs[i])
			}
		}
	}
	if len(end.End) > 0 {
		if _, err := w.exchange(ctx, d, end); err != nil {
			// The shard ends the frames torn when the connection drops.
			w.reset(d)
			return failAll(err)
		}
	}
	return errs
}

// connect dials and greets the shard unless connected; fresh reports a new
// connection.
func (w *writer) connect(ctx context.Context, d *dest) (fresh bool, err error) {
	if d.conn != nil {
		return false, nil
	}
	dialer := net.Dialer{Timeout: w.cfg.DialTimeout}
	c, err := dialer.DialContext(ctx, "tcp", d.addr)
	if err != nil {
		if ctxErr := ctx.Err(); ctxErr != nil {
			return true, fmt.Errorf("dial: %w", ctxErr)
		}
		return true, fmt.Errorf("%w: %w", transport.ErrUnreachable, err)
	}
	w.mu.Lock()
	closed := w.closed
	if !closed {
		d.conn, d.br = c, bufio.NewReader(c)
	}
	w.mu.Unlock()
	if closed {
		_ = c.Close()
		return true, transport.ErrClosed
	}
	rep, err := w.exchange(ctx, d, request{Op: opHello})
	if err != nil {
		w.reset(d)
		return true, err
	}
	d.hello = rep.Hello
	return true, nil
}

// exchange sends one request and reads its reply, bounded by ctx.
func (w *writer) exchange(ctx context.Context, d *dest, req request) (reply, error) {
	deadline, _ := ctx.Deadline()
	if err := d.conn.SetDeadline(deadline); err != nil {
		return reply{}, fmt.Errorf("%w: %w", transport.ErrConnLost, err)
	}
	stop := context.AfterFunc(ctx, func() { _ = d.conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	d.buf = appendRequest(d.buf[:0], req)
	if _, err := d.conn.Write(d.buf); err != nil {
		return reply{}, w.lost(ctx, err)
	}
	rep, err := readReply(d.br)
	if err != nil {
		return reply{}, w.lost(ctx, err)
	}
	if rep.Op != req.Op {
		return reply{}, fmt.Errorf("%w: %s reply to a %s request", errBadMessage, rep.Op, req.Op)
	}
	if rep.Status != 0 {
		return reply{}, fmt.Errorf("%w: %s refused: %s", transport.ErrRejected, req.Op, rep.Msg)
	}
	return rep, nil
}

func (w *writer) lost(ctx context.Context, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil {
		return ctxErr
	}
	w.mu.Lock()
	closed := w.closed
	w.mu.Unlock()
	if closed {
		return transport.ErrClosed
	}
	return fmt.Errorf("%w: %w", transport.ErrConnLost, err)
}

// mapping opens the shard's slab in the context of device ord, once per
// connection.
func (w *writer) mapping(d *dest, ord int) (gpu.Mapping, gpu.Device, error) {
	dev, err := w.cfg.Devices.Device(ord)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: %w", transport.ErrUnsupported, err)
	}
	if m := d.maps[ord]; m != nil {
		return m, dev, nil
	}
	m, err := dev.OpenIPC(d.hello.Export.Handle)
	if err != nil {
		return nil, nil, fmt.Errorf("%w: the slab of %s (its cuda:%d) does not open on %s: %w", transport.ErrUnsupported, d.addr, d.hello.Ordinal, dev.Name(), err)
	}
	w.log.Info("cudaipc: opened a shard's slab", "dest", d.addr, "slab_bytes", d.hello.Size, "on", dev.Name())
	d.maps[ord] = m
	return m, dev, nil
}

// reset drops the connection and closes the mappings: after a lost
// connection the shard may be gone, and a mapping would keep its memory.
// The caller holds d.sem, so no copy through a mapping is running.
func (w *writer) reset(d *dest) {
	w.mu.Lock()
	c := d.conn
	d.conn, d.br = nil, nil
	w.mu.Unlock()
	if c != nil {
		_ = c.Close()
	}
	for ord, m := range d.maps {
		if err := m.Close(); err != nil {
			w.log.Warn("cudaipc: closing a mapping failed", "dest", d.addr, "on", gpu.Name(ord), "cause", err)
		}
		delete(d.maps, ord)
	}
	d.hello = hello{}
}

// Close cuts every connection, waits for writes in flight to see it, and
// closes every mapping.
func (w *writer) Close() error {
	w.mu.Lock()
	if w.closed {
		w.mu.Unlock()
		return nil
	}
	w.closed = true
	dests := make([]*dest, 0, len(w.dests))
	for _, d := range w.dests {
		dests = append(dests, d)
		if d.conn != nil {
			_ = d.conn.Close()
		}
	}
	w.mu.Unlock()
	for _, d := range dests {
		d.sem <- struct{}{}
		w.reset(d)
		<-d.sem
	}
	return nil
}
