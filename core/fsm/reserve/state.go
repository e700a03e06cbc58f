package reserve

import (
	"fmt"

	"github.com/ecmooncake/ecmooncake/core/internal/enum"
	"github.com/ecmooncake/ecmooncake/core/internal/machine"
)

// State is the state of a region (one slab allocation holding one mm_hash).
type State uint8

const (
	// Writing: reserved, the writer may write. Next: Ready (Complete),
	// Cancelled (abandoned or no longer wanted, no write in flight),
	// Expired (lease ended, no write in flight), or CancelPending /
	// ExpirePending when that happens with writes in flight.
	Writing State = iota
	// Ready: the bytes are complete and may be loaded. Next: Cancelled
	// (the only transfer is cancelled before any load) or Expired (never
	// loaded within the lease, or evicted as a resident copy).
	Ready
	// CancelPending: doomed by an abandon or cancel while a write was in
	// flight; the memory waits for the write to end. Next: Cancelled.
	CancelPending
	// ExpirePending: the lease ended while a write was in flight. Next:
	// Expired when the write ends, or Cancelled if the writer abandoned
	// meanwhile.
	ExpirePending
	// Cancelled is final: the memory is back in the slab.
	Cancelled
	// Expired is final: the memory is back in the slab.
	Expired
	numStates
)

var stateNames = [numStates]string{
	Writing:       "writing",
	Ready:         "ready",
	CancelPending: "cancel_pending",
	ExpirePending: "expire_pending",
	Cancelled:     "cancelled",
	Expired:       "expired",
}

func (s State) String() string { return enum.Name("State", stateNames[:], s) }

// pending reports whether the region is doomed but still holds memory
// because writes are in flight.
func (s State) pending() bool { return s == CancelPending || s == ExpirePending }

// final reports whether the region is over and its memory returned.
func (s State) final() bool { return s == Cancelled || s == Expired }

var legal = machine.NewEdges(numStates, map[State][]State{
	Writing:       {Ready, CancelPending, ExpirePending, Cancelled, Expired},
	Ready:         {Cancelled, Expired},
	CancelPending: {Cancelled},
	ExpirePending: {Cancelled, Expired},
})

// ErrBadTransition: an illegal state move (a bug in the table, never caused
// by input); the sentinel every state machine shares.
var ErrBadTransition = machine.ErrIllegalTransition

// transition is the only place a region's state changes.
func (r *region) transition(to State) error {
	if !legal.Allows(r.state, to) {
		return fmt.Errorf("reserve: region %d (%s): %s -> %s: %w", r.res, r.mmHash, r.state, to, ErrBadTransition)
	}
	r.state = to
	return nil
}

// Kind says how a transfer is served.
type Kind uint8

const (
	// KindWrite: the producer writes the bytes into the granted region,
	// then calls Complete.
	KindWrite Kind = iota + 1
	// KindFollow: another transfer is writing the same mm_hash; no write,
	// readiness (or failure) comes as an event.
	KindFollow
	// KindCached: a ready copy exists; it is ready now, no write.
	KindCached
)

var kindNames = []string{KindWrite: "write", KindFollow: "follow", KindCached: "cached"}

func (k Kind) String() string { return enum.Name("Kind", kindNames, k) }
