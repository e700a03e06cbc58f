package mooncake

import (
	"fmt"
	"sync"
	"syscall"
	"unsafe"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/gpu"
)

// staging is a registered bounce buffer of the producer, carved by a
// first-fit allocator and registered once: in host memory (anonymous
// memory outside the Go heap, which the engine reads from its own threads
// after the call that handed it over has returned), or in the memory of
// one GPU, filled by device-to-device copies. Safe for concurrent use.
type staging struct {
	mem    []byte // the host view; nil for device memory
	base   uintptr
	n      uint64
	where  string // "cpu" or "cuda:N", as the engine is told
	dev    gpu.Device
	devMem gpu.DeviceMem

	mu    sync.Mutex
	alloc *slab.Allocator
	freed chan struct{} // closed and replaced at every free
}

func newStaging(n int64) (*staging, error) {
	mem, err := syscall.Mmap(-1, 0, int(n), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("mooncake: map a %d-byte staging slab: %w", n, err)
	}
	s := &staging{mem: mem, base: uintptr(unsafe.Pointer(unsafe.SliceData(mem))), n: uint64(n), where: "cpu"}
	s.alloc, s.freed = slab.NewAllocator(uint64(n)), make(chan struct{})
	return s, nil
}

// newDeviceStaging allocates n bytes of dev's memory for staging.
func newDeviceStaging(dev gpu.Device, n int64) (*staging, error) {
	da, ok := dev.(gpu.DeviceAllocator)
	if !ok {
		return nil, fmt.Errorf("mooncake: %s cannot allocate device memory for staging (a %T)", dev.Name(), dev)
	}
	m, err := da.AllocDevice(uint64(n))
	if err != nil {
		return nil, fmt.Errorf("mooncake: a %d-byte staging slab on %s: %w", n, dev.Name(), err)
	}
	s := &staging{base: m.Addr(), n: m.Len(), where: dev.Name(), dev: dev, devMem: m}
	s.alloc, s.freed = slab.NewAllocator(m.Len()), make(chan struct{})
	return s, nil
}

func (s *staging) region() region { return region{addr: s.base, n: s.n} }

// tryAlloc reserves n bytes, or reports that they do not fit now and
// returns a channel closed at the next free (taken under the same lock,
// so that no free can slip in between).
func (s *staging) tryAlloc(n uint64) (uint64, bool, <-chan struct{}) {
	s.mu.Lock()
	defer s.mu.Unlock()
	off, err := s.alloc.Alloc(n)
	return off, err == nil, s.freed
}

func (s *staging) free(off uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if err := s.alloc.Free(off); err != nil {
		panic(fmt.Sprintf("mooncake: staging free at %d: %v", off, err)) // a double free: a broken invariant
	}
	close(s.freed)
	s.freed = make(chan struct{})
}

// bytes is the host view of [off, off+n); host staging only.
func (s *staging) bytes(off, n uint64) []byte { return s.mem[off : off+n : off+n] }

func (s *staging) close() error {
	if s.devMem != nil {
		if err := s.devMem.Free(); err != nil {
			return fmt.Errorf("mooncake: free the staging slab on %s: %w", s.where, err)
		}
		return nil
	}
	if err := syscall.Munmap(s.mem); err != nil {
		return fmt.Errorf("mooncake: unmap the staging slab: %w", err)
	}
	return nil
}
