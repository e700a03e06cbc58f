package cuda

/*
#cgo LDFLAGS: -ldl
#include <stdlib.h>
#include "shim.h"
*/
import "C"

import (
	"fmt"
	"runtime"
	"sync"
	"time"
	"unsafe"

	"github.com/ecmooncake/ecmooncake/core/gpu"
)

// DefaultLibrary is the driver library opened when none is named.
const DefaultLibrary = "libcuda.so.1"

// Driver is the loaded driver library. It implements gpu.Devices.
type Driver struct {
	path    string
	version int
	count   int

	mu   sync.Mutex
	devs map[int]*Device
}

var (
	loadMu sync.Mutex
	loaded *Driver
)

// Open loads the driver library at path (DefaultLibrary when empty) and
// initialises it. The function table is process-wide, so once a load has
// succeeded every later Open returns that driver. Every error wraps
// gpu.ErrUnavailable.
func Open(path string) (*Driver, error) {
	if path == "" {
		path = DefaultLibrary
	}
	loadMu.Lock()
	defer loadMu.Unlock()
	if loaded != nil {
		return loaded, nil
	}
	if err := loadLibrary(path); err != nil {
		return nil, err
	}
	if r := C.ecm_cuInit(0); r != C.ECM_CUDA_SUCCESS {
		return nil, fmt.Errorf("cuda: the CUDA driver (%s) loaded but cuInit failed: %w: %w", path, resultErr(r), gpu.ErrUnavailable)
	}
	d := &Driver{path: path, devs: map[int]*Device{}}
	var v, n C.int
	if r := C.ecm_cuDriverGetVersion(&v); r != C.ECM_CUDA_SUCCESS {
		return nil, fmt.Errorf("cuda: cuDriverGetVersion: %w: %w", resultErr(r), gpu.ErrUnavailable)
	}
	if r := C.ecm_cuDeviceGetCount(&n); r != C.ECM_CUDA_SUCCESS {
		return nil, fmt.Errorf("cuda: cuDeviceGetCount: %w: %w", resultErr(r), gpu.ErrUnavailable)
	}
	d.version, d.count = int(v), int(n)
	if d.count == 0 {
		return nil, fmt.Errorf("cuda: the CUDA driver (%s) sees no device: %w", path, gpu.ErrUnavailable)
	}
	loaded = d
	return d, nil
}

// loadLibrary fills the function table from the library at path. A failed
// load leaves the table as it was.
func loadLibrary(path string) error {
	cpath := C.CString(path)
	defer C.free(unsafe.Pointer(cpath))
	var msg [512]C.char
	if C.ecm_cu_load(cpath, &msg[0], C.size_t(len(msg))) != 0 {
		return fmt.Errorf("cuda: cannot use the CUDA driver (%s): %s: %w", path, C.GoString(&msg[0]), gpu.ErrUnavailable)
	}
	return nil
}

var defaultDriver = sync.OnceValues(func() (*Driver, error) { return Open("") })

// Default is the driver from DefaultLibrary, opened on first use.
func Default() (*Driver, error) { return defaultDriver() }

// Version is the driver's CUDA version, e.g. 13000 for 13.0.
func (d *Driver) Version() int { return d.version }

// Count is the number of devices this process sees.
func (d *Driver) Count() int { return d.count }

// Device returns the device of an ordinal, retaining its primary context
// and creating its streams on first use.
func (d *Driver) Device(ordinal int) (gpu.Device, error) {
	return d.device(ordinal)
}

func (d *Driver) device(ordinal int) (*Device, error) {
	if ordinal < 0 || ordinal >= d.count {
		return nil, fmt.Errorf("cuda: %s: no such device (this process sees %d): %w", gpu.Name(ordinal), d.count, gpu.ErrUnavailable)
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if dev := d.devs[ordinal]; dev != nil {
		return dev, nil
	}
	dev, err := newDevice(ordinal)
	if err != nil {
		return nil, err
	}
	d.devs[ordinal] = dev
	return dev, nil
}

var _ gpu.Devices = (*Driver)(nil)

// resultErr describes a driver result code.
func resultErr(r C.ecm_CUresult) error {
	return fmt.Errorf("%s (%s)", C.GoString(C.ecm_cu_error_name(r)), C.GoString(C.ecm_cu_error_string(r)))
}

func check(what string, r C.ecm_CUresult) error {
	if r == C.ECM_CUDA_SUCCESS {
		return nil
	}
	return fmt.Errorf("cuda: %s: %w", what, resultErr(r))
}

// Device is one GPU's primary context and the streams this package copies
// on. It implements gpu.Device.
type Device struct {
	ordinal int
	model   string
	cd      C.ecm_CUdevice
	ctx     C.ecm_CUcontext
	// d2x carries device-to-host and device-to-device copies, h2d the
	// other direction, so that the two PCIe directions overlap.
	d2x, h2d C.ecm_CUstream

	queueMu sync.Mutex // held while a batch of device copies is queued on d2x

	done  freeList[C.ecm_CUevent]    // events for waiting on copies
	timed freeList[[2]C.ecm_CUevent] // (start, done) pairs with timing enabled
	// recorded keeps the events RecordEvent hands out once they are
	// closed, up to maxRecorded of them: an encoder's hand-over records
	// one a batch, and a cuEventCreate each was most of its cost.
	recorded freeList[C.ecm_CUevent]
}

// maxRecorded bounds the closed events a device keeps for RecordEvent;
// one closed past it is destroyed. Events in flight are not bounded by
// it: they are the sources the producer holds.
const maxRecorded = 64

// freeList keeps events for reuse; its zero value is empty and ready.
type freeList[T any] struct {
	mu   sync.Mutex
	free []T
}

// get returns a kept value, else a new one from create.
func (l *freeList[T]) get(create func() (T, error)) (T, error) {
	l.mu.Lock()
	if n := len(l.free); n > 0 {
		v := l.free[n-1]
		l.free = l.free[:n-1]
		l.mu.Unlock()
		return v, nil
	}
	l.mu.Unlock()
	return create()
}

func (l *freeList[T]) put(v T) {
	l.mu.Lock()
	l.free = append(l.free, v)
	l.mu.Unlock()
}

// keep is put for a list of at most max values: it reports false, keeping
// nothing, when the list is full, for the caller to destroy v.
func (l *freeList[T]) keep(v T, max int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.free) >= max {
		return false
	}
	l.free = append(l.free, v)
	return true
}

func newDevice(ordinal int) (*Device, error) {
	var cd C.ecm_CUdevice
	if r := C.ecm_cuDeviceGet(&cd, C.int(ordinal)); r != C.ECM_CUDA_SUCCESS {
		return nil, fmt.Errorf("cuda: %s: cuDeviceGet: %w", gpu.Name(ordinal), resultErr(r))
	}
	dev := &Device{ordinal: ordinal, cd: cd}
	var name [256]C.char
	if C.ecm_cuDeviceGetName(&name[0], C.int(len(name)), cd) == C.ECM_CUDA_SUCCESS {
		dev.model = C.GoString(&name[0])
	}
	if r := C.ecm_cuDevicePrimaryCtxRetain(&dev.ctx, cd); r != C.ECM_CUDA_SUCCESS {
		return nil, fmt.Errorf("cuda: %s: cuDevicePrimaryCtxRetain: %w", gpu.Name(ordinal), resultErr(r))
	}
	err := dev.with(func() error {
		if err := check("cuStreamCreate", C.ecm_cuStreamCreate(&dev.d2x, C.ECM_CU_STREAM_NON_BLOCKING)); err != nil {
			return err
		}
		return check("cuStreamCreate", C.ecm_cuStreamCreate(&dev.h2d, C.ECM_CU_STREAM_NON_BLOCKING))
	})
	if err != nil {
		return nil, fmt.Errorf("cuda: %s: %w", gpu.Name(ordinal), err)
	}
	return dev, nil
}

// with runs f on this goroutine's OS thread, locked for the duration, with
// the device's primary context current.
func (d *Device) with(f func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := check("cuCtxSetCurrent", C.ecm_cuCtxSetCurrent(d.ctx)); err != nil {
		return err
	}
	return f()
}

// Name implements gpu.Device.
func (d *Device) Name() string { return gpu.Name(d.ordinal) }

// Ordinal implements gpu.Device.
func (d *Device) Ordinal() int { return d.ordinal }

// Model is the device's product name, e.g. "NVIDIA H200".
func (d *Device) Model() string { return d.model }

// getDone returns a free blocking-sync event; the caller holds the thread
// with the context current.
func (d *Device) getDone() (C.ecm_CUevent, error) {
	return d.done.get(func() (C.ecm_CUevent, error) {
		var ev C.ecm_CUevent
		err := check("cuEventCreate", C.ecm_cuEventCreate(&ev, C.ECM_CU_EVENT_BLOCKING_SYNC|C.ECM_CU_EVENT_DISABLE_TIMING))
		return ev, err
	})
}

// getTimed returns a free (start, done) pair of events that keep time;
// done blocks its waiter rather than spinning. The caller holds the thread
// with the context current.
func (d *Device) getTimed() ([2]C.ecm_CUevent, error) {
	return d.timed.get(newTimed)
}

func newTimed() ([2]C.ecm_CUevent, error) {
	var p [2]C.ecm_CUevent
	if err := check("cuEventCreate", C.ecm_cuEventCreate(&p[0], 0)); err != nil {
		return p, err
	}
	if err := check("cuEventCreate", C.ecm_cuEventCreate(&p[1], C.ECM_CU_EVENT_BLOCKING_SYNC)); err != nil {
		C.ecm_cuEventDestroy(p[0])
		return p, err
	}
	return p, nil
}

// copyErr names the failed driver call of a copy helper.
func copyErr(what string, failed *C.char, r C.ecm_CUresult) error {
	if r == C.ECM_CUDA_SUCCESS {
		return nil
	}
	fn := "copy"
	if failed != nil {
		fn = C.GoString(failed)
	}
	return fmt.Errorf("cuda: %s: %s: %w", what, fn, resultErr(r))
}

// event is an event this package created, recorded on a caller's stream.
// Closing it hands the CUDA event back to its device for the next
// RecordEvent (a closed event is waited on by no one: a stream that
// waits on it took its state when the wait was queued), or destroys it
// when the device keeps maxRecorded already.
type event struct {
	d    *Device
	ev   C.ecm_CUevent
	once sync.Once
}

func (e *event) Close() error {
	var err error
	e.once.Do(func() {
		if e.d.recorded.keep(e.ev, maxRecorded) {
			return
		}
		err = e.d.with(func() error { return check("cuEventDestroy", C.ecm_cuEventDestroy(e.ev)) })
	})
	return err
}

func handleOf(ev gpu.Event) (C.ecm_CUevent, error) {
	if ev == nil {
		return nil, nil
	}
	e, ok := gpu.Base(ev).(*event)
	if !ok {
		return nil, fmt.Errorf("cuda: an event of type %T is not a CUDA event", ev)
	}
	return e.ev, nil
}

// newRecorded creates an event for RecordEvent: no timing, so that
// recording and waiting on it cost the least. The caller holds the thread
// with the context current.
func newRecorded() (C.ecm_CUevent, error) {
	var ev C.ecm_CUevent
	err := check("cuEventCreate", C.ecm_cuEventCreate(&ev, C.ECM_CU_EVENT_DISABLE_TIMING))
	return ev, err
}

// RecordEvent implements gpu.Device: the event comes from the device's
// closed ones when it keeps any, else from cuEventCreate.
func (d *Device) RecordEvent(stream uintptr) (gpu.Event, error) {
	e := &event{d: d}
	err := d.with(func() error {
		ev, err := d.recorded.get(newRecorded)
		if err != nil {
			return err
		}
		if err := check("cuEventRecord", C.ecm_cuEventRecordOn(ev, C.uintptr_t(stream))); err != nil {
			// Not kept: the failure may be the event's own.
			C.ecm_cuEventDestroy(ev)
			return err
		}
		e.ev = ev
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("cuda: %s: record event on stream %#x: %w", d.Name(), stream, err)
	}
	return e, nil
}

// CopyDevice implements gpu.Device: every copy is queued on one stream,
// then one wait covers them all.
func (d *Device) CopyDevice(ops []gpu.DeviceCopy) error {
	_, err := d.CopyDeviceTimed(ops)
	return err
}

// CopyDeviceTimed implements gpu.TimedCopier. The stream first waits for
// every source's event, then runs the copies between two timing events,
// and one host wait covers them all: a batch's copies start once all its
// sources are ready (they are normally the outputs of one model step, one
// event), and the GPU's own time is told apart from the host's wait.
func (d *Device) CopyDeviceTimed(ops []gpu.DeviceCopy) (gpu.CopyTiming, error) {
	return d.CopyDeviceThen(ops, nil)
}

// CopyDeviceThen queues a batch with its words (QueueCopyThen) and waits
// for it.
func (d *Device) CopyDeviceThen(ops []gpu.DeviceCopy, then []gpu.ValueWrite) (gpu.CopyTiming, error) {
	return gpu.CopyThen(d, ops, then)
}

// QueueCopyThen implements gpu.ValueWriter: the stream waits for every
// source's event, then runs the copies between two timing events, with
// one cuStreamWriteValue64 per word after the copies and before the done
// event, in one driver call; the host's wait is the Pending's.
func (d *Device) QueueCopyThen(ops []gpu.DeviceCopy, then []gpu.ValueWrite) (gpu.Pending, error) {
	if len(ops) == 0 && len(then) == 0 {
		return &pending{d: d}, nil
	}
	cops := make([]C.ecm_copy, len(ops)+1) // never empty: &cops[0] is passed
	waited := map[C.ecm_CUevent]bool{}
	for i, op := range ops {
		after, err := handleOf(op.After)
		if err != nil {
			return nil, err
		}
		// The stream waits once per event, however many copies follow it.
		if waited[after] {
			after = nil
		} else if after != nil {
			waited[after] = true
		}
		cops[i] = C.ecm_copy{dst: C.ecm_CUdeviceptr(op.Dst), src: C.ecm_CUdeviceptr(op.Src), n: C.uint64_t(op.N), after: after}
	}
	words := make([]C.ecm_value_write, len(then)+1)
	for i, w := range then {
		words[i] = C.ecm_value_write{addr: C.ecm_CUdeviceptr(w.Addr), value: C.uint64_t(w.Value)}
	}
	p := &pending{d: d, what: fmt.Sprintf("%s: %d device copies, %d ready words", d.Name(), len(ops), len(then)), queued: true}
	var queueNS [3]C.int64_t
	err := d.with(func() error {
		evs, err := d.getTimed()
		if err != nil {
			return err
		}
		var failed *C.char
		// Batches from concurrent writers queue one after the other, so
		// that each one's start and done events bracket its own copies.
		d.queueMu.Lock()
		r := C.ecm_cu_copy_batch_queue(d.d2x, evs[0], evs[1], &cops[0], C.int(len(ops)), &words[0], C.int(len(then)), &queueNS[0], &failed)
		d.queueMu.Unlock()
		if r != C.ECM_CUDA_SUCCESS {
			// A failed copy can leave the events recorded or not; fresh
			// ones are cheaper than finding out.
			C.ecm_cuEventDestroy(evs[0])
			C.ecm_cuEventDestroy(evs[1])
			return copyErr(p.what, failed, r)
		}
		p.evs = evs
		return nil
	})
	if err != nil {
		return nil, err
	}
	p.queue = [3]time.Duration{time.Duration(queueNS[0]), time.Duration(queueNS[1]), time.Duration(queueNS[2])}
	return p, nil
}

// pending is a batch queued by QueueCopyThen: its timing events, taken
// back into the device's pool once waited for.
type pending struct {
	d      *Device
	what   string
	queued bool // false: an empty batch
	evs    [2]C.ecm_CUevent
	queue  [3]time.Duration // whole, the waits, the copies (ecm_cu_copy_batch_queue)
	once   sync.Once
	tm     gpu.CopyTiming
	err    error
}

// Wait implements gpu.Pending. A second call returns the first's answer.
func (p *pending) Wait() (gpu.CopyTiming, error) {
	p.once.Do(func() {
		if !p.queued {
			return
		}
		var waitNS C.int64_t
		var gpuMS C.float
		p.err = p.d.with(func() error {
			var failed *C.char
			if r := C.ecm_cu_wait_timed(p.evs[0], p.evs[1], &waitNS, &gpuMS, &failed); r != C.ECM_CUDA_SUCCESS {
				C.ecm_cuEventDestroy(p.evs[0])
				C.ecm_cuEventDestroy(p.evs[1])
				return copyErr(p.what, failed, r)
			}
			p.d.timed.put(p.evs)
			return nil
		})
		if p.err != nil {
			return
		}
		p.tm = gpu.CopyTiming{Queue: p.queue[0], QueueWaits: p.queue[1], QueueCopies: p.queue[2], Wait: time.Duration(waitNS)}
		if gpuMS >= 0 {
			p.tm.GPU = time.Duration(float64(gpuMS) * float64(time.Millisecond))
		}
	})
	return p.tm, p.err
}

// hostReg is host memory registered with one device's context.
type hostReg struct {
	d    *Device
	p    unsafe.Pointer
	dev  uintptr
	once sync.Once
}

func (r *hostReg) DevAddr() uintptr { return r.dev }

func (r *hostReg) Close() error {
	var err error
	r.once.Do(func() {
		err = r.d.with(func() error { return check("cuMemHostUnregister", C.ecm_cu_host_unregister(r.p)) })
	})
	return err
}

// RegisterHost implements gpu.ValueWriter: cuMemHostRegister(DEVICEMAP)
// in this device's context, then cuMemHostGetDevicePointer. It fails,
// touching nothing, when the driver or the device cannot store words from
// a stream (no cuStreamWriteValue64_v2, and v1's attributes off).
func (d *Device) RegisterHost(mem []byte) (gpu.HostRegistration, error) {
	if len(mem) == 0 {
		return nil, fmt.Errorf("cuda: %s: register 0 bytes of host memory", d.Name())
	}
	var why *C.char
	if C.ecm_cu_value_writes(d.cd, &why) == 0 {
		return nil, fmt.Errorf("cuda: %s: no stream memory operations: %s", d.Name(), C.GoString(why))
	}
	r := &hostReg{d: d, p: unsafe.Pointer(unsafe.SliceData(mem))}
	err := d.with(func() error {
		var dev C.ecm_CUdeviceptr
		var failed *C.char
		if rc := C.ecm_cu_host_register(r.p, C.size_t(len(mem)), &dev, &failed); rc != C.ECM_CUDA_SUCCESS {
			return copyErr("register host memory", failed, rc)
		}
		r.dev = uintptr(dev)
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("cuda: %s: %d bytes at %p: %w", d.Name(), len(mem), r.p, err)
	}
	return r, nil
}

// CopyToHost implements gpu.Device.
func (d *Device) CopyToHost(dst []byte, src uintptr, after gpu.Event) error {
	return d.CopyToHostBatch([]gpu.HostCopy{{Dst: dst, Src: src, After: after}})[0]
}

// CopyToHostBatch implements gpu.Device: the ops are queued on d2x and
// waited for once, so a batch of small copies costs one wait, not one
// each. An op whose queueing fails fails alone, and the ops after it are
// queued again in a batch of their own.
func (d *Device) CopyToHostBatch(ops []gpu.HostCopy) []error {
	errs := make([]error, len(ops))
	what := func(i int) string {
		return fmt.Sprintf("%s: %d bytes to host from %#x", d.Name(), len(ops[i].Dst), ops[i].Src)
	}
	cops := make([]C.ecm_host_copy, 0, len(ops))
	idx := make([]int, 0, len(ops))
	// The host buffers may be Go memory: pinned while C holds them.
	var pin runtime.Pinner
	defer pin.Unpin()
	var after []C.ecm_CUevent // each copy's event, before dedupe
	for i, op := range ops {
		if len(op.Dst) == 0 {
			continue
		}
		ev, err := handleOf(op.After)
		if err != nil {
			errs[i] = err
			continue
		}
		after = append(after, ev)
		pin.Pin(unsafe.SliceData(op.Dst))
		cops = append(cops, C.ecm_host_copy{dst: unsafe.Pointer(unsafe.SliceData(op.Dst)), src: C.ecm_CUdeviceptr(op.Src), n: C.uint64_t(len(op.Dst))})
		idx = append(idx, i)
	}
	for len(cops) > 0 {
		// The stream waits once per event, however many copies of this
		// call follow it (again after a failed op, whose wait may be the
		// one that failed).
		waited := map[C.ecm_CUevent]bool{}
		for j, ev := range after {
			cops[j].after = ev
			if waited[ev] {
				cops[j].after = nil
			} else if ev != nil {
				waited[ev] = true
			}
		}
		failedAt := C.int(-1)
		r := C.ecm_CUresult(C.ECM_CUDA_SUCCESS)
		var failed *C.char
		err := d.with(func() error {
			done, err := d.getDone()
			if err != nil {
				return err
			}
			r = C.ecm_cu_copy_dtoh_batch(d.d2x, done, &cops[0], C.int(len(cops)), &failedAt, &failed)
			if r != C.ECM_CUDA_SUCCESS {
				// A failed batch's event state is unknown: destroyed.
				C.ecm_cuEventDestroy(done)
				return nil
			}
			d.done.put(done)
			return nil
		})
		switch {
		case err != nil:
			for _, i := range idx {
				errs[i] = fmt.Errorf("cuda: %s: %w", what(i), err)
			}
			return errs
		case r == C.ECM_CUDA_SUCCESS:
			return errs
		case failedAt < 0:
			for _, i := range idx {
				errs[i] = copyErr(what(i), failed, r)
			}
			return errs
		}
		i := idx[failedAt]
		errs[i] = copyErr(what(i), failed, r)
		cops, idx, after = cops[failedAt+1:], idx[failedAt+1:], after[failedAt+1:]
	}
	return errs
}

// CopyFromHost implements gpu.Device.
func (d *Device) CopyFromHost(dst uintptr, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return d.hostCopy(func(done C.ecm_CUevent, failed **C.char) C.ecm_CUresult {
		return C.ecm_cu_copy_htod(d.h2d, done, C.ecm_CUdeviceptr(dst), unsafe.Pointer(unsafe.SliceData(src)), C.size_t(len(src)), failed)
	}, func() string { return fmt.Sprintf("%s: %d bytes from host to %#x", d.Name(), len(src), dst) })
}

// hostCopy runs one copy between host and device that records done, an
// event of the free list, and waits for it. A failed copy's event is
// destroyed, as its state is unknown, and its error names what.
func (d *Device) hostCopy(run func(done C.ecm_CUevent, failed **C.char) C.ecm_CUresult, what func() string) error {
	return d.with(func() error {
		done, err := d.getDone()
		if err != nil {
			return err
		}
		var failed *C.char
		if r := run(done, &failed); r != C.ECM_CUDA_SUCCESS {
			C.ecm_cuEventDestroy(done)
			return copyErr(what(), failed, r)
		}
		d.done.put(done)
		return nil
	})
}

// hostMem is memory from cuMemHostAlloc.
type hostMem struct {
	d    *Device
	p    unsafe.Pointer
	b    []byte
	once sync.Once
}

func (m *hostMem) Bytes() []byte { return m.b }

func (m *hostMem) Free() error {
	var err error
	m.once.Do(func() {
		err = m.d.with(func() error { return check("cuMemFreeHost", C.ecm_cuMemFreeHost(m.p)) })
		m.b = nil
	})
	return err
}

// AllocHost implements gpu.Device. The memory is portable: pinned for
// every context, so any device may copy to or from it.
func (d *Device) AllocHost(n int) (gpu.HostMem, error) {
	if n <= 0 {
		return nil, fmt.Errorf("cuda: page-locked allocation of %d bytes", n)
	}
	m := &hostMem{d: d}
	err := d.with(func() error {
		return check("cuMemHostAlloc", C.ecm_cuMemHostAlloc(&m.p, C.size_t(n), C.ECM_CU_MEMHOSTALLOC_PORTABLE))
	})
	if err != nil {
		return nil, fmt.Errorf("cuda: %s: %d bytes of page-locked memory: %w", d.Name(), n, err)
	}
	m.b = unsafe.Slice((*byte)(m.p), n)
	return m, nil
}

// allocation returns the base and size of the device allocation that holds
// [addr, addr+n), checking that it is this device's memory.
func (d *Device) allocation(addr uintptr, n uint64) (base uintptr, size uint64, err error) {
	infos := []C.ecm_pointer_info{{p: C.ecm_CUdeviceptr(addr)}}
	if err := d.pointers(infos); err != nil {
		return 0, 0, fmt.Errorf("cuda: %s: memory at %#x: %w", d.Name(), addr, err)
	}
	return d.inAllocation(infos[0], addr, n)
}

// pointers reads the attributes of every pointer of infos in one crossing
// into C, with the context current once.
func (d *Device) pointers(infos []C.ecm_pointer_info) error {
	return d.with(func() error {
		C.ecm_cu_pointers_info(&infos[0], C.int(len(infos)))
		return nil
	})
}

// inAllocation checks one pointer's attributes: device memory of this
// device, with [addr, addr+n) inside its allocation.
func (d *Device) inAllocation(info C.ecm_pointer_info, addr uintptr, n uint64) (base uintptr, size uint64, err error) {
	err = check("cuPointerGetAttributes", info.status)
	if err == nil && info.mem_type != C.ECM_CU_MEMORYTYPE_DEVICE {
		err = fmt.Errorf("memory type %d is not device memory", info.mem_type)
	}
	if err == nil && int(info.ordinal) != d.ordinal {
		err = fmt.Errorf("the memory belongs to %s", gpu.Name(int(info.ordinal)))
	}
	base, size = uintptr(info.base), uint64(info.size)
	if err == nil && (addr < base || n > size || uint64(addr-base) > size-n) {
		err = fmt.Errorf("[%#x,+%d) runs past its allocation [%#x,+%d)", addr, n, base, size)
	}
	if err != nil {
		return 0, 0, fmt.Errorf("cuda: %s: memory at %#x: %w", d.Name(), addr, err)
	}
	return base, size, nil
}

// CheckDevices implements gpu.Device: one crossing into the driver for
// the whole batch (a hand-over of 8 sources paid 8, each with its own
// context switch).
func (d *Device) CheckDevices(spans []gpu.Span) []error {
	errs := make([]error, len(spans))
	if len(spans) == 0 {
		return errs
	}
	infos := make([]C.ecm_pointer_info, len(spans))
	for i, sp := range spans {
		infos[i].p = C.ecm_CUdeviceptr(sp.Addr)
	}
	if err := d.pointers(infos); err != nil {
		for i, sp := range spans {
			errs[i] = fmt.Errorf("cuda: %s: memory at %#x: %w", d.Name(), sp.Addr, err)
		}
		return errs
	}
	for i, sp := range spans {
		_, _, errs[i] = d.inAllocation(infos[i], sp.Addr, sp.N)
	}
	return errs
}

// ExportIPC implements gpu.Device.
func (d *Device) ExportIPC(addr uintptr, n uint64) (gpu.Export, error) {
	base, _, err := d.allocation(addr, n)
	if err != nil {
		return gpu.Export{}, err
	}
	var h C.ecm_CUipcMemHandle
	if err := d.with(func() error { return check("cuIpcGetMemHandle", C.ecm_cuIpcGetMemHandle(&h, C.ecm_CUdeviceptr(base))) }); err != nil {
		return gpu.Export{}, fmt.Errorf("cuda: %s: export %#x: %w", d.Name(), addr, err)
	}
	var out gpu.Export
	copy(out.Handle[:], unsafe.Slice((*byte)(unsafe.Pointer(&h)), gpu.IPCHandleLen))
	out.Offset = uint64(addr - base)
	return out, nil
}

type mapping struct {
	d    *Device
	addr uintptr
	once sync.Once
}

func (m *mapping) Addr() uintptr { return m.addr }

func (m *mapping) Close() error {
	var err error
	m.once.Do(func() {
		err = m.d.with(func() error {
			return check("cuIpcCloseMemHandle", C.ecm_cuIpcCloseMemHandle(C.ecm_CUdeviceptr(m.addr)))
		})
	})
	return err
}

// OpenIPC implements gpu.Device. Peer access is enabled lazily, so memory
// of another GPU of the host opens too.
func (d *Device) OpenIPC(h gpu.IPCHandle) (gpu.Mapping, error) {
	var ch C.ecm_CUipcMemHandle
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&ch)), gpu.IPCHandleLen), h[:])
	var p C.ecm_CUdeviceptr
	err := d.with(func() error {
		return check("cuIpcOpenMemHandle", C.ecm_cuIpcOpenMemHandle(&p, &ch, C.ECM_CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS))
	})
	if err != nil {
		return nil, fmt.Errorf("cuda: %s: open IPC handle: %w", d.Name(), err)
	}
	return &mapping{d: d, addr: uintptr(p)}, nil
}

var (
	_ gpu.Device          = (*Device)(nil)
	_ gpu.TimedCopier     = (*Device)(nil)
	_ gpu.DeviceAllocator = (*Device)(nil)
	_ gpu.ValueWriter     = (*Device)(nil)
)

// deviceMem is memory from cuMemAlloc.
type deviceMem struct {
	d    *Device
	addr uintptr
	n    uint64
	once sync.Once
}

func (m *deviceMem) Addr() uintptr { return m.addr }
func (m *deviceMem) Len() uint64   { return m.n }

func (m *deviceMem) Free() error {
	var err error
	m.once.Do(func() { err = m.d.memFree(m.addr) })
	return err
}

// AllocDevice implements gpu.DeviceAllocator: a transport's own staging
// slab (encoder outputs themselves are PyTorch's).
func (d *Device) AllocDevice(n uint64) (gpu.DeviceMem, error) {
	if n == 0 {
		return nil, fmt.Errorf("cuda: %s: device allocation of 0 bytes", d.Name())
	}
	p, err := d.memAlloc(int(n))
	if err != nil {
		return nil, fmt.Errorf("cuda: %s: %d bytes of device memory: %w", d.Name(), n, err)
	}
	return &deviceMem{d: d, addr: p, n: n}, nil
}

// memAlloc and memFree serve AllocDevice and this package's tests.
func (d *Device) memAlloc(n int) (uintptr, error) {
	var p C.ecm_CUdeviceptr
	err := d.with(func() error { return check("cuMemAlloc", C.ecm_cuMemAlloc(&p, C.size_t(n))) })
	return uintptr(p), err
}

func (d *Device) memFree(p uintptr) error {
	return d.with(func() error { return check("cuMemFree", C.ecm_cuMemFree(C.ecm_CUdeviceptr(p))) })
}
