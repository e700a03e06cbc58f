package slab

import (
	"errors"
	"fmt"
	"unsafe"
)

var (
	// ErrOutOfRange: a view that does not lie inside the memory.
	ErrOutOfRange = errors.New("out of range")
	// ErrNotHost: a byte view asked of device memory.
	ErrNotHost = errors.New("not host memory")
)

// DeviceCPU names host memory.
const DeviceCPU = "cpu"

// Memory describes caller-owned memory. It never owns what it describes:
// the caller keeps the buffer alive for as long as the Memory is in use.
type Memory struct {
	Addr   uintptr
	Len    uint64
	Device string // "cpu" or "cuda:N"

	// host is the byte view of host memory; nil for device memory, whose
	// address must never be turned into a Go pointer.
	host []byte
}

// HostMemory describes host memory. At the C boundary b is built with
// unsafe.Slice from the pointer Python passed; tests pass Go slices.
func HostMemory(b []byte) Memory {
	if b == nil {
		// An empty host view is still a host view.
		b = []byte{}
	}
	return Memory{
		Addr:   uintptr(unsafe.Pointer(unsafe.SliceData(b))),
		Len:    uint64(len(b)),
		Device: DeviceCPU,
		host:   b[:len(b):len(b)],
	}
}

// DeviceMemory describes n bytes of accelerator memory at addr. The address
// is kept as a number only; the transports that can reach it (CUDA IPC,
// RDMA) use it through their own APIs.
func DeviceMemory(addr uintptr, n uint64, device string) Memory {
	return Memory{Addr: addr, Len: n, Device: device}
}

// IsHost reports whether the memory has a host byte view.
func (m Memory) IsHost() bool { return m.host != nil }

// Bytes returns the n bytes at off as a slice whose capacity ends with it,
// so that an append can never spill past the view.
func (m Memory) Bytes(off, n uint64) ([]byte, error) {
	if m.host == nil {
		return nil, fmt.Errorf("slab: view [%d,+%d) of %s memory: %w", off, n, m.Device, ErrNotHost)
	}
	if off > m.Len || n > m.Len-off {
		return nil, fmt.Errorf("slab: view [%d,+%d) of %d bytes: %w", off, n, m.Len, ErrOutOfRange)
	}
	return m.host[off : off+n : off+n], nil
}
