package push

import (
	"fmt"
	"testing"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
)

// BenchmarkSubmitStep8 is the manager's share of a producer's Submit of 8
// pushes to a consumer of one shard: Add each, then the Ready that hands
// out their reserve batch. Each round's pushes are then settled (granted,
// written, completed) untimed, so that the manager's tables stay the size
// of one batch.
func BenchmarkSubmitStep8(b *testing.B) {
	m := New(Config{})
	now := time.Unix(0, 0)
	dests := []string{"shard-0"}
	pushes := make([][8]Push, b.N)
	for k := range pushes {
		for i := range pushes[k] {
			pushes[k][i] = Push{TransferID: fmt.Sprintf("t-%d-%d", k, i), MMHash: fmt.Sprintf("%032x%032x", k, i), NBytes: 4096,
				Dests: dests, Meta: `{"dtype":"uint8","shape":[1,4096]}`}
		}
	}
	b.ReportAllocs()
	b.ResetTimer()
	for k := range b.N {
		for _, p := range pushes[k] {
			if err := m.Add(p, now); err != nil {
				b.Fatal(err)
			}
		}
		out := m.Ready(now)
		b.StopTimer()
		if len(out.Reserves["shard-0"]) != 8 {
			b.Fatalf("round %d: %d reserves", k, len(out.Reserves["shard-0"]))
		}
		settle(b, m, pushes[k][:], now)
		b.StartTimer()
	}
}

// settle takes a batch from its reserve to done.
func settle(b *testing.B, m *Manager, ps []Push, now time.Time) {
	for i, p := range ps {
		m.Granted(p.TransferID, p.Dests[0], Grant{Kind: KindWrite, Res: ids.ResID(i + 1), Token: ids.Token{1}, NBytes: p.NBytes}, now)
		if err := m.SourceReady(p.MMHash, SourceID(i+1), p.NBytes, now); err != nil {
			b.Fatal(err)
		}
	}
	dest := ps[0].Dests[0]
	ws := m.Ready(now).Writes[dest]
	for _, w := range ws {
		m.WriteDone(w.TransferID, dest, nil, now)
	}
	cs := m.Ready(now).Completes[dest]
	for _, c := range cs {
		m.CompleteDone(c.TransferID, dest, nil, now)
	}
	if out := m.Ready(now); len(out.Done) != len(ps) {
		b.Fatalf("%d of %d done (%d writes, %d completes)", len(out.Done), len(ps), len(ws), len(cs))
	}
}
