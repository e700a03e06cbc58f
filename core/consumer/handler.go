package consumer

import (
	"errors"
	"fmt"
	"time"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/fsm/reserve"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/trace"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// handler answers control requests on the server goroutine. Every op is a
// few table calls under the mutex: no I/O, so the server never stalls.
type handler struct{ s *Shard }

var (
	_ control.Handler     = handler{}
	_ control.PeerWatcher = handler{}
)

// PeerGone: a producer's connection ended (on the Unix path), perhaps
// with its process. The writes it was granted stay as they are, but
// another producer's reserve of their content may take them over
// (reserve.Table.PeerGone), so that an item the proxy sends to a second
// encoder does not wait out the dead writer's lease.
func (h handler) PeerGone(peer string) {
	s := h.s
	s.mu.Lock()
	n := s.table.PeerGone(peer, time.Now())
	s.mu.Unlock()
	if n > 0 {
		s.log.Warn("a writer's connection ended; its writes may be taken over", "peer", peer, "writes", n)
	}
}

func (h handler) Handle(req wire.Request) wire.Reply {
	s := h.s
	switch req.Op {
	case wire.OpPeers:
		return wire.OKReply(req.ID, s.peers())
	case wire.OpEventPort:
		return wire.OKReply(req.ID, wire.EventPortReply{Endpoint: s.events.Endpoint(), Epoch: s.epoch})
	case wire.OpReserveBatch:
		return answer(req, func(b wire.ReserveBatch) wire.ReserveBatchReply { return s.reserve(req.Peer, b) })
	case wire.OpClaimBatch:
		return answer(req, func(b wire.ClaimBatch) wire.ClaimBatchReply { return s.claim(req.Peer, b) })
	case wire.OpCompleteBatch:
		return answer(req, s.complete)
	case wire.OpCancel:
		return answer(req, s.cancel)
	case wire.OpStatus:
		return answer(req, s.status)
	default:
		return wire.ErrReply(req.ID, wire.CodeUnknownOp, fmt.Sprintf("consumer shard does not serve op %q", req.Op))
	}
}

// answer decodes req's body as a B and replies with what op makes of it.
func answer[B interface{ Validate() error }, R any](req wire.Request, op func(B) R) wire.Reply {
	body, err := wire.DecodeBody[B](req.Body)
	if err != nil {
		return wire.ErrReply(req.ID, wire.CodeBadRequest, fmt.Sprintf("%s: %v", req.Op, err))
	}
	return wire.OKReply(req.ID, op(body))
}

// tookOver logs a write grant that took over an orphaned write (counted
// by the table: ecm_orphaned_writes_total{outcome="taken_over"}).
func (s *Shard) tookOver(g reserve.Grant, mmHash, peer string) {
	if g.TookOver {
		s.log.Warn("write taken over from a writer whose connection ended", "transfer_id", g.TransferID, "mm_hash", mmHash, "peer", peer)
	}
}

// peers describes the whole consumer as this shard knows it: every shard's
// control endpoint follows from the port convention, but only this shard's
// data-plane address is known here, so a producer asks each shard once.
func (s *Shard) peers() wire.PeersReply {
	shards := make([]wire.ShardInfo, s.cfg.TPSize)
	for r := range shards {
		shards[r] = wire.ShardInfo{Rank: r, Control: control.Endpoint(s.cfg.IP, config.ShardPort(s.cfg.Port, s.cfg.DPRank, s.cfg.TPSize, r))}
	}
	shards[s.cfg.TPRank].Control = s.server.Endpoint()
	offer := transport.Offer(s.recv, s.cfg.Transport)
	shards[s.cfg.TPRank].Data = offer
	shards[s.cfg.TPRank].Epoch = s.epoch
	return wire.PeersReply{
		Shards: shards, TPSize: s.cfg.TPSize, DPRank: s.cfg.DPRank, Host: s.host,
		SlabBytes: s.slab.Size(), Transports: transport.Names(offer),
	}
}

// reserve answers a batch that came on the connection peer: its quota is
// that connection's, whatever requester the batch names, since only the
// connection is proven (by the secret, or by the kernel's peer
// credentials).
func (s *Shard) reserve(peer string, b wire.ReserveBatch) wire.ReserveBatchReply {
	trace.StampAll(trace.ReserveReceived, b.Items, reserveItemKey)
	defer trace.StampAll(trace.ReserveReplied, b.Items, reserveItemKey)
	items := make([]reserve.Item, len(b.Items))
	for i, it := range b.Items {
		items[i] = reserve.Item{TransferID: it.TransferID, MMHash: it.MMHash, NBytes: it.NBytes, Meta: it.Meta, Owner: b.Requester, Peer: peer}
	}
	s.mu.Lock()
	now := time.Now()
	grants := s.table.Reserve(items, now)
	s.admitRemoteLocked(grants, items, now)
	credit := s.creditLocked(peer, b.Requester, b.CreditBytes, now)
	s.flushLocked()
	s.mu.Unlock()
	out := wire.ReserveBatchReply{Grants: make([]wire.Grant, len(grants)), Epoch: s.epoch, Host: s.host, Data: transport.Offer(s.recv, s.cfg.Transport), Credit: credit}
	for i, g := range grants {
		w := wire.Grant{TransferID: g.TransferID, Kind: g.Kind.String(), NBytes: g.NBytes}
		if g.Err != nil {
			w.Err = g.Err.Error()
			switch {
			case errors.Is(g.Err, reserve.ErrInProgress):
				w.Code = wire.GrantInProgress
			case errors.Is(g.Err, reserve.ErrOverQuota):
				w.Code = wire.GrantOverQuota
			}
			s.log.Warn("reserve refused", "transfer_id", g.TransferID, "mm_hash", items[i].MMHash, "nbytes", items[i].NBytes, "cause", g.Err)
		} else if g.Kind == reserve.KindWrite {
			w.Res, w.Token, w.Addr = uint64(g.Res), g.Token, s.remoteAddr(g)
			s.tookOver(g, items[i].MMHash, peer)
		}
		out.Grants[i] = w
	}
	return out
}

func (s *Shard) complete(b wire.CompleteBatch) wire.CompleteBatchReply {
	now := time.Now()
	out := wire.CompleteBatchReply{Results: make([]wire.ItemResult, len(b.Items))}
	s.mu.Lock()
	for i, it := range b.Items {
		var err error
		if it.Abandon {
			s.endRemoteLocked(ids.ResID(it.Res), it.Token, false, now)
			err = s.table.Abandon(ids.ResID(it.Res), it.Token, it.Reason, now)
		} else {
			s.endRemoteLocked(ids.ResID(it.Res), it.Token, true, now)
			err = s.table.Complete(ids.ResID(it.Res), it.Token, now)
		}
		out.Results[i].TransferID = it.TransferID
		if err != nil {
			out.Results[i].Err = err.Error()
		}
	}
	s.flushLocked()
	s.mu.Unlock()
	for i, r := range out.Results {
		if r.Err != "" {
			s.log.Warn("complete refused", "transfer_id", r.TransferID, "res", b.Items[i].Res, "cause", r.Err)
		}
	}
	return out
}

func (s *Shard) cancel(b wire.Cancel) wire.CancelReply {
	now := time.Now()
	n := 0
	s.mu.Lock()
	for _, id := range b.TransferIDs {
		// A cancel by id carries no token: it detaches waiters and
		// followers, and leaves a write to the holder of its token.
		switch err := s.table.Detach(id, now); {
		case err == nil:
			n++
		case errors.Is(err, reserve.ErrNeedsToken):
			s.cancelsLeft++
			s.log.Debug("cancel left a write to its writer", "transfer_id", id, "cause", err)
		case !errors.Is(err, reserve.ErrUnknown):
			s.log.Warn("cancel refused", "transfer_id", id, "cause", err)
		}
	}
	s.flushLocked()
	s.mu.Unlock()
	return wire.CancelReply{Cancelled: n}
}

func (s *Shard) status(b wire.Status) wire.StatusReply {
	out := wire.StatusReply{Items: make([]wire.ItemStatus, len(b.TransferIDs)), Epoch: s.epoch}
	s.mu.Lock()
	defer s.mu.Unlock()
	for i, id := range b.TransferIDs {
		out.Items[i].TransferID = id
		st, ok := s.table.Status(id)
		if !ok {
			continue
		}
		out.Items[i] = wire.ItemStatus{TransferID: id, MMHash: st.MMHash, State: st.State.String(), NBytes: st.NBytes, Known: true, Done: st.Done}
	}
	return out
}

// sink lets the data plane ask the table where each frame may land.
type sink struct{ s *Shard }

var (
	_ transport.RegionSink   = sink{}
	_ transport.CompleteSink = sink{}
	_ transport.RemoteSink   = sink{}
	_ transport.FlushSink    = sink{}
)

func (k sink) BeginWrite(res ids.ResID, tok ids.Token, off, n uint64) ([]byte, error) {
	s := k.s
	s.mu.Lock()
	defer s.mu.Unlock()
	at, err := s.table.BeginWrite(res, tok, off, n, time.Now())
	if err != nil {
		return nil, refusal(err)
	}
	dst, err := s.slab.View(at, n)
	if err != nil {
		// The table granted a region the slab cannot show: a broken
		// invariant. Undo the write count so the region can still end.
		s.table.EndWrite(res, false, time.Now())
		s.flushLocked()
		return nil, fmt.Errorf("consumer: reservation %d maps outside the slab: %w", res, err)
	}
	return dst, nil
}

// BeginRegion admits a frame like BeginWrite but answers with where it
// lands in the slab: the way in for transports that write a GPU slab.
func (k sink) BeginRegion(res ids.ResID, tok ids.Token, off, n uint64) (uint64, error) {
	s := k.s
	s.mu.Lock()
	defer s.mu.Unlock()
	at, err := s.table.BeginWrite(res, tok, off, n, time.Now())
	if err != nil {
		return 0, refusal(err)
	}
	return at, nil
}

func (k sink) EndWrite(res ids.ResID, ok bool) {
	s := k.s
	s.mu.Lock()
	s.table.EndWrite(res, ok, time.Now())
	s.flushLocked()
	s.mu.Unlock()
}

// EndComplete ends a frame that carried its item's completion (TCP): the
// frame that leaves every byte landed completes the item, and its Ready
// events go out (Flush) before the frame is acknowledged, so no
// complete_batch follows the bytes. The receiver calls Flush once for the
// frames that arrived together, so that they cost the scheduler one event
// message, not one each.
//
// A shard with a one-sided plane beside TCP opened the region's write for
// a one-sided writer at the grant (direct.go); a frame that brings the
// completion with the grant's token says its writer chose TCP, so that
// placeholder write ends here, as the complete would have ended it.
func (k sink) EndComplete(res ids.ResID, tok ids.Token, off, n uint64) error {
	s := k.s
	s.mu.Lock()
	now := time.Now()
	s.endRemoteLocked(res, tok, true, now)
	err := s.table.EndComplete(res, tok, off, n, now)
	if next, ok := s.nextDeadlineLocked(); ok {
		s.ticks.Due(next)
	}
	s.mu.Unlock()
	if err != nil {
		s.log.Warn("in-band complete refused", "res", res, "offset", off, "length", n, "cause", err)
		return refusal(err)
	}
	return nil
}

// Flush sends the events the frames ended since the last call left
// pending (transport.FlushSink); any other call that flushes the shard's
// events sends them too, in order.
func (k sink) Flush() {
	k.s.mu.Lock()
	k.s.sendEventsLocked()
	k.s.mu.Unlock()
}

// refusal tags a table refusal with the data plane's reason, so the writer
// learns why (and the receiver counts it) without knowing the table.
func refusal(err error) error {
	var reason error
	switch {
	case errors.Is(err, reserve.ErrBadToken):
		reason = transport.ErrBadToken
	case errors.Is(err, reserve.ErrUnknown):
		reason = transport.ErrUnknownRes
	case errors.Is(err, reserve.ErrOutOfBounds):
		reason = transport.ErrOutOfBounds
	case errors.Is(err, reserve.ErrGone), errors.Is(err, reserve.ErrNotWritable), errors.Is(err, reserve.ErrNoWrite):
		reason = transport.ErrGone
	default:
		return err
	}
	return fmt.Errorf("%w: %w", reason, err)
}

func reserveItemKey(it wire.ReserveItem) string { return it.MMHash }
