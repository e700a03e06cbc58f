// Package transport is the data plane: it moves encoder outputs from a
// producer's host memory into regions that a consumer has reserved, and
// nothing else. Reservations, tokens and readiness belong to the control
// plane; this package only carries bytes and reports, per item, whether
// they landed.
//
// # Pieces
//
//   - Transport: one way of moving bytes (Listen on the consumer, NewWriter
//     on the producer). tcp.TCP is the embedded default; Inmem is the
//     in-process fake with fault injection, for tests of everything above.
//   - Sink: what the consumer shard plugs into a Receiver. The transport
//     asks it, frame by frame, where the bytes may go.
//   - Writer: what the producer uses. Write blocks until every item of a
//     batch is acknowledged or has failed and returns one error per item.
//   - Direct, DirectSink: the hooks of one-sided transports, which write
//     into registered memory without asking the sink per frame (package
//     mooncake, RDMA through Mooncake TransferEngine; package shm, one
//     memcpy into a slab file in /dev/shm on the same host; package
//     cudaipc, a device copy into a CUDA IPC mapping of a GPU slab); the
//     sink's owner then admits the writer per region (see Direct, DirectOf).
//     A RemoteSink lets the receiver of a one-sided plane complete such a
//     write in-band (cudaipc, when the writer's ready word appears).
//
// # Consumer side
//
//	tr := tcp.NewTCP(tcp.TCPConfig{Logger: log})
//	recv, err := tr.Listen("10.0.0.5:0", shardSink) // publish recv.Addr() on the control plane
//	...
//	defer recv.Close() // after Close returns the sink is never called again
//
// # Producer side
//
//	w := tr.NewWriter() // one per process: it keeps a connection pool per destination
//	defer w.Close()
//	errs := w.Write(ctx, dataAddr, []transport.WriteItem{{Res: r, Token: tok, Src: buf}})
//	for i, err := range errs {
//		switch {
//		case err == nil: // landed; now send `complete` on the control plane
//		case errors.Is(err, transport.ErrRejected): // the consumer refused (see ErrGone, ErrBadToken, ...)
//		case errors.Is(err, transport.ErrConnLost): // may have partly landed; retry or fail the request
//		}
//	}
//
// # Invariants
//
//   - A write lands only inside what Sink.BeginWrite hands out for that
//     reservation id, token, offset and length. Nothing on the wire names an
//     address the receiver trusts; offset+length overflow is refused before
//     the sink is asked.
//   - EndWrite is called exactly once per successful BeginWrite, after the
//     transport has stopped touching dst, and before the writer can learn
//     that the frame landed. A frame that carries its item's completion
//     (WriteItem.Complete, on a writer that InBand says completes in-band)
//     ends through CompleteSink.EndComplete in its place when it landed
//     whole, so that the shard completes the item before the writer hears
//     of its last frame; a sink without it refuses the frame (ErrNoInBand).
//   - When Write returns, no goroutine of the transport still reads any Src:
//     the caller may free or reuse its buffers at once, also after a
//     deadline or a Close.
//   - Write returns by ctx's deadline; items still open get ctx's error.
//   - A refused frame costs only itself: its payload is drained, an ack says
//     why, and the connection carries the next frame. Bytes that do not
//     decode as a frame cost that connection, never the listener.
//
// # Where each piece lives
//
// This package holds only what every plane shares: the interfaces above,
// WriteItem and DeviceSrc, the sentinel errors and the Status table that
// carries a refusal across any wire (StatusOf, Status.Err), RecvStats and
// its counters, the checks every receiver owes a sink (OpenFrame), and the
// in-process fake Inmem. Each data plane lives in a folder of its own and
// reaches the others only through these: tcp (the embedded default, with
// its frame codec, handshake and ceiling), shm, cudaipc and mooncake. The
// accept loop and the capped connection set that tcp, shm and cudaipc
// run are in internal/serve, and the SO_PEERCRED admission and SCM_RIGHTS
// descriptors of the same-host planes (shm, cudaipc) in internal/unixfd;
// neither imports anything of this tree, so no plane reaches back up for
// a helper (layout_test.go holds the tree to that).
//
// # GPU memory
//
// A source in GPU memory comes as WriteItem.Dev, with a readiness event the
// transport orders its reads after; TCP, shm and Inmem refuse it
// (ErrDeviceMemory, see RefuseDevice), and so does mooncake with an engine
// that is no CUDA build: the producer wraps those in package staged. A slab in GPU memory has no byte view: its shard is a
// RegionSink, which admits a frame like BeginWrite but answers with the
// frame's offset in the slab. A FrameSink tells frames apart, so a sink
// that stages a frame through host memory can copy it on when that frame
// ends. The packages below this one build on these: staged (TCP, shm and a
// non-CUDA mooncake with GPU memory, through page-locked buffers), cudaipc (same host, one-sided,
// device to device) and route (which plane serves which destination: Picker,
// MultiReceiver).
package transport
