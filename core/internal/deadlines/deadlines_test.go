package deadlines

import (
	"container/heap"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

type entry struct {
	at time.Time
	id string
}

func (a entry) Before(b entry) bool {
	if !a.at.Equal(b.at) {
		return a.at.Before(b.at)
	}
	return a.id < b.id
}

func TestHeapPopsEarliestThenByTieBreak(t *testing.T) {
	t0 := time.Unix(0, 0)
	var h Heap[entry]
	for _, e := range []entry{{t0.Add(2), "a"}, {t0.Add(1), "z"}, {t0.Add(1), "b"}, {t0, "q"}} {
		heap.Push(&h, e)
	}
	var got []string
	for h.Len() > 0 {
		got = append(got, heap.Pop(&h).(entry).id)
	}
	require.Equal(t, []string{"q", "b", "z", "a"}, got)
	for _, e := range h[:cap(h)] {
		require.Equal(t, entry{}, e, "popped slots are cleared")
	}
}

func TestSecs(t *testing.T) {
	require.Equal(t, "60s", Secs(time.Minute))
	require.Equal(t, "0.5s", Secs(500*time.Millisecond))
}
