// Package control owns the ZeroMQ sockets of the control plane: the ROUTER
// server of a consumer shard, the DEALER client a producer (or scheduler)
// keeps per shard, and the PUSH/PULL pair that carries readiness events from
// shards to their scheduler. Messages and their codec live in package wire;
// what a request means lives in the Handler, which this package only calls.
//
// # Usage
//
// One *zmq.Context per process object, created and terminated by its owner
// and passed to every constructor here:
//
//	zctx, _ := zmq.NewContext()
//	defer zctx.Term() // after every Close below
//
//	srv, err := control.NewServer(zctx, control.Endpoint(ecIP, port), handler, log)
//	defer srv.Close()
//
//	cli, err := control.Dial(zctx, srv.Endpoint(), log, control.WithCallTimeout(5*time.Second))
//	defer cli.Close()
//	var grants wire.ReserveBatchReply
//	err = cli.Call(ctx, wire.OpReserveBatch, wire.ReserveBatch{Requester: requester, Items: items}, &grants)
//	var werr *wire.Error
//	if errors.As(err, &werr) { /* the server refused: werr.Code */ }
//
//	pub, err := control.NewEventPub(zctx, ecIP, log) // the shard; advertise pub.Endpoint()
//	pub.Send(evs...) // one flush's events: one message (wire.EncodeEvents)
//
//	sub, err := control.NewEventSub(zctx, log) // the scheduler
//	err = sub.Connect(endpointFromEventPortOp)
//	for evs := range sub.Events() { apply evs as one batch }
//
// # Event messages
//
// A publisher's Send takes the events of one flush of a shard (every
// readiness, failure and gone record one call produced) and sends them as
// one binary event message (wire.EncodeEvents; several only past
// wire.MaxEventRecords or wire.MaxMessage), and a subscriber hands each
// message's events to its reader together, so that a batch of 8 items is
// one message to queue, write, read and apply, not 8. Each event still
// has its own seq (a message's run without a hole), so gaps, drops and
// the status resync work per event as before; a publisher's queues and
// backlogs are bounded in events (EventQueue, however they are packed),
// a subscriber's in messages. PubStats.Sent and SubStats.Received count
// events, Messages the messages they came in. An invalid event is refused and
// counted (PubStats.Invalid), its seq spent, and the message goes on
// without it. A JSON event from a publisher of an older build is refused,
// counted (SubStats.Legacy) and logged once: shard and scheduler run from
// one library.
//
// # Links
//
// The runtimes (consumer, producer, scheduler) see the control plane only
// through the small interfaces of links.go: Links opens a Serving server, a
// Publisher, Callers and a Subscriber for one process object. ZMQ is the
// production Links; InmemNetwork (inmem.go) is the fake beside it, which
// keeps the codec, the one-request-at-a-time server and the event order,
// and can partition, delay and heal the link between any two objects.
// Each runtime takes its links from OpenLinks, which checks auth_secret
// and opens ZMQ links with its security unless the caller gave links of
// its own; CloseIfFailed closes given links when the runtime's Open fails.
//
// # The Unix path
//
// Peers on one host skip libzmq's I/O threads: Unix (unixlinks.go) is the
// Links of a process with control_unix set, the default (OpenLinks,
// WithUnixPath). Its
// servers also listen on the abstract Unix name of their endpoint
// (UnixName: "@ecmooncake/control/host:port"; abstract, so that no name a
// peer gives opens a file), read by Go's network poller, one goroutine per
// connection, the handler still called one request at a time across both
// paths. Its callers to an address of this network namespace call over
// that name, the same wire frames behind a u32 length (unixframe.go),
// pipelined on one connection and matched by id; peers elsewhere get a
// ZeroMQ client as before.
//
// Admission (unixauth.go): both ends check the other's uid with
// SO_PEERCRED (ours or root; the client too, so that a name squatted by
// another user is not trusted), then, with a secret, a challenge–response
// HMAC over fresh nonces of both ends proves each holds it; the secret
// never travels. Refusals are named to the refused end and counted by the
// server (ServerStats.Refused: unix_uid, unix_conn_cap, unix_uid_cap,
// unix_handshake and the auth_* reasons of CURVE). One gate
// (unixgate.go) accepts for the call server and the event publisher
// alike: the uid is read at accept, so a uid not admitted never holds a
// place, nor one over its share. Bounds: UnixMaxConns connections,
// UnixMaxConnsPerUID of them per peer uid, frames
// of at most wire.MaxMessage checked before they are read, a deadline on
// every handshake, read and write.
//
// A call that could not be sent over Unix (nothing listens on the name,
// refused, at the cap) goes over ZeroMQ, counted by cause
// (Unix.Fallbacks, ecm_failures_total{component="control_client",
// reason="unix_fallback_<cause>"}) and logged when the cause changes; the
// Unix path is tried again after a second. A call that may have reached
// the server over Unix is never resent over ZeroMQ: it fails, as a lost
// ZeroMQ reply would.
//
// Readiness events take the Unix path too (unixevents.go): a publisher
// (UnixEventPub) also listens on its ZeroMQ endpoint's Unix name, admits
// subscribers through the same gate as the server's callers, and writes
// each event message to every admitted subscriber from that connection's
// goroutine, one seq per event across both paths; while none is
// admitted, events go over ZeroMQ and a
// bounded backlog keeps them for a subscriber yet to come, as a PUSH
// socket keeps them for its PULL. A subscriber (UnixEventSub) follows a
// same-host publisher over Unix, redialling a lost connection, and any
// other, or one that refused it, over ZeroMQ (counted as the fallback
// cause "events_<cause>"). A subscriber's queue holds opts.eventQueue
// events, the messages beyond are dropped and counted (PubStats.Dropped,
// SubStats.Gaps), and a write that passes its deadline closes the
// connection (PubStats.WriteFailures); the scheduler's status resync
// covers what was dropped, as over ZeroMQ.
//
// # Security
//
// A deployment-wide secret turns on libzmq's CURVE on every socket: every
// holder derives the same server and client key pairs from it
// (DeriveKeys), servers (ROUTER, event PUSH) admit only the client key,
// clients (DEALER, event PULL) accept only the server key, and every
// message is encrypted, the data-plane tokens in reserve replies included:
//
//	sec, err := control.NewSecurity(secret, allowUnauthenticated)
//	srv, err := control.NewServer(zctx, bind, handler, log, control.WithServerSecurity(sec))
//	cli, err := control.Dial(zctx, ep, log, control.WithClientSecurity(sec))
//
// Without a secret a server bound beyond loopback serves loopback peers
// only (protected mode) unless allowUnauthenticated; bound on loopback it
// serves as it always did. Admission is decided by one rule (policy.decide)
// that the ZAP handler of each zmq context applies to every new
// connection; refusals that happen before ZAP is asked (a hello that does
// not decrypt, a peer of the other mechanism) come from a socket monitor.
// Every refusal is counted (ServerStats.Refused and
// ecm_failures_total{component="control"}) and logged once per cause. A
// client refused by its server fails its calls at once with ErrAuth, and
// an error saying which setting to change, instead of at its deadline;
// it counts what it was refused too (ClientStats.Refused,
// SubStats.Refused, ZMQ.Refused for all the sockets of one links, and
// ecm_failures_total{component="control_client"}).
//
// The ends of a mechanism mismatch race: whichever reads the other's whole
// greeting first hangs up, maybe before writing the rest of its own, and
// the other end then sees only a connection closed mid-handshake. So a
// server counts a peer that hung up mid-handshake (auth_aborted), and a
// client takes two hang-ups in a row, with no success between, as a
// refusal (a server that went away hangs up once; one that refuses this
// end does so on every reconnect).
//
// # Limits
//
// ZMQ_MAXMSGSIZE caps each part of a message at what a control message
// can be (wire.MaxMessage and a 64 KiB margin): libzmq checks it at the
// part's header, before allocating it, and disconnects the peer. The
// sockets here also cap the whole message (MaxMessageBytes, and a few
// parts), reading the parts of a message over the cap into nothing.
// libzmq itself assembles a whole multipart message before handing over
// its first part, so a message is bounded inside libzmq only part by
// part: libzmq has no option that caps the parts of one message (pipe
// high-water marks count whole messages, and the parts of one not yet
// complete count for nothing), so the worst a peer past the handshake can
// make one connection hold is unbounded in parts, each at most
// maxFrame; authentication, not a cap, is what keeps strangers from
// sending one at all. With a secret, configured or per-user (the default
// of the Python package), a peer must hold it before it can send a frame;
// under allow_unauthenticated, anybody who reaches the port can make a
// shard hold a message of many parts until it has all arrived.
//
// ZMQ_HANDSHAKE_IVL (handshakeTimeout, 5 s) closes a connection that has
// not completed its handshake, and every server socket keeps at most
// DefaultMaxConns connections (WithMaxConns). libzmq has no connection cap
// of its own, so the cap is kept from the socket monitor's ACCEPTED and
// DISCONNECTED events (connCap, by the rule of core/internal/conncap that
// the metadata store shares): at the cap the connection that has
// waited longest in its handshake is shut down (shutdown(2) on libzmq's
// descriptor, which libzmq then reports closed), never one old enough to
// have completed it, so a flood of silent connections holds at most the
// cap and a peer holding the secret still gets in. Each close is counted
// as ecm_failures_total{component="control",reason="conn_cap"} and in
// ServerStats.ConnsEvicted. One peer address holds at most
// DefaultMaxConnsPerPeer of them (WithMaxConnsPerPeer; the monitor names
// the descriptor, getpeername(2) its peer), and a flood makes room from
// its own address's connections (reason conn_cap_peer when the address
// is over its share).
//
// Endpoints are "tcp://host:port" with IPv4, bracketed IPv6 ("tcp://[::1]:5")
// or a hostname; Endpoint and SplitEndpoint build and parse them. Hostnames
// are resolved with the Go resolver: a client connects to the first address,
// a server binds every address, so both agree whatever the name maps to.
//
// # Invariants
//
//   - Each socket belongs to exactly one goroutine, started by its
//     constructor and ended by Close, and every such goroutine runs the
//     same poll loop (owner.loop). It parks in Go, not in libzmq: the
//     socket's ZMQ_FD is watched by Go's network poller, so a parked owner
//     holds no thread and no P (a cgo zmq_poll would hold both, which at
//     GOMAXPROCS 2 stalls the goroutines it readies). Other goroutines
//     reach it through Go channels and a wake-up that expires the read
//     deadline of its wait; no socket is ever used by two goroutines.
//     Queued work and arriving messages are picked up at once; the loop's
//     tick only clocks reconnects.
//   - Linger is 0 on every socket, every receive and send of an owner is
//     non-blocking, and the owner's wait ends at its tick: Close and zmq
//     context termination never hang on a peer.
//   - Nothing blocks a caller beyond its own deadline. Call honours its
//     context (a context without deadline gets the client's default,
//     DefaultCallTimeout unless set with WithCallTimeout); EventPub.Send
//     never blocks and drops when its queue is full.
//   - Every socket goroutine recovers panics: a handler panic becomes a
//     CodeInternal reply and the server keeps serving; any other panic is
//     logged, stops that one object (ErrStopped for whoever waits on it)
//     and never reaches the process.
//   - A message the server cannot decode, of another version or of an
//     unknown op still gets an error reply, with its id when one could be
//     read (else id 0), and the server keeps serving.
//   - Replies are matched to calls by id. A reply that arrives after its
//     call gave up is dropped and counted (ClientStats.LateReplies). A
//     request whose call gave up before the socket could take it is never
//     sent, and a client queues nothing for a server it is not connected
//     to, so a server that comes back is not flooded with stale work.
//   - Close is idempotent, waits for the goroutine and closes the socket;
//     calls in flight fail with ErrClosed.
package control
