// Package push is the producer's push manager: it decides, inside the
// encoder instance's worker, what to send to which consumer shard and when
// an encoder output may be freed.
//
// It owns one record per (transfer_id, destination shard) and the sources
// (encoder outputs) those records read, and nothing else: no sockets, no
// goroutines, no locks, no clock. Like etcd raft's core, effects come out
// as values, by the protocol of core/fsm: Ready returns one Effects with
// the reservations, writes, completes and cancels to send, batched per
// destination, the sources to free and the failures and completions to
// report, and taking it acknowledges it; the runtime performs them and
// reports each outcome back (Granted, WriteDone, CompleteDone,
// CancelDone). Time comes in as an argument. Its owner serialises calls.
//
// # Flow of one push
//
//	Add ─▶ Reserving ─grant write─▶ WaitingInputs ─source, Ready─▶ Writing ─WriteDone─▶ Notifying ─CompleteDone─▶ Done
//	           └─grant follow/cached─▶ Done                             └─WriteDoneInBand─▶ Done
//
//	Cancel:   Reserving, WaitingInputs ─▶ Cancelled;  Writing ─▶ CancelPending ─WriteDone─▶ Cancelled
//	          (not a write that another push of the content follows: it goes on for the follower;
//	          nor, until the grants tell, one that another push of the content may come to follow)
//	Failures: refused or invalid grant, write or complete error, size mismatch, any deadline ─▶ Failed
//
// Reserving is the part of the design's WAITING_INPUTS spent waiting for the
// destination region; WaitingInputs proper waits for the source. The
// reservation goes out before the encoder runs, so both waits overlap the
// encoder's work. The edges are exactly those documented on the State
// constants; transition is the only function that allows a move, and every
// state change goes through it.
//
// # Sources
//
// Pushes of the same mm_hash share one source: SourceReady hands it over
// once and every write of that content reads it. A source is released (it
// appears in Effects.Releases, once) only when no write that reads it is in
// flight and no live record may still write it (none Reserving or
// WaitingInputs). A write in flight holds its source even after its record
// failed by deadline or was cancelled: a timeout cannot prove the transport
// stopped reading, so only WriteDone ends the hold. A source that no push
// needs, or a second source for content that already has one, is released
// at the next Ready.
//
// # Completes
//
// The complete is one way on the producer's path: the write's end releases
// the source (the shard holds the bytes) in the same Ready that hands the
// complete out, and nothing the manager hands out afterwards waits for the
// complete's answer. The shard still checks each complete (its token, a
// live reservation) and publishes readiness as it accepts it; its answer
// comes back through CompleteDone and only ends the record: accepted, Done;
// refused or lost, Failed (counted in Stats.CompletesFailed) with a Cancel
// that gives the region up, as for a failed write. A destination has at
// most CompleteWindow completes out and unanswered; the next ones wait in
// Notifying, in order, for a place (Stats.WindowWaits), under the same
// NotifyWait deadline, so that a shard that stopped answering holds a
// bounded number. A record that ends, by its answer or its deadline, gives
// its place back.
//
// A data plane that completes in-band (TCP: the frames of an item carry
// its completion and the shard makes it ready as the last byte lands,
// before acknowledging it) reports its write with WriteDoneInBand: the
// record ends Done as the write ends, with no complete to send and no
// place in the window.
//
// # Regions on the consumer
//
// A record that ends Cancelled or Failed while holding a granted region
// emits a Cancel to that shard so the region is freed; so does a grant
// that arrives after its record ended. Follow and cached grants need
// nothing written and end the record Done. Once the bytes landed
// (Notifying) the push is no longer cancelled: the complete goes out and
// the consumer's scheduler drops what no request wants.
//
// A shard makes the later of two reservations of one content follow the
// earlier's write and fails the follower if that writer gives up. So a
// cancel does not give up a write that another push follows, nor one it
// may come to follow: while a push of the content to that shard still
// waits for its grant (even when the cancelled push's own grant has not
// come back either), the cancel waits with the record, and takes effect as
// soon as the grants show nobody follows it. A follow grant that comes back
// before its writer's grant marks the records still waiting for theirs.
// A write that a push joins while it waits for its source gets that push's
// own wait (SourceWait from the follow grant) when it ends later: the
// follower's request hands the content's source over and this write
// carries it, so a write whose own request went away before its encoder
// ran does not take a late follower down with it. For the same reason a
// write whose wait for the source runs out while another push of the
// content has its reservation out to that shard (the shard may have made
// it follow already) waits for that answer, at most that reservation's
// deadline: a follow extends the wait, any other answer ends it.
//
// The other crossing is a cancel on its way to the shard when another push
// of the content to that shard is added: a reservation that overtook the
// cancel (each batch is a call of its own) would be made to follow the
// region being given up and fail with it. So from the moment a record's
// Cancel is queued (or, for a write cancelled in flight, from the moment
// it is CancelPending) until the runtime reports it answered (CancelDone,
// also for a call that failed), reservations of that content to that shard
// stay queued; they then get a region of their own. The same holds from
// the moment a record ends (cancelled, or failed at its deadline) while its
// own reservation there is out and unanswered, until that answer comes: the
// shard may have made it a region that its late grant's Cancel gives up. A
// record forgotten from the tombstones no longer holds anything, since no
// answer can find it. A held reservation keeps
// its ReserveWait deadline, so a cancel never answered cannot hold it
// forever; it does keep the manager Pending.
//
// # Deadlines
//
// Every waiting state has one: Reserving (ReserveWait), WaitingInputs
// (SourceWait), Writing and CancelPending (WriteWait, from the moment the
// write went out), Notifying (NotifyWait). A deadline at T fires for any
// call with now >= T; the record fails with a reason naming the state and
// the wait, and the failure appears in the next Ready. Every method that
// takes now applies due deadlines first; Tick does only that.
//
// # Identity
//
// A transfer_id names one push. Adding the same push again is a no-op,
// even after it ended (tombstones, at most MaxTombstones, keyed by a
// seeded 64-bit hash of the transfer_id, remember it by a seeded 64-bit
// digest of what makes it the same push, and its records' last states;
// the records themselves only while one waits for its reservation's
// answer; tomb.go says why they hold no pointer);
// a transfer_id that names another mm_hash, size or set of destinations,
// or an mm_hash announced with another size, is refused with ErrCollision
// for that push alone.
//
// # Usage
//
//	m := push.New(push.Config{})
//	m.Add(push.Push{TransferID: id, MMHash: h, NBytes: n, Dests: shards}, now) // before the encoder runs
//	m.SourceReady(h, src, n, now)                                              // save_caches, after its CUDA event
//	for {
//		rd := m.Ready(now)
//		for dest, items := range rd.Reserves { send one reserve_batch; m.Granted(id, dest, grant, now) per reply item }
//		for dest, ws := range rd.Writes { start the writes; m.WriteDone (or WriteDoneInBand) (id, dest, err, now) as each ends }
//		for dest, cs := range rd.Completes { send one complete_batch, go on; m.CompleteDone(id, dest, err, now) as its answer comes }
//		for dest, cs := range rd.Cancels { send cancels; m.CancelDone(id, dest, now) per item, answered or not }
//		free rd.Releases; report rd.Failures and rd.Done
//		wait for an outcome or NextDeadline; m.Tick(now)
//	}
//	m.Pending() // has_pending_push_work
//
// # Invariants
//
// CheckInvariants verifies them: every write in flight reads a source that
// is still held (a released source is never read); a held source that no
// record waits for or reads (every record of its content Notifying or
// ended) is queued for release at the next Ready; each Notifying record
// has its complete either queued or out, and the completes out per
// destination match their count and stay within CompleteWindow; each content's count of
// waiting records and of writes in flight matches its records; Writing and
// CancelPending records have a write in flight and WaitingInputs, Writing,
// Notifying and CancelPending records hold a write grant; a WaitingInputs
// record whose source is held has its write queued; every live record has a
// current deadline and no terminal one does; a transfer is retired exactly
// when all its records ended and none has a write in flight; indexes by
// transfer_id and mm_hash agree; tombstones stay within their bound. No
// method ever attempted an illegal move.
package push
