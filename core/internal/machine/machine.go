package machine

import (
	"errors"
	"fmt"
)

// State is a state enum: small unsigned values, named by String.
type State interface {
	~uint8
	String() string
}

// Edges is a state enum's table of legal moves.
type Edges[S State] struct {
	n     S
	legal []bool // legal[from*n+to]
}

// NewEdges builds the table of n states from each state's exits; a state
// missing from next has none.
func NewEdges[S State](n S, next map[S][]S) Edges[S] {
	e := Edges[S]{n: n, legal: make([]bool, int(n)*int(n))}
	for from, tos := range next {
		for _, to := range tos {
			if from >= n || to >= n {
				panic(fmt.Sprintf("machine: edge %s -> %s outside %d states", from, to, n))
			}
			e.legal[int(from)*int(n)+int(to)] = true
		}
	}
	return e
}

// Allows reports whether from -> to is legal; a value past the last state
// moves nowhere, so a corrupt state cannot be moved on.
func (e Edges[S]) Allows(from, to S) bool {
	return from < e.n && to < e.n && e.legal[int(from)*int(e.n)+int(to)]
}

// Check is Allows as an error wrapping ErrIllegalTransition that names both
// states.
func (e Edges[S]) Check(from, to S) error {
	if !e.Allows(from, to) {
		return fmt.Errorf("%w: %s -> %s", ErrIllegalTransition, from, to)
	}
	return nil
}

// Refusals of input: callers see them and branch on them.
var (
	// ErrInvalid: an argument is missing or malformed.
	ErrInvalid = errors.New("invalid argument")
	// ErrCollision: an id already names other content (or a size other
	// than the one given).
	ErrCollision = errors.New("collision")
	// ErrSizeMismatch: content announced or asked for with another size
	// than the one it has.
	ErrSizeMismatch = errors.New("size mismatch")
	// ErrUnknown: an id that was never issued here (or long forgotten).
	ErrUnknown = errors.New("unknown")
)

// Bugs of a machine, never caused by input.
var (
	// ErrIllegalTransition: a move the state machine does not allow.
	ErrIllegalTransition = errors.New("illegal transition")
	// ErrInvariant: CheckInvariants found inconsistent state.
	ErrInvariant = errors.New("invariant violated")
)
