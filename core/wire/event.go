package wire

import "fmt"

// Event tells the consumer scheduler that one shard finished a transfer:
// Ready with its size, or abandoned (Ready false) with a reason. Seq is
// assigned by the publisher, from 1, one per event offered, so that a gap
// reveals dropped events.
type Event struct {
	V          int    `json:"v"`
	Shard      int    `json:"shard"`
	Seq        uint64 `json:"seq"`
	TransferID string `json:"transfer_id"`
	MMHash     string `json:"mm_hash"`
	Ready      bool   `json:"ready"`
	NBytes     uint64 `json:"nbytes,omitempty"`
	Reason     string `json:"reason,omitempty"`
	// SentNS is when the publisher sent the event (Unix nanoseconds, its
	// wall clock), so that the scheduler can time the event's delivery;
	// 0 when unknown. Only a measurement: nothing depends on it.
	SentNS int64 `json:"sent_ns,omitempty"`
}

// Validate checks version, sequence, ids, and a size on a ready event.
func (e Event) Validate() error {
	if e.V != Version {
		return versionErr(e.V)
	}
	if e.Shard < 0 {
		return fmt.Errorf("%w: shard: %d is negative", ErrInvalid, e.Shard)
	}
	if e.Seq == 0 {
		return fmt.Errorf("%w: seq: must be non-zero", ErrInvalid)
	}
	if err := checkID("transfer_id", e.TransferID); err != nil {
		return err
	}
	if err := checkID("mm_hash", e.MMHash); err != nil {
		return err
	}
	if e.SentNS < 0 {
		return fmt.Errorf("%w: sent_ns: %d is negative", ErrInvalid, e.SentNS)
	}
	if e.Ready && e.NBytes == 0 {
		return fmt.Errorf("%w: nbytes: must be positive on a ready event", ErrInvalid)
	}
	return nil
}

// EncodeEvent validates and encodes e.
func EncodeEvent(e Event) ([]byte, error) { return encode("event", e) }

// DecodeEvent decodes and validates one event frame. On failure the
// returned Event holds whatever fields could be read.
func DecodeEvent(b []byte) (Event, error) {
	var e Event
	if err := decode("event", b, &e); err != nil {
		return e, err
	}
	if err := e.Validate(); err != nil {
		return e, fmt.Errorf("wire: decode event %d of shard %d: %w", e.Seq, e.Shard, err)
	}
	return e, nil
}
