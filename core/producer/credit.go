package producer

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/ecmooncake/ecmooncake/core/fsm/push"
	"github.com/ecmooncake/ecmooncake/core/fsm/slab"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// Standing credit (credit_window_bytes): each shard with a one-sided data
// plane grants this producer a window of slab room ahead, in the reserve
// and claim replies it gets anyway. A batch whose items all fit the window
// takes their regions from it here, with no reserve_batch: the manager is
// granted them at once, the bytes go over the one-sided plane as for any
// grant, and one claim_batch per shard names them when the write ended, in
// place of complete_batch; the shard files each item already written. A
// batch that does not fit (an empty window is the shard's backpressure),
// and every batch to a shard that granted no window (TCP, credit off
// there), reserves as before; both are counted (CreditBatches,
// CreditFallbacks). A claim the shard refuses (its window went stale: a
// restart, a lapsed lease) drops the window, and its items are reserved,
// written and completed again from the sources the write still holds: the
// push goes on.
//
// Safety of the window's room: the producer carves only until half the
// lease the shard last gave, counted from when it sent the request that
// brought it, and the shard keeps the room for the whole lease, so a write
// in flight lands in room the shard still holds for it unless the write
// itself outlasts half the lease. A reply applies only when its window
// version is newer than the last one applied (replies of pipelined calls
// may cross; a dropped window keeps its floor), and the room of items
// carved and not yet claimed (a cancelled one's until its write ended) is
// taken out of whatever a reply says, so two items never share bytes.
//
// Dedup: content that more than one live push carries is reserved, so
// that the manager learns from the grants which write each follows. A
// carved item's grant is provisional in the manager until its claim is
// answered: a write of its content it may be made to follow is not given
// up meanwhile, and a claim answered follower marks that write followed
// (push.Manager.FollowsAt), as a follow grant would.

// creditWindow is this producer's window on one shard, as the shard last
// told it, less what was carved since.
type creditWindow struct {
	gen    uint64
	token  ids.Token
	base   uint64
	plane  string    // the data plane of the incarnation that granted it
	usable time.Time // carve only before
	free   []wire.CreditExtent
}

// creditSeen is the newest window state applied from a shard: its
// generation and version. It outlives a dropped window, so that a reply
// that crossed a newer one (or the drop) is never applied.
type creditSeen struct{ gen, version uint64 }

func (a creditSeen) newer(b creditSeen) bool {
	return a.gen > b.gen || (a.gen == b.gen && a.version > b.version)
}

// carved is an item that took its region from a window: what its claim
// will name.
type carved struct {
	dest  string
	gen   uint64
	token ids.Token
	item  wire.ClaimItem
	// writing: a write of it was launched; cancelled: its push was
	// cancelled meanwhile, so the write's end claims nothing.
	writing, cancelled bool
}

func (c carved) extent() wire.CreditExtent {
	return wire.CreditExtent{Off: c.item.Offset, Len: alignUp(c.item.NBytes)}
}

// creditResBase starts the ids of carved items: far above any id a shard
// issues (a counter from 1), so that the two never meet.
const creditResBase ids.ResID = 1 << 63

func alignUp(n uint64) uint64 { return (n + slab.Align - 1) &^ (slab.Align - 1) }

// CreditStats counts the standing credit.
type CreditStats struct {
	Batches   uint64 `json:"credit_batches"`   // batches that took their regions from a window
	Fallbacks uint64 `json:"credit_fallbacks"` // batches that reserved with credit on
	Refused   uint64 `json:"claims_refused"`   // carved items the window no longer served (write or claim refused), reserved again
	Wasted    uint64 `json:"claims_wasted"`    // claimed items the shard already held or was receiving
}

// noteCreditLocked applies the window a reply of dest brought, sent at
// sent; nil drops the window (the shard grants none). A reply no newer
// than what was applied is stale: another crossed it.
func (p *Producer) noteCreditLocked(dest string, c *wire.CreditGrant, sent time.Time, plane string) {
	if c == nil {
		delete(p.credit, dest)
		return
	}
	seen := creditSeen{c.Gen, c.Version}
	if last, ok := p.credSeen[dest]; ok && !seen.newer(last) {
		return
	}
	p.credSeen[dest] = seen
	w := &creditWindow{gen: c.Gen, token: c.Token, base: c.Base, plane: plane,
		usable: sent.Add(time.Duration(c.LeaseMs) * time.Millisecond / 2), free: slices.Clone(c.Extents)}
	// Room carved here and not yet claimed there is still free in the
	// reply: not for another item.
	for _, k := range p.carves {
		if k.dest == dest {
			w.free = subtract(w.free, k.extent())
		}
	}
	p.credit[dest] = w
}

// noteWritingLocked marks the carved items among ws as written from now
// on, so that a cancel lets their write end before their room is free.
func (p *Producer) noteWritingLocked(ws []push.Write) {
	for _, w := range ws {
		if k, ok := p.carves[w.Res]; ok {
			k.writing = true
			p.carves[w.Res] = k
		}
	}
}

// creditTakeLocked grants the batch items to dest from its window, all of
// them or none, and reports whether it did.
func (p *Producer) creditTakeLocked(dest string, items []push.ReserveItem, now time.Time) bool {
	if p.cfg.CreditWindowBytes == 0 {
		return false
	}
	w := p.credit[dest]
	// A plane whose frames pass the shard's receiver (TCP, completing
	// in-band) admits bytes only into regions that exist: a window is of
	// no use over it, as to a producer on another host of a shard that
	// also serves a one-sided plane.
	if w == nil || !now.Before(w.usable) || transport.InBand(p.writer, w.plane) {
		p.creditStats.Fallbacks++
		return false
	}
	for _, it := range items {
		if p.mgr.Shared(it.MMHash) {
			p.creditStats.Fallbacks++
			return false
		}
	}
	free := slices.Clone(w.free)
	offs := make([]uint64, len(items))
	for i, it := range items {
		off, ok := firstFit(free, alignUp(it.NBytes))
		if !ok {
			p.creditStats.Fallbacks++
			return false
		}
		offs[i] = off
		free = subtract(free, wire.CreditExtent{Off: off, Len: alignUp(it.NBytes)})
	}
	w.free = free
	p.creditStats.Batches++
	for i, it := range items {
		p.creditRes++
		res := creditResBase + p.creditRes
		p.carves[res] = carved{dest: dest, gen: w.gen, token: w.token,
			item: wire.ClaimItem{TransferID: it.TransferID, MMHash: it.MMHash, NBytes: it.NBytes, Meta: it.Meta, Offset: offs[i]}}
		p.mgr.Granted(it.TransferID, dest, push.Grant{Kind: push.KindWrite, Res: res, Token: w.token, NBytes: it.NBytes,
			Addr: w.base + offs[i], Plane: w.plane, Provisional: true}, now)
	}
	p.creditAgain = true
	return true
}

// dropCreditCancelsLocked answers, with no message, the cancels of carved
// items: nothing was claimed, so the shard holds nothing of theirs (their
// room stays in the window). An item whose write is out keeps its room
// until the write ends (claimWritten), so that no other item is carved
// where it may still land. It returns the other cancels.
func (p *Producer) dropCreditCancelsLocked(dest string, cs []push.Cancel, now time.Time) []push.Cancel {
	out := cs[:0:0]
	for _, c := range cs {
		k, ok := p.carves[c.Res]
		if !ok {
			out = append(out, c)
			continue
		}
		if k.writing {
			k.cancelled = true
			p.carves[c.Res] = k
		} else {
			delete(p.carves, c.Res)
		}
		p.mgr.CancelDone(c.TransferID, dest, now)
	}
	return out
}

// claimWritten ends the carved items of a write batch to dest: one
// claim_batch names those that landed, a refused one is reserved, written
// and completed again, and each is reported to the manager as done
// (WriteDoneInBand: no complete follows). It returns which of ws it ended;
// the caller reports the others as before.
func (p *Producer) claimWritten(dest, addr string, ws []push.Write, items []transport.WriteItem, errs []error) map[int]bool {
	p.mu.Lock()
	var landed, failed []int
	done := map[int]error{}
	metas := map[int]string{}
	byGen := map[uint64][]int{}
	for i, w := range ws {
		k, ok := p.carves[w.Res]
		if !ok {
			continue
		}
		if k.cancelled {
			// Its push went away: its write ended, and its room is free
			// again; the caller reports the write as for any other.
			delete(p.carves, w.Res)
			continue
		}
		metas[i] = k.item.Meta
		if err := errAt(errs, i); err != nil {
			// The window's plane failed it (a shard restarted on another
			// slab, say): the window is no good, and the item reserves.
			p.log.Warn("write into the credit window failed; reserving the item", "peer", dest, "transfer_id", w.TransferID, "cause", err)
			delete(p.carves, w.Res)
			delete(p.credit, dest)
			p.creditStats.Refused++
			failed = append(failed, i)
			continue
		}
		landed = append(landed, i)
		byGen[k.gen] = append(byGen[k.gen], i)
	}
	p.mu.Unlock()
	if len(failed) == 0 && len(landed) == 0 {
		return nil
	}
	again := failed
	for _, idx := range byGen {
		for _, i := range p.claim(dest, ws, idx) {
			again = append(again, i)
		}
		for _, i := range idx {
			if !slices.Contains(again, i) {
				done[i] = nil
			}
		}
	}
	if len(again) > 0 {
		for i, err := range p.reserveAgain(dest, addr, ws, items, again, metas) {
			done[again[i]] = err
		}
	}
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	ended := make(map[int]bool, len(done))
	for i, err := range done {
		p.mgr.WriteDoneInBand(ws[i].TransferID, dest, err, now)
		ended[i] = true
	}
	return ended
}

func errAt(errs []error, i int) error {
	if i < len(errs) {
		return errs[i]
	}
	return errors.New("transport returned too few results")
}

// claim sends one claim_batch for the carved items idx of ws (one
// window generation) and returns those the shard refused for credit, to
// be reserved again. Any other refusal, or a failed call, is the item's
// end too: reported through the manager as a failed write.
func (p *Producer) claim(dest string, ws []push.Write, idx []int) (again []int) {
	p.mu.Lock()
	req := wire.ClaimBatch{Requester: p.requester, CreditBytes: p.cfg.CreditWindowBytes}
	for _, i := range idx {
		// Only claimWritten ends these carves: they are all here.
		k := p.carves[ws[i].Res]
		req.Gen, req.Token = k.gen, k.token
		req.Items = append(req.Items, k.item)
	}
	plane := ""
	if w := p.credit[dest]; w != nil {
		plane = w.plane
	}
	p.mu.Unlock()

	start := time.Now()
	var rep wire.ClaimBatchReply
	err := p.call(dest, wire.OpClaimBatch, req, &rep)
	if err == nil {
		metrics.Phase(PhaseClaimRTT, time.Since(start))
	}
	if err == nil && len(rep.Grants) != len(idx) {
		err = fmt.Errorf("claim_batch to %s: %d grants for %d items", dest, len(rep.Grants), len(idx))
	}

	p.mu.Lock()
	defer p.mu.Unlock()
	for _, i := range idx {
		delete(p.carves, ws[i].Res)
	}
	if err != nil {
		// Nothing is known of what the shard filed: reserve them all. A
		// claim that was filed answers the reserve as the same transfer's
		// grant (a write grant of a ready region) or as done.
		delete(p.credit, dest)
		p.creditStats.Refused += uint64(len(idx))
		return idx
	}
	p.noteCreditLocked(dest, rep.Credit, start, plane)
	now := time.Now()
	for k, g := range rep.Grants {
		switch {
		case g.Err == "" && g.Kind == wire.KindFollow:
			p.creditStats.Wasted++
			p.mgr.FollowsAt(ws[idx[k]].TransferID, dest, now)
		case g.Err == "" && g.Kind != wire.KindWrite:
			p.creditStats.Wasted++
		case g.Err != "":
			p.log.Warn("claim refused; reserving the item", "peer", dest, "transfer_id", g.TransferID, "code", g.Code, "cause", g.Err)
			p.creditStats.Refused++
			if g.Code == wire.GrantCreditRefused {
				delete(p.credit, dest)
			}
			again = append(again, idx[k])
		}
	}
	return again
}

// PhaseClaimRTT times a claim_batch round trip (package metrics).
const PhaseClaimRTT = "claim_rtt"

// reserveAgain takes items idx of ws, whose claim was refused, through
// today's path while their sources are still held: reserve_batch, the
// write into the granted regions, complete_batch. It returns each item's
// outcome.
func (p *Producer) reserveAgain(dest, addr string, ws []push.Write, items []transport.WriteItem, idx []int, metas map[int]string) []error {
	out := make([]error, len(idx))
	fail := func(err error) []error {
		for i := range out {
			out[i] = err
		}
		return out
	}
	req := wire.ReserveBatch{Requester: p.requester}
	for _, i := range idx {
		req.Items = append(req.Items, wire.ReserveItem{TransferID: ws[i].TransferID, MMHash: ws[i].MMHash, NBytes: ws[i].NBytes, Meta: metas[i]})
	}
	var rep wire.ReserveBatchReply
	if err := p.call(dest, wire.OpReserveBatch, req, &rep); err != nil {
		return fail(fmt.Errorf("reserve after a refused claim: %w", err))
	}
	if len(rep.Grants) != len(idx) {
		return fail(fmt.Errorf("reserve_batch to %s: %d grants for %d items", dest, len(rep.Grants), len(idx)))
	}
	// The shard may have restarted on another data plane: write where the
	// incarnation that granted says.
	if pl := p.replyPlane(dest, rep); pl.addr != "" {
		addr = pl.addr
		p.mu.Lock()
		p.notePlaneLocked(dest, pl)
		p.mu.Unlock()
	}
	var writes []transport.WriteItem
	var at []int
	var cb wire.CompleteBatch
	for k, g := range rep.Grants {
		switch {
		case g.Err != "":
			out[k] = fmt.Errorf("reserve after a refused claim: %s", g.Err)
		case g.Kind == wire.KindWrite:
			it := items[idx[k]]
			it.Res, it.Token, it.Addr, it.Size = ids.ResID(g.Res), g.Token, g.Addr, g.NBytes
			writes = append(writes, it)
			at = append(at, k)
			cb.Items = append(cb.Items, wire.CompleteItem{TransferID: g.TransferID, Res: g.Res, Token: g.Token})
		}
	}
	if len(writes) == 0 {
		return out
	}
	for j, err := range p.writeTo(dest, addr, writes) {
		if err != nil {
			out[at[j]] = err
			cb.Items[j].Abandon, cb.Items[j].Reason = true, "write failed"
		}
	}
	var crep wire.CompleteBatchReply
	if err := p.call(dest, wire.OpCompleteBatch, cb, &crep); err != nil {
		for _, k := range at {
			if out[k] == nil {
				out[k] = fmt.Errorf("complete after a refused claim: %w", err)
			}
		}
		return out
	}
	for j, r := range crep.Results {
		if j < len(at) && r.Err != "" && out[at[j]] == nil {
			out[at[j]] = fmt.Errorf("complete after a refused claim at %s: %s", dest, r.Err)
		}
	}
	return out
}

// firstFit finds the lowest offset of free where n bytes fit.
func firstFit(free []wire.CreditExtent, n uint64) (uint64, bool) {
	for _, e := range free {
		if e.Off%slab.Align == 0 && e.Len >= n {
			return e.Off, true
		}
	}
	return 0, false
}

// subtract takes x out of the sorted extents free.
func subtract(free []wire.CreditExtent, x wire.CreditExtent) []wire.CreditExtent {
	out := make([]wire.CreditExtent, 0, len(free)+1)
	xe := x.Off + x.Len
	for _, e := range free {
		ee := e.Off + e.Len
		if ee <= x.Off || e.Off >= xe {
			out = append(out, e)
			continue
		}
		if e.Off < x.Off {
			out = append(out, wire.CreditExtent{Off: e.Off, Len: x.Off - e.Off})
		}
		if ee > xe {
			out = append(out, wire.CreditExtent{Off: xe, Len: ee - xe})
		}
	}
	return out
}
