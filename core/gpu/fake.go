package gpu

import (
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"
)

// FakeHost is one host with fake GPUs, for tests: device memory is Go
// memory behind fake addresses, and IPC works between any two of its
// devices (it stands in for several processes of one machine). Copies
// check both ends against live allocations, so a transport that writes
// outside one fails loudly. It implements Devices.
type FakeHost struct {
	mu       sync.Mutex
	gpus     int
	devs     map[int]*fakeDevice
	allocs   []*fakeAlloc
	next     uintptr
	handles  map[IPCHandle]*fakeAlloc
	nextIPC  uint64
	streams  map[uintptr]*FakeStream
	failNext []error
	failOpen []error
	// value writes: how many of the next ones to skip, and why
	// registration fails (nil: it works)
	skipWords   int
	refuseHost  error
	wordsStored int
	// batches queued by QueueCopyThen, and those of them waited for
	queued, waited int

	// counters read by tests
	mappings, events, hostBufs int
	copies, recorded, checks   int
	hostBatches                int // CopyToHostBatch calls
}

type fakeAlloc struct {
	base  uintptr
	mem   []byte
	dev   int  // owning device; -1 for page-locked host memory
	alias bool // an IPC mapping of another allocation's memory
	freed bool
}

// fakeBase keeps fake device addresses far from anything real.
const fakeBase = uintptr(0x7e00_0000_0000)

// NewFakeHost returns a host with gpus devices, cuda:0 .. cuda:gpus-1.
func NewFakeHost(gpus int) *FakeHost {
	return &FakeHost{
		gpus:    gpus,
		devs:    map[int]*fakeDevice{},
		next:    fakeBase,
		handles: map[IPCHandle]*fakeAlloc{},
		streams: map[uintptr]*FakeStream{},
	}
}

// Device implements Devices.
func (h *FakeHost) Device(ordinal int) (Device, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if ordinal < 0 || ordinal >= h.gpus {
		return nil, fmt.Errorf("gpu: %s: %w (fake host has %d devices)", Name(ordinal), ErrUnavailable, h.gpus)
	}
	d := h.devs[ordinal]
	if d == nil {
		d = &fakeDevice{h: h, ordinal: ordinal}
		h.devs[ordinal] = d
	}
	return d, nil
}

// Alloc allocates n bytes of device memory on a device and returns its
// address and the test's window onto it.
func (h *FakeHost) Alloc(ordinal, n int) (uintptr, []byte) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.addLocked(make([]byte, n), ordinal, false).base, h.allocs[len(h.allocs)-1].mem
}

// Free frees device memory from Alloc. Mappings of it keep working, as
// with CUDA, where the memory lives until its last mapping is closed; a
// new OpenIPC of its handle fails.
func (h *FakeHost) Free(addr uintptr) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	for _, a := range h.allocs {
		if a.base == addr && !a.freed && !a.alias {
			a.freed = true
			return nil
		}
	}
	return fmt.Errorf("gpu: fake free %#x: not an allocation", addr)
}

// FailNextCopies makes the next copies (one per error) fail with errs.
func (h *FakeHost) FailNextCopies(errs ...error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.failNext = append(h.failNext, errs...)
}

// FailNextOpens makes the next OpenIPC calls (one per error) fail with
// errs, as on hosts where two processes may not share GPU memory.
func (h *FakeHost) FailNextOpens(errs ...error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.failOpen = append(h.failOpen, errs...)
}

// OpenMappings counts IPC mappings not closed yet.
func (h *FakeHost) OpenMappings() int { return h.read(&h.mappings) }

// OpenEvents counts events recorded and not closed yet.
func (h *FakeHost) OpenEvents() int { return h.read(&h.events) }

// RecordedEvents counts events ever recorded, closed or not: what a test
// reads when the code under test may already have closed them.
func (h *FakeHost) RecordedEvents() int { return h.read(&h.recorded) }

// HostBuffers counts page-locked buffers allocated and not freed.
func (h *FakeHost) HostBuffers() int { return h.read(&h.hostBufs) }

// Copies counts copies performed.
func (h *FakeHost) Copies() int { return h.read(&h.copies) }

// HostCopyBatches counts device-to-host batches (CopyToHost and
// CopyToHostBatch calls), each of which a real device waits for once.
func (h *FakeHost) HostCopyBatches() int { return h.read(&h.hostBatches) }

// Checks counts CheckDevices calls (each checks a batch of spans).
func (h *FakeHost) Checks() int { return h.read(&h.checks) }

// release marks a handle released and takes it off counter, under h.mu,
// then runs also (when not nil); releasing it again is an error.
func (h *FakeHost) release(done *bool, counter *int, what string, also func()) error {
	h.mu.Lock()
	defer h.mu.Unlock()
	if *done {
		return fmt.Errorf("gpu: fake %s twice", what)
	}
	*done = true
	*counter--
	if also != nil {
		also()
	}
	return nil
}

// read returns one of h's counters, read under h.mu.
func (h *FakeHost) read(counter *int) int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return *counter
}

func (h *FakeHost) addLocked(mem []byte, dev int, alias bool) *fakeAlloc {
	a := &fakeAlloc{base: h.next, mem: mem, dev: dev, alias: alias}
	// A gap after each allocation, so that running off its end lands on
	// no other allocation.
	h.next += (uintptr(len(mem))/(1<<20) + 2) << 20
	h.allocs = append(h.allocs, a)
	return a
}

// resolveLocked returns the bytes [addr, addr+n) of a live allocation.
func (h *FakeHost) resolveLocked(what string, addr uintptr, n uint64) (*fakeAlloc, []byte, error) {
	for _, a := range h.allocs {
		if a.freed && !a.alias || addr < a.base || addr >= a.base+uintptr(len(a.mem)) {
			continue
		}
		off := uint64(addr - a.base)
		if n > uint64(len(a.mem))-off {
			return nil, nil, fmt.Errorf("gpu: fake %s [%#x,+%d) runs past its allocation of %d bytes at %#x", what, addr, n, len(a.mem), a.base)
		}
		return a, a.mem[off : off+n], nil
	}
	return nil, nil, fmt.Errorf("gpu: fake %s %#x: no live allocation there", what, addr)
}

// failLocked consumes one injected copy failure, if any.
func (h *FakeHost) failLocked() error {
	h.copies++
	if len(h.failNext) == 0 {
		return nil
	}
	err := h.failNext[0]
	h.failNext = h.failNext[1:]
	return err
}

// FakeStream stands for a stream of another library (PyTorch's): while it
// is held, events recorded on it are pending, as if a long kernel were
// still writing the source.
type FakeStream struct {
	id   uintptr
	mu   sync.Mutex
	held chan struct{} // nil when not held; closed by Release
}

// NewStream registers a stream; pass Handle() where a stream handle goes.
func (h *FakeHost) NewStream() *FakeStream {
	h.mu.Lock()
	defer h.mu.Unlock()
	s := &FakeStream{id: uintptr(len(h.streams) + 1)}
	h.streams[s.id] = s
	return s
}

// Handle is the stream's handle for RecordEvent.
func (s *FakeStream) Handle() uintptr { return s.id }

// Hold makes events recorded from now on pending until Release.
func (s *FakeStream) Hold() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held == nil {
		s.held = make(chan struct{})
	}
}

// Release completes the pending events.
func (s *FakeStream) Release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.held != nil {
		close(s.held)
		s.held = nil
	}
}

type fakeEvent struct {
	h      *FakeHost
	done   <-chan struct{} // nil: complete
	closed bool
}

func (e *fakeEvent) wait() {
	if e != nil && e.done != nil {
		<-e.done
	}
}

func (e *fakeEvent) Close() error {
	return e.h.release(&e.closed, &e.h.events, "event closed", nil)
}

type fakeHostMem struct {
	h     *FakeHost
	a     *fakeAlloc
	freed bool
}

func (m *fakeHostMem) Bytes() []byte { return m.a.mem }

func (m *fakeHostMem) Free() error {
	return m.h.release(&m.freed, &m.h.hostBufs, "host memory freed", func() { m.a.freed = true })
}

type fakeMapping struct {
	h      *FakeHost
	a      *fakeAlloc
	closed bool
}

func (m *fakeMapping) Addr() uintptr { return m.a.base }

func (m *fakeMapping) Close() error {
	// The alias stays in the table, marked dead, so that a copy through a
	// closed mapping fails instead of landing somewhere.
	return m.h.release(&m.closed, &m.h.mappings, "mapping closed", func() { m.a.freed, m.a.alias = true, false })
}

type fakeDevice struct {
	h       *FakeHost
	ordinal int
}

func (d *fakeDevice) Name() string { return Name(d.ordinal) }
func (d *fakeDevice) Ordinal() int { return d.ordinal }

func (d *fakeDevice) CheckDevices(spans []Span) []error {
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	d.h.checks++
	errs := make([]error, len(spans))
	for i, sp := range spans {
		errs[i] = d.checkLocked(sp.Addr, sp.N)
	}
	return errs
}

func (d *fakeDevice) checkLocked(addr uintptr, n uint64) error {
	a, _, err := d.h.resolveLocked("check", addr, n)
	if err != nil {
		return err
	}
	if a.dev != d.ordinal || a.alias {
		return fmt.Errorf("gpu: fake check %#x: memory of %s, not of %s", addr, Name(a.dev), d.Name())
	}
	return nil
}

func (d *fakeDevice) RecordEvent(stream uintptr) (Event, error) {
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	e := &fakeEvent{h: d.h}
	if s := d.h.streams[stream]; s != nil {
		s.mu.Lock()
		if s.held != nil {
			e.done = s.held
		}
		s.mu.Unlock()
	} else if stream != 0 {
		return nil, fmt.Errorf("gpu: fake record event: unknown stream %#x", stream)
	}
	d.h.events++
	d.h.recorded++
	return e, nil
}

func waitAfter(ev Event) error {
	if ev == nil {
		return nil
	}
	fe, ok := Base(ev).(*fakeEvent)
	if !ok {
		return fmt.Errorf("gpu: fake device given a foreign event %T", ev)
	}
	fe.wait()
	return nil
}

func (d *fakeDevice) CopyDevice(ops []DeviceCopy) error {
	for _, op := range ops {
		if err := waitAfter(op.After); err != nil {
			return err
		}
		if err := d.copy(func() error {
			_, dst, err := d.h.resolveLocked("copy destination", op.Dst, op.N)
			if err != nil {
				return err
			}
			_, src, err := d.h.resolveLocked("copy source", op.Src, op.N)
			if err != nil {
				return err
			}
			copy(dst, src)
			return nil
		}); err != nil {
			return err
		}
	}
	return nil
}

// CopyDeviceTimed implements TimedCopier: the fake's "GPU" is the memcpy,
// and the host sees it end at once.
func (d *fakeDevice) CopyDeviceTimed(ops []DeviceCopy) (CopyTiming, error) {
	start := time.Now()
	err := d.CopyDevice(ops)
	took := time.Since(start)
	return CopyTiming{GPU: took, Wait: took}, err
}

func (d *fakeDevice) CopyToHost(dst []byte, src uintptr, after Event) error {
	return d.CopyToHostBatch([]HostCopy{{Dst: dst, Src: src, After: after}})[0]
}

// CopyToHostBatch implements Device: each op in turn, so that an injected
// failure (FailNextCopies) fails the op it falls on and no other.
func (d *fakeDevice) CopyToHostBatch(ops []HostCopy) []error {
	d.h.mu.Lock()
	d.h.hostBatches++
	d.h.mu.Unlock()
	errs := make([]error, len(ops))
	for i, op := range ops {
		if errs[i] = waitAfter(op.After); errs[i] != nil {
			continue
		}
		errs[i] = d.copy(func() error { return d.h.moveLocked("copy source", op.Src, op.Dst, false) })
	}
	return errs
}

func (d *fakeDevice) CopyFromHost(dst uintptr, src []byte) error {
	return d.copy(func() error { return d.h.moveLocked("copy destination", dst, src, true) })
}

// moveLocked copies host bytes to the fake memory at addr (toFake) or from
// it; what names addr's side in errors.
func (h *FakeHost) moveLocked(what string, addr uintptr, host []byte, toFake bool) error {
	_, mem, err := h.resolveLocked(what, addr, uint64(len(host)))
	if err != nil {
		return err
	}
	if toFake {
		copy(mem, host)
	} else {
		copy(host, mem)
	}
	return nil
}

func (d *fakeDevice) copy(f func() error) error {
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	if err := d.h.failLocked(); err != nil {
		return err
	}
	return f()
}

func (d *fakeDevice) AllocHost(n int) (HostMem, error) {
	if n <= 0 {
		return nil, fmt.Errorf("gpu: fake host alloc of %d bytes", n)
	}
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	a := d.h.addLocked(make([]byte, n), -1, false)
	d.h.hostBufs++
	return &fakeHostMem{h: d.h, a: a}, nil
}

func (d *fakeDevice) ExportIPC(addr uintptr, n uint64) (Export, error) {
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	a, _, err := d.h.resolveLocked("export", addr, n)
	if err != nil {
		return Export{}, err
	}
	if a.dev != d.ordinal || a.alias {
		return Export{}, fmt.Errorf("gpu: fake export %#x: not device memory of %s", addr, d.Name())
	}
	for h, b := range d.h.handles {
		if b == a {
			return Export{Handle: h, Offset: uint64(addr - a.base)}, nil
		}
	}
	d.h.nextIPC++
	var h IPCHandle
	binary.LittleEndian.PutUint64(h[:], d.h.nextIPC)
	d.h.handles[h] = a
	return Export{Handle: h, Offset: uint64(addr - a.base)}, nil
}

func (d *fakeDevice) OpenIPC(h IPCHandle) (Mapping, error) {
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	if len(d.h.failOpen) > 0 {
		err := d.h.failOpen[0]
		d.h.failOpen = d.h.failOpen[1:]
		return nil, err
	}
	a, ok := d.h.handles[h]
	if !ok || a.freed {
		return nil, errors.New("gpu: fake open IPC handle: invalid handle (the exporter freed it or never made it)")
	}
	m := d.h.addLocked(a.mem, a.dev, true)
	d.h.mappings++
	return &fakeMapping{h: d.h, a: m}, nil
}

// SkipNextValueWrites makes the next n value writes of CopyDeviceThen
// vanish, as if the word never reached host memory: the copies still
// land and the batch still succeeds.
func (h *FakeHost) SkipNextValueWrites(n int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.skipWords += n
}

// RefuseHostRegister makes RegisterHost fail with err (nil: it works
// again), as on a driver without stream memory operations.
func (h *FakeHost) RefuseHostRegister(err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.refuseHost = err
}

// WordsStored counts value writes stored.
func (h *FakeHost) WordsStored() int { return h.read(&h.wordsStored) }

type fakeRegistration struct {
	h    *FakeHost
	a    *fakeAlloc
	done bool
}

func (r *fakeRegistration) DevAddr() uintptr { return r.a.base }

func (r *fakeRegistration) Close() error {
	var unused int
	return r.h.release(&r.done, &unused, "unregister host memory", func() { r.a.freed = true })
}

// RegisterHost implements ValueWriter: the device sees mem at a fake
// address of its own.
func (d *fakeDevice) RegisterHost(mem []byte) (HostRegistration, error) {
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	if d.h.refuseHost != nil {
		return nil, d.h.refuseHost
	}
	if len(mem) == 0 || uintptr(unsafe.Pointer(unsafe.SliceData(mem)))%8 != 0 {
		return nil, fmt.Errorf("gpu: fake register host memory: %d bytes, not 8-byte aligned or empty", len(mem))
	}
	return &fakeRegistration{h: d.h, a: d.h.addLocked(mem, -1, false)}, nil
}

// QueueCopyThen implements ValueWriter: as a GPU's stream does, the fake
// runs the batch on its own (a goroutine: it waits for the sources'
// events, copies, then stores the words) while the caller goes on, and
// its Pending waits for that.
//
// Its queueing is its bookkeeping, all of it the copies' part (a fake
// stream has no waits to queue: the goroutine waits for the events).
func (d *fakeDevice) QueueCopyThen(ops []DeviceCopy, then []ValueWrite) (Pending, error) {
	start := time.Now()
	d.h.mu.Lock()
	d.h.queued++
	d.h.mu.Unlock()
	p := &fakePending{h: d.h, done: make(chan struct{})}
	queued := time.Since(start)
	go func() {
		defer close(p.done)
		p.tm, p.err = d.CopyDeviceThen(ops, then)
		p.tm.Queue, p.tm.QueueCopies = queued, queued
	}()
	return p, nil
}

type fakePending struct {
	h    *FakeHost
	done chan struct{}
	once sync.Once
	tm   CopyTiming
	err  error
}

func (p *fakePending) Wait() (CopyTiming, error) {
	<-p.done
	p.once.Do(func() {
		p.h.mu.Lock()
		p.h.waited++
		p.h.mu.Unlock()
	})
	return p.tm, p.err
}

// QueuedBatches counts the batches QueueCopyThen queued, and those of
// them not waited for yet.
func (h *FakeHost) QueuedBatches() (queued, unwaited int) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.queued, h.queued - h.waited
}

// CopyDeviceThen runs a batch: the copies, then each word
// stored atomically (another process may be reading it), unless skipped.
func (d *fakeDevice) CopyDeviceThen(ops []DeviceCopy, then []ValueWrite) (CopyTiming, error) {
	tm, err := d.CopyDeviceTimed(ops)
	if err != nil {
		return tm, err
	}
	d.h.mu.Lock()
	defer d.h.mu.Unlock()
	for _, w := range then {
		_, mem, err := d.h.resolveLocked("value write", w.Addr, 8)
		if err != nil {
			return tm, err
		}
		if w.Addr%8 != 0 {
			return tm, fmt.Errorf("gpu: fake value write at %#x: not 8-byte aligned", w.Addr)
		}
		if d.h.skipWords > 0 {
			d.h.skipWords--
			continue
		}
		atomic.StoreUint64((*uint64)(unsafe.Pointer(unsafe.SliceData(mem))), w.Value)
		d.h.wordsStored++
	}
	return tm, nil
}

var (
	_ Devices     = (*FakeHost)(nil)
	_ Device      = (*fakeDevice)(nil)
	_ TimedCopier = (*fakeDevice)(nil)
	_ ValueWriter = (*fakeDevice)(nil)
)
