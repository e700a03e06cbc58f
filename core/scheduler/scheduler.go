package scheduler

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ecmooncake/ecmooncake/core/config"
	"github.com/ecmooncake/ecmooncake/core/control"
	"github.com/ecmooncake/ecmooncake/core/fsm/sched"
	"github.com/ecmooncake/ecmooncake/core/internal/due"
	"github.com/ecmooncake/ecmooncake/core/internal/logqueue"
	"github.com/ecmooncake/ecmooncake/core/metrics"
	"github.com/ecmooncake/ecmooncake/core/trace"
	"github.com/ecmooncake/ecmooncake/core/wire"
)

// resyncAge is how long an item waits for its event before the shard
// goroutines ask the shards for its status directly.
const resyncAge = time.Second

// Scheduler is safe for concurrent use.
type Scheduler struct {
	cfg config.Scheduler
	// log never waits on its writer (logqueue): the engine loop's step,
	// which holds the caller's GIL, logs under mu.
	log    *slog.Logger
	logs   *logqueue.Queue
	shards []string

	mu       sync.Mutex // guards table, changed, stats; never held across I/O
	table    *sched.Table
	changed  chan struct{} // closed and replaced on every table change
	resynced uint64
	// failures collects requests' failures (deadlines and shard reports)
	// until the next Step hands them to the engine; bounded, oldest first
	// out, since a later Ensure reports every failure of a request anyway.
	failures []sched.Failure
	// watch is caller memory (C, not Go) that receives the table's
	// generation after every change, so that a caller can see that nothing
	// changed without calling in; nil until Watch, never written once
	// closed.
	watch   *uint64
	waits   waitClock
	unwatch func() // detaches the metrics probe

	links control.Links
	sub   control.Subscriber
	// poller, when the subscriber is one, delivers same-host shards'
	// events straight to apply, from its reader or from Poll; nil: every
	// event goes through pump.
	poller  control.Poller
	cancels []chan []string // per shard
	// answered counts, per shard, the heartbeats it answered: a caller
	// that saw the network heal waits for one more to know that no probe
	// sent before the heal can still declare the shard lost (a follow
	// goroutine has one probe in flight at a time).
	answered []atomic.Uint64
	ticks    *due.Loop
	// life ends at Close: it stops the goroutines, and a control call in
	// flight returns at once instead of at its deadline. Ended and ended
	// under mu.
	life *due.Life
	wg   sync.WaitGroup
}

// Options carries what the caller chooses beyond the settings.
type Options struct {
	Log *slog.Logger
	// Links dials the shards and subscribes to their events; when nil,
	// ZeroMQ with the security of auth_secret. The scheduler closes it.
	Links control.Links
}

// Open starts the background goroutines; it does not wait for the shards,
// which may start later than the scheduler.
func Open(cfg config.Scheduler, opt Options) (_ *Scheduler, err error) {
	defer control.CloseIfFailed(&err, opt.Links)
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if opt.Log == nil {
		opt.Log = slog.Default()
	}
	logs := logqueue.New("scheduler")
	defer func() {
		if err != nil {
			logs.Close()
		}
	}()
	log := slog.New(logs.Handler(opt.Log.Handler()))
	shards := cfg.Shards
	if len(shards) == 0 {
		for r := 0; r < cfg.TPSize; r++ {
			shards = append(shards, control.Endpoint(cfg.IP, config.ShardPort(cfg.Port, cfg.DPRank, cfg.TPSize, r)))
		}
	}
	links, _, err := control.OpenLinks("scheduler", cfg.LoadSecret, false, opt.Links, control.WithUnixPath(cfg.ControlUnix))
	if err != nil {
		return nil, err
	}
	sub, err := links.Subscribe(log)
	if err != nil {
		if opt.Links == nil {
			_ = links.Close()
		}
		return nil, fmt.Errorf("scheduler: event socket: %w", err)
	}
	s := &Scheduler{
		cfg: cfg, log: log.With("role", "scheduler"), logs: logs, shards: shards,
		table:   sched.New(sched.Config{Shards: len(shards), EventWait: cfg.PushWait(), LoadWait: cfg.LoadTimeout()}),
		changed: make(chan struct{}),
		links:   links, sub: sub,
		ticks: due.NewLoop(),
		life:  due.NewLife(),
	}
	s.waits = waitClock{}
	if p, ok := sub.(control.Poller); ok {
		// Before the first Connect (the follow goroutines below).
		p.Direct(func(evs []wire.Event) { s.apply(evs...) })
		s.poller = p
	}
	s.unwatch = metrics.Watch(s.metricsName(), s.probe)
	s.wg.Add(2)
	go s.pump()
	go s.ticker()
	s.answered = make([]atomic.Uint64, len(shards))
	for i, ep := range shards {
		ch := make(chan []string, 64)
		s.cancels = append(s.cancels, ch)
		s.wg.Add(1)
		go s.follow(i, ep, ch)
	}
	return s, nil
}

// Shards returns the control endpoints the scheduler follows, by TP rank.
func (s *Scheduler) Shards() []string { return append([]string(nil), s.shards...) }

// Has answers has_cache_item.
func (s *Scheduler) Has(mmHash string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.table.Has(mmHash)
}

// Generation is the transfer table's generation (sched.Table.Generation):
// answers given at one generation stand until it moves.
func (s *Scheduler) Generation() uint64 {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.table.Generation()
}

// Watch makes the scheduler store the table's generation into *counter,
// atomically, whenever the table changed, until Close returns. counter is
// memory the caller owns and keeps alive until then (8-byte aligned, not
// Go memory): reading it costs the caller a load instead of a call.
func (s *Scheduler) Watch(counter *uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.life.Ended() {
		return
	}
	s.watch = counter
	s.publishLocked()
}

func (s *Scheduler) publishLocked() {
	if s.watch != nil && !s.life.Ended() {
		// A plain word in the caller's memory, read by Python: sync/atomic's
		// store on the raw address, where the library's own counters use
		// go.uber.org/atomic's types.
		atomic.StoreUint64(s.watch, s.table.Generation())
	}
}

// changedLocked wakes every waiter and the ticker, and publishes the
// generation.
func (s *Scheduler) changedLocked() {
	s.publishLocked()
	close(s.changed)
	s.changed = make(chan struct{})
	s.ticks.Wake()
}

// Poll applies the events that same-host shards have sent and that are
// waiting in their sockets, on the caller's thread, without waiting; it
// returns how many it applied. The engine's loop, which steps without
// pause while a request waits for its encoder output, sees an item as
// soon as its event is in the socket instead of after the wake of the
// reader thread (tens of microseconds after an idle gap, more on a
// loaded host). Never blocks: a shard whose reader is applying is
// skipped, as its events are being applied.
func (s *Scheduler) Poll() int {
	if s.poller == nil || s.life.Ended() {
		return 0
	}
	return s.poller.Poll()
}

// pump moves readiness events into the table: those of shards followed
// over ZeroMQ, and of every shard when the subscriber cannot be polled.
func (s *Scheduler) pump() {
	defer s.wg.Done()
	for {
		select {
		case <-s.life.Done():
			return
		case evs, ok := <-s.sub.Events():
			if !ok {
				return
			}
			s.apply(evs...)
		}
	}
}

// apply applies the events of one message (or of one status resync) under
// one lock, in one step of the table.
func (s *Scheduler) apply(evs ...wire.Event) {
	defer s.recover("event")
	now := time.Now()
	ids := make([]string, len(evs))
	in := make([]sched.Event, len(evs))
	for i, ev := range evs {
		if ev.SentNS > 0 {
			metrics.Phase(metrics.PhaseEventDelivery, time.Duration(now.UnixNano()-ev.SentNS))
		}
		in[i] = sched.Event{Shard: ev.Shard, TransferID: ev.TransferID, MMHash: ev.MMHash, Ready: ev.Ready,
			NBytes: ev.NBytes, Reason: ev.Reason, Gone: ev.Kind == wire.EventGone}
		ids[i] = ev.TransferID
		if ev.Ready && ev.Kind != wire.EventGone {
			trace.Stamp(trace.EventDelivered, ev.MMHash)
		}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.table.OnEvents(in, now)
	s.waits.settle(s.table, ids, now)
	s.changedLocked()
}

// ticker applies deadlines when they fall due.
func (s *Scheduler) ticker() {
	defer s.wg.Done()
	s.ticks.Run(s.life.Done(), func() (next time.Time, ok bool) {
		defer s.recover("tick")
		s.mu.Lock()
		defer s.mu.Unlock()
		now := time.Now()
		rd := s.table.Ready(now)
		if cancels := s.applyLocked(rd); len(cancels) > 0 {
			// Cancels come from Step's calls, whose own Ready takes them;
			// one left here still reaches the shards (queueCancels never
			// blocks).
			s.waits.settle(s.table, cancels, now)
			s.queueCancels(cancels)
		}
		if !rd.Empty() {
			s.changedLocked()
		} else {
			// A deadline can end a record that no request waits for (a
			// resident copy): no failure, yet Has changes.
			s.publishLocked()
		}
		return s.table.NextDeadline()
	})
}

// follow keeps one shard's events flowing: it learns the shard's event
// endpoint, subscribes, then resyncs items that wait too long and forwards
// cancels. The client is owned by this goroutine alone.
func (s *Scheduler) follow(rank int, endpoint string, cancels <-chan []string) {
	defer s.wg.Done()
	defer s.recover("follow")
	log := s.log.With("shard", rank, "peer", endpoint)
	client, err := s.links.Dial(endpoint, log)
	if err != nil {
		log.Error("cannot follow shard", "cause", err)
		return
	}
	defer client.Close()
	backoff := 50 * time.Millisecond
	var life shardLife
	for {
		var rep wire.EventPortReply
		err := s.call(client, wire.OpEventPort, struct{}{}, &rep)
		if err == nil {
			err = s.sub.Connect(rep.Endpoint)
		}
		if err == nil {
			life.epoch = rep.Epoch
			log.Info("following shard events", "events", rep.Endpoint, "epoch", rep.Epoch)
			break
		}
		log.Debug("shard not reachable yet", "cause", err)
		if !s.sleep(backoff) {
			return
		}
		backoff = min(backoff*2, 2*time.Second)
	}
	resync := time.NewTicker(resyncAge / 2)
	defer resync.Stop()
	for {
		select {
		case <-s.life.Done():
			return
		case ids := <-cancels:
			var rep wire.CancelReply
			if err := s.call(client, wire.OpCancel, wire.Cancel{TransferIDs: ids}, &rep); err != nil {
				log.Warn("cancel not delivered", "items", len(ids), "cause", err)
			}
		case <-resync.C:
			if s.heartbeat(rank, client, log, &life) {
				s.resync(rank, client, log, &life)
			}
		}
	}
}

// shardLife is what one follow goroutine knows of its shard's liveness.
type shardLife struct {
	epoch  string // the incarnation whose events are followed; "" when the shard names none
	down   bool   // declared lost and not heard from since
	misses int    // probes in a row that got no answer
}

// missesToLose is how many heartbeats in a row must go unanswered before a
// shard is declared lost. One is not enough: a request a DEALER sent just
// as its peer restarted on the same port goes down with the old connection
// and is never answered, though the new incarnation answers the next probe
// at once; declaring the shard lost then would fail every transfer
// waiting for it. A shard that is really gone is declared lost after this
// many control timeouts instead of one.
const missesToLose = 2

// heartbeat asks the shard for its event endpoint, which doubles as a
// liveness probe and tells a restart (a new epoch, a new endpoint). A shard
// that leaves missesToLose probes in a row unanswered, each within the
// control timeout, is declared lost, and a
// restarted one is followed anew: either way the items it held stop being
// available (sched.Table.ShardLost, ShardRestarted). It reports whether the
// shard answered.
func (s *Scheduler) heartbeat(rank int, client control.Caller, log *slog.Logger, life *shardLife) bool {
	var rep wire.EventPortReply
	err := s.call(client, wire.OpEventPort, struct{}{}, &rep)
	var refused *wire.Error
	switch {
	case err != nil && errors.As(err, &refused):
		return true // it answered, so it lives
	case err != nil:
		life.misses++
		if life.misses < missesToLose {
			log.Info("shard did not answer a heartbeat; probing again before declaring it lost", "misses", life.misses, "cause", err)
			return false
		}
		if !life.down {
			life.down = true
			log.Warn("shard lost: the items it held are no longer available", "cause", err)
			s.dropShard(rank, fmt.Sprintf("shard %d stopped answering: %v", rank, err), false)
		}
		return false
	}
	life.misses = 0
	s.answered[rank].Add(1)
	s.noteEpoch(rank, log, life, rep.Epoch)
	if err := s.sub.Connect(rep.Endpoint); err != nil {
		log.Warn("cannot follow the shard's events", "events", rep.Endpoint, "cause", err)
	}
	if life.down {
		log.Info("shard answers again", "epoch", rep.Epoch)
	}
	life.down = false
	return true
}

// noteEpoch handles the epoch a shard answered with: a new one means the
// shard restarted and lost what it held, unless it was already declared
// lost (then everything was failed already).
func (s *Scheduler) noteEpoch(rank int, log *slog.Logger, life *shardLife, epoch string) {
	if epoch == "" || epoch == life.epoch {
		return
	}
	if life.epoch != "" && !life.down {
		log.Warn("shard restarted: the items it held are gone", "old_epoch", life.epoch, "epoch", epoch)
		s.dropShard(rank, fmt.Sprintf("shard %d restarted (epoch %s, was %s): what it held is gone", rank, epoch, life.epoch), true)
	}
	life.epoch = epoch
}

// dropShard applies a lost or restarted shard to the table.
func (s *Scheduler) dropShard(rank int, reason string, restarted bool) {
	defer s.recover("drop shard")
	now := time.Now()
	s.mu.Lock()
	defer s.mu.Unlock()
	if restarted {
		s.table.ShardRestarted(rank, reason, now)
	} else {
		s.table.ShardLost(rank, reason, now)
	}
	s.changedLocked()
}

// resync asks the shard about items that have waited longer than
// resyncAge and feeds the answers in as if they were events.
func (s *Scheduler) resync(rank int, client control.Caller, log *slog.Logger, life *shardLife) {
	s.mu.Lock()
	waiting := s.table.Waiting(time.Now(), resyncAge)
	s.mu.Unlock()
	if len(waiting) == 0 {
		return
	}
	if len(waiting) > wire.MaxItems {
		waiting = waiting[:wire.MaxItems]
	}
	var rep wire.StatusReply
	if err := s.call(client, wire.OpStatus, wire.Status{TransferIDs: waiting}, &rep); err != nil {
		log.Debug("status resync failed", "cause", err)
		return
	}
	// A restart between the heartbeat and this reply is handled first,
	// so that the new incarnation's answers are not taken for the old's.
	s.noteEpoch(rank, log, life, rep.Epoch)
	var evs []wire.Event
	for _, it := range rep.Items {
		if !it.Known {
			continue
		}
		switch it.State {
		case "ready":
			evs = append(evs, wire.Event{Shard: rank, TransferID: it.TransferID, MMHash: it.MMHash, Ready: true, NBytes: it.NBytes})
		case "cancelled", "expired":
			evs = append(evs, wire.Event{Shard: rank, TransferID: it.TransferID, MMHash: it.MMHash, Reason: "shard reports the reservation " + it.State})
		}
	}
	if len(evs) > 0 {
		s.mu.Lock()
		s.resynced += uint64(len(evs))
		s.mu.Unlock()
		s.apply(evs...)
	}
}

func (s *Scheduler) call(c control.Caller, op wire.Op, body, out any) error {
	ctx, cancel := context.WithTimeout(s.life, s.cfg.ControlTimeout())
	defer cancel()
	start := time.Now()
	err := c.Call(ctx, op, body, out)
	metrics.RoundTrip(string(op), time.Since(start), err)
	return err
}

func (s *Scheduler) sleep(d time.Duration) bool { return due.Sleep(s.life.Done(), d) }

func (s *Scheduler) recover(what string) {
	if r := recover(); r != nil {
		s.log.Error("scheduler: recovered panic", "in", what, "panic", r)
	}
}

// Close stops every goroutine and closes the sockets.
func (s *Scheduler) Close() error {
	s.mu.Lock()
	ended := s.life.End()
	s.watch = nil
	s.mu.Unlock()
	if !ended {
		return nil
	}
	s.unwatch()
	err := s.sub.Close()
	s.wg.Wait()
	err = errors.Join(err, s.links.Close())
	s.logs.Close()
	if err != nil {
		return fmt.Errorf("scheduler: close: %w", err)
	}
	return nil
}

// maxHeldFailures bounds the failures kept for the next Step.
const maxHeldFailures = 4096

// applyLocked performs what the table's Ready handed out, by the protocol
// of core/fsm: failures are noted for the next Step; the cancels are
// returned, for the caller to send to the shards.
func (s *Scheduler) applyLocked(rd sched.Effects) (cancels []string) {
	if len(rd.Failures) > 0 {
		s.noteFailuresLocked(rd.Failures)
	}
	return rd.Cancels
}

// noteFailuresLocked logs failures once and keeps them for the next Step.
func (s *Scheduler) noteFailuresLocked(fails []sched.Failure) {
	for _, f := range fails {
		s.log.Warn("encoder output unavailable", "request_id", f.RequestID, "transfer_id", f.TransferID, "mm_hash", f.MMHash, "cause", f.Reason)
		metrics.Failed("scheduler", metrics.Reason(f.Reason))
	}
	s.failures = append(s.failures, fails...)
	if over := len(s.failures) - maxHeldFailures; over > 0 {
		s.failures = append(s.failures[:0], s.failures[over:]...)
	}
}
