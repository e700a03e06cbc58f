package sched

import (
	"container/heap"
	"math/bits"
	"strconv"
	"time"
)

// deadline is one entry of the deadline heap. Entries are never removed
// when a record changes state; instead each record remembers the seq of its
// current entry and an entry whose seq no longer matches is skipped. That
// keeps every state change O(log n) without a position index.
type deadline struct {
	at  time.Time
	id  string
	seq uint64
}

type deadlineHeap []deadline

func (h deadlineHeap) Len() int { return len(h) }

// Less orders ties by id and seq so that deadlines that fall due together
// fire in the same order on every run.
func (h deadlineHeap) Less(i, j int) bool {
	if !h[i].at.Equal(h[j].at) {
		return h[i].at.Before(h[j].at)
	}
	if h[i].id != h[j].id {
		return h[i].id < h[j].id
	}
	return h[i].seq < h[j].seq
}

func (h deadlineHeap) Swap(i, j int) { h[i], h[j] = h[j], h[i] }

func (h *deadlineHeap) Push(x any) { *h = append(*h, x.(deadline)) }

func (h *deadlineHeap) Pop() any {
	old := *h
	d := old[len(old)-1]
	*h = old[:len(old)-1]
	return d
}

var _ heap.Interface = (*deadlineHeap)(nil)

// shardSet is a bitmap of the shards that reported a transfer ready.
type shardSet []uint64

func newShardSet(shards int) shardSet { return make(shardSet, (shards+63)/64) }

func (s shardSet) add(i int) { s[i/64] |= 1 << (uint(i) % 64) }

func (s shardSet) remove(i int) { s[i/64] &^= 1 << (uint(i) % 64) }

func (s shardSet) has(i int) bool { return s[i/64]&(1<<(uint(i)%64)) != 0 }

func (s shardSet) count() int {
	n := 0
	for _, w := range s {
		n += bits.OnesCount64(w)
	}
	return n
}

// inRange reports whether s is sized for shards and names no shard outside
// 0..shards-1.
func (s shardSet) inRange(shards int) bool {
	if len(s) != (shards+63)/64 {
		return false
	}
	if rem := shards % 64; rem != 0 && s[len(s)-1]>>uint(rem) != 0 {
		return false
	}
	return true
}

// secs renders a wait the way operators configure it ("60s", "0.5s").
func secs(d time.Duration) string {
	return strconv.FormatFloat(d.Seconds(), 'f', -1, 64) + "s"
}
