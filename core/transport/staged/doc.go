// Package staged carries GPU memory over a transport that moves host
// memory (TCP; on the producer side also shm and mooncake with an engine
// that is no CUDA build), by staging it through page-locked host buffers
// on both sides. A staged chunk keeps its item's grant (Addr, Size), so
// one-sided inner transports place it as they would the whole item.
//
// Producer side: a device source is cut into chunks; each chunk is copied
// to a page-locked buffer (ordered after the source's readiness event) and
// handed to the inner writer as a frame of its own at its offset in the
// reservation, while the next chunk is already being copied. So the PCIe
// copy of chunk k+1 runs while chunk k is on the socket, and the number of
// chunks in flight is bounded by the staging budget. Host sources pass
// straight through.
//
// Consumer side: a sink over a device slab admits each frame through the
// shard's RegionSink and hands the transport a page-locked buffer to read
// the payload into. When the frame ends, its copy to its place in the
// slab is queued (gpu.Uploader; transport.LaterFrame) and the receiver
// reads the next frame while the copy engine moves this one. Before it
// acknowledges anything (at the latest when its next read would wait, or
// after 64 frames), the receiver settles each frame it owes an ack
// (transport.Settle): that waits for the frame's own copy and only then
// ends the frame in the shard, and the sink's Flush publishes what they
// completed. So a frame is acknowledged, and its item completed and
// published, only after its bytes are on the GPU; the socket reads and
// the PCIe copies of one connection's stream overlap, those of different
// connections do too, and no connection's ack waits for another's copy. A
// device that cannot queue uploads, and a frame staged through pageable
// memory, copy and wait in the frame's End instead. A receiving frame
// that finds every buffer lent to queued frames finishes those first.
//
// The receive side never waits for a buffer: a frame that finds the
// budget spent stages through ordinary (pageable) memory instead, slower
// but never stuck behind a peer that stopped sending mid-frame.
package staged
