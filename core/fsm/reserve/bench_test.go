package reserve

import (
	"fmt"
	"math"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
)

// BenchmarkReserveAmongResidents is one item's life on a shard whose slab
// is full of resident copies (loaded once and released, kept for reuse):
// its reserve evicts the least recently used copy, then it is completed,
// acquired and released, and becomes the newest resident. The table's
// cost of that must not grow with how many residents it holds.
func BenchmarkReserveAmongResidents(b *testing.B) {
	const item = 4 << 10
	for _, n := range []int{1 << 10, 1 << 14, 1 << 17} {
		b.Run(fmt.Sprintf("residents=%d", n), func(b *testing.B) {
			s := slab.NewSlab(slab.HostMemory(make([]byte, n*item)))
			tab := New(s, Config{MaxPendingBytesPerOwner: math.MaxUint64}, testTokens(1))
			now := epoch
			k := 0
			life := func() {
				k++
				it := Item{TransferID: fmt.Sprintf("t%d", k), MMHash: fmt.Sprintf("h%d", k), NBytes: item, Owner: "o", Peer: "p"}
				g := tab.Reserve([]Item{it}, now)[0]
				if g.Err != nil {
					b.Fatal(g.Err)
				}
				if err := tab.Complete(g.Res, g.Token, now); err != nil {
					b.Fatal(err)
				}
				if _, _, err := tab.Acquire(it.MMHash, now); err != nil {
					b.Fatal(err)
				}
				if err := tab.Release(it.MMHash, now); err != nil {
					b.Fatal(err)
				}
				tab.Ready()
				now = now.Add(time.Microsecond)
			}
			for range n {
				life()
			}
			for b.Loop() {
				life()
			}
		})
	}
}
