// Package slab owns the registered receive memory of one consumer shard and
// the allocator that carves it into regions.
//
// # Memory
//
// A Memory describes memory that someone else owns: Python allocates the
// slab as a numpy array or a torch tensor and hands over (pointer, nbytes,
// device). Host memory carries a byte view built at the C boundary with
// unsafe.Slice; device memory ("cuda:N") carries only its address, because a
// GPU address must never become a Go pointer. Memory.Bytes is the one way to
// reach the bytes and is bounds-checked without overflow.
//
// # Allocator
//
// Allocator is a first-fit allocator over the offsets [0, size). Every offset
// and every length is a multiple of Align (requests are rounded up), so each
// region starts on a boundary that DMA engines and vector copies like. Free
// extents are kept sorted by offset and fully coalesced: two free extents are
// never adjacent. That makes first fit exact (a request fails only when no
// contiguous run of free bytes is large enough) and lets Free find its
// neighbours by binary search.
//
// Invariants, checked by the tests after every step:
//   - live allocations and free extents never overlap, and together cover
//     [0, Size()) exactly;
//   - InUse() is the sum of the rounded lengths of the live allocations;
//   - once everything is freed there is a single free extent of Size() bytes.
//
// # Slab
//
// Slab joins a Memory to an Allocator and gives it a lifecycle:
//
//	Open ──Close(force)──▶ Closing ──last Free──▶ Closed
//	  └──────────Close (nothing in use)─────────────▲
//
// Only an Open slab allocates. Close(false) is refused while bytes are in
// use; Close(true) stops new allocations at once and lets the holders of
// the remaining regions free them, the slab reaching Closed with the last
// Free. The owner of the memory may release it only once State() is Closed:
// until then a region may still be written.
//
// A Slab is not safe for concurrent use; its owner (the reservation table)
// serialises calls. The Memory value it returns is immutable and may be
// shared freely, which is how the data plane reaches region bytes without
// taking the owner's lock.
package slab
