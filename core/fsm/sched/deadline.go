package sched

import (
	"math/bits"
	"time"

	"github.com/ecmooncake/ecmooncake/core/internal/deadlines"
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

// Before orders ties by id and seq so that deadlines that fall due together
// fire in the same order on every run.
func (a deadline) Before(b deadline) bool {
	if !a.at.Equal(b.at) {
		return a.at.Before(b.at)
	}
	if a.id != b.id {
		return a.id < b.id
	}
	return a.seq < b.seq
}

type deadlineHeap = deadlines.Heap[deadline]

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
