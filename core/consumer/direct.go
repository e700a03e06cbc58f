package consumer

import (
	"fmt"
	"time"

	"github.com/ecmooncake/ecmooncake/core/fsm/reserve"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/trace"
	"github.com/ecmooncake/ecmooncake/core/transport"
)

// One-sided data planes (mooncake: RDMA writes straight into the slab;
// shm and cuda_ipc: a copy into the producer's mapping of it) never ask
// the table where a frame may land, so the shard admits the
// writer itself. A write grant opens one write of the whole region
// (BeginWrite) and the writer's complete or abandon ends it, or, when the
// writer chose TCP after all, its first frame that carries the item's
// completion (sink.EndComplete). Until then
// the region is "being written": a cancel or a lease expiry fails its
// transfers at once but keeps its memory, as writer grace requires for any
// transport, because bytes may still arrive.
//
// A producer that vanishes never completes nor abandons. Its writes end
// with it (its engine's connections go), but the shard cannot see that,
// so it ends such a write itself after remoteGrace leases: one lease for
// the producer to write (its own deadline is shorter), one for bytes still
// in flight to land.
const remoteGrace = 2

// remoteWrite is a region admitted for a one-sided writer.
type remoteWrite struct {
	tok    ids.Token
	end    time.Time // when the shard gives up on the writer
	mmHash string    // names the item in trace stamps
}

// admitRemoteLocked opens the region's write for each new write grant.
// A grant repeated for a producer that lost the reply is already open.
// grants answer items, one for one.
func (s *Shard) admitRemoteLocked(grants []reserve.Grant, items []reserve.Item, now time.Time) {
	if s.direct == nil {
		return
	}
	for i, g := range grants {
		if g.Err != nil || g.Kind != reserve.KindWrite {
			continue
		}
		if _, open := s.remote[g.Res]; open {
			continue
		}
		if _, err := s.table.BeginWrite(g.Res, g.Token, 0, g.NBytes, now); err != nil {
			// The table just granted it: a broken invariant. The grant
			// still goes out; its writer's complete will fail cleanly.
			s.log.Error("consumer: cannot admit a one-sided writer to its own grant", "res", g.Res, "cause", err)
			continue
		}
		rw := remoteWrite{tok: g.Token, end: now.Add(remoteGrace * s.cfg.Lease())}
		if i < len(items) {
			rw.mmHash = items[i].MMHash
		}
		s.remote[g.Res] = rw
	}
}

// remoteAddr is the address a one-sided writer targets for grant g.
func (s *Shard) remoteAddr(g reserve.Grant) uint64 {
	if s.direct == nil || g.Kind != reserve.KindWrite {
		return 0
	}
	return s.direct.RemoteAddr(g.Offset)
}

// endRemoteLocked ends the writer's write of res when tok is its token:
// landed when the writer completes, torn when it abandons.
func (s *Shard) endRemoteLocked(res ids.ResID, tok ids.Token, landed bool, now time.Time) {
	rw, open := s.remote[res]
	if !open || !rw.tok.Equal(tok) {
		return
	}
	delete(s.remote, res)
	s.table.EndWrite(res, landed, now)
}

// WatchRemote implements transport.RemoteSink: res must be a one-sided
// write this shard opened at its grant, tok its token. A receiver that
// completes in-band (cuda_ipc's ready words) watches for it until the
// shard gives up on the writer.
func (k sink) WatchRemote(res ids.ResID, tok ids.Token) (time.Time, error) {
	s := k.s
	s.mu.Lock()
	defer s.mu.Unlock()
	rw, err := s.openRemoteLocked(res, tok)
	if err != nil {
		return time.Time{}, err
	}
	return rw.end, nil
}

// CompleteRemote implements transport.RemoteSink: it ends the one-sided
// write landed and completes the reservation, as a complete message
// would, and publishes readiness before it returns. The write is no
// longer open afterwards, so a second call is refused and nothing is
// published twice.
func (k sink) CompleteRemote(res ids.ResID, tok ids.Token) error {
	s := k.s
	s.mu.Lock()
	now := time.Now()
	rw, err := s.openRemoteLocked(res, tok)
	if err == nil {
		trace.Stamp(trace.ReadyWordSeen, rw.mmHash)
		s.endRemoteLocked(res, tok, true, now)
		err = s.table.Complete(res, tok, now)
		s.flushLocked()
	}
	s.mu.Unlock()
	if err != nil {
		s.log.Warn("in-band complete of a one-sided write refused", "res", res, "cause", err)
		return refusal(err)
	}
	return nil
}

// openRemoteLocked is res's open one-sided write, when tok is its token.
func (s *Shard) openRemoteLocked(res ids.ResID, tok ids.Token) (remoteWrite, error) {
	rw, open := s.remote[res]
	switch {
	case !open:
		return rw, fmt.Errorf("region %d has no open one-sided write: %w", res, transport.ErrUnknownRes)
	case !rw.tok.Equal(tok):
		return rw, fmt.Errorf("one-sided write of region %d: %w", res, transport.ErrBadToken)
	}
	return rw, nil
}

// expireRemoteLocked ends the writes whose writer never came back.
func (s *Shard) expireRemoteLocked(now time.Time) {
	for res, rw := range s.remote {
		if now.Before(rw.end) {
			continue
		}
		delete(s.remote, res)
		s.log.Warn("one-sided writer never completed nor abandoned; ending its write", "res", res)
		s.table.EndWrite(res, false, now)
	}
}

// nextDeadlineLocked is the earliest of the table's deadlines and the
// one-sided writers' ends.
func (s *Shard) nextDeadlineLocked() (time.Time, bool) {
	next, ok := s.table.NextDeadline()
	for _, rw := range s.remote {
		if !ok || rw.end.Before(next) {
			next, ok = rw.end, true
		}
	}
	return next, ok
}

// Memory lets a one-sided transport register the slab.
func (k sink) Memory() (uintptr, uint64, string) {
	m := k.s.slab.Memory()
	return m.Addr, m.Len, m.Device
}
