package wire

import "fmt"

// EventKind says what an event reports. The zero kind, omitted on the wire,
// is a transfer's outcome, so events from peers that predate kinds decode
// as they always did.
type EventKind string

const (
	// EventTransfer: one transfer finished, Ready with its size or failed
	// with a reason. It names the transfer and its mm_hash.
	EventTransfer EventKind = ""
	// EventGone: the shard no longer holds the content of mm_hash (its
	// copy was evicted, its lease ran out, or it was cancelled) after it
	// had reported it ready. It names no transfer: the copy may have
	// served transfers that the shard forgot long ago, so the scheduler
	// must drop every record that relied on this shard's copy.
	EventGone EventKind = "gone"
)

// Event tells the consumer scheduler what one shard learnt: a transfer
// finished (Ready with its size, or failed with a reason), or a copy of
// some content is gone (Kind EventGone). Seq is assigned by the publisher,
// from 1, one per event offered, so that a gap reveals dropped events.
type Event struct {
	V          int       `json:"v"`
	Kind       EventKind `json:"kind,omitempty"`
	Shard      int       `json:"shard"`
	Seq        uint64    `json:"seq"`
	TransferID string    `json:"transfer_id"`
	MMHash     string    `json:"mm_hash"`
	Ready      bool      `json:"ready"`
	NBytes     uint64    `json:"nbytes,omitempty"`
	Reason     string    `json:"reason,omitempty"`
	// SentNS is when the publisher sent the event (Unix nanoseconds, its
	// wall clock), so that the scheduler can time the event's delivery;
	// 0 when unknown. Only a measurement: nothing depends on it.
	SentNS int64 `json:"sent_ns,omitempty"`
}

// Validate checks version, kind, sequence, ids, and a size on a ready
// event. A gone event names content and no transfer, and is never ready.
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
	switch e.Kind {
	case EventTransfer:
		if err := checkID("transfer_id", e.TransferID); err != nil {
			return err
		}
	case EventGone:
		// A transfer id would suggest that only that transfer is affected.
		if e.TransferID != "" {
			return fmt.Errorf("%w: transfer_id: must be empty on a gone event", ErrInvalid)
		}
		if e.Ready {
			return fmt.Errorf("%w: ready: a gone event is never ready", ErrInvalid)
		}
	default:
		// A kind from a newer peer cannot be acted on safely by guessing.
		return fmt.Errorf("%w: kind: unknown %.64q", ErrInvalid, e.Kind)
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
	if len(e.Reason) > MaxEventReason {
		return fmt.Errorf("%w: reason: %d bytes, limit %d (CutReason)", ErrInvalid, len(e.Reason), MaxEventReason)
	}
	return nil
}
