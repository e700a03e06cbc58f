// Package cudaipc is the same-host data plane for GPU memory: the
// producer copies device to device straight into the consumer's GPU slab,
// through a CUDA IPC mapping of it, over NVLink or PCIe peer access or
// within one GPU.
//
// # Protocol
//
// The consumer shard exports its slab's IPC handle once, when it starts
// listening, and serves a small binary protocol on a TCP socket (see
// wire.go): hello (the handle, its offset into the allocation, the slab
// size and an instance id that changes when the shard restarts), begin
// (admit frames: the shard checks reservation, token, offset and length
// exactly as for any transport, and answers with each frame's offset in
// the slab) and end (each admitted frame landed, or not). Nothing the
// producer sends names an address; the shard names offsets inside its
// own slab, and only inside live reservations.
//
// # One Write
//
// One begin for the whole batch, the copies (all queued on one stream
// behind each source's readiness event, one wait), one end: two round
// trips per batch whatever its size. End is sent only after the copies
// have completed, so the shard ends a frame, and the producer completes
// the item, only once its bytes are in the slab.
//
// # Mappings
//
// The producer opens the handle once per consumer shard and device and
// keeps the mapping while its connection lives. A lost connection closes
// the mappings at once (a mapping keeps the exporter's memory alive, even
// after the exporter exits), and the next Write reconnects: a shard that
// restarted answers hello with a new instance and a new handle. A write
// that finds its idle connection dead reconnects once before failing.
// Close closes every connection and mapping.
//
// A handle that cannot be opened here (another host's, or a GPU this
// process cannot reach) fails the batch with transport.ErrUnsupported,
// which tells a caller with another transport to that shard to use it.
package cudaipc
