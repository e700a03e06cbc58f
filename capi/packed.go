package capi

import (
	"encoding/binary"
	"fmt"
	"unicode/utf8"

	"github.com/ecmooncake/ecmooncake/core/producer"
)

// The packed layouts of ecm_producer_submit_packed and
// ecm_producer_sources_packed (include/ecmooncake.h): a batch is n
// records back to back, little-endian, each a fixed head then its strings'
// bytes in head order. They replace JSON on the encoder's hot path, where
// one batch a model step crosses the boundary: the caller packs with one
// struct.pack a record, and the decoder here checks every length against
// the bytes that remain, so no input, however hostile, reads past the
// buffer or sizes an allocation beyond it.
const (
	// pushHead: u64 nbytes, u32 len(transfer_id), u32 len(mm_hash),
	// u32 len(consumer), u32 len(meta).
	pushHead = 8 + 4*4
	// sourceHead: u64 ptr, u64 nbytes, u64 stream, i32 device,
	// u32 len(mm_hash).
	sourceHead = 8 + 8 + 8 + 4 + 4

	// MaxPackedBytes bounds one packed batch: MaxSources records of
	// generous strings fit, and a length beyond it is a caller's bug.
	MaxPackedBytes = 64 << 20
)

// PackedSource is one record of a packed sources batch: an encoder output
// at [Ptr, Ptr+N), in host memory when Device is negative, else on the GPU
// of that CUDA ordinal, produced by work queued on Stream.
type PackedSource struct {
	MMHash string
	Ptr    uintptr
	N      uint64
	Stream uintptr
	Device int32
}

// packedReader walks a packed batch; every read is bounds-checked and the
// first failure sticks, naming the record it was in.
type packedReader struct {
	fn   string
	b    []byte
	off  int
	item int
	err  error
}

func (r *packedReader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = statusErr(StatusInvalid, "%s: item %d at byte %d: %s", r.fn, r.item, r.off, fmt.Sprintf(format, args...))
	}
}

// head returns the next k bytes of a record's fixed head.
func (r *packedReader) head(k int) []byte {
	if r.err != nil {
		return nil
	}
	if len(r.b)-r.off < k {
		r.fail("record head needs %d bytes, %d remain", k, len(r.b)-r.off)
		return nil
	}
	h := r.b[r.off : r.off+k]
	r.off += k
	return h
}

// text returns the next n bytes as a UTF-8 string named what.
func (r *packedReader) text(what string, n uint32) string {
	return r.textLike(what, n, "")
}

// textLike is text, returning prev itself when the bytes spell it: the
// pushes of a batch mostly share their consumer and meta, and a string
// less a push is an allocation less on the encoder's per-batch call.
func (r *packedReader) textLike(what string, n uint32, prev string) string {
	if r.err != nil {
		return ""
	}
	if uint64(n) > uint64(len(r.b)-r.off) {
		r.fail("%s is %d bytes, %d remain", what, n, len(r.b)-r.off)
		return ""
	}
	s := r.b[r.off : r.off+int(n)]
	r.off += int(n)
	if string(s) == prev { // compared without a copy
		return prev
	}
	if !utf8.Valid(s) {
		r.off -= int(n)
		r.fail("%s is not UTF-8", what)
		return ""
	}
	return string(s)
}

func (r *packedReader) end() error {
	if r.err == nil && r.off != len(r.b) {
		r.err = statusErr(StatusInvalid, "%s: %d bytes after the last item", r.fn, len(r.b)-r.off)
	}
	return r.err
}

// decodeRecords decodes n records of a head of headLen bytes that fill b
// exactly: record reads the strings the head announces and fills one T.
// The batch is bounded before anything is allocated, and the first
// failure, the reader's or one record sets on it, ends the batch.
func decodeRecords[T any](fn string, n int, b []byte, headLen int, record func(r *packedReader, h []byte, out *T)) ([]T, error) {
	if len(b) > MaxPackedBytes {
		return nil, statusErr(StatusInvalid, "%s: %d bytes; at most %d per batch", fn, len(b), MaxPackedBytes)
	}
	// A record is never shorter than its head: checked before any
	// allocation is sized by n.
	if uint64(n)*uint64(headLen) > uint64(len(b)) {
		return nil, statusErr(StatusInvalid, "%s: %d items need at least %d bytes, got %d", fn, n, n*headLen, len(b))
	}
	r := &packedReader{fn: fn, b: b}
	out := make([]T, n)
	for i := range out {
		r.item = i
		h := r.head(headLen)
		if h == nil {
			break
		}
		record(r, h, &out[i])
	}
	if err := r.end(); err != nil {
		return nil, err
	}
	return out, nil
}

// DecodePushes decodes n packed push records that fill b exactly.
func DecodePushes(fn string, n int, b []byte) ([]producer.Push, error) {
	var consumer, meta string // the record before's
	return decodeRecords(fn, n, b, pushHead, func(r *packedReader, h []byte, p *producer.Push) {
		le := binary.LittleEndian
		p.NBytes = le.Uint64(h[0:])
		p.TransferID = r.text("transfer_id", le.Uint32(h[8:]))
		p.MMHash = r.text("mm_hash", le.Uint32(h[12:]))
		p.Consumer = r.textLike("consumer", le.Uint32(h[16:]), consumer)
		p.Meta = r.textLike("meta", le.Uint32(h[20:]), meta)
		consumer, meta = p.Consumer, p.Meta
	})
}

// DecodeSources decodes n packed source records that fill b exactly, and
// checks each (ptr, nbytes) with Span.
func DecodeSources(fn string, n int, b []byte) ([]PackedSource, error) {
	return decodeRecords(fn, n, b, sourceHead, func(r *packedReader, h []byte, s *PackedSource) {
		le := binary.LittleEndian
		s.Ptr, s.N, s.Stream = uintptr(le.Uint64(h[0:])), le.Uint64(h[8:]), uintptr(le.Uint64(h[16:]))
		s.Device = int32(le.Uint32(h[24:]))
		s.MMHash = r.text("mm_hash", le.Uint32(h[28:]))
		// The item is named only when refused: formatting it for every
		// accepted one would cost more than the rest of the record.
		if r.err == nil && Span(r.fn, "", s.Ptr, s.N) != nil {
			r.err = Span(r.fn, fmt.Sprintf("item %d (%s)", r.item, s.MMHash), s.Ptr, s.N)
		}
	})
}

// ProducerSubmitPacked announces a packed batch of pushes. reasons is nil
// when every push was accepted, else one reason a push ("" for accepted
// ones), for the caller to report per item.
func ProducerSubmitPacked(h uint64, n int, b []byte) (reasons []byte, err error) {
	const fn = "ecm_producer_submit_packed"
	p, err := producers.get(h)
	if err != nil {
		return nil, err
	}
	pushes, err := DecodePushes(fn, n, b)
	if err != nil {
		return nil, err
	}
	errs := p.Submit(pushes)
	var texts []string
	for i, e := range errs {
		if e == nil {
			continue
		}
		if texts == nil {
			texts = make([]string, len(errs))
		}
		texts[i] = e.Error()
	}
	if texts == nil {
		return nil, nil
	}
	return marshal(texts)
}
