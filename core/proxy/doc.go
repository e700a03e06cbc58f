// Package proxy is the EPD proxy: the OpenAI-compatible HTTP front an
// operator runs before encoder and prefill/decode (PD) vLLM instances.
//
// # One request
//
// For POST /v1/chat/completions (and /v1/completions, which carries no
// media and is forwarded as it is) the proxy:
//
//  1. picks the consumer: the healthy PD instance that served most of the
//     request's images (affinity.go) unless it is busier than the least
//     loaded by more than Config.AffinitySlack, else the one with the
//     fewest requests in flight; and its least-loaded DP rank, sent as
//     X-data-parallel-rank;
//  2. sends each distinct media part (image_url, input_audio, audio_url,
//     video_url) to the least-loaded encoder, one item per call, all
//     concurrently, with ec_transfer_params naming the consumer's control
//     endpoint (ec_port + dp_rank*tp_size) and a fresh transfer_id;
//  3. rewrites the request for the consumer: each encoded part becomes an
//     image_embeds / audio_embeds / video_embeds part carrying the
//     encoder's metadata, with uuid = the encoder's identifier, and
//     ec_transfer_params.ec_items lists {mm_hash, transfer_id} per media
//     part in prompt order (a repeated image is encoded once and listed at
//     each place);
//  4. streams the consumer's answer back unchanged.
//
// An item the picked PD is known to hold is not encoded (AffinityReuse);
// nor, with StoreReuse, one encoded before that the PD gets from Mooncake
// Store itself: its media part stays, under the item's identifier, and its
// ec_items entry says "source": "store" (affinity.go).
//
// An item the encoder could not serve keeps its original media part (the
// consumer encodes it itself). A consumer that fails before the first
// output byte — unreachable, a 5xx answer, or an SSE error event before
// any token (vLLM sends a role-only chunk first; it is held back) — is
// retried up to Retries times on another consumer, with every item encoded
// again under new transfer ids. Once output has reached the client nothing
// is retried. With prefill and decode instances (Config.Prefill/Decode),
// the prefill is the consumer and is called with vLLM's P/D parameters
// (max_tokens 1, kv_transfer_params.do_remote_decode), then the decode
// instance gets the same rewritten request with the prefill's
// kv_transfer_params.
//
// # Client-chosen cache keys
//
// A content part's "uuid" names its item's cache key in vLLM. Such keys
// are kept apart per tenant, refused or trusted (Config.ClientMediaKeys;
// keys.go says why and how), before anything is sent on.
//
// # Cancellation
//
// Every backend call of a request shares one context. A client that
// closes its connection cancels it — a peek at the socket notices while
// the proxy waits, a failed write while it streams — and a cancelled
// context closes the backend connections at once, so vLLM aborts the
// request. The backend client (upstream.go) is net/http's Transport for
// this: fasthttp's own client cannot abandon a call in flight. The server
// side stays fasthttp.
//
// # Backend connections
//
// A backend closes a connection idle for its keep-alive (vLLM: 5 s). The
// proxy closes its idle connections first (UpstreamIdleTimeoutS, 4 s by
// default), and a request that fails on a reused connection before any
// response byte is sent again on a freshly dialed one, never on another
// pooled one of the same age (ecm_proxy_upstream_redials_total). Such a
// stale connection never counts against the backend's health: only a
// fresh connection's failure, or one after response bytes, reaches the
// caller.
//
// # Backends
//
// Static backends come from Config; others register through package
// discovery and lapse when their heartbeat stops. Every backend's /health
// is checked each HealthInterval; FailThreshold consecutive failures
// (checks or calls) drop it until a check passes again.
//
// # Discovery is an administrative surface
//
// Whoever registers a consumer decides where encoders push and where
// requests go, so register and deregister need Config.RegisterToken as a
// bearer token (compared through digests in constant time); with no token
// they are off (403). A registration never replaces, refreshes or removes
// a static backend (409). With Config.AdminPort, register, deregister and
// backends move to a port of their own and the user-facing port no longer
// serves them. Every refusal is counted
// (ecm_proxy_registration_refusals_total{op,reason}) and logged, at most
// once per interval per reason. Discovery bodies are capped before they
// are read.
//
// # Memory
//
// The proxy's memory for request bodies is the budget it advertises,
// max_body_bytes × max_bodies_in_flight (bodyBudget): a body is read into
// one buffer of its announced length, granted before it is allocated (a
// chunked body grows by doubling, the buffer it replaces counted until
// the copy is done), and that buffer is the only copy. The request is
// split into the values the rewrite touches without copying them, and
// every request sent on (to an encoder, the consumer, a prefill or decode
// instance) is written from slices of it and the few bytes the proxy adds
// (jsonspan.go). One client (peer address) holds at most
// max_body_bytes_per_client of the budget (half by default), so its
// stalled uploads leave the rest to others. TestProxyMemoryStaysWithin
// TheBodiesInFlight measures a proxy process's resident set against the
// bytes it holds (cmd/proxyrss). Backend answers are read whole only when
// not streamed, at most max_body_bytes each, outside the budget.
//
// # Metrics
//
// /metrics on the main port (and on MetricsPort when set) serves the
// proxy's own series — requests by route and outcome, latency, the
// encode / transfer_wait / pd phases, media items by fate, consumer
// retries, stale-connection redials, health checks by role and outcome,
// backend health — together with the process registry of package metrics.
package proxy
