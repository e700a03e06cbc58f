package transport

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/atomic"
)

// InmemNetwork connects Inmem transports inside one process, the way
// HashiCorp raft's InmemTransport does: listeners are registered by address,
// and faults are injected per destination address. Faults set before a
// listener exists apply once it does.
type InmemNetwork struct {
	// inBand: writers complete items in-band (WriteItem.Complete), as
	// TCP's do; see SetInBand.
	inBand bool

	mu        sync.Mutex
	listeners map[string]*inmemReceiver
	faults    map[string]*inmemFaults
	nextAddr  int
}

type inmemFaults struct {
	failNext int
	tears    []int
	delay    time.Duration
}

// NewInmemNetwork returns an empty network.
func NewInmemNetwork() *InmemNetwork {
	return &InmemNetwork{
		listeners: make(map[string]*inmemReceiver),
		faults:    make(map[string]*inmemFaults),
	}
}

func (n *InmemNetwork) faultsFor(addr string) *inmemFaults {
	f := n.faults[addr]
	if f == nil {
		f = &inmemFaults{}
		n.faults[addr] = f
	}
	return f
}

// SetInBand makes the network's writers complete items in-band, as TCP's
// do (they report InBand and their frames carry WriteItem.Complete); call
// it before any transfer.
func (n *InmemNetwork) SetInBand() { n.inBand = true }

// FailNext makes the next frames frames sent to addr fail in transit: the
// sink never sees them and the writer gets ErrConnLost.
func (n *InmemNetwork) FailNext(addr string, frames int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.faultsFor(addr).failNext += frames
}

// TearNext makes the next frame sent to addr break after k payload bytes:
// the sink sees BeginWrite, k bytes copied, then EndWrite(false); the writer
// gets ErrConnLost. Calls queue up, one torn frame each.
func (n *InmemNetwork) TearNext(addr string, k int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	f := n.faultsFor(addr)
	f.tears = append(f.tears, k)
}

// SetDelay holds every frame sent to addr for d before delivering it (zero
// removes the delay). A writer whose ctx ends meanwhile gets ctx's error.
func (n *InmemNetwork) SetDelay(addr string, d time.Duration) {
	n.mu.Lock()
	defer n.mu.Unlock()
	n.faultsFor(addr).delay = d
}

// Kill makes the listener at addr vanish as if its process died: later
// frames get ErrUnreachable and its sink is never called again. It reports
// whether a listener was there.
func (n *InmemNetwork) Kill(addr string) bool {
	n.mu.Lock()
	r := n.listeners[addr]
	n.mu.Unlock()
	if r == nil {
		return false
	}
	_ = r.Close()
	return true
}

// route consumes the faults due for one frame to addr.
func (n *InmemNetwork) route(addr string) (delay time.Duration, fail bool, tear int) {
	n.mu.Lock()
	defer n.mu.Unlock()
	tear = -1
	f := n.faults[addr]
	if f == nil {
		return 0, false, tear
	}
	if f.failNext > 0 {
		f.failNext--
		return f.delay, true, tear
	}
	if len(f.tears) > 0 {
		tear, f.tears = f.tears[0], f.tears[1:]
	}
	return f.delay, false, tear
}

func (n *InmemNetwork) lookup(addr string) *inmemReceiver {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.listeners[addr]
}

// Inmem is the in-process fake of Transport. Writes copy synchronously, in
// the caller's goroutine, through the same Sink calls and the same chunking
// as TCP, so sinks and callers can be tested without sockets.
type Inmem struct {
	network   *InmemNetwork
	chunkSize int
}

// InmemChunkSize is the largest frame the fake cuts an item into: the TCP
// plane's default, so that the fake splits items as the real plane does
// (its conformance tests hold both to it).
const InmemChunkSize = 8 << 20

// NewInmem returns a transport on network that splits items into frames
// of at most InmemChunkSize bytes, like TCP.
func NewInmem(network *InmemNetwork) *Inmem {
	return &Inmem{network: network, chunkSize: InmemChunkSize}
}

// Name implements Transport.
func (t *Inmem) Name() string { return "inmem" }

// Listen registers sink at addr; an empty addr picks a fresh one.
func (t *Inmem) Listen(addr string, sink Sink) (Receiver, error) {
	if sink == nil {
		return nil, errors.New("transport: inmem listen: nil sink")
	}
	n := t.network
	n.mu.Lock()
	defer n.mu.Unlock()
	if addr == "" {
		n.nextAddr++
		addr = fmt.Sprintf("inmem-%d", n.nextAddr)
	}
	if _, taken := n.listeners[addr]; taken {
		return nil, fmt.Errorf("transport: inmem listen %s: address in use", addr)
	}
	r := &inmemReceiver{network: n, addr: addr, sink: sink}
	n.listeners[addr] = r
	return r, nil
}

// NewWriter implements Transport.
func (t *Inmem) NewWriter() Writer { return &inmemWriter{t: t} }

type inmemReceiver struct {
	network *InmemNetwork
	addr    string
	sink    Sink
	stats   RecvCounters

	// mu is held for reading while a frame is inside the sink, so that
	// Close can wait for it.
	mu     sync.RWMutex
	closed bool
}

func (r *inmemReceiver) Addr() string     { return r.addr }
func (r *inmemReceiver) Stats() RecvStats { return r.stats.Snapshot() }

func (r *inmemReceiver) Close() error {
	r.network.mu.Lock()
	if r.network.listeners[r.addr] == r {
		delete(r.network.listeners, r.addr)
	}
	r.network.mu.Unlock()
	r.mu.Lock()
	r.closed = true
	r.mu.Unlock()
	return nil
}

// deliver plays one frame into the sink; tear >= 0 breaks it after that
// many bytes.
func (r *inmemReceiver) deliver(it WriteItem, sp Span, tear int) error {
	r.mu.RLock()
	defer r.mu.RUnlock()
	if r.closed {
		return fmt.Errorf("%w: listener closed", ErrUnreachable)
	}
	dst, end, err := OpenFrame(r.sink, it.Res, it.Token, it.Off+uint64(sp.Off), uint64(sp.End-sp.Off), it.Complete && r.network.inBand)
	if err != nil {
		r.stats.Reject(statusOf(err))
		return err
	}
	src := it.Src[sp.Off:sp.End]
	if tear >= 0 && tear < len(src) {
		copy(dst, src[:tear])
		_ = end(false)
		return fmt.Errorf("%w: injected tear after %d of %d bytes", ErrConnLost, tear, len(src))
	}
	copy(dst, src)
	err = end(true)
	// Each frame is answered alone here: what it completed is published
	// before its answer, as a FlushSink asks.
	Flush(r.sink)
	if err != nil {
		err = rejected(err)
		r.stats.Reject(statusOf(err))
		return err
	}
	r.stats.Landed(uint64(len(src)))
	return nil
}

type inmemWriter struct {
	t      *Inmem
	closed atomic.Bool
}

// Write implements Writer: frames go one after another, each fully
// delivered (or failed) before the next. Every frame of an item is tried
// even after one fails, as with TCP, where they travel independently; the
// item reports the first failure.
func (w *inmemWriter) Write(ctx context.Context, dest string, items []WriteItem) []error {
	if errs := RefuseDevice("inmem", dest, items); errs != nil {
		return errs
	}
	errs := make([]error, len(items))
	for i, it := range items {
		for _, sp := range Split(len(it.Src), w.t.chunkSize) {
			if err := w.frame(ctx, dest, it, sp); err != nil && errs[i] == nil {
				errs[i] = itemErr("inmem", dest, it.Res, sp.Off, sp.End, err)
			}
		}
	}
	return errs
}

func (w *inmemWriter) frame(ctx context.Context, dest string, it WriteItem, sp Span) error {
	if w.closed.Load() {
		return ErrClosed
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	n := w.t.network
	delay, fail, tear := n.route(dest)
	if delay > 0 {
		t := time.NewTimer(delay)
		select {
		case <-ctx.Done():
			t.Stop()
			return ctx.Err()
		case <-t.C:
		}
	}
	r := n.lookup(dest)
	if r == nil {
		return fmt.Errorf("%w: no listener", ErrUnreachable)
	}
	if fail {
		return fmt.Errorf("%w: injected fault", ErrConnLost)
	}
	return r.deliver(it, sp, tear)
}

// InBand implements InBandWriter: as the network was set up.
func (w *inmemWriter) InBand(string) bool { return w.t.network.inBand }

// Close implements Writer; later writes fail with ErrClosed.
func (w *inmemWriter) Close() error {
	w.closed.Store(true)
	return nil
}
