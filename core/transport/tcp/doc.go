// Package tcp is the `tcp` data plane, the embedded default: a writer
// keeps a pool of TCP connections per destination and sends each item as
// frames, each checked by the receiver against the sink and answered by
// an ack. It implements transport.Transport; see package transport for
// the contract (Sink, Writer, Receiver) and its invariants.
//
// # Wire format and behaviour
//
// Each frame is a fixed 56-byte little-endian header (see AppendHeader)
// followed by its payload; each frame is answered by one ack (see
// AppendAck) in order on the same connection. The writer keeps
// TCPConfig.Conns persistent connections per destination, dialed lazily
// and redialed after a failure. Items larger than ChunkSize are cut into
// nearly equal chunks dealt round-robin over the pool, so one large item
// uses every connection at once. Header and payload go out in one writev
// straight from Src, and the receiver reads a payload larger than what it
// has buffered straight into the sink's dst, in one readv with its read
// buffer, so that the next frame's header comes with it: one read system
// call a frame while the stream flows.
//
// Small frames travel in groups, with no change to the wire: the chunks of
// one Write queued together for a connection go out in one writev (at most
// 64 frames and 1 MiB), and the receiver holds the acks of frames that
// arrived together back until its next read would wait (it tries the
// socket without waiting first), then writes them together; the writer
// reads them with one read. That holds for payloads read straight into
// the slab too, so a stream of 64 KiB frames costs one ack write per
// pause of the stream, not one per frame. Every frame of a group keeps its own header and is checked on its
// own (reservation id, token, offset, length): a refused frame inside a
// group fails alone and the frames around it land, while bytes that do not
// decode as a header end the connection after the frames before them were
// acked. A receiver never waits for the network with acks held back, so a
// group's acks never wait for a later frame.
//
// A frame may carry its item's completion (FlagComplete, set when the
// item asks: WriteItem.Complete): the receiver then ends it through the
// sink's in-band completion (transport.CompleteSink), which completes the
// reservation once every byte of it has landed, before the frame's ack.
// The writer sets it on every frame of such an item, since the frames
// travel over several connections and any of them may land last; an
// item whose every frame was acknowledged is complete at the shard, and
// no complete message follows it. A sink that does not complete in-band
// refuses such a frame (transport.ErrNoInBand).
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
// # Admission
//
// A new data connection proves itself before it counts (handshake.go):
// the receiver opens with a Challenge naming the Mode, and the writer's
// Preamble answers it with a MAC of the challenge keyed by the deployment
// secret (ModeSecret); with no secret, the connection's first frame must
// carry the write token of a live grant (ModeGrant). Connections still
// in their handshake have a budget of their own (MaxUnproven) and a short
// deadline (HandshakeTimeout), so that peers that connect and stall never
// take a proven connection's slot.
//
// # Accepting connections
//
// The receiver runs the accept loop that every plane shares
// (internal/serve.Acceptor): a failing Accept (out of descriptors) is
// retried after a growing wait instead of ending the listener, and a
// panic costs one connection.
//
// # Ceiling
//
// The ceiling that benchmarks divide this plane's throughput by is the
// plane with the reservations taken out (ceiling.go): the same writer and
// receiver, frame size and socket options, with a sink that admits every
// frame into memory of its own. ListenCeiling and CeilingSend are its two
// ends, for processes of their own (cmd/ecm-ceiling, which the Python
// benchmarks start); LoopbackCeiling runs both in one process.
package tcp
