// Package metadata is a Mooncake-compatible metadata store: the small HTTP
// service that Mooncake TransferEngines in HTTP metadata mode
// (metadata "http://host:port/metadata") use to publish and look up their
// segments, so that such a deployment needs no etcd or Redis.
//
// # Protocol
//
// The semantics are those of Mooncake's HTTP metadata plugin and of its
// reference server:
//
//	GET    /metadata?key=K   200 and the stored JSON body; 404 when K is missing
//	PUT    /metadata?key=K   stores the JSON body; 200; a second PUT overwrites
//	DELETE /metadata?key=K   200, whether or not K was there
//	GET    /health           200 "ok"
//
// Keys arrive URL-escaped in the query string (curl_easy_escape on the
// engine's side) and are stored unescaped; Mooncake's keys look like
// "mooncake/rpc_meta/<segment>" and "mooncake/ram/<segment>". A PUT must
// carry JSON, since every engine parses what it reads back. Overwriting is
// deliberate: an engine that restarts re-publishes under the same key, and
// refusing that strands it. Any status but 200 is an error to the engine,
// which gives up after 3 s.
//
// With Config.Token set, /metadata requires "Authorization: Bearer
// <token>", which Mooncake sends when MC_METADATA_HTTP_TOKEN is set.
//
// # Limits
//
// Whoever can PUT decides which segment an engine connects to, and a
// store without bounds is a memory sink. A request's body limit is chosen
// once its header is read: MaxValueBytes for an authorized PUT, a few KB
// for everything else, so an unauthorized client never makes the store
// buffer a value (401), and an authorized value above the cap is refused
// with 413 before it is read. MaxKeys and MaxTotalBytes (keys and values
// together) bound what is kept: a PUT past either is refused with 507,
// except that overwriting an existing key never counts against MaxKeys.
// Invariant: the counted bytes equal the sum of every key and value, and
// never exceed MaxTotalBytes (FuzzRequests checks it after each request).
//
// # Connections
//
// Whoever reaches the port can open connections, token or not, so
// connections are admitted by the rule the control plane's ports share
// (core/internal/conncap): at most MaxConns at once and MaxConnsPerPeer
// from one address. A connection proves itself by a request with the
// token (without a token none can); at a limit, one that has not, and is
// not in a request, makes room for the newcomer: its address's
// longest-waiting one over the share, or over the cap the
// longest-waiting one of the address holding the most such connections.
// A flood of silent connections therefore makes room from its own, and
// an engine, /health included, is answered while it lasts; only when
// every place is held by a proven connection or one in a request is the
// newcomer answered 503 and closed. A request's header must arrive within
// 5 s of the connection or of the previous request (30 s for an authorized
// PUT's body); Stats counts EvictedConns and RejectedConns, and
// ecm_metadata_refusals_total the reasons conn_evicted and conn_refused.
// Peers that share an address (same-host clients on loopback) are told
// apart only by how long each waited, so a peer of the same address that
// opens connections faster than an engine's request takes could still
// close that engine's newest connection: give engines a token and keep
// the store on loopback or an address untrusted hosts cannot reach.
//
// # Lifetime
//
// The store lives in memory: it is lost when its process ends, and engines
// that published into it must then be restarted (or re-register). A
// consumer shard that starts one on demand (mooncake_metadata_server) owns
// it for its own lifetime; Ensure lets the other shards of the host find
// and use it instead of failing on the bound port. For a store that
// outlives consumers, run `python -m ecmooncake metadata-server` on its own.
//
// Every handler and the serving goroutine recover panics.
package metadata
