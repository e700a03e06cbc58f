// Package cudaipc is the same-host data plane for GPU memory: the
// producer copies device to device straight into the consumer's GPU slab,
// through a CUDA IPC mapping of it, over NVLink or PCIe peer access or
// within one GPU. It is one-sided, like mooncake and shm: a batch costs no
// exchange of its own, only the control plane's reserve and complete.
//
// # Protocol
//
// The consumer shard exports its slab's IPC handle once, when it starts
// listening, and publishes its address on the control plane:
//
//	host:port?nonce=<32 hex digits>
//
// The nonce is new for every Listen, so a shard that restarts on the same
// port publishes a new address, and a reserve reply (which names the data
// plane of the incarnation that granted) tells the producer which
// incarnation's slab its grants are in. The socket serves one exchange per
// producer, the hello (see wire.go): the producer presents the nonce and
// gets the handle, the slab's offset into its allocation, and the slab's
// address and size in the shard's process. The handle goes only to a peer
// that knows the nonce, and the nonce only ever travels on the
// authenticated control plane. The connection then stays open and idle:
// its end is how each side learns that the other is gone. The socket holds
// at most Config.MaxConns connections at once (the shard's max_data_conns,
// like the other data planes); one past the cap is closed at once and
// counted in RecvStats.Closed under transport.ClosedLimit.
//
// # One Write
//
// The receiver is a transport.Direct. A write grant carries the region's
// address (RemoteAddr: the slab's address plus the region's offset) and
// its size, and the shard admits the region's write at the grant and ends
// it at the producer's complete or abandon (package consumer, direct.go),
// so the region is not reused while a copy into it may still land. The
// writer checks every item against its grant (inside [Addr, Addr+Size))
// and the grant against the slab of the incarnation it mapped (inside
// [Base, Base+Size) of its hello), and refuses anything else before
// copying a byte (transport.ErrWriteBounds, transport.ErrStaleAddr). The
// shard's checks stay: only a write grant, which needs the reservation's
// token, makes it hold a region for a writer, and only the producer that
// holds the token can complete it.
//
// Then it queues the batch's copies on one stream of the source's device,
// behind each source's readiness event, records an event after them and
// waits for it (gpu.TimedCopier, which also says how long the GPU took and
// how long waking for the event cost, observed as metrics phases). Write
// returns only after that event completed. As for any one-sided plane, a
// shard whose writer neither completes nor abandons ends the write after
// two leases; a copy still queued then (behind a source whose stream has
// been stuck for that long) could land in a reused region, which is why
// the producer's write deadline (push_wait_timeout_s, 60 s by default)
// should stay far shorter than a lease (lease_s, 300 s by default).
//
// # Ordering
//
// The shard publishes an item when the producer's complete arrives, and
// the producer sends it only after Write returned, that is after the
// copy's completion event was seen complete on the host. An event
// completes only once every copy queued before it on its stream has
// finished writing device memory, the mapped slab included, so by the
// time the complete can exist the bytes are in the slab; whatever the
// consumer then launches to read them (the engine's kernels, ordered after
// the readiness event reached the host) reads the finished bytes.
//
// # Mappings
//
// The producer opens the handle once per shard incarnation and device and
// keeps the mapping while the hello's connection lives. When it ends (the
// shard closed or died) the mapping is closed at once, after the copies in
// flight (a mapping keeps the exporter's memory alive, even after the
// exporter exits). A write naming a new nonce greets the new incarnation
// and closes the old mapping; one naming a nonce the shard no longer
// knows fails with transport.ErrUnreachable. Writes to one shard copy
// concurrently, so a busy encoder keeps several batches in flight. Close
// closes every connection and mapping.
//
// A handle that cannot be opened here (another host's, or a GPU this
// process cannot reach) fails the batch with transport.ErrUnsupported,
// which tells a caller with another transport to that shard to use it.
package cudaipc
