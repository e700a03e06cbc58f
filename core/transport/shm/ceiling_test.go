package shm

import (
	"bytes"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestCopyCeilingReportsEveryRound(t *testing.T) {
	rates, err := CopyCeiling(64<<10, 3, 2)
	require.NoError(t, err)
	require.Len(t, rates, 2)
	for _, r := range rates {
		require.Greater(t, r, 0.0)
	}
}

func TestCopyCeilingRefusesBadSizes(t *testing.T) {
	for _, c := range []struct{ item, count, rounds int }{{0, 1, 1}, {1, 0, 1}, {1, 1, 0}, {1 << 30, 1 << 11, 1}} {
		_, err := CopyCeiling(c.item, c.count, c.rounds)
		require.Error(t, err, "%+v", c)
	}
}

// The ceiling copies with the plane's own parallelCopy: a large item split
// over goroutines lands whole.
func TestParallelCopyOfALargeItemLandsWhole(t *testing.T) {
	src := bytes.Repeat([]byte{1, 2, 3, 5, 7}, (3*copyShare)/5+11)
	dst := make([]byte, len(src))
	parallelCopy(dst, src)
	require.Equal(t, src, dst)
}
