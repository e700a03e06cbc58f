package mooncake

/*
#include <stdint.h>
#include <stdlib.h>

// transfer_engine_c.h's structs, with addresses as uintptr_t (the same
// layout as void *) so that Go fills them without turning numbers into
// pointers. The request is laid out as in Mooncake releases that added
// file_id after target_id; older ones had padding there, so the one layout
// fits both as long as file_id is zero.
struct mc_request {
	int opcode;
	uintptr_t source;
	int32_t target_id;
	uint32_t file_id;
	uint64_t target_offset;
	uint64_t length;
};
struct mc_status { int status; uint64_t transferred_bytes; };
struct mc_buffer { uintptr_t addr; size_t length; };

typedef void *(*create_fn)(const char *, const char *, const char *, uint64_t, int);
typedef void (*destroy_fn)(void *);
typedef int (*ipport_fn)(void *, char *, size_t);
typedef void *(*install_fn)(void *, const char *, void **);
typedef int (*regbatch_fn)(void *, struct mc_buffer *, size_t, const char *);
typedef int (*unregbatch_fn)(void *, uintptr_t *, size_t);
typedef int32_t (*open_fn)(void *, const char *);
typedef uint64_t (*alloc_fn)(void *, size_t);
typedef int (*submit_fn)(void *, uint64_t, struct mc_request *, size_t);
typedef int (*status_fn)(void *, uint64_t, size_t, struct mc_status *);
typedef int (*free_fn)(void *, uint64_t);

static void *mc_create(void *f, const char *m, const char *n, const char *h, uint64_t p, int a) { return ((create_fn)f)(m, n, h, p, a); }
static void mc_destroy(void *f, void *e) { ((destroy_fn)f)(e); }
static int mc_ipport(void *f, void *e, char *buf, size_t n) { return ((ipport_fn)f)(e, buf, n); }
static void *mc_install(void *f, void *e, const char *proto) { return ((install_fn)f)(e, proto, NULL); }
static int mc_regbatch(void *f, void *e, struct mc_buffer *b, size_t n, const char *loc) { return ((regbatch_fn)f)(e, b, n, loc); }
static int mc_unregbatch(void *f, void *e, uintptr_t *a, size_t n) { return ((unregbatch_fn)f)(e, a, n); }
static int32_t mc_open(void *f, void *e, const char *name) { return ((open_fn)f)(e, name); }
static uint64_t mc_alloc(void *f, void *e, size_t n) { return ((alloc_fn)f)(e, n); }
static int mc_submit(void *f, void *e, uint64_t b, struct mc_request *r, size_t n) { return ((submit_fn)f)(e, b, r, n); }
static int mc_free(void *f, void *e, uint64_t b) { return ((free_fn)f)(e, b); }

// ecm_mooncake_shim_open, _check and _request_bytes of
// core/transport/mooncake/shim.
typedef int (*shim_open_fn)(const char *, const char *, char *, size_t);
static int mc_shim_open(void *f, const char *engine, const char *version, char *err, size_t n) {
	return ((shim_open_fn)f)(engine, version, err, n);
}
typedef int (*shim_check_fn)(const char *, size_t *, char *, size_t);
static int mc_shim_check(void *f, const char *version, size_t *req, char *msg, size_t n) {
	return ((shim_check_fn)f)(version, req, msg, n);
}
typedef size_t (*shim_size_fn)(void);
static size_t mc_shim_size(void *f) { return ((shim_size_fn)f)(); }
typedef const char *(*shim_versions_fn)(void);
static const char *mc_shim_versions(void *f) { return ((shim_versions_fn)f)(); }
typedef int (*shim_has_fn)(const char *);
static int mc_shim_has(void *f, const char *sym) { return ((shim_has_fn)f)(sym); }
typedef const char *(*shim_symbol_fn)(size_t);
static const char *mc_shim_symbol(void *f, size_t i) { return ((shim_symbol_fn)f)(i); }

// mc_poll asks for the status of n tasks in one crossing of the cgo
// boundary: rcs[i] is getTransferStatus's return code, sts[i] the status.
static void mc_poll(void *f, void *e, uint64_t b, const uint64_t *ids, size_t n, int *rcs, int *sts) {
	for (size_t i = 0; i < n; i++) {
		struct mc_status s = {0, 0};
		rcs[i] = ((status_fn)f)(e, b, (size_t)ids[i], &s);
		sts[i] = s.status;
	}
}
*/
import "C"

import (
	"fmt"
	"log/slog"
	"sync"
	"unsafe"

	"github.com/ecmooncake/ecmooncake/core/transport/mooncake/internal/dl"
)

// DefaultLibrary is what dlopen looks for on the default search path when
// no path is configured.
const DefaultLibrary = "libtransfer_engine.so"

// symbols are the C functions the transport calls, all resolved at load.
var symbols = []string{
	"createTransferEngine", "destroyTransferEngine", "getLocalIpAndPort", "installTransport",
	"registerLocalMemoryBatch", "unregisterLocalMemoryBatch", "openSegment", "openSegmentNoCache",
	"allocateBatchID", "submitTransfer", "getTransferStatus", "freeBatchID",
}

// shimOpen is the function that marks ecmooncake's shim
// (core/transport/mooncake/shim): the C API over the C++ API of a
// Mooncake pip wheel's engine.so, which it loads when asked. shimCheck
// decides whether a wheel version can be loaded, without loading it.
const (
	shimOpen         = "ecm_mooncake_shim_open"
	shimCheck        = "ecm_mooncake_shim_check"
	shimRequestBytes = "ecm_mooncake_shim_request_bytes"
)

// library is a loaded libtransfer_engine.so (or the shim, with the
// wheel's engine.so behind it) with every function resolved.
type library struct {
	path   string
	engine string // the wheel's engine.so behind the shim; "" for none
	fn     map[string]unsafe.Pointer
	// wheel is what the shim decided about the wheel behind it; zero
	// without one.
	wheel WheelCheck
	// etcd says whether the engine has Mooncake's etcd client
	// (libetcd_wrapper's NewEtcdClient), which etcd:// metadata needs: an
	// engine without it aborts the process on that scheme.
	etcd bool
	// cuda says whether the engine is a CUDA build (cudaMalloc resolves
	// in it or a library it loaded): only such an engine registers GPU
	// memory.
	cuda bool
}

// etcdClientSymbol is the entry of Mooncake's etcd client
// (mooncake-common/etcd, libetcd_wrapper.so), which builds with USE_ETCD
// link and the pip wheels carry.
const etcdClientSymbol = "NewEtcdClient"

var (
	libMu sync.Mutex
	libs  = map[string]*library{}
)

// load opens the library at path once per process. With engine set, path
// is the shim and engine the wheel's engine.so it loads; a shim without an
// engine, or an engine without the shim, is refused with the fix.
//
// Nothing is ever closed: an engine library runs threads of its own, and
// unloading code under them is not worth the memory it would return. A
// failed load is not remembered, so fixing the path or installing the
// library works without a restart.
func load(path, engine string) (*library, error) {
	if path == "" {
		path = DefaultLibrary
	}
	libMu.Lock()
	defer libMu.Unlock()
	key := path + "\x00" + engine
	if l, ok := libs[key]; ok {
		return l, nil
	}
	h, err := dl.Open(path)
	if err != nil {
		fix := "build Mooncake with -DBUILD_SHARED_LIBS=ON and set mooncake_library, or ECMOONCAKE_MOONCAKE_LIBRARY, to the library's path"
		if engine != "" {
			fix = "mooncake_library must name ecmooncake's libecmooncake_mooncake.so, which python3 build/build_lib.py builds with g++"
		}
		return nil, fmt.Errorf("%w: cannot load %s: %v (%s)", ErrUnavailable, path, err, fix)
	}
	open, shimErr := h.Sym(shimOpen)
	switch {
	case engine != "" && shimErr != nil:
		return nil, fmt.Errorf("%w: mooncake_engine is set (%s) but mooncake_library %s is not ecmooncake's shim (it lacks %s): name libecmooncake_mooncake.so there, or leave mooncake_engine empty for a libtransfer_engine.so",
			ErrUnavailable, engine, path, shimOpen)
	case engine == "" && shimErr == nil:
		return nil, fmt.Errorf("%w: %s is ecmooncake's shim over a Mooncake wheel and needs mooncake_engine, the path of the wheel's mooncake/engine.so (%s)",
			ErrUnavailable, path, InstallHint)
	}
	l := &library{path: path, engine: engine, fn: make(map[string]unsafe.Pointer, len(symbols))}
	if engine != "" {
		if l.wheel, err = openEngine(h, open, engine); err != nil {
			return nil, err
		}
	}
	l.etcd, l.cuda = engineHas(h, engine != "", etcdClientSymbol), engineHas(h, engine != "", cudaSymbol)
	for _, name := range symbols {
		f, err := h.Sym(name)
		if err != nil {
			// The library stays loaded: dlclose of a half-checked C++
			// library buys nothing and can run its static destructors.
			return nil, fmt.Errorf("%w: %s lacks %s (%v): not a Mooncake TransferEngine library with the C API",
				ErrUnavailable, path, name, err)
		}
		l.fn[name] = f
	}
	libs[key] = l
	return l, nil
}

// WheelCheck is what the shim decided about a Mooncake wheel's version.
type WheelCheck struct {
	Version string `json:"version"`
	// Checked is true for a version the shim was checked against; a newer
	// one loads with Warning set.
	Checked bool   `json:"checked"`
	Warning string `json:"warning,omitempty"`
	// RequestBytes is the size of Transport::TransferRequest the shim
	// declares for the version's release range.
	RequestBytes int `json:"request_bytes"`
	// CheckedVersions lists the versions the shim was checked against.
	CheckedVersions string `json:"checked_versions"`
}

// CheckWheel asks the shim at shim (libecmooncake_mooncake.so) whether it
// can load a wheel of version, without loading any engine: a refusal is an
// error wrapping ErrUnavailable that says why and the fix.
func CheckWheel(shim, version string) (WheelCheck, error) {
	h, err := dl.Open(shim)
	if err != nil {
		return WheelCheck{}, fmt.Errorf("%w: cannot load %s: %v", ErrUnavailable, shim, err)
	}
	return checkWheel(h, version)
}

// ShimSymbols lists the mangled names of the C++ functions the shim at
// shim resolves in a wheel's engine.so: what every wheel it loads must
// export.
func ShimSymbols(shim string) ([]string, error) {
	h, err := dl.Open(shim)
	if err != nil {
		return nil, fmt.Errorf("%w: cannot load %s: %v", ErrUnavailable, shim, err)
	}
	f, err := h.Sym("ecm_mooncake_shim_symbol")
	if err != nil {
		return nil, fmt.Errorf("%w: %s is not ecmooncake's shim: %v", ErrUnavailable, shim, err)
	}
	var out []string
	for i := 0; ; i++ {
		name := C.mc_shim_symbol(f, C.size_t(i))
		if name == nil {
			return out, nil
		}
		out = append(out, C.GoString(name))
	}
}

func checkWheel(h dl.Lib, version string) (WheelCheck, error) {
	out := WheelCheck{Version: version}
	check, err := h.Sym(shimCheck)
	if err != nil {
		return out, fmt.Errorf("%w: not ecmooncake's shim (it lacks %s): %v", ErrUnavailable, shimCheck, err)
	}
	if versions, err := h.Sym("ecm_mooncake_shim_versions"); err == nil {
		out.CheckedVersions = C.GoString((*C.char)(C.mc_shim_versions(versions)))
	}
	cv := C.CString(version)
	defer C.free(unsafe.Pointer(cv))
	const n = 2048
	buf := (*C.char)(C.calloc(1, n))
	defer C.free(unsafe.Pointer(buf))
	var req C.size_t
	rc := C.mc_shim_check(check, cv, &req, buf, n)
	out.RequestBytes = int(req)
	switch {
	case rc < 0:
		return out, fmt.Errorf("%w: %s", ErrUnavailable, C.GoString(buf))
	case rc == 0:
		out.Checked = true
	default:
		out.Warning = C.GoString(buf)
	}
	return out, nil
}

// openEngine has the shim check the wheel's version and load its engine.so.
// A version the shim was not checked against loads with a warning, logged
// here once per process (the library is loaded once) and kept for Probe.
func openEngine(h dl.Lib, open unsafe.Pointer, engine string) (WheelCheck, error) {
	version, err := WheelVersion(engine)
	if err != nil {
		return WheelCheck{}, fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	wc, err := checkWheel(h, version)
	if err != nil {
		return wc, fmt.Errorf("%w (Mooncake wheel engine %s)", err, engine)
	}
	ce, cv := C.CString(engine), C.CString(version)
	defer C.free(unsafe.Pointer(ce))
	defer C.free(unsafe.Pointer(cv))
	const n = 2048
	buf := (*C.char)(C.calloc(1, n))
	defer C.free(unsafe.Pointer(buf))
	switch rc := C.mc_shim_open(open, ce, cv, buf, n); {
	case rc < 0:
		return wc, fmt.Errorf("%w: Mooncake wheel engine %s: %s", ErrUnavailable, engine, C.GoString(buf))
	case rc > 0:
		wc.Warning = C.GoString(buf)
		slog.Default().Warn("mooncake: "+wc.Warning, "engine", engine, "version", version)
	}
	if size, err := h.Sym(shimRequestBytes); err == nil {
		wc.RequestBytes = int(C.mc_shim_size(size))
	}
	return wc, nil
}

// The methods below are the C API, one to one, with C types converted.
// Each returns what the C function returns; decoding into errors is the
// caller's (see codes.go), because only it knows the convention.

func (l *library) create(metadata, serverName, host string, port uint64) unsafe.Pointer {
	cm, cn, ch := C.CString(metadata), C.CString(serverName), C.CString(host)
	defer C.free(unsafe.Pointer(cm))
	defer C.free(unsafe.Pointer(cn))
	defer C.free(unsafe.Pointer(ch))
	// auto_discover 0: nothing is installed until installTransport, so the
	// protocol is the configured one and not the engine's guess.
	return C.mc_create(l.fn["createTransferEngine"], cm, cn, ch, C.uint64_t(port), 0)
}

func (l *library) destroy(e unsafe.Pointer) { C.mc_destroy(l.fn["destroyTransferEngine"], e) }

func (l *library) localIPAndPort(e unsafe.Pointer) (string, int) {
	buf := (*C.char)(C.calloc(1, 512))
	defer C.free(unsafe.Pointer(buf))
	rc := C.mc_ipport(l.fn["getLocalIpAndPort"], e, buf, 512)
	return C.GoString(buf), int(rc)
}

func (l *library) install(e unsafe.Pointer, proto string) bool {
	cp := C.CString(proto)
	defer C.free(unsafe.Pointer(cp))
	return C.mc_install(l.fn["installTransport"], e, cp) != nil
}

// registerBatch registers regions given as (address, length) pairs.
func (l *library) registerBatch(e unsafe.Pointer, regions []region, location string) int {
	n := len(regions)
	entries := make([]C.struct_mc_buffer, max(n, 1))
	for i, r := range regions {
		entries[i].addr = C.uintptr_t(r.addr)
		entries[i].length = C.size_t(r.n)
	}
	cl := C.CString(location)
	defer C.free(unsafe.Pointer(cl))
	return int(C.mc_regbatch(l.fn["registerLocalMemoryBatch"], e, &entries[0], C.size_t(n), cl))
}

func (l *library) unregisterBatch(e unsafe.Pointer, regions []region) int {
	n := len(regions)
	addrs := make([]C.uintptr_t, max(n, 1))
	for i, r := range regions {
		addrs[i] = C.uintptr_t(r.addr)
	}
	list := &addrs[0]
	return int(C.mc_unregbatch(l.fn["unregisterLocalMemoryBatch"], e, list, C.size_t(n)))
}

func (l *library) openSegment(e unsafe.Pointer, name string, noCache bool) int32 {
	cn := C.CString(name)
	defer C.free(unsafe.Pointer(cn))
	f := l.fn["openSegment"]
	if noCache {
		f = l.fn["openSegmentNoCache"]
	}
	return int32(C.mc_open(f, e, cn))
}

func (l *library) allocBatch(e unsafe.Pointer, capacity int) uint64 {
	return uint64(C.mc_alloc(l.fn["allocateBatchID"], e, C.size_t(capacity)))
}

// request is one WRITE of n bytes from src (registered local memory) to
// remote on segment seg.
type request struct {
	src    uintptr
	seg    int32
	remote uint64
	n      uint64
}

func (l *library) submit(e unsafe.Pointer, batch uint64, reqs []request) int {
	if len(reqs) == 0 {
		return 0
	}
	cr := make([]C.struct_mc_request, len(reqs))
	for i, r := range reqs {
		cr[i] = C.struct_mc_request{
			opcode: 1, source: C.uintptr_t(r.src), target_id: C.int32_t(r.seg),
			target_offset: C.uint64_t(r.remote), length: C.uint64_t(r.n),
		}
	}
	return int(C.mc_submit(l.fn["submitTransfer"], e, C.uint64_t(batch), &cr[0], C.size_t(len(reqs))))
}

// poll fills rcs and sts for the tasks in ids.
func (l *library) poll(e unsafe.Pointer, batch uint64, ids []uint64, rcs, sts []int32) {
	if len(ids) == 0 {
		return
	}
	C.mc_poll(l.fn["getTransferStatus"], e, C.uint64_t(batch), (*C.uint64_t)(unsafe.Pointer(&ids[0])), C.size_t(len(ids)),
		(*C.int)(unsafe.Pointer(&rcs[0])), (*C.int)(unsafe.Pointer(&sts[0])))
}

func (l *library) freeBatch(e unsafe.Pointer, batch uint64) int {
	return int(C.mc_free(l.fn["freeBatchID"], e, C.uint64_t(batch)))
}

// cudaSymbol is a CUDA runtime function every CUDA build of Mooncake
// calls, and so links.
const cudaSymbol = "cudaMalloc"

// engineHas says whether the engine defines sym, in itself or a library
// it loaded: through the shim, in the wheel's engine.so; otherwise in the
// library at h (dlsym on a handle searches what that dlopen loaded).
func engineHas(h dl.Lib, shim bool, sym string) bool {
	if !shim {
		_, err := h.Sym(sym)
		return err == nil
	}
	has, err := h.Sym("ecm_mooncake_shim_engine_has")
	if err != nil {
		return false
	}
	cs := C.CString(sym)
	defer C.free(unsafe.Pointer(cs))
	return C.mc_shim_has(has, cs) == 1
}

// describe names the library for errors: the shim with its wheel's
// engine, or the library alone.
func (l *library) describe() string {
	if l.engine != "" {
		return fmt.Sprintf("the engine %s (wheel %s)", l.engine, l.wheel.Version)
	}
	return l.path
}
