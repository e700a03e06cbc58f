package control

import (
	"errors"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/atomic"
)

func TestCallTable(t *testing.T) {
	errRefused := errors.New("refused")
	errLost := errors.New("lost")
	for _, tc := range []struct {
		name string
		run  func(t *testing.T, tb *callTable, trips *atomic.Uint64)
	}{
		{"a reply reaches its caller once and is counted", func(t *testing.T, tb *callTable, trips *atomic.Uint64) {
			ch, err := tb.add(1)
			require.NoError(t, err)
			require.True(t, tb.waiting(1))
			require.True(t, tb.deliver(1, result{}, trips))
			require.NoError(t, (<-ch).err)
			require.EqualValues(t, 1, trips.Load())
			require.False(t, tb.deliver(1, result{}, trips), "a second reply finds nobody")
			require.EqualValues(t, 1, trips.Load())
		}},
		{"an error reply is not a round trip", func(t *testing.T, tb *callTable, trips *atomic.Uint64) {
			ch, err := tb.add(1)
			require.NoError(t, err)
			require.True(t, tb.deliver(1, result{err: errLost}, trips))
			require.ErrorIs(t, (<-ch).err, errLost)
			require.Zero(t, trips.Load())
		}},
		{"a forgotten call gets no reply", func(t *testing.T, tb *callTable, trips *atomic.Uint64) {
			_, err := tb.add(1)
			require.NoError(t, err)
			tb.forget(1)
			require.False(t, tb.waiting(1))
			require.False(t, tb.deliver(1, result{}, trips))
			require.Zero(t, tb.size())
		}},
		{"a refusal fails the waiting calls and the next until reopened", func(t *testing.T, tb *callTable, trips *atomic.Uint64) {
			ch, err := tb.add(1)
			require.NoError(t, err)
			tb.refuse(errRefused)
			require.ErrorIs(t, (<-ch).err, errRefused)
			_, err = tb.add(2)
			require.ErrorIs(t, err, errRefused)
			require.True(t, tb.isClosed())
			tb.refuse(nil)
			_, err = tb.add(3)
			require.NoError(t, err)
			require.Equal(t, 1, tb.size())
		}},
		{"only the first close counts, and it lasts", func(t *testing.T, tb *callTable, trips *atomic.Uint64) {
			ch, err := tb.add(1)
			require.NoError(t, err)
			require.True(t, tb.close(errLost, errors.New("connection lost: lost")))
			require.EqualError(t, (<-ch).err, "connection lost: lost")
			require.False(t, tb.close(errRefused, errRefused))
			_, err = tb.add(2)
			require.ErrorIs(t, err, errLost, "the first close's error stays")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tb := newCallTable()
			tc.run(t, &tb, atomic.NewUint64(0))
		})
	}
}
