// Package cudaipc is the same-host data plane for GPU memory: the
// producer copies device to device straight into the consumer's GPU slab,
// through a CUDA IPC mapping of it, over NVLink or PCIe peer access or
// within one GPU. It is one-sided, like mooncake and shm, but it completes
// in-band: the producer's GPU stores a ready word into memory the shard
// reads after the copies, and the shard marks the item ready when it sees
// the word. A batch costs the control plane's reserve and nothing else.
//
// # Protocol
//
// The consumer shard exports its slab's IPC handle once, when it starts
// listening on a new abstract Unix socket, and publishes its address on
// the control plane:
//
//	@ecmooncake-cudaipc-<pid>-<16 hex digits>?nonce=<32 hex digits>
//
// The nonce is new for every Listen, so a shard that restarts publishes a
// new address, and a reserve reply (which names the data plane of the
// incarnation that granted) tells the producer which incarnation's slab
// its grants are in. A connection is admitted only from a process of the
// shard's uid (SO_PEERCRED, core/transport/internal/unixfd). Its first
// exchange is the hello (see wire.go): the producer presents the nonce
// and gets the handle, the slab's offset into its allocation, the slab's
// address and size in the shard's process and, when the shard's sink can
// complete in-band (transport.RemoteSink), a ready-word region of its own:
// a sealed memfd passed with SCM_RIGHTS, of which the shard keeps its own
// mapping (layout and invariants in words.go). The handle and the region
// go only to a peer that knows the nonce, and the nonce only ever travels
// on the authenticated control plane. The connection then stays open: it
// carries the producer's announcements, and its end is how each side
// learns that the other is gone. The socket holds at most Config.MaxConns
// connections at once (the shard's max_data_conns, like the other data
// planes); one past the cap is closed at once and counted in
// RecvStats.Closed under transport.ClosedLimit.
//
// # One Write
//
// The receiver is a transport.Direct. A write grant carries the region's
// address (RemoteAddr: the slab's address plus the region's offset) and
// its size, and the shard admits the region's write at the grant and ends
// it when the write completes or is abandoned (package consumer,
// direct.go), so the region is not reused while a copy into it may still
// land. The writer checks every item against its grant (inside [Addr,
// Addr+Size)) and the grant against the slab of the incarnation it mapped
// (inside [Base, Base+Size) of its hello), and refuses anything else
// before copying a byte (transport.ErrWriteBounds, transport.ErrStaleAddr).
//
// Items that complete in-band (WriteItem.Complete, asked for when
// InBand(dest) is true) each take a free slot of the region and the next
// sequence, and the writer sends one message naming, per item, the
// reservation, its token, the slot and the value it will store there,
// before it queues any copy, so that the shard's wake overlaps the copy.
// Then it queues the batch's copies on one stream of the source's device,
// behind each source's readiness event, one cuStreamWriteValue64 per item
// after them (flags 0: a memory barrier first), records an event after
// those and waits for it (gpu.ValueWriter; the timings are observed as
// metrics phases). Write returns only after that event completed, so the
// source goes back to the encoder as before; no complete message follows.
// Start (transport.Starter) is Write cut at the wait: on a shard already
// greeted it announces and queues on the caller's thread and leaves the
// wait to the finish it returns, so that the producer queues a batch's
// copies in the hand-over itself and only the wait runs on the batch's
// goroutine (package producer, startWriteLocked). The slab's mapping is
// held (read-locked) from the start until the finish.
//
// The shard checks each announced entry (slot inside the region and not
// watched already, the attachment's generation and a sequence above every
// earlier one, and through the sink an open one-sided write of this shard
// with that token) and watches the slot: one goroutine per attachment
// scans its watched words back to back for 2 ms after each announcement
// (a batch's copies end within that), then naps between scans, longer each
// time up to a millisecond (receiver.go says why the spin is that long:
// a Go nap under a millisecond can take a whole one). A word equal to its announced value frees the slot (the
// shard stores 0 there) and completes the item through the sink
// (RemoteSink.CompleteRemote: WRITING → READY, readiness published, once).
// Everything refused is counted in RecvStats.Rejected by reason and
// logged rate-limited, and marks nothing ready; an entry the sink refused
// (its write gone, say cancelled meanwhile) is still watched, only to
// store the 0 that frees its slot when the producer's word lands. An entry is dropped when
// the shard gives up on its write (two leases) or when the connection
// ends; its region then ends the way every one-sided write a producer
// walked away from ends, after the writer grace.
//
// Where the new path cannot serve, the items complete by message as
// before (the producer's complete_batch): a shard whose sink cannot
// complete in-band offers no region, and a device that cannot store words
// from a stream (no cuStreamWriteValue64, or registration of the region
// fails) makes the writer's InBand false for that attachment; both are
// logged once and counted (WriterStats.ByMessage). A host source, and a
// device of an in-band attachment that cannot register the region, get
// their word stored by the writer itself after the copy completed
// (WriterStats.HostWords), which keeps the word's promise.
//
// # Ordering
//
// The word is stored after the copies on the same stream, and the store
// is fenced after them: a slot holding the announced value means every
// byte of the item is in the slab. The shard marks the item ready only
// after it read that value, and publishes readiness after that; whatever
// the consumer then launches to read the bytes (the engine's kernels,
// ordered after the readiness event reached the host) reads the finished
// bytes. A value left in a slot by an earlier use never equals a fresh
// one (the sequence only grows on an attachment, and the generation tells
// attachments apart), and a slot is reused only once the shard stored 0
// in it, so a stale word completes nothing.
//
// # Mappings
//
// The producer opens the handle once per shard incarnation and device,
// maps the ready-word region once per attachment and registers it once
// per device (cuMemHostRegister, DEVICEMAP), and keeps all of it while the
// hello's connection lives. Registering ends with a probe: the device
// stores one word into the producer's own slot and the producer reads it
// back; a word that does not arrive makes the attachment complete by
// message (logged, counted as a fallback), so that no item ever waits on
// a word a driver drops. When it ends (the shard closed or died) the
// mapping, the registrations and the region are released at once, after
// the copies in flight (a mapping keeps the exporter's memory alive, even
// after the exporter exits). A write naming a new nonce greets the new
// incarnation; one naming a nonce the shard no longer knows fails with
// transport.ErrUnreachable. Writes to one shard copy concurrently, so a
// busy encoder keeps several batches in flight. Close closes every
// connection, region and mapping.
//
// A handle that cannot be opened here (another host's, or a GPU this
// process cannot reach) fails the batch with transport.ErrUnsupported,
// which tells a caller with another transport to that shard to use it.
package cudaipc
