package producer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ecmooncake/ecmooncake/core/fsm/push"
	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/trace"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// driver is the goroutine that takes the manager's step when a deadline
// falls due or when woken (by Cancel, say); Submit, Sources and each
// ending batch take it themselves (see advance). It never does I/O itself: each batch runs on
// its own goroutine and reports back through the manager.
func (p *Producer) driver() {
	defer p.wg.Done()
	p.steps.Run(p.life.Done(), func() (next time.Time, ok bool) {
		defer p.recover("driver")
		p.mu.Lock()
		defer p.mu.Unlock()
		p.stepLocked()
		return p.mgr.NextDeadline()
	})
}

// stepLocked ticks the manager and applies what it has ready.
func (p *Producer) stepLocked() {
	now := time.Now()
	p.mgr.Tick(now)
	p.applyLocked(p.mgr.Ready(now))
	// A batch granted from a credit window (credit.go) can write now.
	for p.creditAgain {
		p.creditAgain = false
		p.applyLocked(p.mgr.Ready(now))
	}
}

// advance takes the driver's step on a batch's goroutine as the batch
// ends, so that what its outcome made ready (the write after a reserve,
// the complete after a write, the done after a complete) starts without a
// hand-off to the driver goroutine, a thread wake-up each.
func (p *Producer) advance() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.advanceLocked()
}

// advanceLocked is advance for a caller that holds mu (Submit and
// Sources, whose pushes and sources the step sends on at once). The driver is woken
// only when the step left a deadline before the one it waits for, or when
// the step failed, for the driver to take it again.
func (p *Producer) advanceLocked() {
	if p.life.Ended() {
		return
	}
	defer func() {
		if r := recover(); r != nil {
			_ = p.panicked("driver step", r)
			p.kick()
		}
	}()
	p.stepLocked()
	if next, ok := p.mgr.NextDeadline(); ok {
		p.steps.Due(next)
	}
}

// applyLocked records outcomes and launches one goroutine per batch.
func (p *Producer) applyLocked(r push.Effects) {
	if r.Empty() {
		return
	}
	for dest, items := range r.Reserves {
		if p.creditTakeLocked(dest, items, time.Now()) {
			continue
		}
		p.launch("reserve_batch", dest, func() { p.reserve(dest, items) }, func(err error) {
			for _, it := range items {
				p.mgr.Granted(it.TransferID, dest, push.Grant{Err: err.Error()}, time.Now())
			}
		})
	}
	for dest, ws := range r.Writes {
		items := make([]transport.WriteItem, len(ws))
		var missing []int
		for i, w := range ws {
			src, ok := p.sources[w.Src]
			if !ok || src.size() < w.NBytes {
				missing = append(missing, i)
				continue
			}
			items[i] = src.writeItem(w)
		}
		if len(missing) > 0 {
			// The manager asked to write from a source it released: a
			// broken invariant. Fail those writes rather than read freed
			// memory.
			now := time.Now()
			for _, i := range missing {
				p.mgr.WriteDone(ws[i].TransferID, dest, fmt.Errorf("source %d of %s is not held", ws[i].Src, ws[i].MMHash), now)
			}
			ws, items = dropIndexes(ws, items, missing)
			if len(ws) == 0 {
				p.kick()
				continue
			}
		}
		p.noteWritingLocked(ws)
		cached := p.planes[dest].addr
		if key, ok := onePlane(ws, cached); ok {
			// The common batch: every grant from one incarnation, so the
			// batch is the group, without a map and copies to find it.
			p.launchWrite(dest, key, ws, items)
			continue
		}
		for key, idx := range groupByPlane(ws, cached) {
			gws, gitems := pickIndexes(ws, items, idx)
			p.launchWrite(dest, key, gws, gitems)
		}
	}
	for dest, cs := range r.Completes {
		p.launch("complete_batch", dest, func() { p.complete(dest, cs) }, func(err error) {
			for _, c := range cs {
				p.mgr.CompleteDone(c.TransferID, dest, err, time.Now())
			}
		})
	}
	for dest, cs := range r.Cancels {
		if cs = p.dropCreditCancelsLocked(dest, cs, time.Now()); len(cs) == 0 {
			continue
		}
		// Answered or not, each cancel is reported: the manager holds the
		// reservations of its content to this shard back until then.
		answered := func() {
			now := time.Now()
			for _, c := range cs {
				p.mgr.CancelDone(c.TransferID, dest, now)
			}
		}
		p.launch("cancel", dest, func() { p.cancel(dest, cs); p.mu.Lock(); defer p.mu.Unlock(); answered() }, func(error) { answered() })
	}
	for _, id := range r.Releases {
		p.releaseSourceLocked(id)
		p.out.Released = append(p.out.Released, id)
	}
	for _, f := range r.Failures {
		p.failLocked(Failure{TransferID: f.TransferID, MMHash: f.MMHash, Dest: f.Dest, Reason: f.Reason})
	}
	p.out.Done = append(p.out.Done, r.Done...)
	if len(r.Releases)+len(r.Done) > 0 {
		p.signalLocked()
	}
}

// launchWrite starts one write batch to dest's data plane at key.
func (p *Producer) launchWrite(dest string, key planeKey, ws []push.Write, items []transport.WriteItem) {
	p.batches++
	started := p.startWriteLocked(dest, key.addr, ws, items)
	p.launch("write", dest, func() { p.write(dest, key.addr, key.cached, ws, items, started) }, func(err error) {
		for _, w := range ws {
			p.mgr.WriteDone(w.TransferID, dest, err, time.Now())
		}
	})
}

// onePlane is the plane of every write of ws when they share one.
func onePlane(ws []push.Write, cached string) (planeKey, bool) {
	key := func(w push.Write) planeKey {
		if w.Plane == "" {
			return planeKey{addr: cached, cached: true}
		}
		return planeKey{addr: w.Plane}
	}
	first := key(ws[0])
	for _, w := range ws[1:] {
		if key(w) != first {
			return planeKey{}, false
		}
	}
	return first, true
}

// planeKey is where one group of writes goes: the data plane of the
// incarnation that granted them, or (cached) the address the last lookup
// found, for grants that came without one.
type planeKey struct {
	addr   string
	cached bool
}

// groupByPlane splits one destination's writes by the data plane each
// grant names: after a restart a batch may hold grants of two
// incarnations, and each must reach the process that issued it.
func groupByPlane(ws []push.Write, cached string) map[planeKey][]int {
	out := map[planeKey][]int{}
	for i, w := range ws {
		k := planeKey{addr: w.Plane}
		if k.addr == "" {
			k = planeKey{addr: cached, cached: true}
		}
		out[k] = append(out[k], i)
	}
	return out
}

func pickIndexes(ws []push.Write, items []transport.WriteItem, idx []int) ([]push.Write, []transport.WriteItem) {
	w2 := make([]push.Write, len(idx))
	i2 := make([]transport.WriteItem, len(idx))
	for k, i := range idx {
		w2[k], i2[k] = ws[i], items[i]
	}
	return w2, i2
}

func dropIndexes(ws []push.Write, items []transport.WriteItem, drop []int) ([]push.Write, []transport.WriteItem) {
	skip := map[int]bool{}
	for _, i := range drop {
		skip[i] = true
	}
	var w2 []push.Write
	var i2 []transport.WriteItem
	for i := range ws {
		if !skip[i] {
			w2 = append(w2, ws[i])
			i2 = append(i2, items[i])
		}
	}
	return w2, i2
}

// launch runs one batch on its own goroutine. A panic in it is reported
// through failed (under the lock) as the error of every item of the batch,
// so that they fail now rather than at their deadlines; the manager ignores
// reports for items the batch had already settled.
// op and dest name the batch ("write", "shard-0") only if it panics: the
// name is not built for every batch.
func (p *Producer) launch(op, dest string, f func(), failed func(err error)) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer p.advance()
		defer func() {
			r := recover()
			if r == nil {
				return
			}
			what := op + " to " + dest
			err := p.panicked(what, r)
			if failed == nil {
				return
			}
			defer p.recover(what + " (reporting a panic)")
			p.mu.Lock()
			defer p.mu.Unlock()
			failed(err)
		}()
		f()
	}()
}

func (p *Producer) reserve(dest string, items []push.ReserveItem) {
	req := wire.ReserveBatch{Requester: p.requester, Items: make([]wire.ReserveItem, len(items)), CreditBytes: p.cfg.CreditWindowBytes}
	for i, it := range items {
		req.Items[i] = wire.ReserveItem{TransferID: it.TransferID, MMHash: it.MMHash, NBytes: it.NBytes, Meta: it.Meta}
	}
	var rep wire.ReserveBatchReply
	start := time.Now()
	trace.StampAll(trace.ReserveSent, items, reserveKey)
	err := p.call(dest, wire.OpReserveBatch, req, &rep)
	trace.StampAll(trace.ReserveAnswered, items, reserveKey)
	if err == nil {
		metrics.Phase(metrics.PhaseReserveRTT, time.Since(start))
	}
	if err == nil && len(rep.Grants) != len(items) {
		err = fmt.Errorf("reserve_batch to %s: %d grants for %d items", dest, len(rep.Grants), len(items))
	}
	var pl plane
	if err == nil {
		pl = p.replyPlane(dest, rep)
	}
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	if err == nil {
		p.notePlaneLocked(dest, pl)
		if p.cfg.CreditWindowBytes > 0 {
			p.noteCreditLocked(dest, rep.Credit, start, pl.addr)
		}
		if _, waiting := p.granted[dest]; !waiting {
			p.granted[dest] = now
		}
	}
	for i, it := range items {
		g := push.Grant{Err: errText(err)}
		if err == nil {
			w := rep.Grants[i]
			g = push.Grant{Kind: w.Kind, Res: ids.ResID(w.Res), Token: w.Token, NBytes: w.NBytes, Addr: w.Addr, Plane: pl.addr, Err: w.Err}
			if w.Code != "" && w.Err != "" {
				// By name first, so that whoever reads the reason can match it.
				g.Err = w.Code + ": " + w.Err
			}
			if w.TransferID != it.TransferID {
				g.Err = fmt.Sprintf("reserve_batch to %s: grant %d names %q, want %q", dest, i, w.TransferID, it.TransferID)
			}
		}
		p.mgr.Granted(it.TransferID, dest, g, now)
	}
}

// replyPlane is the data plane of the incarnation that answered a reserve
// reply. A reply without one (an older shard) leaves the grants to the
// address of the last lookup.
func (p *Producer) replyPlane(dest string, rep wire.ReserveBatchReply) plane {
	if len(rep.Data) == 0 {
		return plane{}
	}
	addr, err := p.pick("shard", dest, rep.Host, rep.Data)
	if err != nil {
		p.log.Warn("reserve reply names no data plane this producer can use; writing to the one looked up", "peer", dest, "cause", err)
		return plane{}
	}
	return plane{addr: addr, epoch: rep.Epoch}
}

// notePlaneLocked records what a shard said about its data plane. A new
// epoch means the shard restarted: its consumer is looked up again at its
// next push, since the new incarnation may be laid out differently.
func (p *Producer) notePlaneLocked(dest string, pl plane) {
	if pl.addr == "" {
		return
	}
	old := p.planes[dest]
	if old.epoch != "" && pl.epoch != "" && old.epoch != pl.epoch {
		p.log.Info("consumer shard restarted; writing to its new data plane", "peer", dest,
			"old_epoch", old.epoch, "epoch", pl.epoch, "data", pl.addr)
		p.forgetConsumerLocked(dest)
		delete(p.credit, dest)
		delete(p.credSeen, dest) // the new incarnation counts its windows afresh
	}
	p.planes[dest] = pl
}

// write sends one batch to one data plane. A batch sent to the address of
// the last lookup (its grants named no plane) that finds nobody there, or
// a slab that does not hold its regions, is sent once more to the address
// the shard gives now, when that differs: the shard restarted on a new
// data plane after granting.
func (p *Producer) write(dest, addr string, cached bool, ws []push.Write, items []transport.WriteItem, started *startedWrite) {
	var errs []error
	var inBand bool
	if started != nil {
		inBand = started.inBand
		errs = started.finish()
	} else {
		start := time.Now()
		p.handedOff(p.granted, dest, metrics.PhaseWriteHandoff, start)
		// A plane that completes in-band (TCP) carries each item's completion
		// in its frames: an item whose every frame was acknowledged is ready
		// at the shard, and no complete_batch follows. A retry to a moved
		// plane asks again, of that plane.
		inBand = transport.InBand(p.writer, addr)
		for i := range items {
			items[i].Complete = inBand
		}
		trace.StampAll(trace.WriteEnqueued, ws, writeKey)
		errs = p.writeTo(dest, addr, items)
	}
	if cached {
		inBand = p.retryStale(dest, addr, items, errs, inBand)
	}
	trace.StampAll(trace.WriteEnded, ws, writeKey)
	claimed := p.claimWritten(dest, addr, ws, items, errs)
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	failed, landed := false, false
	for i, w := range ws {
		if claimed[i] {
			continue
		}
		var err error
		if i < len(errs) {
			err = errs[i]
		} else {
			err = errors.New("transport returned too few results")
		}
		failed = failed || err != nil
		landed = landed || err == nil
		if inBand {
			p.mgr.WriteDoneInBand(w.TransferID, dest, err, now)
		} else {
			p.mgr.WriteDone(w.TransferID, dest, err, now)
		}
	}
	if _, waiting := p.wrote[dest]; landed && !waiting && !inBand {
		p.wrote[dest] = now
	}
	if failed {
		p.forgetLocked(dest)
	}
}

// startedWrite is a batch begun in the step (startWriteLocked), whose
// write goroutine only finishes it.
type startedWrite struct {
	inBand bool
	finish func() []error
}

// startWriteLocked begins the batch's write here, on the thread that took
// the step (for Sources, the encoder's thread calling hand_over), where
// the data plane can do so without waiting (transport.Starter: cuda_ipc
// announces the items and queues their copies and ready words): the
// batch's goroutine then only waits for the copies, and the copy no
// longer waits for that goroutine to be woken and run (~200 µs of
// hand_over -> write_enqueued on an H100 host). It returns nil where the
// write goes to its goroutine whole: a plane that cannot start, or one
// whose shard is not greeted yet (the first write greets it, which waits).
func (p *Producer) startWriteLocked(dest, addr string, ws []push.Write, items []transport.WriteItem) *startedWrite {
	st, ok := p.writer.(transport.Starter)
	if !ok || addr == "" || !st.CanStart(addr) {
		return nil
	}
	inBand := transport.InBand(p.writer, addr)
	for i := range items {
		items[i].Complete = inBand
	}
	now := time.Now()
	if t, ok := p.granted[dest]; ok {
		delete(p.granted, dest)
		metrics.Phase(metrics.PhaseWriteHandoff, now.Sub(t))
	}
	trace.StampAll(trace.WriteEnqueued, ws, writeKey)
	ctx, cancel := context.WithTimeout(p.life, p.cfg.PushWait())
	finish, ok := st.Start(ctx, addr, items)
	if !ok {
		cancel()
		return nil
	}
	trace.StampAll(trace.WriteStarted, ws, writeKey)
	return &startedWrite{inBand: inBand, finish: func() []error {
		defer cancel()
		errs := finish()
		metrics.Phase(metrics.PhaseWrite, time.Since(now))
		p.observeWrite(planeName(addr, p.tr.Name()), now, items, errs)
		return errs
	}}
}

func (p *Producer) writeTo(dest, addr string, items []transport.WriteItem) []error {
	if addr == "" {
		err := fmt.Errorf("no data-plane address known for %s", dest)
		errs := make([]error, len(items))
		for i := range errs {
			errs[i] = err
		}
		return errs
	}
	ctx, cancel := context.WithTimeout(p.life, p.cfg.PushWait())
	defer cancel()
	start := time.Now()
	errs := p.writer.Write(ctx, addr, items)
	metrics.Phase(metrics.PhaseWrite, time.Since(start))
	p.observeWrite(planeName(addr, p.tr.Name()), start, items, errs)
	return errs
}

// stale reports whether a write failed as one to a data plane that is no
// longer the shard's: nobody listens there, or the writer found the region
// outside the slab the address describes.
func stale(err error) bool {
	return errors.Is(err, transport.ErrUnreachable) || errors.Is(err, transport.ErrStaleAddr)
}

// retryStale resends, once, the items of a batch that failed as stale when
// the shard now names another data plane, and reports whether the batch's
// items were completed in-band: a batch is sent again whole to one plane
// or not at all, so that its items' completions are all of one kind.
func (p *Producer) retryStale(dest, addr string, items []transport.WriteItem, errs []error, inBand bool) bool {
	var idx []int
	for i, err := range errs {
		if i < len(items) && stale(err) {
			idx = append(idx, i)
		}
	}
	if len(idx) == 0 {
		return inBand
	}
	pl, err := p.askPlane(-1, dest)
	if err != nil || pl.addr == addr {
		return inBand
	}
	if again := transport.InBand(p.writer, pl.addr); again != inBand && len(idx) < len(items) {
		// Some items landed on the old plane, completed one way; the rest
		// would be completed the other: they fail as stale, for the
		// manager to push again.
		return inBand
	}
	p.mu.Lock()
	p.notePlaneLocked(dest, pl)
	p.mu.Unlock()
	p.log.Info("data plane moved; sending the batch again", "peer", dest, "from", addr, "to", pl.addr, "items", len(idx))
	inBand = transport.InBand(p.writer, pl.addr)
	again := make([]transport.WriteItem, len(idx))
	for k, i := range idx {
		again[k] = items[i]
		again[k].Complete = inBand
	}
	for k, err := range p.writeTo(dest, pl.addr, again) {
		errs[idx[k]] = err
	}
	return inBand
}

// forgetLocked drops what we learnt about the shard dest and its
// consumer, so that the next push looks it up again: a shard that
// restarted listens on a new data-plane address.
func (p *Producer) forgetLocked(dest string) {
	delete(p.planes, dest)
	p.forgetConsumerLocked(dest)
}

// forgetConsumerLocked drops the finished lookups of consumers that have
// dest among their shards.
func (p *Producer) forgetConsumerLocked(dest string) {
	for ep, ci := range p.consumers {
		select {
		case <-ci.ready:
		default:
			continue // a lookup in flight will learn the new layout anyway
		}
		for _, d := range ci.dests {
			if d == dest {
				delete(p.consumers, ep)
				break
			}
		}
	}
}

// handedOff times the hand-off to dest that began at since[dest], if one
// is waiting, and ends it.
func (p *Producer) handedOff(since map[string]time.Time, dest string, phase string, now time.Time) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if t, ok := since[dest]; ok {
		delete(since, dest)
		metrics.Phase(phase, now.Sub(t))
	}
}

// complete sends one complete_batch and applies its answer when it comes.
// It is one way on the producer's path: the sources of these items went
// back when their writes ended, and nothing else waits for this goroutine;
// the manager bounds how many completes a shard has out (complete_window).
// A refusal fails its push through the manager (reported and counted),
// which gives the region up.
func (p *Producer) complete(dest string, cs []push.Complete) {
	req := wire.CompleteBatch{Items: make([]wire.CompleteItem, len(cs))}
	for i, c := range cs {
		req.Items[i] = wire.CompleteItem{TransferID: c.TransferID, Res: uint64(c.Res), Token: c.Token}
	}
	start := time.Now()
	p.handedOff(p.wrote, dest, metrics.PhaseCompleteHandoff, start)
	var rep wire.CompleteBatchReply
	trace.StampAll(trace.CompleteSent, cs, completeKey)
	err := p.call(dest, wire.OpCompleteBatch, req, &rep)
	trace.StampAll(trace.CompleteAnswered, cs, completeKey)
	if err == nil {
		metrics.Phase(metrics.PhaseCompleteRTT, time.Since(start))
	}
	if err == nil && len(rep.Results) != len(cs) {
		err = fmt.Errorf("complete_batch to %s: %d results for %d items", dest, len(rep.Results), len(cs))
	}
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, c := range cs {
		e := err
		if e == nil && rep.Results[i].Err != "" {
			e = fmt.Errorf("complete at %s: %s", dest, rep.Results[i].Err)
		}
		p.mgr.CompleteDone(c.TransferID, dest, e, now)
	}
}

// The item of each traced hop: its mm_hash, the key every process of the
// path knows it by.
func reserveKey(it push.ReserveItem) string { return it.MMHash }
func writeKey(w push.Write) string          { return w.MMHash }
func completeKey(c push.Complete) string    { return c.MMHash }

// cancel tells the shard to drop reservations: an abandon for the ones we
// were granted a write for (followers fail at once), a plain cancel for
// the rest. Best effort: the consumer's lease covers a lost message.
func (p *Producer) cancel(dest string, cs []push.Cancel) {
	var ab wire.CompleteBatch
	var plain wire.Cancel
	for _, c := range cs {
		if c.Res != 0 {
			ab.Items = append(ab.Items, wire.CompleteItem{TransferID: c.TransferID, Res: uint64(c.Res), Token: c.Token, Abandon: true, Reason: "producer cancelled the push"})
		} else {
			plain.TransferIDs = append(plain.TransferIDs, c.TransferID)
		}
	}
	if len(ab.Items) > 0 {
		var rep wire.CompleteBatchReply
		if err := p.call(dest, wire.OpCompleteBatch, ab, &rep); err != nil {
			p.log.Warn("abandon not delivered", "peer", dest, "items", len(ab.Items), "cause", err)
		}
	}
	if len(plain.TransferIDs) > 0 {
		var rep wire.CancelReply
		if err := p.call(dest, wire.OpCancel, plain, &rep); err != nil {
			p.log.Warn("cancel not delivered", "peer", dest, "items", len(plain.TransferIDs), "cause", err)
		}
	}
}

func errText(err error) string {
	if err == nil {
		return ""
	}
	return err.Error()
}
