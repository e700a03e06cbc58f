// The fork gate: the C side of every export of include/ecmooncake.h.
//
// A child forked after the library was loaded inherits the Go runtime's
// memory but none of its threads. Entering the runtime there can wait
// forever: on a P that a parent's thread owned at the fork, or on a lock
// it held (one fork in three, with two threads calling in, hung that way).
// So the check cannot live in Go: each ecm_* function here refuses a
// forked child before any Go code runs, and only otherwise calls its Go
// half, ecmgo_* in main.go. The ecmgo_* symbols are local to the library
// (ecmooncake.map): a caller cannot reach the runtime past the gate.
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include "_cgo_export.h"
#include "ecmooncake.h"

// Set in the child of every fork() after the load (pthread_atfork), so
// that the process that loaded the library pays a load, not a getpid
// system call, per call.
static volatile int ecm_forked;
// Set when the child handler could not be registered: every call asks for
// the pid instead.
static int ecm_unwatched;
static pid_t ecm_load_pid;

static void ecm_mark_forked(void) { ecm_forked = 1; }

__attribute__((constructor)) static void ecm_watch_forks(void) {
  ecm_load_pid = getpid();
  if (pthread_atfork(NULL, NULL, ecm_mark_forked) != 0) {
    ecm_unwatched = 1;
  }
}

static inline int ecm_in_forked_child(void) {
  return __builtin_expect(ecm_forked, 0) || (ecm_unwatched && getpid() != ecm_load_pid);
}

// The refusal, with C's malloc so that ecm_free (free) takes it. No Go, no
// lock that a parent's thread could have held: malloc is made safe across
// fork by libc.
static int ecm_refuse_forked(const char *fn, char **err) {
  if (err != NULL) {
    static const char format[] =
        "%s: libecmooncake was loaded in pid %d and called from forked child %d; load it after fork "
        "(a Go runtime does not survive fork: its threads stay in the parent)";
    int pid = (int)getpid();
    int n = snprintf(NULL, 0, format, fn, (int)ecm_load_pid, pid);
    char *msg = n < 0 ? NULL : malloc((size_t)n + 1);
    if (msg != NULL) {
      snprintf(msg, (size_t)n + 1, format, fn, (int)ecm_load_pid, pid);
    }
    *err = msg;
  }
  return ECM_ERR_STATE;
}

// ecm_free takes no gate: a forked child must still be able to free the
// error text of the call that refused it. Every text the library returns
// is C's malloc (C.CString on the Go side).
void ecm_free(char *p) { free(p); }

// GATED defines ecm_NAME(PARAMS), which refuses a forked child and
// otherwise calls ecmgo_NAME ARGS. PARAMS are the header's (the compiler
// checks them against its prototype), with err last.
#define GATED(name, params, args)                        \
  int ecm_##name params {                                \
    if (ecm_in_forked_child()) {                         \
      return ecm_refuse_forked("ecm_" #name, err);       \
    }                                                    \
    return ecmgo_##name args;                            \
  }

// Go's exports take char * and void * where the header promises const:
// the Go half never writes through them.
#define IN(p) ((char *)(p))
#define MEM(p) ((void *)(p))

GATED(abi_version, (int32_t *out_version, char **err), (out_version, err))
GATED(configure, (const char *config_json, char **err), (IN(config_json), err))
GATED(gpu_info, (char **out_json, char **err), (out_json, err))
GATED(mooncake_info, (const char *config_json, char **out_json, char **err), (IN(config_json), out_json, err))
GATED(stats, (ecm_handle_t h, char **out_json, char **err), (h, out_json, err))
GATED(close, (ecm_handle_t h, char **err), (h, err))
GATED(trace, (const char *in_json, char **out_json, char **err), (IN(in_json), out_json, err))

GATED(consumer_open, (const char *config_json, void *slab, uint64_t slab_len, ecm_handle_t *out, char **err),
      (IN(config_json), slab, slab_len, out, err))
GATED(consumer_open_device,
      (const char *config_json, void *slab, uint64_t slab_len, int32_t device, ecm_handle_t *out, char **err),
      (IN(config_json), (uintptr_t)slab, slab_len, device, out, err))
GATED(consumer_info, (ecm_handle_t h, char **out_json, char **err), (h, out_json, err))
GATED(consumer_acquire, (ecm_handle_t h, const char *in_json, char **out_json, char **err),
      (h, IN(in_json), out_json, err))
GATED(consumer_release, (ecm_handle_t h, const char *in_json, char **out_json, char **err),
      (h, IN(in_json), out_json, err))

GATED(producer_open, (const char *config_json, ecm_handle_t *out, char **err), (IN(config_json), out, err))
GATED(producer_submit_packed,
      (ecm_handle_t h, uint64_t n, const void *in, uint64_t in_len, char **out_json, char **err),
      (h, n, MEM(in), in_len, out_json, err))
GATED(producer_sources_packed,
      (ecm_handle_t h, uint64_t n, const void *in, uint64_t in_len, uint64_t *out_sources, char **err),
      (h, n, MEM(in), in_len, out_sources, err))
GATED(noop, (ecm_handle_t h, uint64_t n, const void *in, uint64_t in_len, uint64_t *out, char **err),
      (h, n, MEM(in), in_len, out, err))
GATED(producer_cancel, (ecm_handle_t h, const char *in_json, char **err), (h, IN(in_json), err))
GATED(producer_poll, (ecm_handle_t h, int32_t timeout_ms, char **out_json, char **err),
      (h, timeout_ms, out_json, err))

GATED(scheduler_open, (const char *config_json, ecm_handle_t *out, char **err), (IN(config_json), out, err))
GATED(scheduler_step, (ecm_handle_t h, const char *in_json, char **out_json, char **err),
      (h, IN(in_json), out_json, err))
GATED(scheduler_has, (ecm_handle_t h, const char *mm_hash, int32_t *out, char **err), (h, IN(mm_hash), out, err))
GATED(scheduler_watch, (ecm_handle_t h, uint64_t *counter, char **err), (h, counter, err))
GATED(scheduler_poll, (ecm_handle_t h, int32_t *out, char **err), (h, out, err))
GATED(scheduler_wait, (ecm_handle_t h, const char *in_json, int32_t timeout_ms, char **out_json, char **err),
      (h, IN(in_json), timeout_ms, out_json, err))

GATED(proxy_open, (const char *config_json, ecm_handle_t *out, char **err), (IN(config_json), out, err))
GATED(registrar_open, (const char *config_json, ecm_handle_t *out, char **err), (IN(config_json), out, err))
GATED(metrics_text, (char **out_text, char **err), (out_text, err))
GATED(metadata_server_open, (const char *config_json, ecm_handle_t *out, char **err), (IN(config_json), out, err))
