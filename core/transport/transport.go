package transport

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
)

// Sink is the receiving end of the data plane: the consumer shard's
// reservation table and slab. The transport calls it once per incoming
// frame, from one goroutine per connection, so implementations must be safe
// for concurrent use.
//
// BeginWrite checks that [off, off+n) lies inside the live reservation res
// authorised by tok and returns the destination bytes (len(dst) == n). A
// non-nil error refuses the frame; wrap one of ErrBadToken, ErrUnknownRes,
// ErrOutOfBounds or ErrGone so that the refusal reaches the writer with its
// reason (anything else reaches it as plain ErrRejected). The error text is
// sent to the writer, so it must not contain the token.
//
// EndWrite is called exactly once for every successful BeginWrite, after
// the transport has stopped touching dst: ok is true when all n bytes
// landed, false when the frame was torn (the peer vanished mid-payload or
// the receiver closed). The writer learns that a frame landed only after
// EndWrite(res, true) has returned.
type Sink interface {
	BeginWrite(res ids.ResID, tok ids.Token, off, n uint64) (dst []byte, err error)
	EndWrite(res ids.ResID, ok bool)
}

// WriteItem is one source buffer to write into one reservation, starting at
// offset Off of the reserved region (0 for a whole item). Src is host
// memory; it must stay valid and unchanged until Write returns, and no
// transport touches it after. A source in GPU memory comes as Dev instead,
// with Src nil; only the transports that can read device memory accept it
// (see DeviceSrc).
type WriteItem struct {
	Res   ids.ResID
	Token ids.Token
	Src   []byte
	Off   uint64
	Dev   *DeviceSrc
	// Addr is the remote address of the reserved region that the grant
	// carried, for one-sided transports (see Direct): the item lands at
	// Addr+Off. Transports that ask the sink for every frame ignore it.
	Addr uint64
	// Size is the size of the reserved region that the grant carried: a
	// one-sided transport that can check it (shm) refuses an item reaching
	// past Addr+Size.
	Size uint64
	// Complete asks the receiver to complete the reservation in-band: each
	// frame carries the completion, and the shard marks the item ready
	// when its last byte lands, so that no complete message follows. Only
	// a writer that InBand says serves dest honours it; the others ignore
	// it, and their items are completed by message.
	Complete bool
}

// Len is the number of bytes the item writes.
func (it WriteItem) Len() uint64 {
	if it.Dev != nil {
		return it.Dev.Len
	}
	return uint64(len(it.Src))
}

// Writer is the producer side. Write blocks until every item is
// acknowledged by the receiver or has failed, and returns one error per item
// (nil means every byte landed and the sink accepted it). It returns by
// ctx's deadline at the latest; items still in flight then get ctx's error.
// Errors name the destination and the cause, and wrap the sentinels below.
// Write is safe for concurrent use. Close fails pending writes with
// ErrClosed and releases everything; it is idempotent.
type Writer interface {
	Write(ctx context.Context, dest string, items []WriteItem) []error
	Close() error
}

// InBandWriter is a Writer that can complete reservations on the data
// connection to dest (WriteItem.Complete): a frame that lands and is
// acknowledged carries its item's completion, so an item whose every
// frame was acknowledged is complete at the shard.
type InBandWriter interface {
	InBand(dest string) bool
}

// Starter is a Writer that can begin a batch on the caller's thread and
// finish it elsewhere: Start does what must come first (cuda_ipc: the
// announcement, and the copies queued on the GPU) without waiting for the
// transfer, and finish waits for it and returns what Write would. ok is
// false, with nothing done, when starting would have to wait (no
// connection to dest yet): the caller then calls Write. finish is called
// exactly once. CanStart says, without side effects, whether Start would
// start a batch to dest now.
type Starter interface {
	CanStart(dest string) bool
	Start(ctx context.Context, dest string, items []WriteItem) (finish func() []error, ok bool)
}

// InBand reports whether w completes in-band the items it writes to dest
// that ask it to.
func InBand(w Writer, dest string) bool {
	ib, ok := w.(InBandWriter)
	return ok && ib.InBand(dest)
}

// CompleteSink is a Sink that completes reservations in-band. EndComplete
// ends a frame admitted by BeginWrite, whose n bytes at off all landed and
// which carried its item's completion, in place of EndWrite(res, true):
// the sink counts those bytes landed and completes the reservation once
// every byte of it has. A non-nil error (it must not contain the token)
// says why the item did not complete and reaches the writer as the
// frame's refusal. A FrameSink's frames complete in-band when they are
// CompleteFrames.
type CompleteSink interface {
	Sink
	EndComplete(res ids.ResID, tok ids.Token, off, n uint64) error
}

// FlushSink is a Sink that holds back what the ends of in-band frames
// publish (the shard's readiness events for the items they completed)
// until Flush, so that frames that arrive together announce their items
// in one message. A receiver calls Flush before it acknowledges any frame
// that ended since the last call (a writer that hears its frame
// acknowledged may count on its item being announced), and before it
// waits for the network.
type FlushSink interface {
	Sink
	Flush()
}

// Flush calls sink's Flush when it is a FlushSink.
func Flush(sink Sink) {
	if fs, ok := sink.(FlushSink); ok {
		fs.Flush()
	}
}

// RemoteSink is a Sink whose one-sided writes (see Direct) a receiver
// can complete in-band: cuda_ipc's shard watches the ready word that the
// writer's GPU stores after its copies, and completes the write when the
// word appears, so that no complete message follows the bytes.
type RemoteSink interface {
	Sink
	// WatchRemote checks that res is a one-sided write of this shard that
	// is open and that tok authorises, and returns when the shard gives up
	// on it (its writer grace): a receiver stops watching for it then.
	// The error (without the token) wraps ErrUnknownRes, ErrBadToken or
	// ErrGone.
	WatchRemote(res ids.ResID, tok ids.Token) (until time.Time, err error)
	// CompleteRemote ends that write landed and completes its
	// reservation: the region becomes ready and its readiness is
	// published, once. A write no longer open (completed, abandoned,
	// given up on) is refused, and nothing is marked ready.
	CompleteRemote(res ids.ResID, tok ids.Token) error
}

// CompleteFrame is a Frame that can end with its item's completion, like
// CompleteSink.EndComplete, in place of End(true).
type CompleteFrame interface {
	Frame
	EndComplete() error
}

// Receiver is a listening data-plane endpoint feeding one Sink. After Close
// returns, the sink is never called again.
type Receiver interface {
	Addr() string
	Close() error
	Stats() RecvStats
}

// RecvStats counts what a Receiver has seen since it started. Frames and
// Bytes count frames that landed; Rejected counts refused frames by reason
// (Status.String()); BadConns counts connections closed because the peer
// sent something that is not a frame; Closed counts the connections the
// receiver closed or refused to protect itself, by reason (over the
// connection cap, idle, a frame that stalled, a peer of another user).
// Writes of a one-sided receiver never pass through it; Attached counts the
// writers it handed its slab to instead, and Completed the items it
// completed in-band for them (cuda_ipc's ready words).
type RecvStats struct {
	Frames, Bytes uint64
	Rejected      map[string]uint64
	BadConns      uint64
	Closed        map[string]uint64 `json:",omitempty"`
	Attached      uint64            `json:",omitempty"`
	Completed     uint64            `json:",omitempty"`
}

// Transport is one way of moving bytes into remote reservations.
type Transport interface {
	Name() string
	Listen(addr string, sink Sink) (Receiver, error)
	NewWriter() Writer
}

var _ Transport = (*Inmem)(nil)

// Sentinel errors. Every refusal by a receiver wraps ErrRejected, and the
// specific reasons wrap it too, so callers can test either.
var (
	ErrRejected    = errors.New("rejected by receiver")
	ErrBadToken    = rejection("bad token")
	ErrUnknownRes  = rejection("unknown reservation")
	ErrOutOfBounds = rejection("outside the reservation")
	ErrGone        = rejection("reservation gone")
	// ErrNoInBand: a frame asked for its item's completion in-band and
	// the receiver's sink does not complete in-band.
	ErrNoInBand = rejection("in-band completion not served")

	// ErrConnLost: the path to the receiver broke before the frame was
	// acknowledged. Part of the item may have landed; the sink saw
	// EndWrite(false) for any torn frame.
	ErrConnLost = errors.New("connection lost before acknowledgement")
	// ErrUnreachable: nothing is listening at the destination.
	ErrUnreachable = errors.New("destination unreachable")
	// ErrClosed: the Writer or Receiver was closed.
	ErrClosed = errors.New("transport closed")
	// ErrNotAdmitted: the receiver refused the connection before any of
	// its frames: no valid proof (a missing or different auth_secret, a
	// token of no live grant), a receiver of another protocol version, or
	// no room. Nothing of the refused connection reached the sink.
	ErrNotAdmitted = errors.New("data connection not admitted")
	// ErrBadFrame: bytes that do not decode as a frame header or an ack.
	ErrBadFrame = errors.New("bad frame")

	// ErrRefusedByWriter: the writer's own checks refused an item before
	// any byte left; the receiver never saw it. It does not wrap
	// ErrRejected, so that an error says which side refused.
	ErrRefusedByWriter = errors.New("refused by the writer")
	// ErrWriteBounds: the item reaches past the region its grant reserved.
	ErrWriteBounds = fmt.Errorf("%w: bytes outside the granted region", ErrRefusedByWriter)
	// ErrStaleAddr: the granted region lies outside the slab that the
	// destination address describes: the address names another
	// incarnation of the shard (it restarted since it was looked up).
	ErrStaleAddr = fmt.Errorf("%w: region outside the slab the destination address describes (stale address: the shard may have restarted)", ErrRefusedByWriter)
)

// Status is the outcome a receiver reports for one frame.
type Status uint16

// Status values on the wire. New reasons may be added; a writer treats a
// value it does not know as StatusOther.
const (
	StatusOK Status = iota
	// StatusOther is a refusal for a reason the others do not name.
	StatusOther
	StatusBadToken
	StatusUnknownRes
	StatusOutOfBounds
	StatusGone
	// StatusClosing, in an ack with Seq 0 (a goodbye), says the receiver
	// closes the connection without having begun any frame sent after its
	// last ack: the writer may resend those frames on a new connection.
	StatusClosing
	// StatusNotAdmitted, in an ack with Seq 0, refuses the connection: it
	// did not prove itself (see Mode), or the receiver has no room for
	// it. The message says which; the receiver then closes it.
	StatusNotAdmitted
)

// statusNames are the reason names used as the keys of RecvStats.Rejected.
var statusNames = [...]string{
	StatusOK:          "ok",
	StatusOther:       "other",
	StatusBadToken:    "bad_token",
	StatusUnknownRes:  "unknown_res",
	StatusOutOfBounds: "out_of_bounds",
	StatusGone:        "gone",
	StatusClosing:     "closing",
	StatusNotAdmitted: "not_admitted",
}

// String returns the reason name used as the key of RecvStats.Rejected.
func (s Status) String() string {
	if int(s) < len(statusNames) {
		return statusNames[s]
	}
	return fmt.Sprintf("status_%d", uint16(s))
}

// rejection is the error of one reason a receiver refuses a frame for; it
// wraps ErrRejected.
func rejection(reason string) error { return fmt.Errorf("%w: %s", ErrRejected, reason) }

// statusErrs are the refusals that cross the wire by name, as a status:
// statusOf looks a sink's error up here, and errOf gives it back to the
// writer.
var statusErrs = []struct {
	s   Status
	err error
}{
	{StatusBadToken, ErrBadToken},
	{StatusUnknownRes, ErrUnknownRes},
	{StatusOutOfBounds, ErrOutOfBounds},
	{StatusGone, ErrGone},
}

// statusOf classifies a refusal returned by a Sink.
func statusOf(err error) Status {
	if err == nil {
		return StatusOK
	}
	for _, e := range statusErrs {
		if errors.Is(err, e.err) {
			return e.s
		}
	}
	return StatusOther
}

// errOf is the inverse of statusOf on the writer's side of the wire.
func errOf(s Status) error {
	if s == StatusOK {
		return nil
	}
	for _, e := range statusErrs {
		if e.s == s {
			return e.err
		}
	}
	return ErrRejected
}

// OpenFrame runs the checks every transport owes the sink and asks it for
// the destination bytes, and for the function that ends the frame (called
// exactly once). A frame that carries its item's completion (complete)
// ends, when every byte arrived, through the sink's in-band completion
// (CompleteSink, CompleteFrame); a sink without one refuses it with
// ErrNoInBand. The returned error always wraps ErrRejected.
func OpenFrame(sink Sink, res ids.ResID, tok ids.Token, off, n uint64, complete bool) ([]byte, func(ok bool) error, error) {
	if off+n < off {
		return nil, nil, fmt.Errorf("offset %d + length %d overflows: %w", off, n, ErrOutOfBounds)
	}
	var dst []byte
	var end func(ok bool) error
	if fs, ok := sink.(FrameSink); ok {
		f, err := fs.BeginFrame(res, tok, off, n)
		if err != nil {
			return nil, nil, rejected(err)
		}
		dst, end = f.Bytes(), f.End
		if complete {
			cf, ok := f.(CompleteFrame)
			if !ok {
				_ = f.End(false)
				return nil, nil, ErrNoInBand
			}
			end = func(ok bool) error {
				if ok {
					return cf.EndComplete()
				}
				return cf.End(false)
			}
		}
	} else {
		cs, inBand := sink.(CompleteSink)
		if complete && !inBand {
			return nil, nil, ErrNoInBand
		}
		var err error
		if dst, err = sink.BeginWrite(res, tok, off, n); err != nil {
			return nil, nil, rejected(err)
		}
		end = func(ok bool) error { sink.EndWrite(res, ok); return nil }
		if complete {
			end = func(ok bool) error {
				if ok {
					return cs.EndComplete(res, tok, off, n)
				}
				sink.EndWrite(res, false)
				return nil
			}
		}
	}
	if uint64(len(dst)) != n {
		// A sink bug must not let a frame write outside what it asked for.
		_ = end(false)
		return nil, nil, fmt.Errorf("%w: sink gave %d bytes for a %d-byte frame", ErrRejected, len(dst), n)
	}
	return dst, end, nil
}

// rejected makes a sink's refusal wrap ErrRejected.
func rejected(err error) error {
	if !errors.Is(err, ErrRejected) {
		err = fmt.Errorf("%w: %w", ErrRejected, err)
	}
	return err
}

// Span is one frame's share of an item.
type Span struct{ Off, End int }

// chunkAlign keeps chunk boundaries on large, page-friendly multiples.
const chunkAlign = 64 << 10

// Split cuts an n-byte item into frames of at most chunk bytes, of nearly
// equal size so that the connections they are spread over finish together.
// A zero-length item is one empty frame: the receiver still checks it.
func Split(n, chunk int) []Span {
	if n <= chunk {
		return []Span{{0, n}}
	}
	k := (n + chunk - 1) / chunk
	size := (n + k - 1) / k
	if chunk%chunkAlign == 0 {
		size = (size + chunkAlign - 1) / chunkAlign * chunkAlign
	}
	out := make([]Span, 0, k)
	for off := 0; off < n; off += size {
		out = append(out, Span{off, min(off+size, n)})
	}
	return out
}

// itemErr builds the error one item reports: who, where, which bytes, why.
func itemErr(kind, dest string, res ids.ResID, off, end int, err error) error {
	return fmt.Errorf("transport: %s write to %s: res %d bytes [%d,%d): %w", kind, dest, res, off, end, err)
}
