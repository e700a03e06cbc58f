// Package transport is the data plane: it moves encoder outputs from a
// producer's host memory into regions that a consumer has reserved, and
// nothing else. Reservations, tokens and readiness belong to the control
// plane; this package only carries bytes and reports, per item, whether
// they landed.
//
// # Pieces
//
//   - Transport: one way of moving bytes (Listen on the consumer, NewWriter
//     on the producer). TCP is the embedded default; Inmem is the
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
//     that the frame landed.
//   - When Write returns, no goroutine of the transport still reads any Src:
//     the caller may free or reuse its buffers at once, also after a
//     deadline or a Close.
//   - Write returns by ctx's deadline; items still open get ctx's error.
//   - A refused frame costs only itself: its payload is drained, an ack says
//     why, and the connection carries the next frame. Bytes that do not
//     decode as a frame cost that connection, never the listener.
//
// # TCP wire format and behaviour
//
// Each frame is a fixed 56-byte little-endian header (see AppendHeader)
// followed by its payload; each frame is answered by one ack (see
// AppendAck) in order on the same connection. The writer keeps
// TCPConfig.Conns persistent connections per destination, dialed lazily
// and redialed after a failure. Items larger than ChunkSize are cut into
// nearly equal chunks dealt round-robin over the pool, so one large item
// uses every connection at once. Header and payload go out in one writev
// straight from Src, and the receiver reads a payload larger than what it
// has buffered straight into the sink's dst.
//
// Small frames travel in groups, with no change to the wire: the chunks of
// one Write queued together for a connection go out in one writev (at most
// 64 frames and 1 MiB), and the receiver, which parses frames that arrived
// together from its read buffer, holds their acks back until its next read
// would wait, then writes them together; the writer reads them with one
// read. Every frame of a group keeps its own header and is checked on its
// own (reservation id, token, offset, length): a refused frame inside a
// group fails alone and the frames around it land, while bytes that do not
// decode as a header end the connection after the frames before them were
// acked. A receiver never waits for the network with acks held back, so a
// group's acks never wait for a later frame.
//
// A connection whose write fails (deadline, cancel, peer gone) is
// half-closed: the receiver sees the torn frame end (EndWrite(false)),
// while acks for the frames sent in full before it still arrive.
//
// The receiver bounds what a peer can hold (see TCPConfig): at most
// MaxConns connections, an idle one making room for a newcomer and a
// newcomer closed at once when every one has a frame in flight;
// IdleTimeout between frames; FrameTimeout from a frame's first byte to
// its ack, after which the frame ends torn and the connection closes, so
// that a stalled or stopped writer cannot keep a region's write open past
// its lease. A receiver that closes a connection with no frame begun says
// so first with a goodbye (an ack with Seq 0 and StatusClosing); the
// writer then sends the frames it had not had acked again, once, on a new
// connection. Each close is counted in RecvStats.Closed by reason.
//
// Every receiver that accepts connections (tcp here, shm and cuda_ipc in
// their packages) runs the same accept loop, Acceptor: a failing Accept
// (out of descriptors) is retried after a growing wait instead of ending
// the listener, and a panic costs one connection. shm and cuda_ipc keep
// their connections in a Conns, which closes one past MaxConns at once
// (ClosedLimit) and cuts them all at Close; Counts backs the Rejected and
// Closed maps of every receiver's stats.
//
// The ceiling that benchmarks divide TCP throughput by is this data plane
// with the reservations taken out (ceiling.go): the same writer and
// receiver, frame size and socket options, with a sink that admits every
// frame into memory of its own. ListenCeiling and CeilingSend are its two
// ends, for processes of their own (cmd/ecm-ceiling, which the Python
// benchmarks start); LoopbackCeiling runs both in one process.
//
// # GPU memory
//
// A source in GPU memory comes as WriteItem.Dev, with a readiness event the
// transport orders its reads after; TCP and Inmem refuse it
// (ErrDeviceMemory). A slab in GPU memory has no byte view: its shard is a
// RegionSink, which admits a frame like BeginWrite but answers with the
// frame's offset in the slab. A FrameSink tells frames apart, so a sink
// that stages a frame through host memory can copy it on when that frame
// ends. The packages below this one build on these: staged (TCP with GPU
// memory, through page-locked buffers), cudaipc (same host, one-sided,
// device to device) and route (which plane serves which destination: Picker,
// MultiReceiver).
package transport
