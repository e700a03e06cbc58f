package invariant

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestReport(t *testing.T) {
	require.NoError(t, New(nil).Err())

	sentinel, cause := errors.New("invariant violated"), errors.New("cause")
	r := New(sentinel)
	r.Bad("record %d: %w", 7, cause)
	r.Bad("count %d", 2)
	err := r.Err()
	require.ErrorIs(t, err, sentinel)
	require.ErrorIs(t, err, cause)
	require.EqualError(t, err, "invariant violated: record 7: cause\ninvariant violated: count 2")

	require.NoError(t, New(sentinel).IllegalMoves(0).Err())
	require.EqualError(t, New(sentinel).IllegalMoves(3).Err(), "invariant violated: 3 illegal moves attempted")

	plain := New(nil)
	plain.Bad("region %d", 1)
	require.EqualError(t, plain.Err(), "region 1")
}
