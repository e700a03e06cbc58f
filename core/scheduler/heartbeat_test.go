package scheduler

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// probes answers event_port heartbeats from a script: an error, or an
// answer naming epoch.
type probes struct {
	script []error
	epoch  string
	calls  int
}

func (p *probes) Call(_ context.Context, op wire.Op, _, out any) error {
	if op != wire.OpEventPort {
		return fmt.Errorf("probes: unexpected %s", op)
	}
	p.calls++
	if len(p.script) > 0 {
		err := p.script[0]
		p.script = p.script[1:]
		if err != nil {
			return err
		}
	}
	*out.(*wire.EventPortReply) = wire.EventPortReply{Endpoint: "tcp://127.0.0.1:9", Epoch: p.epoch}
	return nil
}

func (p *probes) Close() error { return nil }

// One probe lost on its way (a DEALER's request that went down with the
// old connection of a shard restarting on the same port) is not a lost
// shard: only missesToLose probes in a row without an answer are. The
// test failed before: the first lost probe ended every waiting transfer.
func TestOneLostHeartbeatIsNotALostShard(t *testing.T) {
	cases := map[string]struct {
		script []error
		want   sched.State
	}{
		"answered":             {script: []error{nil, nil}, want: sched.WaitingEvent},
		"one lost probe":       {script: []error{context.DeadlineExceeded, nil}, want: sched.WaitingEvent},
		"lost, then lost":      {script: []error{context.DeadlineExceeded, context.DeadlineExceeded}, want: sched.Unavailable},
		"lost, answered, lost": {script: []error{context.DeadlineExceeded, nil, context.DeadlineExceeded}, want: sched.WaitingEvent},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			s := openIdle(t)
			s.Step(StepIn{Expect: []ExpectIn{{RequestID: "r1", Items: []sched.Expected{{TransferID: "t1", MMHash: "h1"}}}}})
			life := shardLife{epoch: "e1"}
			p := &probes{script: tc.script, epoch: "e1"}
			log := slog.New(slog.NewTextHandler(io.Discard, nil))
			for range tc.script {
				s.heartbeat(0, p, log, &life)
			}
			s.mu.Lock()
			got, ok := s.table.Status("t1")
			s.mu.Unlock()
			require.True(t, ok)
			require.Equal(t, tc.want, got)
		})
	}
}
