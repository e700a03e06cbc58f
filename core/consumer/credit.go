package consumer

import (
	"cmp"
	"errors"
	"slices"
	"time"

	"github.com/ecmooncake/ecmooncake/core/fsm/reserve"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// Standing credit (core/fsm/reserve credit.go): a producer that asks for a
// window (credit_bytes in reserve_batch or claim_batch) learns it in the
// reply, writes a batch into it over the one-sided data plane with no
// reserve round trip, and names the items in one claim_batch. Only a shard
// with a one-sided plane grants credit: TCP's frames pass the shard's own
// receiver, which admits them only into a live region, and they complete
// in-band already.

// creditLocked grants or renews requester's window on peer, as the wire
// carries it; nil when the shard grants none. Under mu.
func (s *Shard) creditLocked(peer, requester string, want uint64, now time.Time) *wire.CreditGrant {
	if want == 0 || s.direct == nil || s.cfg.CreditWindowBytes == 0 {
		return nil
	}
	c, ok := s.table.Credit(peer, requester, want, now)
	if !ok {
		return nil
	}
	g := &wire.CreditGrant{
		Gen: c.Gen, Version: c.Version, Token: c.Token, Base: s.direct.RemoteAddr(0),
		LeaseMs: uint64(max(c.Deadline.Sub(now), 0) / time.Millisecond),
		Extents: make([]wire.CreditExtent, 0, min(len(c.Extents), wire.MaxCreditExtents)),
	}
	for _, e := range largest(c.Extents, wire.MaxCreditExtents) {
		g.Extents = append(g.Extents, wire.CreditExtent{Off: e.Off, Len: e.Len})
	}
	return g
}

// largest is the n largest of extents, in offset order: a window cut in
// more pieces than a reply carries is told of its largest ones, and the
// room of the others waits unused until claims and top-ups join it.
func largest(extents []reserve.Extent, n int) []reserve.Extent {
	if len(extents) <= n {
		return extents
	}
	by := slices.Clone(extents)
	slices.SortStableFunc(by, func(a, b reserve.Extent) int { return cmp.Compare(b.Len, a.Len) })
	by = by[:n]
	slices.SortFunc(by, func(a, b reserve.Extent) int { return cmp.Compare(a.Off, b.Off) })
	return by
}

// claim files a batch a producer wrote into its window, and renews the
// window in the reply. Each item is refused before any region exists
// unless the window covers it; a refused item is answered with
// GrantCreditRefused, and its producer reserves it again.
func (s *Shard) claim(peer string, b wire.ClaimBatch) wire.ClaimBatchReply {
	claims := make([]reserve.Claim, len(b.Items))
	for i, it := range b.Items {
		claims[i] = reserve.Claim{
			Item:   reserve.Item{TransferID: it.TransferID, MMHash: it.MMHash, NBytes: it.NBytes, Meta: it.Meta, Owner: b.Requester, Peer: peer},
			Offset: it.Offset, Gen: b.Gen, Token: b.Token,
		}
	}
	s.mu.Lock()
	now := time.Now()
	grants := s.table.Claim(claims, now)
	credit := s.creditLocked(peer, b.Requester, b.CreditBytes, now)
	s.flushLocked()
	s.mu.Unlock()
	out := wire.ClaimBatchReply{Grants: make([]wire.Grant, len(grants)), Credit: credit, Epoch: s.epoch}
	for i, g := range grants {
		w := wire.Grant{TransferID: g.TransferID, Kind: g.Kind.String(), NBytes: g.NBytes}
		if g.Err != nil {
			w.Kind, w.Err = "", g.Err.Error()
			switch {
			case errors.Is(g.Err, reserve.ErrNoCredit), errors.Is(g.Err, reserve.ErrStaleCredit),
				errors.Is(g.Err, reserve.ErrBadToken), errors.Is(g.Err, reserve.ErrOutOfBounds):
				w.Code = wire.GrantCreditRefused
			case errors.Is(g.Err, reserve.ErrInProgress):
				w.Code = wire.GrantInProgress
			case errors.Is(g.Err, reserve.ErrOverQuota):
				w.Code = wire.GrantOverQuota
			}
			s.log.Warn("claim refused", "transfer_id", g.TransferID, "mm_hash", claims[i].MMHash, "offset", claims[i].Offset, "nbytes", claims[i].NBytes, "cause", g.Err)
		} else if g.Kind == reserve.KindWrite {
			w.Res, w.Token = uint64(g.Res), g.Token
			s.tookOver(g, claims[i].MMHash, peer)
		}
		out.Grants[i] = w
	}
	return out
}
