package wire

import (
	"fmt"

	"github.com/ecmooncake/ecmooncake/core/ids"
)

// Standing credit on the wire. A producer asks for a window
// (ReserveBatch.CreditBytes, ClaimBatch.CreditBytes) and learns it in the
// replies it receives anyway (ReserveBatchReply.Credit,
// ClaimBatchReply.Credit): no message of its own. A batch then takes its
// regions from the window, writes them over a one-sided data plane, and
// names them in one ClaimBatch per shard.

// MaxCreditExtents bounds the extents of one window.
const MaxCreditExtents = 64

// CreditExtent is free room of a window: slab offsets [Off, Off+Len).
type CreditExtent struct {
	Off uint64 `json:"off"`
	Len uint64 `json:"len"`
}

// CreditGrant is a producer's window on one shard, as of this reply:
// its generation and token (which every claim presents), the version of
// its room (a producer applies only a reply newer than the last it
// applied: replies of pipelined calls may cross), how long its lease
// still runs, its free room (at most MaxCreditExtents extents, the
// largest: room left out is simply not used), and Base, the one-sided
// data plane's address of slab offset 0 (a write to offset o targets
// Base+o).
type CreditGrant struct {
	Gen     uint64         `json:"gen"`
	Version uint64         `json:"version,omitempty"`
	Token   ids.Token      `json:"token"`
	LeaseMs uint64         `json:"lease_ms"`
	Base    uint64         `json:"base,omitempty"`
	Extents []CreditExtent `json:"extents"`
}

func (c *CreditGrant) validate() error {
	if c == nil {
		return nil
	}
	switch {
	case c.Gen == 0:
		return fmt.Errorf("%w: credit.gen: must be positive", ErrInvalid)
	case c.Token.IsZero():
		return fmt.Errorf("%w: credit.token: a window needs a token", ErrInvalid)
	case len(c.Extents) > MaxCreditExtents:
		return fmt.Errorf("%w: credit.extents: %d entries, limit %d", ErrInvalid, len(c.Extents), MaxCreditExtents)
	}
	for i, e := range c.Extents {
		// Checked once here so that a writer's Base+Off+Len cannot wrap.
		end := e.Off + e.Len
		if e.Len == 0 || end < e.Off || c.Base+end < c.Base {
			return fmt.Errorf("%w: credit.extents[%d]: [%d,+%d) is empty or wraps", ErrInvalid, i, e.Off, e.Len)
		}
	}
	return nil
}

// ClaimItem names bytes a producer wrote into its window: the item, as in
// ReserveItem, and the slab offset where they start.
type ClaimItem struct {
	TransferID string `json:"transfer_id"`
	MMHash     string `json:"mm_hash"`
	NBytes     uint64 `json:"nbytes"`
	Meta       string `json:"meta,omitempty"`
	Offset     uint64 `json:"offset"`
}

// ClaimBatch is the body of OpClaimBatch: one batch's items written into
// the requester's window of generation Gen, presenting its Token. The
// shard files each one already written, or refuses it before any region
// exists; a refused item is reserved again by its producer.
type ClaimBatch struct {
	Requester   string      `json:"requester"`
	Gen         uint64      `json:"gen"`
	Token       ids.Token   `json:"token"`
	Items       []ClaimItem `json:"items"`
	CreditBytes uint64      `json:"credit_bytes,omitempty"`
}

// Validate requires a requester, a generation, a token and 1..MaxItems
// items, each with both ids and a size.
func (b ClaimBatch) Validate() error {
	if err := checkRequester(b.Requester); err != nil {
		return err
	}
	if b.Gen == 0 {
		return fmt.Errorf("%w: gen: must be positive", ErrInvalid)
	}
	if b.Token.IsZero() {
		return fmt.Errorf("%w: token: a claim needs its window's token", ErrInvalid)
	}
	return checkItems(b.Items, func(i int, it ClaimItem) error {
		return ReserveItem{TransferID: it.TransferID, MMHash: it.MMHash, NBytes: it.NBytes, Meta: it.Meta}.check(i)
	})
}

// GrantCreditRefused: a claim the window did not cover (stale or unknown
// window, bad token, outside its room): its producer drops the window and
// reserves the item.
const GrantCreditRefused = "credit_refused"

// ClaimBatchReply answers ClaimBatch, one grant per item, in order: a
// write grant is a region already written and ready; follow and cached
// answer content the shard held or was receiving.
type ClaimBatchReply struct {
	Grants []Grant      `json:"grants"`
	Credit *CreditGrant `json:"credit,omitempty"`
	Epoch  string       `json:"epoch,omitempty"`
}

// Validate checks the grants as ReserveBatchReply does, and the window.
func (r ClaimBatchReply) Validate() error {
	if err := checkOptional("epoch", r.Epoch); err != nil {
		return err
	}
	if err := r.Credit.validate(); err != nil {
		return err
	}
	return checkGrants(r.Grants)
}
