package gpu

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"go.uber.org/atomic"
)

// ErrUnavailable is wrapped by every error that means "this process has
// no usable GPU": no driver library, no device, a driver too old.
var ErrUnavailable = errors.New("GPU support unavailable")

// IPCHandleLen is the size of an IPC memory handle (CUipcMemHandle).
const IPCHandleLen = 64

// IPCHandle names a device allocation across processes of one host.
type IPCHandle [IPCHandleLen]byte

// Export describes exported device memory: Handle names the whole
// allocation that contains it, and the memory starts Offset bytes into it
// (PyTorch's caching allocator hands out pieces of larger allocations).
type Export struct {
	Handle IPCHandle
	Offset uint64
}

// Event marks completed work on a stream. Close releases it; a copy
// already ordered behind it is unaffected.
type Event interface {
	Close() error
}

// HostMem is page-locked host memory: the GPU reads and writes it at full
// speed. Bytes stays valid until Free.
type HostMem interface {
	Bytes() []byte
	Free() error
}

// DeviceMem is device memory this process allocated: Len bytes at Addr,
// until Free.
type DeviceMem interface {
	Addr() uintptr
	Len() uint64
	Free() error
}

// DeviceAllocator is a Device that allocates device memory of its own: a
// transport that registers memory once with a network engine keeps a
// staging slab there, since registering every source costs more than a
// device-to-device copy into memory registered already.
type DeviceAllocator interface {
	AllocDevice(n uint64) (DeviceMem, error)
}

// Mapping is another process's device memory opened in this one. Addr is
// where the exported allocation starts here; Close unmaps it.
type Mapping interface {
	Addr() uintptr
	Close() error
}

// Span is N bytes of device memory at Addr.
type Span struct {
	Addr uintptr
	N    uint64
}

// CheckDevice checks one span (Device.CheckDevices).
func CheckDevice(d Device, addr uintptr, n uint64) error {
	return d.CheckDevices([]Span{{Addr: addr, N: n}})[0]
}

// DeviceCopy is one device-to-device copy of N bytes from Src to Dst, both
// addresses this device can reach (its own memory, a peer's, a Mapping),
// ordered after After when that is not nil.
type DeviceCopy struct {
	Dst, Src uintptr
	N        uint64
	After    Event
}

// Device is one GPU as this process sees it. Every method is safe for
// concurrent use, and every copy has completed when its method returns.
type Device interface {
	// Name is "cuda:N", N being Ordinal.
	Name() string
	Ordinal() int
	// CheckDevices checks a batch of spans at once: errs[i] is nil when
	// span i is device memory of this device inside one allocation, else
	// says why not.
	CheckDevices(spans []Span) (errs []error)
	// RecordEvent records an event on a stream this process created
	// elsewhere (0 is the legacy default stream): it completes once the
	// work queued there so far has.
	RecordEvent(stream uintptr) (Event, error)
	// CopyDevice performs ops and returns the first error.
	CopyDevice(ops []DeviceCopy) error
	// CopyToHost copies len(dst) bytes from src after `after`: a batch
	// of one.
	CopyToHost(dst []byte, src uintptr, after Event) error
	// CopyToHostBatch performs ops, queued together and waited for once;
	// errs[i] is op i's error. A failed op fails alone where the device
	// can tell which one failed, and every op after it is still tried.
	CopyToHostBatch(ops []HostCopy) (errs []error)
	// CopyFromHost copies src to dst.
	CopyFromHost(dst uintptr, src []byte) error
	// AllocHost allocates n bytes of page-locked host memory.
	AllocHost(n int) (HostMem, error)
	// ExportIPC exports the device memory [addr, addr+n).
	ExportIPC(addr uintptr, n uint64) (Export, error)
	// OpenIPC opens memory another process exported, for this device.
	OpenIPC(h IPCHandle) (Mapping, error)
}

// HostCopy is one copy of len(Dst) bytes from device memory at Src to
// host memory, ordered after After when that is not nil.
type HostCopy struct {
	Dst   []byte
	Src   uintptr
	After Event
}

// CopyTiming says where one batch of device copies spent its time, so
// that a caller can tell the copy itself from what it cost to learn that
// it ended.
type CopyTiming struct {
	// Queue is the host time spent queuing the copies and their event.
	Queue time.Duration
	// QueueWaits and QueueCopies are parts of Queue: the stream's waits
	// for the sources' events, and the copies with their start event (the
	// rest is the ready words and the done event); 0 where the device
	// does not tell them apart.
	QueueWaits, QueueCopies time.Duration
	// GPU is the copies' own time on the GPU, from the first copy's start
	// to the last one's end (timing events); 0 when the device cannot say.
	GPU time.Duration
	// Wait is the host time from the start of the wait (right after the
	// queueing, or when a Pending's Wait was called) until the batch's
	// completion was seen. Wait less GPU is what waking for the event
	// cost, plus any queueing ahead of the copies; 0 when the batch had
	// ended before the wait began.
	Wait time.Duration
}

// TimedCopier is a Device that reports CopyTiming: CopyDeviceTimed is
// CopyDevice with the timing of the batch.
type TimedCopier interface {
	CopyDeviceTimed(ops []DeviceCopy) (CopyTiming, error)
}

// Devices opens devices by ordinal. Implementations cache: asking twice
// returns the same Device.
type Devices interface {
	Device(ordinal int) (Device, error)
}

// Name is the name of the device of an ordinal, or "cpu" for a negative one.
func Name(ordinal int) string {
	if ordinal < 0 {
		return "cpu"
	}
	return fmt.Sprintf("cuda:%d", ordinal)
}

// Unavailable is a Devices that has none, saying why.
type Unavailable struct{ Err error }

// Device implements Devices.
func (u Unavailable) Device(ordinal int) (Device, error) {
	return nil, fmt.Errorf("gpu: %s: %w", Name(ordinal), u.Err)
}

// Configured is devs, or when that is nil an Unavailable saying that
// nothing configured devices for what.
func Configured(devs Devices, what string) Devices {
	if devs == nil {
		return Unavailable{Err: errors.New("no GPU devices configured for " + what)}
	}
	return devs
}

// Share turns one event into n handles, so that n sources produced by the
// same stream wait on one recorded event; each handle closes once, and ev
// is closed with the last of them.
func Share(ev Event, n int) []Event {
	if n == 1 {
		return []Event{ev}
	}
	left := &atomic.Int32{}
	left.Store(int32(n))
	out := make([]Event, n)
	for i := range out {
		out[i] = &shared{ev: ev, left: left}
	}
	return out
}

type shared struct {
	ev   Event
	left *atomic.Int32
	once sync.Once
}

func (s *shared) Close() error {
	var err error
	s.once.Do(func() {
		if s.left.Add(-1) == 0 {
			err = s.ev.Close()
		}
	})
	return err
}

// Base is the event a handle from Share stands for, or ev itself: what a
// Device waits on.
func Base(ev Event) Event {
	if s, ok := ev.(*shared); ok {
		return s.ev
	}
	return ev
}

// ValueWrite is one 8-byte store that a device makes, on its copy
// stream, into host memory registered with it (HostRegistration): Value
// at the device address Addr.
type ValueWrite struct {
	Addr  uintptr
	Value uint64
}

// HostRegistration is host memory that a device may store into; DevAddr
// is where the device sees its first byte. Close unregisters it.
type HostRegistration interface {
	DevAddr() uintptr
	Close() error
}

// ValueWriter is a Device whose copy stream can store words into
// registered host memory after a batch's copies (cuStreamWriteValue64):
// a word written that way says that every copy queued before it on the
// stream has landed, since the store waits for them and is fenced after
// them. A device that cannot (a driver without stream memory operations)
// fails RegisterHost.
type ValueWriter interface {
	// RegisterHost lets the device store into mem, which must be
	// page-aligned and stay mapped until Close.
	RegisterHost(mem []byte) (HostRegistration, error)
	// QueueCopyThen queues what CopyDeviceTimed runs, with the writes
	// after the copies and before the event the host waits for, and
	// returns without waiting: the caller's thread is free while the GPU
	// copies, and the batch's Pending, waited for exactly once, says when
	// every copy has landed and every word is stored.
	QueueCopyThen(ops []DeviceCopy, then []ValueWrite) (Pending, error)
}

// Pending is a batch queued on a device.
type Pending interface {
	// Wait returns once the batch completed, with its timing, or why it
	// failed. It is called once.
	Wait() (CopyTiming, error)
}

// CopyThen queues a batch with its words on vw and waits for it.
func CopyThen(vw ValueWriter, ops []DeviceCopy, then []ValueWrite) (CopyTiming, error) {
	p, err := vw.QueueCopyThen(ops, then)
	if err != nil {
		return CopyTiming{}, err
	}
	return p.Wait()
}
