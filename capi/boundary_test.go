package capi

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestArgumentChecks(t *testing.T) {
	require.NoError(t, NotNil("f", "out", true))
	require.ErrorContains(t, NotNil("f", "out", false), "f: out is NULL")
	require.Equal(t, StatusInvalid, Classify(NotNil("f", "out", false)))

	for _, tc := range []struct {
		n  uint64
		ok bool
	}{{0, true}, {1, true}, {MaxSources, true}, {MaxSources + 1, false}, {1 << 62, false}, {^uint64(0), false}} {
		k, err := Count("f", tc.n)
		if tc.ok {
			require.NoError(t, err)
			require.Equal(t, int(tc.n), k)
		} else {
			require.Equal(t, StatusInvalid, Classify(err), tc.n)
		}
	}

	for name, tc := range map[string]struct {
		p    uintptr
		n    uint64
		want string
	}{
		"empty":      {0, 0, ""},
		"ordinary":   {0x1000, 4096, ""},
		"null":       {0, 16, "is NULL"},
		"huge":       {0x1000, 1 << 63, "address space"},
		"wraps":      {^uintptr(0) - 8, 16, "address space"},
		"minus one":  {0x1000, ^uint64(0), "address space"},
		"large slab": {0x7f0000000000, 64 << 30, ""},
	} {
		err := Span("f", "slab", tc.p, tc.n)
		if tc.want == "" {
			require.NoError(t, err, name)
		} else {
			require.ErrorContains(t, err, tc.want, name)
		}
	}
}
