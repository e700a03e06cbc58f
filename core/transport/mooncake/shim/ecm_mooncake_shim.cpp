// ecm_mooncake_shim: Mooncake TransferEngine's C API (transfer_engine_c.h,
// the functions the mooncake transport resolves) implemented over the C++
// API that a Mooncake pip wheel's engine.so exports. The wheels link the
// engine into a Python module and export no C API, but their C++ symbols
// have default visibility; this library resolves them by name at run time
// (ecm_mooncake_shim_open), so it links against nothing of Mooncake's and
// builds without a wheel present.
//
// Calling C++ methods by address needs the exact layouts and signatures of
// the release the wheel was built from, so the shim accepts only the wheel
// versions it was checked against (kSupported) and refuses the rest before
// it touches engine.so. Only what is called is declared here, from
// Mooncake's public headers at the tag of each supported version.
//
// Nothing thrown inside Mooncake may cross into the caller (Go, through
// cgo): every call is wrapped and turns an exception into the C API's
// error value, counted in ecm_mooncake_shim_exceptions.

#include <dlfcn.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

namespace {

// Wheel versions whose engine.so this file's declarations match, checked
// against the headers at Mooncake's tag v<version>.
const char *const kSupported[] = {"0.3.12.post1"};
const char kSupportedList[] = "0.3.12.post1";

// include/transport/transport.h (Transport::TransferRequest): 48 bytes.
struct TransferRequest {
    int opcode;  // enum OpCode { READ, WRITE }
    void *source;
    uint64_t target_id;  // SegmentID
    uint64_t target_offset;
    size_t length;
    int advise_retry_cnt;
    int transport_hint;
};
static_assert(sizeof(TransferRequest) == 48, "Transport::TransferRequest of v0.3.12.post1");

struct TransferStatus {
    int s;  // enum TransferStatusEnum
    size_t transferred_bytes;
};
static_assert(sizeof(TransferStatus) == 16, "Transport::TransferStatus");

struct BufferEntry {
    void *addr;
    size_t length;
};

// include/common/base/status.h: a uint16_t code and an owned message
// (new[]). Its destructor is user-provided, which makes it returned
// through a hidden pointer; this one must be too, so it frees the message
// the same way and cannot be copied.
class Status {
   public:
    Status() = default;
    Status(const Status &) = delete;
    Status &operator=(const Status &) = delete;
    ~Status() { delete[] message_; }
    int code() const { return static_cast<int>(code_); }

   private:
    uint16_t code_ = 0;
    const char *message_ = nullptr;
};

// TransferEngine is three shared_ptrs and a bool at v0.3.12.post1 (56
// bytes). The shim never reads it; it allocates more than that so that
// the constructor writes only memory the shim owns.
constexpr size_t kEngineBytes = 1024;

using Str = std::string;
using CtorFn = void (*)(void *, bool);
using DtorFn = void (*)(void *);
using InitFn = int (*)(void *, const Str &, const Str &, const Str &, uint64_t);
using InstallFn = void *(*)(void *, const Str &, void **);
using IpPortFn = Str (*)(void *);
using OpenFn = uint64_t (*)(void *, const Str &);
using SyncFn = int (*)(void *, const Str &);
using RegBatchFn = int (*)(void *, const std::vector<BufferEntry> &, const Str &);
using UnregBatchFn = int (*)(void *, const std::vector<void *> &);
using AllocFn = uint64_t (*)(void *, size_t);
using SubmitFn = Status (*)(void *, uint64_t, const std::vector<TransferRequest> &);
using StatusFn = Status (*)(void *, uint64_t, size_t, TransferStatus &);
using FreeFn = Status (*)(void *, uint64_t);

struct Api {
    CtorFn ctor;
    DtorFn dtor;
    InitFn init;
    InstallFn install;
    IpPortFn ipport;
    OpenFn open;
    SyncFn sync;
    RegBatchFn regbatch;
    UnregBatchFn unregbatch;
    AllocFn alloc;
    SubmitFn submit;
    StatusFn status;
    FreeFn free;
};

struct Sym {
    const char *mangled;
    const char *readable;
    void **slot;
};

std::mutex g_mu;
Api g_api;
std::atomic<bool> g_loaded{false};
std::string g_engine_path;
std::atomic<long> g_exceptions{0};

// What the shim asked of the engine and the engine granted, process-wide:
// a test that ends every engine reads them to prove that every batch id
// was freed and every registration undone (ecm_mooncake_shim_stats).
struct Counts {
    std::atomic<int64_t> engines_created{0}, engines_destroyed{0};
    std::atomic<int64_t> batches_allocated{0}, batches_freed{0}, free_refused{0};
    std::atomic<int64_t> buffers_registered{0}, buffers_unregistered{0};
    std::atomic<int64_t> submits{0}, submit_refused{0};
};
Counts g_counts;

void put(char *err, size_t n, const std::string &msg) {
    if (err && n) std::snprintf(err, n, "%s", msg.c_str());
}

bool supported(const char *version) {
    for (const char *v : kSupported)
        if (std::strcmp(v, version) == 0) return true;
    return false;
}

// guard runs f, turning any exception into fallback.
template <typename R, typename F>
R guard(R fallback, F f) {
    try {
        return f();
    } catch (...) {
        g_exceptions.fetch_add(1);
        return fallback;
    }
}

}  // namespace

#define ECM_EXPORT __attribute__((visibility("default")))

extern "C" {

ECM_EXPORT const char *ecm_mooncake_shim_versions() { return kSupportedList; }

ECM_EXPORT long ecm_mooncake_shim_exceptions() { return g_exceptions.load(); }

// ecm_mooncake_shim_stats writes up to n counters into out, in this order,
// and returns how many it wrote: engines created, engines destroyed, batch
// ids allocated, batch ids freed, frees the engine refused, buffers
// registered, buffers unregistered, submits, submits the engine refused,
// exceptions caught. New counters are only ever appended.
ECM_EXPORT size_t ecm_mooncake_shim_stats(int64_t *out, size_t n) {
    const int64_t v[] = {
        g_counts.engines_created.load(),    g_counts.engines_destroyed.load(), g_counts.batches_allocated.load(),
        g_counts.batches_freed.load(),      g_counts.free_refused.load(),      g_counts.buffers_registered.load(),
        g_counts.buffers_unregistered.load(), g_counts.submits.load(),         g_counts.submit_refused.load(),
        static_cast<int64_t>(g_exceptions.load()),
    };
    size_t k = 0;
    for (; out && k < n && k < sizeof(v) / sizeof(v[0]); k++) out[k] = v[k];
    return k;
}

// ecm_mooncake_shim_open loads engine_path (a wheel's mooncake/engine.so)
// whose wheel has version, and resolves every C++ function the C API below
// calls. 0 on success; otherwise -1 with the reason in err. Loading a
// second, different engine.so into one process is refused: the C API
// below has one engine library.
ECM_EXPORT int ecm_mooncake_shim_open(const char *engine_path, const char *version, char *err, size_t errlen) {
    std::lock_guard<std::mutex> lock(g_mu);
    if (!engine_path || !*engine_path || !version) {
        put(err, errlen, "no engine.so path or version given");
        return -1;
    }
    if (g_loaded.load()) {
        if (g_engine_path == engine_path) return 0;
        put(err, errlen, "another engine.so (" + g_engine_path + ") is already loaded in this process");
        return -1;
    }
    if (!supported(version)) {
        put(err, errlen,
            std::string("Mooncake wheel version ") + (*version ? version : "(unknown)") +
                " is not one this build supports (supported: " + kSupportedList +
                "); install one with pip install mooncake-transfer-engine-non-cuda==" + kSupported[0] +
                ", or build Mooncake with -DBUILD_SHARED_LIBS=ON and set mooncake_library to its libtransfer_engine.so");
        return -1;
    }
    void *h = dlopen(engine_path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        put(err, errlen, std::string("dlopen ") + engine_path + ": " + (e ? e : "failed"));
        return -1;
    }
    Api api{};
    const Sym syms[] = {
        {"_ZN8mooncake14TransferEngineC1Eb", "TransferEngine::TransferEngine(bool)", (void **)&api.ctor},
        {"_ZN8mooncake14TransferEngineD1Ev", "TransferEngine::~TransferEngine()", (void **)&api.dtor},
        {"_ZN8mooncake14TransferEngine4initERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEES8_S8_m",
         "TransferEngine::init", (void **)&api.init},
        {"_ZN8mooncake14TransferEngine16installTransportERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEEPPv",
         "TransferEngine::installTransport", (void **)&api.install},
        {"_ZN8mooncake14TransferEngine17getLocalIpAndPortB5cxx11Ev", "TransferEngine::getLocalIpAndPort",
         (void **)&api.ipport},
        {"_ZN8mooncake14TransferEngine11openSegmentERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
         "TransferEngine::openSegment", (void **)&api.open},
        {"_ZN8mooncake14TransferEngine16syncSegmentCacheERKNSt7__cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
         "TransferEngine::syncSegmentCache", (void **)&api.sync},
        {"_ZN8mooncake14TransferEngine24registerLocalMemoryBatchERKSt6vectorINS_9Transport11BufferEntryESaIS3_EERKNSt7__"
         "cxx1112basic_stringIcSt11char_traitsIcESaIcEEE",
         "TransferEngine::registerLocalMemoryBatch", (void **)&api.regbatch},
        {"_ZN8mooncake14TransferEngine26unregisterLocalMemoryBatchERKSt6vectorIPvSaIS2_EE",
         "TransferEngine::unregisterLocalMemoryBatch", (void **)&api.unregbatch},
        {"_ZN8mooncake14TransferEngine15allocateBatchIDEm", "TransferEngine::allocateBatchID", (void **)&api.alloc},
        {"_ZN8mooncake14TransferEngine14submitTransferEmRKSt6vectorINS_9Transport15TransferRequestESaIS3_EE",
         "TransferEngine::submitTransfer", (void **)&api.submit},
        {"_ZN8mooncake14TransferEngine17getTransferStatusEmmRNS_9Transport14TransferStatusE",
         "TransferEngine::getTransferStatus", (void **)&api.status},
        {"_ZN8mooncake14TransferEngine11freeBatchIDEm", "TransferEngine::freeBatchID", (void **)&api.free},
    };
    for (const Sym &s : syms) {
        dlerror();
        *s.slot = dlsym(h, s.mangled);
        if (!*s.slot) {
            // engine.so stays loaded: unloading a half-checked C++ library
            // can run its static destructors under threads it started.
            put(err, errlen,
                std::string(engine_path) + " (wheel " + version + ") lacks mooncake::" + s.readable + " (" +
                    s.mangled + "): not the engine this shim was built for");
            return -1;
        }
    }
    g_api = api;
    g_engine_path = engine_path;
    g_loaded.store(true);
    return 0;
}

// The C API of transfer_engine_c.h, as Mooncake's own transfer_engine_c.cpp
// implements it over the same C++ calls. Before ecm_mooncake_shim_open
// succeeds every function fails as the C API fails.

struct shim_request {
    int opcode;
    void *source;
    int32_t target_id;
    uint32_t file_id;
    uint64_t target_offset;
    uint64_t length;
};
struct shim_status {
    int status;
    uint64_t transferred_bytes;
};
struct shim_buffer {
    void *addr;
    size_t length;
};

ECM_EXPORT void *createTransferEngine(const char *metadata, const char *name, const char *host, uint64_t rpc_port,
                           int auto_discover) {
    if (!g_loaded.load()) return nullptr;
    return guard<void *>(nullptr, [&]() -> void * {
        void *mem = ::operator new(kEngineBytes, std::align_val_t(64));
        std::memset(mem, 0, kEngineBytes);
        g_api.ctor(mem, auto_discover != 0);
        int rc = -1;
        try {
            rc = g_api.init(mem, metadata ? metadata : "", name ? name : "", host ? host : "", rpc_port);
        } catch (...) {
            g_exceptions.fetch_add(1);
        }
        if (rc != 0) {
            g_api.dtor(mem);
            ::operator delete(mem, std::align_val_t(64));
            return nullptr;
        }
        g_counts.engines_created.fetch_add(1);
        return mem;
    });
}

ECM_EXPORT void destroyTransferEngine(void *engine) {
    if (!engine || !g_loaded.load()) return;
    guard<int>(0, [&] {
        g_api.dtor(engine);
        return 0;
    });
    g_counts.engines_destroyed.fetch_add(1);
    ::operator delete(engine, std::align_val_t(64));
}

ECM_EXPORT int getLocalIpAndPort(void *engine, char *buf, size_t len) {
    if (!g_loaded.load() || !buf || !len) return -1;
    return guard<int>(-1, [&] {
        Str s = g_api.ipport(engine);
        std::snprintf(buf, len, "%s", s.c_str());
        return 0;
    });
}

ECM_EXPORT void *installTransport(void *engine, const char *proto, void **args) {
    if (!g_loaded.load() || !proto) return nullptr;
    return guard<void *>(nullptr, [&] { return g_api.install(engine, proto, args); });
}

ECM_EXPORT int registerLocalMemoryBatch(void *engine, shim_buffer *list, size_t n, const char *location) {
    if (!g_loaded.load()) return -1;
    return guard<int>(-1, [&] {
        std::vector<BufferEntry> v(n);
        for (size_t i = 0; i < n; i++) v[i] = BufferEntry{list[i].addr, list[i].length};
        int rc = g_api.regbatch(engine, v, location ? location : "*");
        if (rc == 0) g_counts.buffers_registered.fetch_add(static_cast<int64_t>(n));
        return rc;
    });
}

ECM_EXPORT int unregisterLocalMemoryBatch(void *engine, void **addrs, size_t n) {
    if (!g_loaded.load()) return -1;
    return guard<int>(-1, [&] {
        std::vector<void *> v(addrs, addrs + n);
        int rc = g_api.unregbatch(engine, v);
        if (rc == 0) g_counts.buffers_unregistered.fetch_add(static_cast<int64_t>(n));
        return rc;
    });
}

// The C API returns the handle truncated to segment_id_t, which keeps the
// engine's negative error codes (returned as uint64_t) negative.
ECM_EXPORT int32_t openSegment(void *engine, const char *name) {
    if (!g_loaded.load() || !name) return -1;
    return guard<int32_t>(-1, [&] { return static_cast<int32_t>(g_api.open(engine, name)); });
}

ECM_EXPORT int32_t openSegmentNoCache(void *engine, const char *name) {
    if (!g_loaded.load() || !name) return -1;
    return guard<int32_t>(-1, [&] {
        int rc = g_api.sync(engine, name);
        if (rc) return static_cast<int32_t>(rc);
        return static_cast<int32_t>(g_api.open(engine, name));
    });
}

ECM_EXPORT uint64_t allocateBatchID(void *engine, size_t capacity) {
    if (!g_loaded.load()) return UINT64_MAX;
    return guard<uint64_t>(UINT64_MAX, [&] {
        uint64_t id = g_api.alloc(engine, capacity);
        if (id != UINT64_MAX) g_counts.batches_allocated.fetch_add(1);
        return id;
    });
}

// Positive status codes, as Status::Code: 1 is kInvalidArgument.
ECM_EXPORT int submitTransfer(void *engine, uint64_t batch, shim_request *reqs, size_t n) {
    if (!g_loaded.load()) return 1;
    return guard<int>(1, [&] {
        std::vector<TransferRequest> v(n);
        for (size_t i = 0; i < n; i++) {
            v[i] = TransferRequest{reqs[i].opcode, reqs[i].source, static_cast<uint64_t>(reqs[i].target_id),
                                   reqs[i].target_offset, reqs[i].length, 0, 0};
        }
        Status s = g_api.submit(engine, batch, v);
        (s.code() == 0 ? g_counts.submits : g_counts.submit_refused).fetch_add(1);
        return s.code();
    });
}

ECM_EXPORT int getTransferStatus(void *engine, uint64_t batch, size_t task, shim_status *out) {
    if (!g_loaded.load() || !out) return 1;
    return guard<int>(1, [&] {
        TransferStatus st{0, 0};
        Status s = g_api.status(engine, batch, task, st);
        if (s.code() == 0) {
            out->status = st.s;
            out->transferred_bytes = st.transferred_bytes;
        }
        return s.code();
    });
}

ECM_EXPORT int freeBatchID(void *engine, uint64_t batch) {
    if (!g_loaded.load()) return 1;
    return guard<int>(1, [&] {
        Status s = g_api.free(engine, batch);
        (s.code() == 0 ? g_counts.batches_freed : g_counts.free_refused).fetch_add(1);
        return s.code();
    });
}

}  // extern "C"
