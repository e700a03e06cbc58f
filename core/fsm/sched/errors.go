package sched

import (
	"errors"

	"github.com/ecmooncake/ecmooncake/core/internal/machine"
)

// Sentinel errors; callers branch on them with errors.Is. All but
// ErrNotAvailable are the ones every state machine shares
// (core/internal/machine).
var (
	// ErrCollision: a transfer_id already names different content.
	ErrCollision = machine.ErrCollision
	// ErrInvalid: an argument is missing or malformed.
	ErrInvalid = machine.ErrInvalid
	// ErrNotAvailable: no transfer of the content can be loaded now.
	ErrNotAvailable = errors.New("not available")
	// ErrIllegalTransition: a move the state machine does not allow.
	ErrIllegalTransition = machine.ErrIllegalTransition
	// ErrInvariant: CheckInvariants found inconsistent state.
	ErrInvariant = machine.ErrInvariant
)
