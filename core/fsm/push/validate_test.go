package push

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

// Add refuses an empty or repeated destination whatever the length of the
// list: short lists are checked by comparison, long ones with a map.
func TestAddRefusesEmptyAndRepeatedDestinations(t *testing.T) {
	long := func(n int) []string {
		ds := make([]string, n)
		for i := range ds {
			ds[i] = fmt.Sprint("d", i)
		}
		return ds
	}
	cases := []struct {
		name  string
		dests []string
		ok    bool
	}{
		{"one", []string{"d0"}, true},
		{"distinct", []string{"d0", "d1", "d2"}, true},
		{"repeated", []string{"d0", "d1", "d0"}, false},
		{"empty", []string{"d0", ""}, false},
		{"long distinct", long(smallDests + 5), true},
		{"long repeated", append(long(smallDests+5), "d3"), false},
		{"long empty", append(long(smallDests+5), ""), false},
		{"at the bound, repeated", append(long(smallDests-1), "d0"), false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m := New(Config{})
			err := m.Add(Push{TransferID: "t", MMHash: "h", NBytes: 1, Dests: tc.dests}, time.Unix(0, 0))
			if tc.ok {
				require.NoError(t, err)
				return
			}
			require.ErrorIs(t, err, ErrInvalid)
			require.False(t, m.Pending(), "a refused push changes nothing")
		})
	}
}
