package deadlines

import (
	"container/heap"
	"fmt"
	"math/rand/v2"
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

// Add and Take keep the order container/heap keeps, mixed with it in any
// way, allocate nothing once the slice has room, and clear what they hand
// out.
func TestAddAndTakeMatchContainerHeap(t *testing.T) {
	t0 := time.Unix(0, 0)
	rng := rand.New(rand.NewPCG(1, 2))
	var ours, theirs Heap[entry]
	for round := range 2000 {
		switch op := rng.IntN(3); {
		case op < 2 || ours.Len() == 0:
			e := entry{t0.Add(time.Duration(rng.IntN(50))), fmt.Sprint("e", rng.IntN(20), "-", round)}
			if rng.IntN(2) == 0 {
				ours.Add(e)
			} else {
				heap.Push(&ours, e)
			}
			heap.Push(&theirs, e)
		default:
			want := heap.Pop(&theirs).(entry)
			var got entry
			if rng.IntN(2) == 0 {
				got = ours.Take()
			} else {
				got = heap.Pop(&ours).(entry)
			}
			require.Equal(t, want, got, "round %d", round)
		}
	}
	for ours.Len() > 0 {
		require.Equal(t, heap.Pop(&theirs).(entry), ours.Take())
	}
	for _, e := range ours[:cap(ours)] {
		require.Equal(t, entry{}, e, "taken slots are cleared")
	}
	e := entry{t0, "x"}
	require.Zero(t, testing.AllocsPerRun(100, func() { ours.Add(e); _ = ours.Take() }))
}

func TestSecs(t *testing.T) {
	require.Equal(t, "60s", Secs(time.Minute))
	require.Equal(t, "0.5s", Secs(500*time.Millisecond))
}
