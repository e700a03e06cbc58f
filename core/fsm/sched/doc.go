// Package sched is the consumer scheduler's transfer table: it decides,
// inside vLLM's engine-core process of a consumer instance, whether an
// encoder output pushed by a producer can be loaded instead of computed.
//
// It owns one record per transfer and nothing else: no sockets, no
// goroutines, no locks, no clock. Every method takes the time as an
// argument, does O(items it touches) work and never blocks, because vLLM's
// scheduler hooks that call it must not. Its owner (the connector's
// scheduler object) serialises calls. Answers to vLLM's questions (Has,
// Ensure, StartLoad) come back from the calls; effects for others (cancels
// for the shards, failures for requests) are collected until Ready, which
// hands them out once as an Effects value, by the protocol of core/fsm:
// rd := t.Ready(now); cancel rd.Cancels; fail rd.Failures.
//
// # Identity
//
// A transfer_id names one push; an mm_hash names content. Records are keyed
// by transfer_id and indexed by mm_hash. Several requests that name the same
// transfer_id with the same mm_hash share one record. A transfer_id that
// arrives naming a different mm_hash than the one already known (live or
// tombstoned) is a collision: that request alone is refused with
// ErrCollision, the record and its requests are left as they were.
//
// Questions about content (Has, Ensure, StartLoad) are answered by any
// transfer of that mm_hash, because vLLM's encoder cache is keyed by
// content: two requests with the same image and two transfer_ids are both
// served by whichever push is loaded.
//
// # Lifecycle
//
//	Expect ─▶ WaitingEvent ─every shard ready─▶ Available ─StartLoad─▶ Loading ─Loaded ok─▶ Ready ─Freed─▶ Resident
//	                                                                    ▲                                     │
//	                                                                    └──────────────StartLoad──────────────┘
//
//	WaitingEvent: shard failure, gone or EventWait ─▶ Unavailable; Finish or a sibling loaded ─▶ Cancelled
//	Available:    AvailableTTL, shard failure or gone ─▶ Expired;  Finish or a sibling loaded ─▶ Cancelled
//	Loading:      Loaded failed ─▶ Failed; LoadWait, shard failure or gone ─▶ Unavailable
//	Ready:        shard failure or gone ─▶ Expired
//	Resident:     ResidentTTL, shard failure or gone ─▶ Expired
//
// The edges are exactly those documented on the State constants; transition
// is the only function that allows a move, and every state change goes
// through it. Loading ─▶ Cancelled is a legal edge that no method takes on
// its own: Finish leaves loads alone, since the worker may already hold a
// view of the bytes. Terminal records become tombstones (at most
// MaxTombstones, oldest dropped first), so Status answers for them and late
// events for them are ignored rather than mistaken for a new push.
//
// A failure event from a shard ends a record wherever it stands: before
// loading it becomes Unavailable; once the bytes were available it becomes
// Expired.
//
// A gone event names content, not a transfer: the shard's copy of an
// mm_hash ended (evicted to make room, its lease ran out, cancelled) after
// the shard had reported it ready. The copy may have served many transfers
// (its writer, cached answers, followers) that the shard has long
// forgotten, so the shard cannot name them; the table ends every record of
// that mm_hash whose readiness the shard had reported, as a failure event
// would, since an item is available only when every shard holds it. This
// is how a shard's slab evicting a resident copy reaches the table when
// ResidentTTL is zero. A shard's events arrive in order and it holds one
// ready copy of a hash at a time, so reports of a later copy, which follow
// the gone event, are untouched.
//
// # Shards that die or restart
//
// The owner watches each shard's liveness. ShardLost (the shard stopped
// answering) ends every live transfer, since every item needs every shard;
// ShardRestarted (a new incarnation answers) ends the transfers whose bytes
// the shard had reported ready, and leaves those still waiting for it,
// whose push may reach the new incarnation. Either way has_cache_item stops
// answering yes from the dead shard's events, and the waiting requests
// fail at once (retryable).
//
// # Requests and failures
//
// Siblings are the other transfers of one mm_hash. When one of them
// reaches Ready it serves every request waiting for the content, so the
// siblings still waiting or available lose their last request: they are
// cancelled at once and Ready hands their ids to the caller, which
// cancels them on the shards as it does those Finish cancelled. No record
// outlives the requests for its content except the loaded one (and
// resident copies).
//
// Because Ensure answers by content, a request can be told its item is
// there through another request's transfer while its own push still
// waits, and vLLM loads it in the same step. So Finish cancels an
// available transfer only when no live request waits for its content any
// more, not merely when its own requests are gone: the owner of the other
// request may have ended it (an abort) in between. Finish of the last
// request that waits for the content cancels it, as do a load of the
// content and the lease; a transfer still waiting for its push is
// cancelled with its own last request, since nobody was answered from it.
//
// A request waits for each of its items until the content is loaded into
// vLLM's encoder cache (a transfer of that mm_hash reaches Ready); from then
// on it is served and what becomes of the transfer (resident, evicted,
// expired) no longer fails it. While it waits, a transfer that ends fails
// the item for that request: the failure shows in Ensure and Failures, and
// Ready hands it out once. Failures are retryable, except for an item whose
// transfer_id had already ended when the request was registered: the push
// it names is over, and only a new transfer_id can help. A request the
// table does not know expects nothing: Ensure answers ready.
//
// # Events before requests
//
// A producer can finish a push before the proxy's rewritten request reaches
// this engine. Events for an unknown transfer_id are kept as early events
// (at most MaxEarlyEvents transfers, each for EventWait) and applied when
// Expect registers the transfer. Events that name a shard out of range, or
// content or a size other than the record's, are ignored and counted.
//
// # Deadlines
//
// Every waiting state has one: WaitingEvent (EventWait, the push wait),
// Available (AvailableTTL, the reservation lease), Loading (LoadWait),
// Resident (ResidentTTL when set). Deadlines are inclusive: a deadline at T
// fires for any call with now >= T. Every method that takes now applies the
// deadlines due first, so no answer rests on a deadline already passed; Has
// takes no time and reflects the last call that did.
//
// # Generation
//
// Generation counts the changes that can alter an answer: every state
// change, every request or item Expect adds, every request Finish removes.
// An owner asked the same question many times per step (vLLM asks
// ensure_cache_available for every waiting request on every schedule
// pass) can keep the answers with the generation they were given at and
// reuse them until it moves, instead of asking again. The random model
// test checks that no answer changes while the generation stands still.
// Once it moved, Changes answers only for the contents and requests the
// generations since touched (a bounded log, changes.go), where Snapshot
// answers for every live request; the model test keeps such an owner's
// answers by Changes and checks them against the table after every step.
//
// # Usage
//
//	t := sched.New(sched.Config{Shards: tp})
//	// request arrives with ec_transfer_params:
//	if err := t.Expect(reqID, items, now); errors.Is(err, sched.ErrCollision) { reject reqID }
//	// background goroutine, per event message from a shard (its records):
//	t.OnEvents(evs, now)
//	// scheduler hooks:
//	t.Has(mmHash)                         // has_cache_item
//	ready, failed := t.Ensure(reqID, now) // ensure_cache_available; fail the request when failed != nil
//	id, err := t.StartLoad(mmHash, now)   // update_state_after_alloc: put id in the step's metadata
//	t.Loaded(id, ok, reason, now)         // update_connector_output
//	t.Freed(mmHash, now)                  // scheduler_output.free_encoder_mm_hashes
//	t.Finish(reqID, now)                  // request_finished
//	// each step, after its calls, or at NextDeadline:
//	rd := t.Ready(now)
//	cancel rd.Cancels on the shards       // Finish's, and siblings of what Loaded served
//	for _, f := range rd.Failures { fail f.RequestID with f.Reason }
//
// # Invariants
//
// CheckInvariants verifies them: every live record is in a non-terminal
// state, listed once under its mm_hash and never also a tombstone; its
// shard bitmap names only shards 0..Shards-1, is full in Available and
// later states and not full in WaitingEvent; it holds a current deadline
// exactly when its state has one; its attached requests exist and expect
// it. Every item of a request is exactly one of: attached to a live record
// of the same mm_hash, failed, or served; a Ready record has no request
// attached; a WaitingEvent record has one, and an Available record without
// one has its content wanted by an item of a live request, served or not
// (the count of those per mm_hash matches the requests). Tombstones and early
// events stay within their bounds. No method ever attempted an illegal move.
package sched
