// ecm_mooncake_shim: Mooncake TransferEngine's C API (transfer_engine_c.h,
// the functions the mooncake transport resolves) implemented over the C++
// API that a Mooncake pip wheel's engine.so exports. The wheels link the
// engine into a Python module and export no C API, but their C++ symbols
// have default visibility; this library resolves them by name at run time
// (ecm_mooncake_shim_open), so it links against nothing of Mooncake's and
// builds without a wheel present.
//
// Calling C++ methods by address needs the signatures and layouts of the
// release the wheel was built from. Compatibility is decided by what this
// file needs, not by a list of versions: every mangled symbol it calls must
// be in engine.so (the mangling carries the argument types), and the
// layouts it relies on are picked per release range (kReleases). A version
// at or above the oldest range that is not one of the checked versions
// (kChecked) loads with a warning naming them; one below it is refused.
//
// Only what is called is declared here. Mooncake's headers at tag
// v0.3.12.post1 give that release's layouts; no tag of 0.3.13 or later was
// published in the repository we read, so the later layouts come from the
// headers of its main branch (task_group_id, for 0.3.13) and from each
// wheel's own engine.so: the stride of std::vector<TransferRequest> in
// MultiTransport::submitTransfer and the fields its Python binding writes
// into each request (docs/mooncake.md, "Wheels").
//
// Nothing thrown inside Mooncake may cross into the caller (Go, through
// cgo): every call is wrapped and turns an exception into the C API's
// error value, counted in ecm_mooncake_shim_exceptions.

#include <dlfcn.h>

#include <atomic>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <string>
#include <vector>

namespace {

// include/transport/transport.h (Transport::TransferRequest), per release.
// Each fill() writes every field the way that release's own C API and
// Python binding do, defaults included.

// v0.3.12.post1: advise_retry_cnt and transport_hint end it (48 bytes).
struct RequestV0312 {
    int opcode;  // enum OpCode { READ, WRITE }
    void *source;
    uint64_t target_id;  // SegmentID
    uint64_t target_offset;
    size_t length;
    int advise_retry_cnt;
    int transport_hint;
    static RequestV0312 fill(int op, void *src, uint64_t seg, uint64_t off, size_t n) {
        return RequestV0312{op, src, seg, off, n, 0, 0};
    }
};
static_assert(sizeof(RequestV0312) == 48, "Transport::TransferRequest of 0.3.12.post1");

// 0.3.13 and 0.3.13.post1: task_group_id appended, kNoTaskGroup (0) by
// default (56 bytes).
struct RequestV0313 {
    int opcode;
    void *source;
    uint64_t target_id;
    uint64_t target_offset;
    size_t length;
    int advise_retry_cnt;
    int transport_hint;
    uint64_t task_group_id;
    static RequestV0313 fill(int op, void *src, uint64_t seg, uint64_t off, size_t n) {
        return RequestV0313{op, src, seg, off, n, 0, 0, 0};
    }
};
static_assert(sizeof(RequestV0313) == 56, "Transport::TransferRequest of 0.3.13");

// 0.3.14: 72 bytes. MultiTransport::submitTransfer groups adjacent
// requests by the uint64_t at 56 (task_group_id); the wheel's Python
// binding fills every request with 0 at 48, 0 at 56, 1 at 64, and at 68
// the index of the NIC named by its nic_hint argument, -1 for none. No
// header of this release was published, so the fields at 48 and 64 keep
// the binding's values under names that say only where they are.
struct RequestV0314 {
    int opcode;
    void *source;
    uint64_t target_id;
    uint64_t target_offset;
    size_t length;
    int advise_retry_cnt;
    int transport_hint;
    int field48;
    uint64_t task_group_id;
    int field64;
    int nic_index;
    static RequestV0314 fill(int op, void *src, uint64_t seg, uint64_t off, size_t n) {
        return RequestV0314{op, src, seg, off, n, 0, 0, 0, 0, 1, -1};
    }
};
static_assert(sizeof(RequestV0314) == 72, "Transport::TransferRequest of 0.3.14");

// Transport::TransferStatus, the same in every supported release. The
// engine writes it through a reference; the shim hands it one inside a
// larger zeroed buffer, so that a release that appended a field writes
// into memory the shim owns instead of past it.
struct TransferStatus {
    int s;  // enum TransferStatusEnum
    size_t transferred_bytes;
};
static_assert(sizeof(TransferStatus) == 16, "Transport::TransferStatus");
struct TransferStatusRoom {
    TransferStatus st;
    unsigned char spare[112];
};

struct BufferEntry {
    void *addr;
    size_t length;
};

// include/common/base/status.h, the same in every supported release: a
// uint16_t code and an owned message (new[]). Its destructor is
// user-provided, which makes it returned through a hidden pointer; this
// one must be too, so it frees the message the same way and cannot be
// copied.
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

// TransferEngine is 56 bytes at 0.3.12.post1 and 0.3.13 (three
// shared_ptrs and a bool; their constructors write through offset 0x30)
// and larger at 0.3.14, whose constructor writes through offset 0xa0. The shim never reads it; it allocates more than any of
// them so that the constructor writes only memory the shim owns.
constexpr size_t kEngineBytes = 1024;

// Layout is the set of declarations one release range needs.
enum class Layout { V0312, V0313, V0314 };

struct Release {
    const char *first;  // the oldest version with this layout
    Layout layout;
    size_t request_bytes;
};

// Release ranges, oldest first: a version takes the last range whose first
// version it is not below. Older than the first is refused.
const Release kReleases[] = {
    {"0.3.12.post1", Layout::V0312, sizeof(RequestV0312)},
    {"0.3.13", Layout::V0313, sizeof(RequestV0313)},
    {"0.3.14", Layout::V0314, sizeof(RequestV0314)},
};

// Versions whose engine.so was checked against this file: every symbol
// present and the layout of its range confirmed (docs/mooncake.md says
// which wheels of each and where each runs in tests).
const char kChecked[] = "0.3.12.post1, 0.3.13, 0.3.13.post1, 0.3.14";

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
// The request vector's element type depends on the release: the symbol
// is cast to the right type where it is called (submitAs).
using SubmitFn = void *;
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

// symbols is every C++ function the C API below calls, with where its
// address goes in api: the list a wheel's engine.so must export.
std::vector<Sym> symbols(Api &api) {
    return {
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
}

std::mutex g_mu;
Api g_api;
std::atomic<bool> g_loaded{false};
const Release *g_release = nullptr;
void *g_handle = nullptr;  // engine.so, once loaded
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

// Version is a wheel version as pip writes it (PEP 440's release, pre,
// post and dev parts; a local part after '+' is ignored), ordered as PEP
// 440 orders them.
struct Version {
    std::vector<long> release;
    int phase = 2;  // 0 dev, 1 pre-release (a, b, rc), 2 final, 3 post
    long n = 0;     // the number of that dev, pre or post part
};

bool parseVersion(const char *text, Version &v) {
    std::string s(text ? text : "");
    s = s.substr(0, s.find('+'));
    size_t i = 0;
    while (i < s.size() && std::isdigit(static_cast<unsigned char>(s[i]))) {
        size_t j = i;
        while (j < s.size() && std::isdigit(static_cast<unsigned char>(s[j]))) j++;
        v.release.push_back(std::strtol(s.substr(i, j - i).c_str(), nullptr, 10));
        i = j;
        if (i + 1 < s.size() && s[i] == '.' && std::isdigit(static_cast<unsigned char>(s[i + 1]))) i++;
        else break;
    }
    if (v.release.empty()) return false;
    std::string rest = s.substr(i);
    if (rest.empty()) return true;
    if (rest[0] == '.' || rest[0] == '-' || rest[0] == '_') rest = rest.substr(1);
    const struct {
        const char *tag;
        int phase;
    } tags[] = {{"post", 3}, {"dev", 0}, {"rc", 1}, {"a", 1}, {"b", 1}};
    for (const auto &t : tags) {
        size_t k = std::strlen(t.tag);
        if (rest.compare(0, k, t.tag) != 0) continue;
        std::string num = rest.substr(k);
        for (char c : num)
            if (!std::isdigit(static_cast<unsigned char>(c))) return false;
        v.phase = t.phase;
        v.n = num.empty() ? 0 : std::strtol(num.c_str(), nullptr, 10);
        return true;
    }
    return false;
}

int compareVersions(const Version &a, const Version &b) {
    size_t n = a.release.size() > b.release.size() ? a.release.size() : b.release.size();
    for (size_t i = 0; i < n; i++) {
        long x = i < a.release.size() ? a.release[i] : 0;
        long y = i < b.release.size() ? b.release[i] : 0;
        if (x != y) return x < y ? -1 : 1;
    }
    if (a.phase != b.phase) return a.phase < b.phase ? -1 : 1;
    if (a.n != b.n) return a.n < b.n ? -1 : 1;
    return 0;
}

bool checked(const char *version) {
    std::string list(kChecked);
    size_t at = 0;
    while (at <= list.size()) {
        size_t end = list.find(", ", at);
        if (end == std::string::npos) end = list.size();
        if (list.compare(at, end - at, version) == 0 && std::strlen(version) == end - at) return true;
        at = end + 2;
    }
    return false;
}

// decide picks the release range of version: 0 for a checked version, 1
// for one the shim has not been checked against but loads with the
// declarations of its range (msg then says so, naming the checked ones),
// -1 for one it refuses (msg says why and the fix).
int decide(const char *version, const Release **out, std::string &msg) {
    const char *shown = version && *version ? version : "(unknown)";
    Version v;
    if (!parseVersion(version, v)) {
        msg = std::string("Mooncake wheel version ") + shown + " is not a version this shim can place (checked: " + kChecked +
              "); install a released wheel, e.g. pip install mooncake-transfer-engine-non-cuda==0.3.13.post1";
        return -1;
    }
    const Release *pick = nullptr;
    for (const Release &r : kReleases) {
        Version first;
        parseVersion(r.first, first);
        if (compareVersions(v, first) >= 0) pick = &r;
    }
    if (!pick) {
        msg = std::string("Mooncake wheel version ") + shown + " is older than the oldest this shim supports (" +
              kReleases[0].first + "; checked: " + kChecked +
              "); upgrade it with pip install -U mooncake-transfer-engine-non-cuda (or the CUDA wheel you use), or build "
              "Mooncake with -DBUILD_SHARED_LIBS=ON and set mooncake_library to its libtransfer_engine.so";
        return -1;
    }
    *out = pick;
    if (checked(version)) return 0;
    msg = std::string("Mooncake wheel version ") + shown + " is not one this shim was checked against (" + kChecked +
          "); loading it with the declarations of " + pick->first +
          " and later, which hold only if the release kept them: if transfers fail or the process crashes, install "
          "one of the checked versions";
    return 1;
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

// ecm_mooncake_shim_versions lists the wheel versions this shim was
// checked against, comma-separated.
ECM_EXPORT const char *ecm_mooncake_shim_versions() { return kChecked; }

// ecm_mooncake_shim_check decides, without loading anything, whether a
// wheel of version can be loaded: 0 when it is a checked version, 1 when
// it loads with a warning (in msg), -1 when it is refused (why and the
// fix in msg). *request_bytes gets the size of TransferRequest the shim
// would use.
ECM_EXPORT int ecm_mooncake_shim_check(const char *version, size_t *request_bytes, char *msg, size_t msglen) {
    const Release *r = nullptr;
    std::string m;
    int rc = decide(version, &r, m);
    if (request_bytes) *request_bytes = r ? r->request_bytes : 0;
    put(msg, msglen, m);
    return rc;
}

// ecm_mooncake_shim_symbol is the mangled name of the i-th C++ function
// the shim resolves in engine.so, NULL past the last: what a wheel must
// export, for tools that check one without loading it.
ECM_EXPORT const char *ecm_mooncake_shim_symbol(size_t i) {
    static Api scratch;
    static const std::vector<Sym> all = symbols(scratch);
    return i < all.size() ? all[i].mangled : nullptr;
}

// ecm_mooncake_shim_engine_has says whether the loaded engine.so, or a
// library it loaded with it, defines sym: 1 yes, 0 no or no engine
// loaded. It is how the transport learns that the engine was built with
// the etcd client (libetcd_wrapper.so's NewEtcdClient) before it passes
// an etcd:// string that an engine without one would abort on.
ECM_EXPORT int ecm_mooncake_shim_engine_has(const char *sym) {
    if (!g_loaded.load() || !sym) return 0;
    dlerror();
    return dlsym(g_handle, sym) != nullptr ? 1 : 0;
}

// ecm_mooncake_shim_request_bytes is the size of TransferRequest of the
// loaded engine's release; 0 before an engine is loaded.
ECM_EXPORT size_t ecm_mooncake_shim_request_bytes() { return g_loaded.load() ? g_release->request_bytes : 0; }

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
// calls. 0 on success; 1 on success with a warning in err (a version the
// shim was not checked against); otherwise -1 with the reason in err. Loading a
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
    const Release *release = nullptr;
    std::string warning;
    int verdict = decide(version, &release, warning);
    if (verdict < 0) {
        put(err, errlen, warning);
        return -1;
    }
    void *h = dlopen(engine_path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *e = dlerror();
        put(err, errlen, std::string("dlopen ") + engine_path + ": " + (e ? e : "failed"));
        return -1;
    }
    Api api{};
    for (const Sym &s : symbols(api)) {
        dlerror();
        *s.slot = dlsym(h, s.mangled);
        if (!*s.slot) {
            // engine.so stays loaded: unloading a half-checked C++ library
            // can run its static destructors under threads it started.
            put(err, errlen,
                std::string(engine_path) + " (Mooncake wheel " + version + ") lacks mooncake::" + s.readable + " (" +
                    s.mangled + "), which the shim calls: this release changed or dropped it; install one of the "
                    "checked versions (" + kChecked + "), e.g. pip install mooncake-transfer-engine-non-cuda==0.3.13.post1");
            return -1;
        }
    }
    g_api = api;
    g_handle = h;
    g_release = release;
    g_engine_path = engine_path;
    g_loaded.store(true);
    if (verdict > 0) {
        put(err, errlen, warning);
        return 1;
    }
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

}  // extern "C"

namespace {

// submitAs calls TransferEngine::submitTransfer with the requests laid out
// as release Req declares them.
template <typename Req>
int submitAs(void *engine, uint64_t batch, const shim_request *reqs, size_t n) {
    using Fn = Status (*)(void *, uint64_t, const std::vector<Req> &);
    std::vector<Req> v(n);
    for (size_t i = 0; i < n; i++)
        v[i] = Req::fill(reqs[i].opcode, reqs[i].source, static_cast<uint64_t>(reqs[i].target_id), reqs[i].target_offset,
                         reqs[i].length);
    Status s = reinterpret_cast<Fn>(g_api.submit)(engine, batch, v);
    return s.code();
}

}  // namespace

extern "C" {

// Positive status codes, as Status::Code: 1 is kInvalidArgument.
ECM_EXPORT int submitTransfer(void *engine, uint64_t batch, shim_request *reqs, size_t n) {
    if (!g_loaded.load()) return 1;
    return guard<int>(1, [&] {
        int rc = 1;
        switch (g_release->layout) {
            case Layout::V0312:
                rc = submitAs<RequestV0312>(engine, batch, reqs, n);
                break;
            case Layout::V0313:
                rc = submitAs<RequestV0313>(engine, batch, reqs, n);
                break;
            case Layout::V0314:
                rc = submitAs<RequestV0314>(engine, batch, reqs, n);
                break;
        }
        (rc == 0 ? g_counts.submits : g_counts.submit_refused).fetch_add(1);
        return rc;
    });
}

ECM_EXPORT int getTransferStatus(void *engine, uint64_t batch, size_t task, shim_status *out) {
    if (!g_loaded.load() || !out) return 1;
    return guard<int>(1, [&] {
        TransferStatusRoom room{};
        Status s = g_api.status(engine, batch, task, room.st);
        if (s.code() == 0) {
            out->status = room.st.s;
            out->transferred_bytes = room.st.transferred_bytes;
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
