package transport

import (
	"errors"
	"fmt"
	"slices"

	"github.com/ecmooncake/ecmooncake/core/gpu"
	"github.com/ecmooncake/ecmooncake/core/ids"
)

// DeviceSrc is a source in GPU memory: Len bytes at Addr on the device of
// Ordinal (as this process numbers its devices). Ready, when not nil,
// completes once the work that produces the bytes has: a transport orders
// its reads after it on the GPU and never reads the bytes before.
type DeviceSrc struct {
	Addr    uintptr
	Len     uint64
	Ordinal int
	Ready   gpu.Event
}

// ErrDeviceMemory: a host-memory transport was handed a source in device
// memory. The producer's transport stack stages such sources; reaching a
// plain host transport with one is a wiring bug, refused rather than sent
// as zero bytes.
var ErrDeviceMemory = errors.New("source is in device memory; this transport reads host memory only")

// ErrUnsupported: the transport cannot serve this destination at all (an
// IPC handle that does not open here, say). Unlike a refusal it says
// nothing about the reservation, so a caller that has another transport
// to the same destination can switch to it.
var ErrUnsupported = errors.New("transport cannot reach this destination")

// RefuseDevice fails every item of a batch that holds a device source, for
// the transports that read host memory only. It returns nil when all items
// are host memory.
func RefuseDevice(kind, dest string, items []WriteItem) []error {
	for _, it := range items {
		if it.Dev == nil {
			continue
		}
		errs := make([]error, len(items))
		for i, it := range items {
			errs[i] = itemErr(kind, dest, it.Res, int(it.Off), int(it.Off+it.Len()), ErrDeviceMemory)
		}
		return errs
	}
	return nil
}

// RegionSink is a Sink whose slab the transport reaches by offset rather
// than through a host byte view: device memory, written by a GPU copy.
// BeginRegion admits a frame like BeginWrite (same checks, same errors)
// and answers with the frame's offset in the slab; EndWrite ends it.
type RegionSink interface {
	Sink
	BeginRegion(res ids.ResID, tok ids.Token, off, n uint64) (slabOff uint64, err error)
}

// OpenRegion runs the checks every transport owes a RegionSink, like
// OpenFrame does for a Sink. The returned error always wraps ErrRejected.
func OpenRegion(sink RegionSink, res ids.ResID, tok ids.Token, off, n uint64) (uint64, error) {
	if off+n < off {
		return 0, fmt.Errorf("offset %d + length %d overflows: %w", off, n, ErrOutOfBounds)
	}
	at, err := sink.BeginRegion(res, tok, off, n)
	if err != nil {
		return 0, rejected(err)
	}
	return at, nil
}

// FrameSink is a Sink that tells one frame from another: several frames
// of one reservation can be open at once on different connections, and a
// sink that must act on a frame's bytes when it ends (a staging sink
// copies them on to the GPU) needs to know which one ended. When a sink
// is a FrameSink the transports call BeginFrame and Frame.End instead of
// BeginWrite and EndWrite, with the same checks and the same guarantees.
type FrameSink interface {
	Sink
	BeginFrame(res ids.ResID, tok ids.Token, off, n uint64) (Frame, error)
}

// Frame is one admitted frame: Bytes is where its payload goes; End is
// called exactly once, after the transport stopped touching Bytes, with
// ok true when every byte arrived. The writer learns that the frame landed
// only after End(true) has returned nil; an error from End(true) means the
// sink could not take the bytes after all (the frame is torn) and reaches
// the writer as a refusal.
type Frame interface {
	Bytes() []byte
	End(ok bool) error
}

// StatusOf classifies a refusal for the wire, for transports outside this
// package.
func StatusOf(err error) Status { return statusOf(err) }

// Err is the sentinel error a writer reports for a status received from
// the wire (nil for StatusOK).
func (s Status) Err() error { return errOf(s) }

// ItemErr builds the error one item reports, in the form every transport
// uses: kind, destination, reservation and byte range, then the cause.
func ItemErr(kind, dest string, res ids.ResID, off, end uint64, err error) error {
	return fmt.Errorf("transport: %s write to %s: res %d bytes [%d,%d): %w", kind, dest, res, off, end, err)
}

// Picker is a Transport that carries several data planes and picks one for
// each destination shard. The address Pick returns is what its writer's
// Write takes for that shard.
type Picker interface {
	// Pick chooses for the shard whose control endpoint is peer, on host
	// (its host identity), offering the data planes in offered (name to
	// address).
	Pick(peer, host string, offered map[string]string) (dest string, err error)
}

// PickDest is the write address of a shard for tr: tr's own choice when it
// is a Picker, else the address the shard offers for tr's name.
func PickDest(tr Transport, peer, host string, offered map[string]string) (string, error) {
	if p, ok := tr.(Picker); ok {
		return p.Pick(peer, host, offered)
	}
	if a := offered[tr.Name()]; a != "" {
		return a, nil
	}
	return "", fmt.Errorf("shard at %s offers no %s data plane (it offers %v)", peer, tr.Name(), Names(offered))
}

// Names lists the transport names of an offer, sorted.
func Names(offered map[string]string) []string {
	out := make([]string, 0, len(offered))
	for name := range offered {
		out = append(out, name)
	}
	slices.Sort(out)
	return out
}

// MultiReceiver is a Receiver that listens on several data planes at once.
// Addrs maps each transport name to its address; Addr is the first's.
type MultiReceiver interface {
	Receiver
	Addrs() map[string]string
}

// Offer is what a shard lists in its peers reply for r: every data plane
// of a MultiReceiver, else r's address under name.
func Offer(r Receiver, name string) map[string]string {
	if m, ok := r.(MultiReceiver); ok {
		return m.Addrs()
	}
	return map[string]string{name: r.Addr()}
}
