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
// chunks in flight is bounded by the staging budget. Device items of up
// to a chunk are packed instead: those of one Write and one device share
// a buffer of at most a chunk, each copied to its own aligned place in one
// batch of copies that is waited for once, and go to the inner writer in
// one call, so that a plane which groups the
// frames of a call (TCP's writev) sends them together and the budget holds
// a chunk of small items per buffer rather than one. Host sources pass
// straight through.
//
// Consumer side: a sink over a device slab admits each frame through the
// shard's RegionSink, hands the transport a page-locked buffer to read the
// payload into, and when the frame ends copies the buffer to its place in
// the slab before ending the frame in the shard. A frame is acknowledged,
// and so the item can be completed and published, only after its bytes
// are on the GPU. Frames of different connections stage at the same time,
// so one connection's PCIe copy overlaps the others' socket reads.
//
// The receive side never waits for a buffer: a frame that finds the
// budget spent stages through ordinary (pageable) memory instead, slower
// but never stuck behind a peer that stopped sending mid-frame.
package staged
