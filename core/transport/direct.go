package transport

import (
	"errors"
	"fmt"
)

// DirectSink is a Sink whose memory a one-sided transport registers with
// its engine once, so that writers can put bytes straight into it.
type DirectSink interface {
	Sink
	// Memory describes the receive slab: address, length and device
	// ("cpu" or "cuda:N"). The address is never turned into a Go pointer.
	Memory() (addr uintptr, n uint64, device string)
}

// DirectMemory is the slab a one-sided transport registers at Listen: the
// memory of sink, which must be a DirectSink over a slab that is not
// empty.
func DirectMemory(sink Sink) (addr uintptr, n uint64, device string, err error) {
	ds, ok := sink.(DirectSink)
	if !ok {
		return 0, 0, "", errors.New("the sink does not expose its memory (transport.DirectSink)")
	}
	if addr, n, device = ds.Memory(); addr == 0 || n == 0 {
		return 0, 0, "", errors.New("empty slab")
	}
	return addr, n, device, nil
}

// Direct is implemented by the Receiver of a one-sided transport (RDMA,
// shm, cuda_ipc):
// writers put bytes straight into its registered memory, so the transport
// never asks the sink per frame and cannot check each write. The sink's
// owner keeps the data-plane invariant itself instead:
//   - when it grants a reservation it admits one write of the whole region
//     (Sink.BeginWrite) and ends it (EndWrite) only when the writer
//     completes or abandons, so the region is never reused under a writer
//     whose bytes may still arrive;
//   - the grant carries RemoteAddr(the region's slab offset), the only
//     address the writer may target, and the writer refuses any write that
//     would reach past the slab it was told about.
type Direct interface {
	Receiver
	RemoteAddr(slabOff uint64) uint64
}

// DirectPlaner is a receiver over several data planes (a
// MultiReceiver) that names the one-sided one among them, or nil.
type DirectPlaner interface {
	DirectPlane() Direct
}

// DirectOf is r's one-sided data plane: r itself when it is Direct, else
// the one a DirectPlaner names. A shard whose receiver has one admits a
// writer per region at each write grant and puts RemoteAddr in the grant;
// writers over its other planes ignore the address, and their frames are
// admitted as before, alongside.
func DirectOf(r Receiver) (Direct, bool) {
	if d, ok := r.(Direct); ok {
		return d, true
	}
	if p, ok := r.(DirectPlaner); ok {
		if d := p.DirectPlane(); d != nil {
			return d, true
		}
	}
	return nil, false
}

// AddrChecker is implemented by transports that can tell from a data-plane
// address alone that they cannot write there (the other end speaks another
// protocol, say), so that a producer refuses a consumer before any write
// rather than failing each one.
type AddrChecker interface {
	CheckAddr(addr string) error
}

// CheckParsed is the CheckAddr of a transport whose addresses parse into
// a P that check judges: the check its writer runs again before each write.
func CheckParsed[P any](addr string, parse func(string) (P, error), check func(P) error) error {
	p, err := parse(addr)
	if err != nil {
		return err
	}
	return check(p)
}

// PlaceInSlab is where the bytes of it land, as an offset into the slab
// of size bytes at base, after the bounds checks a one-sided writer owes
// the rule that a write lands only inside its reservation: inside the
// region its grant reserved ([Addr, Addr+Size)), and that region inside
// the slab. owner names the slab's side in errors ("consumer", "shard").
func PlaceInSlab(it WriteItem, base, size uint64, owner string) (uint64, error) {
	n := it.Len()
	switch {
	case it.Off > it.Size || n > it.Size-it.Off:
		return 0, fmt.Errorf("%w: bytes [%d,%d) reach past the %d-byte region the grant reserved", ErrWriteBounds, it.Off, it.Off+n, it.Size)
	case it.Addr < base || it.Addr-base > size || it.Size > size-(it.Addr-base):
		return 0, fmt.Errorf("%w: region [%#x,+%d) is outside the %s's %d-byte slab at %#x", ErrStaleAddr, it.Addr, it.Size, owner, size, base)
	}
	return it.Addr - base + it.Off, nil
}
