package push

import "github.com/ecmooncake/ecmooncake/core/internal/machine"

// Sentinel errors; callers branch on them with errors.Is. All are the
// ones every state machine shares (core/internal/machine).
var (
	// ErrCollision: a transfer_id already names another push, or an mm_hash
	// was announced with another size.
	ErrCollision = machine.ErrCollision
	// ErrInvalid: an argument is missing or malformed.
	ErrInvalid = machine.ErrInvalid
	// ErrSizeMismatch: an encoder output's size differs from what its
	// pushes announced.
	ErrSizeMismatch = machine.ErrSizeMismatch
	// ErrIllegalTransition: a move the state machine does not allow.
	ErrIllegalTransition = machine.ErrIllegalTransition
	// ErrInvariant: CheckInvariants found inconsistent state.
	ErrInvariant = machine.ErrInvariant
)
