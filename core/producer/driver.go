package producer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/ecmooncake/ecmooncake/core/ids"
	"github.com/ecmooncake/ecmooncake/core/push"
	"github.com/ecmooncake/ecmooncake/core/transport"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// driver is the one goroutine that ticks the push manager and turns its
// effects into batches. It never does I/O itself: each batch runs on its
// own goroutine and reports back through the manager, then wakes the
// driver.
func (p *Producer) driver() {
	defer p.wg.Done()
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		wait := time.Hour
		func() {
			defer p.recover("driver")
			p.mu.Lock()
			defer p.mu.Unlock()
			now := time.Now()
			p.mgr.Tick(now)
			p.applyLocked(p.mgr.Ready(now))
			if next, ok := p.mgr.NextDeadline(); ok {
				wait = max(time.Until(next), time.Millisecond)
			}
		}()
		timer.Reset(wait)
		select {
		case <-p.stop:
			return
		case <-p.wake:
		case <-timer.C:
		}
	}
}

// applyLocked records outcomes and launches one goroutine per batch.
func (p *Producer) applyLocked(r push.Ready) {
	if r.Empty() {
		return
	}
	for dest, items := range r.Reserves {
		p.launch(func() { p.reserve(dest, items) })
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
		p.batches++
		addr := p.dataAddr[dest]
		p.launch(func() { p.write(dest, addr, ws, items) })
	}
	for dest, cs := range r.Completes {
		p.launch(func() { p.complete(dest, cs) })
	}
	for dest, cs := range r.Cancels {
		p.launch(func() { p.cancel(dest, cs) })
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

func (p *Producer) launch(f func()) {
	p.wg.Add(1)
	go func() {
		defer p.wg.Done()
		defer p.recover("batch")
		f()
		p.kick()
	}()
}

func (p *Producer) reserve(dest string, items []push.ReserveItem) {
	req := wire.ReserveBatch{Items: make([]wire.ReserveItem, len(items))}
	for i, it := range items {
		req.Items[i] = wire.ReserveItem{TransferID: it.TransferID, MMHash: it.MMHash, NBytes: it.NBytes, Meta: it.Meta}
	}
	var rep wire.ReserveBatchReply
	err := p.call(dest, wire.OpReserveBatch, req, &rep)
	if err == nil && len(rep.Grants) != len(items) {
		err = fmt.Errorf("reserve_batch to %s: %d grants for %d items", dest, len(rep.Grants), len(items))
	}
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	for i, it := range items {
		g := push.Grant{Err: errText(err)}
		if err == nil {
			w := rep.Grants[i]
			g = push.Grant{Kind: w.Kind, Res: ids.ResID(w.Res), Token: w.Token, NBytes: w.NBytes, Addr: w.Addr, Err: w.Err}
			if w.TransferID != it.TransferID {
				g.Err = fmt.Sprintf("reserve_batch to %s: grant %d names %q, want %q", dest, i, w.TransferID, it.TransferID)
			}
		}
		p.mgr.Granted(it.TransferID, dest, g, now)
	}
}

func (p *Producer) write(dest, addr string, ws []push.Write, items []transport.WriteItem) {
	var errs []error
	if addr == "" {
		err := fmt.Errorf("no data-plane address known for %s", dest)
		errs = make([]error, len(items))
		for i := range errs {
			errs[i] = err
		}
	} else {
		ctx, cancel := context.WithTimeout(p.life, p.cfg.PushWait())
		start := time.Now()
		errs = p.writer.Write(ctx, addr, items)
		cancel()
		p.observeWrite(start, items, errs)
	}
	now := time.Now()
	p.mu.Lock()
	defer p.mu.Unlock()
	failed := false
	for i, w := range ws {
		var err error
		if i < len(errs) {
			err = errs[i]
		} else {
			err = errors.New("transport returned too few results")
		}
		failed = failed || err != nil
		p.mgr.WriteDone(w.TransferID, dest, err, now)
	}
	if failed {
		p.forgetLocked(dest)
	}
}

// forgetLocked drops what we learnt about the consumer that owns dest, so
// that the next push looks it up again: a shard that restarted listens on
// a new data-plane address.
func (p *Producer) forgetLocked(dest string) {
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

func (p *Producer) complete(dest string, cs []push.Complete) {
	req := wire.CompleteBatch{Items: make([]wire.CompleteItem, len(cs))}
	for i, c := range cs {
		req.Items[i] = wire.CompleteItem{TransferID: c.TransferID, Res: uint64(c.Res), Token: c.Token}
	}
	var rep wire.CompleteBatchReply
	err := p.call(dest, wire.OpCompleteBatch, req, &rep)
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
