package fsmtest

import (
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// State is a state enum: small unsigned values, named by String.
type State interface {
	~uint8
	String() string
}

// Machine describes one enum and its transition function.
type Machine[S State] struct {
	// N is the number of states; values 0..N-1 are valid.
	N S
	// Transition is the machine's one transition function.
	Transition func(from, to S) error
	// Legal lists the edges the test expects, written independently of the
	// table the transition function uses, so that a change to either shows:
	// a line a state, "from -> to to ...", each state by its String.
	Legal string
	// Illegal is the sentinel every refused move wraps.
	Illegal error
	// Terminal reports states that must have no exits.
	Terminal func(S) bool
}

// CheckAll runs every check on m, including one value past the last state.
func CheckAll[S State](t *testing.T, m Machine[S]) {
	t.Helper()
	legal := edges(t, m.N, m.Legal)
	for from := S(0); from <= m.N; from++ {
		for to := S(0); to <= m.N; to++ {
			err := m.Transition(from, to)
			if legal[[2]S{from, to}] {
				require.NoError(t, err, "%s -> %s", from, to)
				continue
			}
			require.Error(t, err, "%s -> %s must be refused", from, to)
			require.True(t, errors.Is(err, m.Illegal), "%s -> %s: %v does not wrap %v", from, to, err, m.Illegal)
			require.Contains(t, err.Error(), from.String())
			require.Contains(t, err.Error(), to.String())
		}
	}
	for s := S(0); s < m.N; s++ {
		exits := 0
		for to := S(0); to < m.N; to++ {
			if m.Transition(s, to) == nil {
				exits++
			}
		}
		if m.Terminal != nil {
			require.Equal(t, m.Terminal(s), exits == 0, "%s: terminal=%v with %d exits", s, m.Terminal(s), exits)
		}
	}
	seen := map[string]bool{}
	for s := S(0); s < m.N; s++ {
		name := s.String()
		require.NotEmpty(t, name)
		require.False(t, seen[name], "duplicate name %s", name)
		seen[name] = true
	}
}

// edges parses a Machine's Legal.
func edges[S State](t *testing.T, n S, spec string) map[[2]S]bool {
	t.Helper()
	byName := map[string]S{}
	for s := S(0); s < n; s++ {
		byName[s.String()] = s
	}
	state := func(name string) S {
		s, ok := byName[name]
		require.True(t, ok, "legal edges: no state %q", name)
		return s
	}
	legal := map[[2]S]bool{}
	for _, line := range strings.Split(spec, "\n") {
		from, tos, ok := strings.Cut(line, "->")
		if !ok {
			require.Empty(t, strings.TrimSpace(line), "legal edges: want from -> to ...")
			continue
		}
		for _, to := range strings.Fields(tos) {
			legal[[2]S{state(strings.TrimSpace(from)), state(to)}] = true
		}
	}
	return legal
}

// Corruptions runs one subtest per entry of corruptions: build returns a
// fresh, consistent machine, the entry corrupts it, and check (its
// CheckInvariants) must then report a violation wrapping sentinel.
func Corruptions[M any](t *testing.T, build func() M, check func(M) error, sentinel error, corruptions map[string]func(M)) {
	t.Helper()
	for name, corrupt := range corruptions {
		t.Run(name, func(t *testing.T) {
			m := build()
			corrupt(m)
			require.ErrorIs(t, check(m), sentinel)
		})
	}
}
