package mooncaketest

/*
#include <stdint.h>
#include <stdlib.h>

struct mcd_stats {
	int64_t engines_live, batches_live, batches_allocated, batches_freed, busy_frees, bad_batch_ids;
	int64_t regs_live, register_calls, unregister_calls, unregister_unknown, open_calls, open_nocache_calls;
	int64_t tasks_submitted, tasks_failed, bytes_landed, writes_refused;
};

static void t_fail_next(void *f, int n) { ((void (*)(int))f)(n); }
static int t_by_name(void *f, const char *s, int v) { return ((int (*)(const char *, int))f)(s, v); }
static int t_kill(void *f, const char *s) { return ((int (*)(const char *))f)(s); }
static void t_stats(void *f, struct mcd_stats *out) { ((void (*)(struct mcd_stats *))f)(out); }
static size_t t_shim_stats(void *f, int64_t *out, size_t n) { return ((size_t (*)(int64_t *, size_t))f)(out, n); }
static int t_raw(void *f, void *e, uintptr_t src, int32_t seg, uint64_t remote, uint64_t item, size_t n) {
	return ((int (*)(void *, void *, int32_t, uint64_t, uint64_t, size_t))f)(e, (void *)src, seg, remote, item, n);
}
*/
import "C"

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"github.com/ecmooncake/ecmooncake/core/transport/mooncake/internal/dl"
)

// EnvLibrary names a real libtransfer_engine.so for the tests to run
// against instead of the double; EnvProtocol the transport they install on
// it (tcp when unset: the tests run on loopback, where RDMA has no device).
const (
	EnvLibrary  = "ECMOONCAKE_MOONCAKE_LIBRARY"
	EnvProtocol = "ECMOONCAKE_MOONCAKE_PROTOCOL"
	// EnvEngine names a Mooncake wheel's engine.so, which EnvLibrary (then
	// ecmooncake's shim) carries.
	EnvEngine = "ECMOONCAKE_MOONCAKE_ENGINE"
)

// RealEngine is the wheel's engine.so the environment names, or "".
func RealEngine() string { return os.Getenv(EnvEngine) }

// PreloadPython makes libpython's symbols global in a process that is not
// Python (a Go test binary), which a wheel's engine.so, a Python module,
// needs before it loads; inside Python they are there already. It asks
// python3 (or $PYTHON) where its shared library is.
func PreloadPython() error {
	py := os.Getenv("PYTHON")
	if py == "" {
		py = "python3"
	}
	out, err := exec.Command(py, "-c",
		"import os, sysconfig as s; print(os.path.join(s.get_config_var('LIBDIR'), s.get_config_var('INSTSONAME')))").Output()
	if err != nil {
		return fmt.Errorf("mooncaketest: ask %s for its libpython: %w", py, err)
	}
	path := strings.TrimSpace(string(out))
	if err := dl.OpenGlobal(path); err != nil {
		return fmt.Errorf("mooncaketest: preload %s for the wheel's engine.so (a Python built without --enable-shared has none): %w", path, err)
	}
	return nil
}

// Real returns the library and protocol the environment names, and
// whether it names one. Tests that only move bytes run against it; those
// that inject faults or read the double's counters skip.
func Real() (library, protocol string, ok bool) {
	library = os.Getenv(EnvLibrary)
	if library == "" {
		return "", "", false
	}
	protocol = os.Getenv(EnvProtocol)
	if protocol == "" {
		protocol = "tcp"
	}
	return library, protocol, true
}

// Source is the path of the double's C source.
func Source() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "testdata", "transfer_engine_double.c")
}

// Build compiles the double into dir/name with the system C compiler
// and returns its path. With omitFreeBatchID the library lacks that one
// function, as a library of the wrong kind or version would.
func Build(dir, name string, omitFreeBatchID bool) (string, error) {
	cc, err := exec.LookPath("cc")
	if err != nil {
		return "", fmt.Errorf("mooncaketest: no C compiler (cc) to build the double: %w", err)
	}
	out := filepath.Join(dir, name)
	args := []string{"-shared", "-fPIC", "-O2", "-pthread", "-o", out, Source()}
	if omitFreeBatchID {
		args = append(args, "-DMCD_OMIT_FREEBATCHID")
	}
	cmd := exec.Command(cc, args...)
	cmd.Stderr = os.Stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("mooncaketest: %s %v: %w", cc, args, err)
	}
	return out, nil
}

// ShimSource is the path of ecmooncake's shim over a Mooncake wheel.
func ShimSource() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "shim", "ecm_mooncake_shim.cpp")
}

// BuildShim compiles the shim into dir/name with the system C++ compiler
// (g++, or $CXX), with the flags build/build_lib.py uses, and returns its
// path.
func BuildShim(dir, name string) (string, error) {
	cxx := os.Getenv("CXX")
	if cxx == "" {
		cxx = "g++"
	}
	if _, err := exec.LookPath(cxx); err != nil {
		return "", fmt.Errorf("mooncaketest: no C++ compiler (%s) to build the shim: %w", cxx, err)
	}
	out := filepath.Join(dir, name)
	args := append(ShimFlags(), "-o", out, ShimSource(), "-ldl")
	cmd := exec.Command(cxx, args...)
	cmd.Stderr = os.Stderr
	if err := cmd.Run(); err != nil {
		return "", fmt.Errorf("mooncaketest: %s %v: %w", cxx, args, err)
	}
	return out, nil
}

// ShimFlags are the compiler flags of the shim, the same in build/build_lib.py.
func ShimFlags() []string {
	return []string{"-std=c++17", "-shared", "-fPIC", "-O2", "-Wall", "-Wextra", "-fvisibility=hidden", "-fvisibility-inlines-hidden"}
}

// Setup is what a test binary runs against: the library, the protocol
// to install on it ("" for the transport's default) and, when the library
// is the double, the double (nil against a real library) and the
// directory it was built in, removed after the run.
type Setup struct {
	Library  string
	Engine   string // the wheel's engine.so behind Library (the shim), or ""
	Protocol string
	Double   *Double
	Dir      string
}

// Main runs m and exits: against the real library the environment names
// (Real), else against the double, built for this run into a temporary
// directory named after prefix. ready receives the setup before any test
// runs; its error fails the run.
func Main(m *testing.M, prefix string, ready func(Setup) error) {
	os.Exit(run(m, prefix, ready))
}

func run(m *testing.M, prefix string, ready func(Setup) error) int {
	s, cleanup, err := setup(prefix)
	defer cleanup()
	if err == nil {
		err = ready(s)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	return m.Run()
}

// setup is the real library the environment names, else the double built
// into a new directory that cleanup removes.
func setup(prefix string) (s Setup, cleanup func(), err error) {
	cleanup = func() {}
	if lib, proto, ok := Real(); ok {
		s = Setup{Library: lib, Engine: RealEngine(), Protocol: proto}
		if s.Engine != "" {
			err = PreloadPython()
		}
		return s, cleanup, err
	}
	if s.Dir, err = os.MkdirTemp("", prefix); err != nil {
		return s, cleanup, err
	}
	dir := s.Dir
	cleanup = func() { _ = os.RemoveAll(dir) }
	if s.Library, err = Build(dir, "libtransfer_engine.so", false); err == nil {
		s.Double, err = Open(s.Library)
	}
	return s, cleanup, err
}

// Stats are the double's process-wide counters.
type Stats struct {
	EnginesLive, BatchesLive, BatchesAllocated, BatchesFreed, BusyFrees, BadBatchIDs         int64
	RegsLive, RegisterCalls, UnregisterCalls, UnregisterUnknown, OpenCalls, OpenNoCacheCalls int64
	TasksSubmitted, TasksFailed, BytesLanded, WritesRefused                                  int64
}

// Double is the loaded double's fault injection and counters.
type Double struct {
	fn map[string]unsafe.Pointer
}

// Open loads the double at path (the same copy the transport loads).
func Open(path string) (*Double, error) {
	lib, err := dl.Open(path)
	if err != nil {
		return nil, fmt.Errorf("mooncaketest: load %s: %v", path, err)
	}
	d := &Double{fn: map[string]unsafe.Pointer{}}
	for _, name := range []string{"mcd_fail_next", "mcd_set_delay_us", "mcd_hold", "mcd_kill", "mcd_stats", "mcd_raw_write"} {
		f, err := lib.Sym(name)
		if err != nil {
			return nil, fmt.Errorf("mooncaketest: %s lacks %s", path, name)
		}
		d.fn[name] = f
	}
	return d, nil
}

// FailNext makes the next n tasks of any engine end FAILED unsent.
func (d *Double) FailNext(n int) { C.t_fail_next(d.fn["mcd_fail_next"], C.int(n)) }

// SetDelay makes the engine serving segment hold every incoming write for
// us microseconds before reading it.
func (d *Double) SetDelay(segment string, us int) error {
	cs := C.CString(segment)
	defer C.free(unsafe.Pointer(cs))
	if C.t_by_name(d.fn["mcd_set_delay_us"], cs, C.int(us)) != 0 {
		return fmt.Errorf("mooncaketest: no engine serves %q", segment)
	}
	return nil
}

// Hold makes the engine serving segment leave every incoming write unread,
// so that its task stays unfinished, until Hold(segment, false), Kill or the
// engine's destruction: a test orders events around a write in flight
// instead of racing a delay.
func (d *Double) Hold(segment string, on bool) error {
	cs := C.CString(segment)
	defer C.free(unsafe.Pointer(cs))
	v := 0
	if on {
		v = 1
	}
	if C.t_by_name(d.fn["mcd_hold"], cs, C.int(v)) != 0 {
		return fmt.Errorf("mooncaketest: no engine serves %q", segment)
	}
	return nil
}

// Kill makes the engine serving segment vanish as if its process died.
func (d *Double) Kill(segment string) error {
	cs := C.CString(segment)
	defer C.free(unsafe.Pointer(cs))
	if C.t_kill(d.fn["mcd_kill"], cs) != 0 {
		return fmt.Errorf("mooncaketest: no engine serves %q", segment)
	}
	return nil
}

// Stats reads the counters.
func (d *Double) Stats() Stats {
	var s C.struct_mcd_stats
	C.t_stats(d.fn["mcd_stats"], &s)
	return Stats{
		EnginesLive: int64(s.engines_live), BatchesLive: int64(s.batches_live), BatchesAllocated: int64(s.batches_allocated),
		BatchesFreed: int64(s.batches_freed), BusyFrees: int64(s.busy_frees), BadBatchIDs: int64(s.bad_batch_ids),
		RegsLive: int64(s.regs_live), RegisterCalls: int64(s.register_calls), UnregisterCalls: int64(s.unregister_calls),
		UnregisterUnknown: int64(s.unregister_unknown), OpenCalls: int64(s.open_calls), OpenNoCacheCalls: int64(s.open_nocache_calls),
		TasksSubmitted: int64(s.tasks_submitted), TasksFailed: int64(s.tasks_failed), BytesLanded: int64(s.bytes_landed),
		WritesRefused: int64(s.writes_refused),
	}
}

// RawWrite moves n items of item bytes from src, src+item, ... (memory
// registered with engine) to remote, remote+item, ... on segment seg as one
// batch, entirely inside
// the double: the baseline a benchmark compares the transport against. It
// returns 0 or the double's error code.
func (d *Double) RawWrite(engine unsafe.Pointer, src uintptr, seg int32, remote, item uint64, n int) int {
	return int(C.t_raw(d.fn["mcd_raw_write"], engine, C.uintptr_t(src), C.int32_t(seg), C.uint64_t(remote), C.uint64_t(item), C.size_t(n)))
}

// ShimStats are the shim's process-wide counts of what it asked of a real
// engine and the engine granted (ecm_mooncake_shim_stats, in its order).
type ShimStats struct {
	EnginesCreated, EnginesDestroyed       int64
	BatchesAllocated, BatchesFreed         int64
	FreeRefused                            int64
	BuffersRegistered, BuffersUnregistered int64
	Submits, SubmitRefused, Exceptions     int64
}

// Shim reads the counters of ecmooncake's shim over a Mooncake wheel.
type Shim struct{ stats unsafe.Pointer }

// OpenShim loads the shim at path (the same copy the transport loads).
func OpenShim(path string) (*Shim, error) {
	lib, err := dl.Open(path)
	if err != nil {
		return nil, fmt.Errorf("mooncaketest: load %s: %v", path, err)
	}
	f, err := lib.Sym("ecm_mooncake_shim_stats")
	if err != nil {
		return nil, fmt.Errorf("mooncaketest: %s lacks ecm_mooncake_shim_stats: not ecmooncake's shim, or an older one", path)
	}
	return &Shim{stats: f}, nil
}

// Stats reads the counters.
func (s *Shim) Stats() ShimStats {
	var v [10]C.int64_t
	n := C.t_shim_stats(s.stats, &v[0], C.size_t(len(v)))
	var out [10]int64
	for i := 0; i < int(n); i++ {
		out[i] = int64(v[i])
	}
	return ShimStats{
		EnginesCreated: out[0], EnginesDestroyed: out[1], BatchesAllocated: out[2], BatchesFreed: out[3],
		FreeRefused: out[4], BuffersRegistered: out[5], BuffersUnregistered: out[6], Submits: out[7],
		SubmitRefused: out[8], Exceptions: out[9],
	}
}
