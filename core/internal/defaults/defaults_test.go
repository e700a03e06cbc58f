package defaults

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestPositive(t *testing.T) {
	n, neg, set := 0, -3, 7
	Positive(&n, 5)
	Positive(&neg, 5)
	Positive(&set, 5)
	require.Equal(t, []int{5, 5, 7}, []int{n, neg, set})
	d := time.Duration(0)
	Positive(&d, time.Second)
	require.Equal(t, time.Second, d)
}
