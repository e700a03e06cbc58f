/*
 * ecmooncake — encoder-cache transport for disaggregated multimodal serving.
 *
 * The public C ABI of libecmooncake.so. This header is kept by hand and is the
 * contract: tests/python/test_abi.py fails when it and the library's exports
 * drift apart, and python/ecmooncake/_ffi.py mirrors it one to one.
 *
 * Conventions (every function):
 *   - returns an int status, ECM_OK (0) on success;
 *   - on failure fills *err with a message the caller frees with ecm_free;
 *     err may be NULL when the caller does not want the text;
 *   - objects cross as opaque ecm_handle_t values, never as pointers;
 *   - structured values cross as UTF-8 JSON; JSON the library returns is
 *     written to *out_json and freed by the caller with ecm_free; the
 *     encoder's per-batch calls take packed binary records instead (see
 *     ecm_producer_submit_packed), so that no batch pays for JSON;
 *   - memory the caller owns (slabs, encoder outputs) is passed as
 *     (pointer, nbytes), with a device where it may be GPU memory; the
 *     library reads or writes it only while the object that received it
 *     is open, and never frees it;
 *   - calls are coarse (one per batch or scheduler step) and never block
 *     unless their name or a timeout argument says so;
 *   - a Go panic never crosses this boundary: it becomes ECM_ERR_INTERNAL;
 *   - pointer parameters (out, out_json, arrays) must not be NULL, and
 *     counts and lengths must be true: each is checked before any work,
 *     and a NULL out, a count above ECM_MAX_SOURCES or a (pointer, nbytes)
 *     that is NULL with a length or runs past the address space fails with
 *     ECM_ERR_INVALID, so that no object is opened for a caller that could
 *     not receive its handle;
 *   - the library works only in the process that loaded it. A child forked
 *     after the load inherits the Go runtime without its threads: every
 *     call from it (except ecm_free) fails at once with ECM_ERR_STATE,
 *     "libecmooncake was loaded in pid X and called from forked child Y;
 *     load it after fork", instead of hanging.
 */
#ifndef ECMOONCAKE_H
#define ECMOONCAKE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define ECM_ABI_VERSION 3

#define ECM_OK 0
#define ECM_ERR_INVALID 1     /* bad argument, config or JSON */
#define ECM_ERR_HANDLE 2      /* unknown, closed or wrong-kind handle */
#define ECM_ERR_STATE 3       /* the object cannot do that now */
#define ECM_ERR_IO 4          /* network or transport failure */
#define ECM_ERR_TIMEOUT 5     /* a deadline passed */
#define ECM_ERR_INTERNAL 6    /* a recovered panic or a broken invariant */
#define ECM_ERR_UNAVAILABLE 7 /* a feature this build or host lacks */

/* Most items one packed producer call takes. */
#define ECM_MAX_SOURCES 65536

typedef uint64_t ecm_handle_t;

/* Library. */
int ecm_abi_version(int32_t *out_version, char **err);
void ecm_free(char *p);
/* Process-wide settings, JSON: {"gomaxprocs": 2, "log_level": "info"}.
 * Call before opening objects; later calls change only the log level. */
int ecm_configure(const char *config_json, char **err);
/* Whether this process can use GPU memory: {"available": bool, "reason",
 * "driver_version", "devices"}. The CUDA driver (libcuda.so.1) is opened
 * with dlopen on first use; without it every GPU feature fails with
 * ECM_ERR_UNAVAILABLE and everything else works. */
int ecm_gpu_info(char **out_json, char **err);
/* Whether Mooncake's TransferEngine can serve the mooncake transport, for
 * {"library": path} (empty: libtransfer_engine.so on the loader's search
 * path): {"library", "available": bool, "reason", "symbols": [functions
 * the transport needs]}. Loads the library as an object choosing mooncake
 * would; creates no engine. */
int ecm_mooncake_info(const char *config_json, char **out_json, char **err);
/* Counters and state of any open object, as JSON. */
int ecm_stats(ecm_handle_t h, char **out_json, char **err);
/* Closes any object; closing twice is ECM_ERR_HANDLE. */
int ecm_close(ecm_handle_t h, char **err);
/* This process's ring of ready-path stamps (docs/design.md lists the hops;
 * off unless $ECMOONCAKE_TRACE or a capacity turned it on).
 * In: {"capacity": N} starts a fresh ring of N entries (0: off);
 * {"drain": true} takes the stamps recorded since the last drain.
 * Out: {"enabled", "capacity", "dropped" (overwritten before a drain),
 * "stamps": [[hop, mm_hash, CLOCK_MONOTONIC ns], ...] oldest first}. */
int ecm_trace(const char *in_json, char **out_json, char **err);

/* Consumer shard (one per TP rank of a consumer instance): owns the receive
 * slab [slab, slab+slab_len) given by the caller, the control server at
 * ec_port + dp_rank*tp_size + tp_rank and the data-plane listeners. */
int ecm_consumer_open(const char *config_json, void *slab, uint64_t slab_len,
                      ecm_handle_t *out, char **err);
/* The same over a receive slab in GPU memory: slab is a device pointer on
 * the CUDA device of ordinal device (as this process numbers them). The
 * shard offers the configured network transport, staged through
 * page-locked host memory, and cuda_ipc to producers on the same host;
 * a frame is published only after its bytes are in the slab. */
int ecm_consumer_open_device(const char *config_json, void *slab,
                             uint64_t slab_len, int32_t device,
                             ecm_handle_t *out, char **err);
/* Endpoints and identity, as JSON. */
int ecm_consumer_info(ecm_handle_t h, char **out_json, char **err);
/* Pins ready items for the engine and says where they lie in the slab.
 * in: {"mm_hashes": [...]}; out: {"items": [{"mm_hash", "offset", "nbytes",
 * "error"}]}. */
int ecm_consumer_acquire(ecm_handle_t h, const char *in_json, char **out_json,
                         char **err);
/* Unpins items the engine freed; they stay as resident copies.
 * in: {"mm_hashes": [...]}; out: {"items": [{"mm_hash", "error"}]}. */
int ecm_consumer_release(ecm_handle_t h, const char *in_json, char **out_json,
                         char **err);

/* Producer (the encoder instance's worker). */
int ecm_producer_open(const char *config_json, ecm_handle_t *out, char **err);
/* The packed batches of the two calls below are n records back to back,
 * little-endian, in in[0, in_len): each a fixed head, then the bytes of
 * its strings (UTF-8, no terminator) in head order. in_len is at most
 * 64 MiB and must be exactly the records' length; every length is checked
 * against the bytes that remain, and a batch that does not decode fails
 * whole with ECM_ERR_INVALID, naming the item and byte offset.
 *
 * Announces pushes before their sources exist; reservations start in the
 * background. Push record: u64 nbytes, u32 len(transfer_id), u32
 * len(mm_hash), u32 len(consumer), u32 len(meta), then transfer_id,
 * mm_hash, consumer (the control endpoint of any shard of the consumer)
 * and meta (the bytes' description, read back by the consumer's engine;
 * may be empty). *out_json is NULL when every push was accepted, else a
 * JSON array of n strings: the reason each push was refused, "" for the
 * accepted ones. */
int ecm_producer_submit_packed(ecm_handle_t h, uint64_t n, const void *in,
                               uint64_t in_len, char **out_json, char **err);
/* Hands over encoder outputs in one call, so that they go out as one write
 * batch per consumer shard. Source record: u64 ptr, u64 nbytes, u64
 * stream, i32 device, u32 len(mm_hash), then mm_hash: the item is
 * [ptr, ptr+nbytes), in host memory when device is -1, else on the GPU of
 * that CUDA ordinal; stream is the CUDA stream (cudaStream_t; 0 is the
 * legacy default stream) whose queued work produces it, ignored for host
 * memory. The call records an event on that stream and returns at once:
 * the library reads the item only after that work completed.
 * out_sources[i] receives the source id, or 0 when item i was refused (the
 * call then fails and *err names every refused item). The library reads a
 * source until ecm_producer_poll reports its id released; the caller keeps
 * the memory alive until then. With n = 0, in and out_sources may be
 * NULL. */
int ecm_producer_sources_packed(ecm_handle_t h, uint64_t n, const void *in,
                                uint64_t in_len, uint64_t *out_sources,
                                char **err);
/* Does nothing and returns ECM_OK: one crossing of the boundary with the
 * argument count of the packed calls, the floor their cost is measured
 * against (python -m ecmooncake.tools.hotpath). */
int ecm_noop(ecm_handle_t h, uint64_t n, const void *in, uint64_t in_len,
             uint64_t *out, char **err);
/* Cancels pushes. in: {"transfer_ids": [...]}. */
int ecm_producer_cancel(ecm_handle_t h, const char *in_json, char **err);
/* Outcomes since the last poll: {"done": [...], "failed": [{"transfer_id",
 * "mm_hash", "reason"}], "released": [source ids], "pending": bool}. Waits up
 * to timeout_ms for at least one outcome (0 = do not wait). */
int ecm_producer_poll(ecm_handle_t h, int32_t timeout_ms, char **out_json,
                      char **err);

/* Consumer scheduler (the consumer instance's engine core): answers from
 * state that a background goroutine keeps current from the shards'
 * readiness events; no call does network I/O. */
int ecm_scheduler_open(const char *config_json, ecm_handle_t *out, char **err);
/* One call per scheduler step. in: {"expect": [{"request_id", "items":
 * [{"transfer_id", "mm_hash"}]}], "load": [mm_hash], "loaded":
 * [{"transfer_id", "ok", "reason"}], "freed": [mm_hash], "finished":
 * [request_id], "ensure": [request_id], "has": [mm_hash], "snapshot":
 * bool, "changes_since": n}; every key optional. out: {"expect_errors":
 * {request_id: reason}, "load": [{"mm_hash", "transfer_id", "error"}],
 * "ensure": {request_id: {"ready", "failed": [...]}}, "has": {mm_hash:
 * bool}, "covered": [mm_hash], "failed": {request_id: [...]},
 * "incremental": bool, "changed": {mm_hash: bool}, "changed_failed":
 * {request_id: [...] or null}, "failures": [...], "generation": n}. A
 * snapshot answers for every registered request at once: "covered" lists
 * the contents of their items that can load now, "failed" the items that
 * will not come, by request. "changes_since" (a generation an earlier step
 * named) answers only what moved since: "changed" for every content whose
 * answer may have moved, "changed_failed" for every registered request
 * whose failures may have moved (null: none now), with "incremental":
 * true; where the scheduler no longer knows that far back it answers a
 * snapshot instead. */
int ecm_scheduler_step(ecm_handle_t h, const char *in_json, char **out_json,
                       char **err);
/* has_cache_item: *out = 1 when mm_hash can be loaded now. */
int ecm_scheduler_has(ecm_handle_t h, const char *mm_hash, int32_t *out,
                      char **err);
/* Makes the scheduler store its generation into *counter (8-byte aligned
 * memory the caller owns and keeps alive until ecm_close returns), with
 * an atomic 64-bit store, whenever its table changed in a way that can
 * change an answer of ecm_scheduler_has or of a step's "ensure" and
 * "has"; a step's out names the generation its answers were given at as
 * "generation". An answer given at the generation *counter still holds
 * stands, so a caller asked the same question many times per step
 * (vLLM's ensure_cache_available) reads one word instead of calling in.
 * The counter only grows; nothing writes it once ecm_close returned. */
int ecm_scheduler_watch(ecm_handle_t h, uint64_t *counter, char **err);
/* Applies, on the calling thread and without waiting, the readiness
 * events that same-host shards sent and that wait in their sockets;
 * *out = how many. A caller that polls anyway (the engine's loop while a
 * request waits) sees an item as soon as its event arrived, instead of
 * after the wake of the library's reader thread. Every step polls too. */
int ecm_scheduler_poll(ecm_handle_t h, int32_t *out, char **err);
/* Blocks up to timeout_ms until every named transfer is available or has
 * failed (for tools and tests; the engine never calls it). in:
 * {"transfer_ids": [...]}; out: {"available": [...], "failed": [...],
 * "waiting": [...]}. */
int ecm_scheduler_wait(ecm_handle_t h, const char *in_json, int32_t timeout_ms,
                       char **out_json, char **err);

/* EPD proxy: the OpenAI-compatible HTTP front for encoder and
 * prefill/decode instances (see `python -m ecmooncake proxy --help` for
 * the settings; "register_token" turns registration on, "admin_port"
 * moves it to a port of its own). Serves in the background until
 * ecm_close; ecm_stats gives its addresses, backends and counters. */
int ecm_proxy_open(const char *config_json, ecm_handle_t *out, char **err);
/* Keeps this instance registered with EPD proxies (heartbeat) until
 * ecm_close, which deregisters it. config: {"proxies": [url], "role",
 * "url", "consumer", "tp_size", "dp_size", "host", "ttl_s",
 * "interval_s", "token"}; token is the proxies' register token, sent as
 * "Authorization: Bearer <token>". */
int ecm_registrar_open(const char *config_json, ecm_handle_t *out,
                       char **err);
/* This process's metrics in the Prometheus text format (what its
 * metrics_port serves on /metrics). */
int ecm_metrics_text(char **out_text, char **err);

/* Mooncake-compatible metadata store (GET/PUT/DELETE /metadata?key=K,
 * GET /health) for TransferEngines in HTTP metadata mode, served in the
 * background until ecm_close. config: {"host": "127.0.0.1", "port": 8080,
 * "token": "", "max_keys": 65536, "max_value_bytes": 16777216,
 * "max_total_bytes": 268435456, "max_conns": 1024, "max_conns_per_peer":
 * 256}; port 0 picks a free one; a limit of 0 is its default; at a
 * connection limit an idle connection that sent no request with the token
 * makes room for a newcomer; with a token every /metadata request needs "Authorization:
 * Bearer <token>". A value above max_value_bytes is refused with 413, a
 * PUT past max_keys or max_total_bytes with 507. ecm_stats gives its
 * address, URL, limits and counters. */
int ecm_metadata_server_open(const char *config_json, ecm_handle_t *out,
                             char **err);

#ifdef __cplusplus
}
#endif

#endif /* ECMOONCAKE_H */
