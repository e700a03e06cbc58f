package ratelog

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestOneLinePerReasonPerInterval(t *testing.T) {
	var l Limiter
	t0 := time.Unix(1000, 0)
	ok, n := l.Admit("a", t0)
	require.True(t, ok)
	require.Zero(t, n)
	for i := 1; i <= 3; i++ {
		ok, _ = l.Admit("a", t0.Add(time.Duration(i)*time.Second))
		require.False(t, ok)
	}
	ok, _ = l.Admit("b", t0.Add(time.Second))
	require.True(t, ok, "each reason has its own interval")
	ok, n = l.Admit("a", t0.Add(Interval))
	require.True(t, ok)
	require.Equal(t, 3, n, "the lines left out are reported with the next one")
}
