package scheduler

import (
	"encoding/json"
	"fmt"
	"testing"

	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
)

// BenchmarkStepRefresh300 answers 300 waiting requests: by naming each
// request and content (json), by a snapshot of them all (snapshot-json),
// and as the connector asks after the table's generation moved, here
// with nothing moved (changes-json); step is the table work alone.
func BenchmarkStepRefresh300(b *testing.B) {
	s := openIdle(b)
	const n = 300
	var in StepIn
	for i := 0; i < n; i++ {
		h := fmt.Sprintf("%064x", i)
		in.Expect = append(in.Expect, ExpectIn{RequestID: fmt.Sprint("req-", i), Items: []sched.Expected{{TransferID: fmt.Sprint("bh-", i), MMHash: h}}})
		in.Ensure = append(in.Ensure, fmt.Sprint("req-", i))
		in.Has = append(in.Has, h)
	}
	s.Step(StepIn{Expect: in.Expect})
	q := StepIn{Ensure: in.Ensure, Has: in.Has}
	raw, _ := json.Marshal(q)
	b.Run("step", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			s.Step(q)
		}
	})
	snap, _ := json.Marshal(StepIn{Snapshot: true})
	at := s.Generation()
	changes, _ := json.Marshal(StepIn{ChangesSince: &at})
	for _, bc := range []struct {
		name string
		raw  []byte
	}{{"snapshot-json", snap}, {"changes-json", changes}, {"json", raw}} {
		b.Run(bc.name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				var in StepIn
				_ = json.Unmarshal(bc.raw, &in)
				out, _ := json.Marshal(s.Step(in))
				_ = out
			}
		})
	}
}
