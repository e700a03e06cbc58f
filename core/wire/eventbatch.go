package wire

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"
)

// An event message carries the events of one publisher's flush (every
// readiness, failure and gone record that one call into the shard
// produced), so that a batch of 8 items costs the scheduler one message
// and one step, not 8. It is binary, not JSON: it sits on the path from
// "the bytes landed" to "the scheduler may load them", and its fields are
// few and fixed. Big endian throughout:
//
//	header (24 bytes)
//	 0  tag      u8   0xEC: an event message (a JSON object starts with '{')
//	 1  version  u8   Version
//	 2  count    u16  records, 1..MaxEventRecords
//	 4  shard    u32
//	 8  seq      u64  the first record's; record i has seq+i
//	16  sent_ns  i64  when the publisher sent it, or 0
//	record (16 bytes, then its strings)
//	 0  kind     u8   0 transfer, 1 gone
//	 1  flags    u8   bit 0 ready; the others are zero
//	 2  nbytes   u64
//	10  lengths  u16 × 3: transfer_id, mm_hash, reason
//	16  transfer_id, mm_hash, reason
//
// The shard's fields (version, shard, sent_ns) are the message's, so the
// records of one message share them, and their seqs run without a hole.
// Nothing may follow the last record. Every record is an Event that
// passes Validate, and the whole message at most MaxMessage bytes.
//
// Compatibility: a JSON event (one per message, what builds before this
// one sent) is refused with ErrLegacyEvent, not decoded. The shard and
// its scheduler run from one library, so meeting one is a deployment of
// two builds: the subscriber counts and logs it (SubStats.Legacy), and
// the status resync still finds those transfers.
const (
	// MaxEventRecords bounds the records of one event message; a flush
	// with more goes out in several.
	MaxEventRecords = 1024
	// MaxEventReason bounds a record's reason (CutReason shortens one).
	MaxEventReason = 1024
	// EventHeaderSize is an event message's size before its records.
	EventHeaderSize = 24

	eventTag        = 0xEC
	eventRecordHead = 16
	eventKindGone   = 1
	eventFlagReady  = 1
)

// ErrLegacyEvent: a JSON event, from a peer of an older build.
var ErrLegacyEvent = fmt.Errorf("%w: a JSON event (an older build's; this build sends and reads binary event messages only)", ErrVersion)

// EventRecordSize is the bytes ev adds to an event message.
func EventRecordSize(ev Event) int {
	return eventRecordHead + len(ev.TransferID) + len(ev.MMHash) + len(ev.Reason)
}

// CutReason shortens a reason to MaxEventReason bytes, at a rune
// boundary, so that a long one (a producer's abandon reason) travels cut
// rather than makes its event invalid.
func CutReason(r string) string {
	if len(r) <= MaxEventReason {
		return r
	}
	n := MaxEventReason
	for n > 0 && !utf8.RuneStart(r[n]) {
		n--
	}
	return r[:n]
}

// EncodeEvents encodes evs as one event message: 1..MaxEventRecords
// events, each valid, of one version, shard and sent time, with seqs
// that rise by one.
func EncodeEvents(evs []Event) ([]byte, error) {
	if len(evs) == 0 || len(evs) > MaxEventRecords {
		return nil, fmt.Errorf("wire: encode events: %w: %d records, want 1..%d", ErrInvalid, len(evs), MaxEventRecords)
	}
	first := evs[0]
	if first.Shard > math.MaxUint32 {
		return nil, fmt.Errorf("wire: encode events: %w: shard %d over %d", ErrInvalid, first.Shard, uint32(math.MaxUint32))
	}
	size := EventHeaderSize
	for i, ev := range evs {
		if err := ev.Validate(); err != nil {
			return nil, fmt.Errorf("wire: encode events: record %d (seq %d): %w", i, ev.Seq, err)
		}
		if ev.V != first.V || ev.Shard != first.Shard || ev.SentNS != first.SentNS || ev.Seq != first.Seq+uint64(i) {
			return nil, fmt.Errorf("wire: encode events: %w: record %d (shard %d, seq %d, sent_ns %d) does not follow record 0 (shard %d, seq %d, sent_ns %d)",
				ErrInvalid, i, ev.Shard, ev.Seq, ev.SentNS, first.Shard, first.Seq, first.SentNS)
		}
		size += EventRecordSize(ev)
	}
	if size > MaxMessage {
		return nil, fmt.Errorf("wire: encode events: %w: %d bytes, limit %d", ErrTooLarge, size, MaxMessage)
	}
	return appendEvents(make([]byte, 0, size), evs), nil
}

// appendEvents appends evs as one event message, unchecked.
func appendEvents(b []byte, evs []Event) []byte {
	first := evs[0]
	b = append(b, eventTag, byte(first.V))
	b = binary.BigEndian.AppendUint16(b, uint16(len(evs)))
	b = binary.BigEndian.AppendUint32(b, uint32(first.Shard))
	b = binary.BigEndian.AppendUint64(b, first.Seq)
	b = binary.BigEndian.AppendUint64(b, uint64(first.SentNS))
	for _, ev := range evs {
		var kind, flags byte
		if ev.Kind == EventGone {
			kind = eventKindGone
		}
		if ev.Ready {
			flags = eventFlagReady
		}
		b = append(b, kind, flags)
		b = binary.BigEndian.AppendUint64(b, ev.NBytes)
		b = binary.BigEndian.AppendUint16(b, uint16(len(ev.TransferID)))
		b = binary.BigEndian.AppendUint16(b, uint16(len(ev.MMHash)))
		b = binary.BigEndian.AppendUint16(b, uint16(len(ev.Reason)))
		b = append(b, ev.TransferID...)
		b = append(b, ev.MMHash...)
		b = append(b, ev.Reason...)
	}
	return b
}

// errShort: the bytes end inside the message.
var errShort = errors.New("message ends early")

// DecodeEvents decodes and validates one event message. Every failure
// wraps a sentinel: ErrTooLarge, ErrMalformed (not an event message, or
// cut short, or bytes after it), ErrLegacyEvent (a JSON event),
// ErrVersion, ErrInvalid.
func DecodeEvents(b []byte) ([]Event, error) {
	if len(b) > MaxMessage {
		return nil, fmt.Errorf("wire: decode events: %w: %d bytes, limit %d", ErrTooLarge, len(b), MaxMessage)
	}
	if len(b) > 0 && b[0] == '{' {
		return nil, fmt.Errorf("wire: decode events: %w", ErrLegacyEvent)
	}
	if len(b) < EventHeaderSize {
		return nil, fmt.Errorf("wire: decode events: %w: %d bytes, shorter than the %d-byte header", ErrMalformed, len(b), EventHeaderSize)
	}
	if b[0] != eventTag {
		return nil, fmt.Errorf("wire: decode events: %w: tag 0x%02x, want 0x%02x", ErrMalformed, b[0], eventTag)
	}
	if v := int(b[1]); v != Version {
		return nil, fmt.Errorf("wire: decode events: %w", versionErr(v))
	}
	n := int(binary.BigEndian.Uint16(b[2:]))
	if n == 0 || n > MaxEventRecords {
		return nil, fmt.Errorf("wire: decode events: %w: %d records, want 1..%d", ErrInvalid, n, MaxEventRecords)
	}
	shard := binary.BigEndian.Uint32(b[4:])
	seq := binary.BigEndian.Uint64(b[8:])
	sent := int64(binary.BigEndian.Uint64(b[16:]))
	if seq == 0 || seq > math.MaxUint64-uint64(n-1) {
		return nil, fmt.Errorf("wire: decode events: %w: seq %d of %d records", ErrInvalid, seq, n)
	}
	if uint64(shard) > math.MaxInt32 {
		// An int on every platform this builds for; no deployment has this
		// many shards.
		return nil, fmt.Errorf("wire: decode events: %w: shard %d", ErrInvalid, shard)
	}
	rest := b[EventHeaderSize:]
	evs := make([]Event, n)
	for i := range evs {
		ev, tail, err := decodeRecord(rest)
		if err != nil {
			return nil, fmt.Errorf("wire: decode events: record %d of %d: %w", i, n, err)
		}
		rest = tail
		ev.V, ev.Shard, ev.Seq, ev.SentNS = Version, int(shard), seq+uint64(i), sent
		if err := ev.Validate(); err != nil {
			return nil, fmt.Errorf("wire: decode events: record %d (seq %d of shard %d): %w", i, ev.Seq, shard, err)
		}
		evs[i] = ev
	}
	if len(rest) > 0 {
		return nil, fmt.Errorf("wire: decode events: %w: %d bytes after the last record", ErrMalformed, len(rest))
	}
	return evs, nil
}

// decodeRecord reads one record's fields (not the message's) off b.
func decodeRecord(b []byte) (Event, []byte, error) {
	var ev Event
	if len(b) < eventRecordHead {
		return ev, nil, fmt.Errorf("%w: %w: %d bytes left, a record needs %d", ErrMalformed, errShort, len(b), eventRecordHead)
	}
	switch b[0] {
	case 0:
		ev.Kind = EventTransfer
	case eventKindGone:
		ev.Kind = EventGone
	default:
		// A kind from a newer peer cannot be acted on safely by guessing.
		return ev, nil, fmt.Errorf("%w: kind: unknown %d", ErrInvalid, b[0])
	}
	if b[1]&^eventFlagReady != 0 {
		return ev, nil, fmt.Errorf("%w: flags: unknown bits 0x%02x", ErrInvalid, b[1]&^eventFlagReady)
	}
	ev.Ready = b[1]&eventFlagReady != 0
	ev.NBytes = binary.BigEndian.Uint64(b[2:])
	lt, lh, lr := int(binary.BigEndian.Uint16(b[10:])), int(binary.BigEndian.Uint16(b[12:])), int(binary.BigEndian.Uint16(b[14:]))
	for _, f := range [...]struct {
		name     string
		n, limit int
	}{{"transfer_id", lt, MaxIDLen}, {"mm_hash", lh, MaxIDLen}, {"reason", lr, MaxEventReason}} {
		if f.n > f.limit {
			return ev, nil, fmt.Errorf("%w: %s: length %d, limit %d", ErrInvalid, f.name, f.n, f.limit)
		}
	}
	b = b[eventRecordHead:]
	if len(b) < lt+lh+lr {
		return ev, nil, fmt.Errorf("%w: %w: %d bytes left, the record's strings need %d", ErrMalformed, errShort, len(b), lt+lh+lr)
	}
	ev.TransferID, ev.MMHash, ev.Reason = string(b[:lt]), string(b[lt:lt+lh]), string(b[lt+lh:lt+lh+lr])
	return ev, b[lt+lh+lr:], nil
}
