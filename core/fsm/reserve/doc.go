// Package reserve is the reservation table of one consumer shard: it owns
// the region bookkeeping of the shard's receive slab and decides, for every
// message a producer or the engine sends, whether it is allowed.
//
// The Table is deterministic, like etcd's raft core: it does no I/O, starts
// no goroutines, takes no locks and reads no clock. Time comes in as the
// now argument. Answers to a caller (grants, offsets, errors) come back
// from the call; effects for others (the Events its scheduler must hear)
// are collected until Ready, which hands them out once as an Effects
// value, by the protocol of core/fsm: rd := t.Ready(); publish rd.Events.
// Its owner (the consumer shard) serialises every call, takes the Ready
// after each call and publishes its events to the consumer scheduler, and
// calls Tick at NextDeadline. Deadlines fire only in Tick, so Ready takes
// no time.
//
// # Words
//
// A region is one slab allocation holding the bytes of one mm_hash; its
// State is the reservation state. A transfer (a transfer_id minted by the
// proxy, one producer push) names a region, and several transfers may name
// one region: the first writes it (KindWrite), a transfer that arrives
// while it is being written follows that write (KindFollow), and one that
// arrives once it is ready is answered at once (KindCached).
//
// # A transfer's life
//
//	grants := t.Reserve(items, now)         // one Grant per item, in order
//	off, err := t.BeginWrite(res, tok, o, n, now) // data plane, per chunk
//	... write n bytes at slab offset off ...
//	t.EndWrite(res, ok, now)                // exactly once per accepted write
//	err = t.Complete(res, tok, now)         // Ready events for all transfers
//	rd := t.Ready()                         // rd.Events: publish, in order
//	off, n, err := t.Acquire(mmHash, now)   // the engine loads: pinned
//	err = t.Release(mmHash, now)            // unpinned: a resident copy
//
// Every transfer gets exactly one terminal Event: Ready, or a failure with
// a reason (cancelled, abandoned, lease expired, refused for room). A follower or cached
// transfer is settled with that event and forgotten into the tombstones; a
// writer's transfer stays with its region until the region ends, so
// Status can report the region's life.
//
// A Ready region that ends (evicted, its lease run out, cancelled) emits
// one more Event, Gone, naming its mm_hash and no transfer: every transfer
// it served already had its Ready event, so without it the scheduler would
// go on offering content this shard no longer holds. Between a hash's
// Ready events and its Gone event the shard holds exactly one copy, so the
// Gone event ends everything those Ready events announced, and nothing
// announced after it. Status agrees: a follower or cached transfer,
// forgotten as Ready, reports Expired (copy gone) while no ready copy of
// its content is left.
//
// # Region states
//
//	Writing ──Complete──▶ Ready ──(lease, never loaded; eviction)──▶ Expired
//	   │                    └──(only transfer cancelled)──▶ Cancelled
//	   ├──abandon / last transfer cancelled──▶ Cancelled, or CancelPending ──▶ Cancelled
//	   └──lease ends──▶ Expired, or ExpirePending ──▶ Expired | Cancelled
//
// Writer grace: a region that a remote writer may still be writing is
// never freed under it. A cancel, abandon or expiry while a write is in
// flight moves the region to a *Pending state; its transfers fail at once,
// but its memory returns to the slab only when the last EndWrite arrives,
// because no timeout can prove that a writer stopped.
//
// Leases: a Writing region must complete within Config.Lease of its
// reservation, and a Ready region must be acquired within Config.Lease of
// becoming ready (a cached answer restarts that lease). Once acquired, a
// region no longer expires: pinned, it stays; released, it is a resident
// copy, evicted when resident bytes pass Config.MaxResidentBytes (least
// recently used first) or when a reservation needs the room. A slab can be
// full by fragmentation, so room means one contiguous extent: a
// reservation evicts only the adjacent residents whose eviction opens one
// (of the candidate runs, the one whose newest copy is oldest), and none
// when no run can.
//
// Refusals: a reservation refused for room (pool full, closing slab) is
// final for its transfer: it gets its failure event at once, so the
// scheduler fails the request waiting for it now rather than at its push
// deadline, and a tombstone answers a repeated reserve with ErrGone.
//
// # Requesters
//
// An Item names its requester (Owner, an identity unguessable to other
// peers) and its peer (Peer, the connection it came on as the control
// plane proved it). A repeated reserve of a live write grant is answered
// with the grant only for the same owner; anyone else gets ErrInProgress
// and no region or token. Quotas count per peer, since an owner is only
// what the peer says: a peer's regions being written, their bytes and its
// followers are bounded (Config.MaxPending*PerOwner, MaxFollowersPerOwner)
// whatever owners it names, at most MaxOwnersPerPeer owners hold records
// under one peer at once, and one write's followers are bounded
// (Config.MaxFollowers): over a bound a reservation is refused with
// ErrOverQuota, counted by reason (Stats.OverQuota) and settled at once
// like a refusal for room, so a flood costs only tombstones, which are
// bounded. The table only compares peers: naming them is the caller's.
//
// A writer's connection that ended (PeerGone: its process may be dead)
// orphans the regions it was writing. An orphaned region is otherwise
// unchanged, but another requester's reserve of its content (its own
// transfer id, or a new one) takes the write over instead of getting
// ErrInProgress or following a write that may never come: a new region
// is its own, the old region's transfers follow it, and the old one is
// cancelled, its memory waiting for writes in flight like any cancel
// (Stats.Orphaned, Stats.TakenOver).
//
// # Safety of the data plane
//
// BeginWrite admits a write only into a Writing region, with that region's
// token (compared in constant time), with 0 < n and off+n within the size
// asked (no overflow). Region ids are never reused, so a late message for
// a finished region gets ErrGone and can never touch a newer one; finished
// regions and transfers are remembered in a bounded FIFO of tombstones for
// clearer errors and for Status. A write that fails part way tears the
// region: Complete then fails with ErrTorn until one write covering the
// whole region is admitted, or the writer abandons.
//
// In-band completion: a data plane whose frames carry the item's
// completion (TCP) ends them with EndComplete instead of EndWrite, and
// the end that leaves every byte landed, with no write in flight,
// completes the region: no complete message follows the bytes. Bytes
// count once and only from such frames, so a replayed or overlapping frame
// tears the region instead of standing in for bytes that never came, and a
// region never completes with a hole; refusals are counted
// (Stats.InBandRefused). A writer that dies between its frames leaves a
// Writing region that its lease ends, as before.
//
// # Standing credit
//
// Credit (credit.go) grants a requester a window of slab room ahead,
// under a generation, a token and a lease, and renews it; Claim files
// items the requester wrote into its window as regions already Ready,
// after checking each against the window (generation, token, lease, the
// extent inside the window's free room); a claim of content held or being
// received is answered cached or follower and its extent stays in the
// window. A window's room is slab allocations the table holds for it
// (slab.Split carves a claimed extent into an allocation of its own), so
// nothing else allocates it; eviction for a reservation treats it as a
// region in use. Tick ends windows whose lease ran out, and their room
// returns to the slab.
//
// # Invariants
//
// CheckInvariants states them in code; the main ones: the slab's bytes in
// use equal the sum of the live regions' allocations and the credit
// windows' room; every live transfer
// names a live region that knows it; a pending region has writes in
// flight; a pinned region is Ready; residents are exactly the Ready,
// acquired, unpinned regions; only Writing and Ready regions can be joined,
// and at most one per mm_hash; tombstones never exceed MaxTombstones.
//
// The table assumes it is the slab's only user.
package reserve
