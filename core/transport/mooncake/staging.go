package mooncake

import (
	"fmt"
	"sync"
	"syscall"
	"unsafe"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
)

// staging is the producer's registered bounce buffer: anonymous memory
// outside the Go heap (the engine reads it from its own threads, after the
// call that handed it over has returned), registered once, carved by a
// first-fit allocator. Safe for concurrent use.
type staging struct {
	mem  []byte
	base uintptr

	mu    sync.Mutex
	alloc *slab.Allocator
	freed chan struct{} // closed and replaced at every free
}

func newStaging(n int64) (*staging, error) {
	mem, err := syscall.Mmap(-1, 0, int(n), syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_PRIVATE|syscall.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("mooncake: map a %d-byte staging slab: %w", n, err)
	}
	return &staging{mem: mem, base: uintptr(unsafe.Pointer(unsafe.SliceData(mem))), alloc: slab.NewAllocator(uint64(n)), freed: make(chan struct{})}, nil
}

func (s *staging) region() region { return region{addr: s.base, n: uint64(len(s.mem))} }

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

func (s *staging) bytes(off, n uint64) []byte { return s.mem[off : off+n : off+n] }

func (s *staging) close() error {
	if err := syscall.Munmap(s.mem); err != nil {
		return fmt.Errorf("mooncake: unmap the staging slab: %w", err)
	}
	return nil
}
