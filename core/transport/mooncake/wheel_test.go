package mooncake

import (
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/transport/mooncake/mooncaketest"
)

// fakeWheel lays out site-packages/mooncake/engine.so with a dist-info per
// version, as pip installs a wheel, and returns the engine's path. The
// engine.so is not a library: nothing may load it before the version check.
func fakeWheel(t *testing.T, versions ...string) string {
	t.Helper()
	site := t.TempDir()
	require.NoError(t, os.MkdirAll(filepath.Join(site, "mooncake"), 0o755))
	engine := filepath.Join(site, "mooncake", "engine.so")
	require.NoError(t, os.WriteFile(engine, []byte("not a library"), 0o644))
	dists := []string{"mooncake_transfer_engine_non_cuda", "mooncake_transfer_engine"}
	for i, v := range versions {
		require.NoError(t, os.Mkdir(filepath.Join(site, dists[i]+"-"+v+".dist-info"), 0o755))
	}
	return engine
}

func TestWheelVersionFromDistInfo(t *testing.T) {
	cases := []struct {
		name     string
		versions []string
		want     string
		err      []string
	}{
		{"one wheel", []string{"0.3.12.post1"}, "0.3.12.post1", nil},
		{"no wheel", nil, "", []string{"no installed Mooncake wheel", "pip install mooncake-transfer-engine-non-cuda==" + NewestWheel}},
		{"two wheels", []string{"0.3.12.post1", "0.3.13"}, "", []string{"more than one Mooncake wheel", "mooncake_transfer_engine 0.3.13", "pip uninstall"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := WheelVersion(fakeWheel(t, tc.versions...))
			if tc.err == nil {
				require.NoError(t, err)
				require.Equal(t, tc.want, got)
				return
			}
			require.Error(t, err)
			for _, w := range tc.err {
				require.Contains(t, err.Error(), w)
			}
		})
	}
}

// The shim refuses a wheel it was not checked against before it loads a
// byte of it, and the pairing of shim and engine is checked both ways.
func TestShimRefusesWhatItCannotCarry(t *testing.T) {
	shim, err := mooncaketest.BuildShim(t.TempDir(), "libecmooncake_mooncake.so")
	require.NoError(t, err)
	cases := []struct {
		name, library, engine string
		want                  []string
	}{
		{"version older than any the shim supports", shim, fakeWheel(t, "0.3.12"),
			[]string{"version 0.3.12 is older than the oldest this shim supports (0.3.12.post1", "pip install -U mooncake-transfer-engine-non-cuda", "libtransfer_engine.so"}},
		{"version that is no version", shim, fakeWheel(t, "nightly"),
			[]string{"version nightly is not a version", "pip install mooncake-transfer-engine-non-cuda==" + NewestWheel}},
		{"unknown version", shim, fakeWheel(t), []string{"no installed Mooncake wheel"}},
		{"shim without an engine", shim, "", []string{"needs mooncake_engine"}},
		{"engine.so that is no library", shim, fakeWheel(t, "0.3.12.post1"), []string{"dlopen", "engine.so"}},
	}
	if double != nil {
		cases = append(cases, struct {
			name, library, engine string
			want                  []string
		}{"engine without the shim", doublePath, fakeWheel(t, "0.3.12.post1"), []string{"not ecmooncake's shim"}})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := New(Config{Library: tc.library, Engine: tc.engine})
			require.ErrorIs(t, err, ErrUnavailable)
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
			got := Probe(tc.library, tc.engine)
			require.False(t, got.Available)
			require.Equal(t, tc.engine, got.Engine)
		})
	}
}

// The shim decides by version range which declarations a wheel needs,
// and whether it was checked against that version; it never loads
// anything to decide.
func TestShimPicksLayoutsByVersion(t *testing.T) {
	shim, err := mooncaketest.BuildShim(t.TempDir(), "libecmooncake_mooncake.so")
	require.NoError(t, err)
	const checked = "0.3.12.post1, 0.3.13, 0.3.13.post1, 0.3.14"
	cases := []struct {
		version string
		bytes   int    // sizeof(Transport::TransferRequest) used; 0: refused
		checked bool   // one of the checked versions
		want    string // in the warning or the refusal
	}{
		{"0.3.12.post1", 48, true, ""},
		{"0.3.13", 56, true, ""},
		{"0.3.13.post1", 56, true, ""},
		{"0.3.14", 72, true, ""},
		// Between checked versions: the range's declarations, with a warning.
		{"0.3.12.post2", 48, false, "declarations of 0.3.12.post1"},
		{"0.3.13.post2", 56, false, "declarations of 0.3.13 and later"},
		{"0.3.14rc1", 56, false, "declarations of 0.3.13 and later"},
		// Newer than any checked: the newest declarations, with a warning.
		{"0.3.14.post1", 72, false, "declarations of 0.3.14"},
		{"0.4.0", 72, false, "declarations of 0.3.14"},
		{"0.3.14+local", 72, false, "not one this shim was checked against"},
		// Older than the oldest range, or no version at all: refused.
		{"0.3.12", 0, false, "older than the oldest this shim supports"},
		{"0.3.9", 0, false, "older than the oldest"},
		{"0.3.12.dev1", 0, false, "older than the oldest"},
		{"", 0, false, "(unknown) is not a version"},
		{"0.3.x", 0, false, "is not a version"},
	}
	for _, tc := range cases {
		t.Run(tc.version, func(t *testing.T) {
			got, err := CheckWheel(shim, tc.version)
			require.Equal(t, checked, got.CheckedVersions)
			if tc.bytes == 0 {
				require.ErrorIs(t, err, ErrUnavailable)
				require.Contains(t, err.Error(), tc.want)
				require.Contains(t, err.Error(), checked, "a refusal names the checked versions")
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.bytes, got.RequestBytes)
			require.Equal(t, tc.checked, got.Checked)
			if tc.checked {
				require.Empty(t, got.Warning)
				return
			}
			require.Contains(t, got.Warning, "Mooncake wheel version "+tc.version+" is not one this shim was checked against ("+checked+")")
			require.Contains(t, got.Warning, tc.want)
		})
	}
}

// fakeEngine builds a library exporting the shim's C++ symbols except
// omit, in a fake wheel of version, and returns the engine's path. Its
// functions are empty: the shim only resolves them at open. With cudart
// set it links a fake libcudart.so.13 (defining cudaMalloc) beside it, as
// a CUDA wheel's engine.so links the real one; with etcd set it defines
// the etcd client's NewEtcdClient, as the wheels' libetcd_wrapper.so does.
func fakeEngine(t *testing.T, shim, version, omit string, cudart, etcd bool) string {
	t.Helper()
	names, err := ShimSymbols(shim)
	require.NoError(t, err)
	require.Len(t, names, 13)
	var src strings.Builder
	found := omit == ""
	for _, n := range names {
		if n == omit {
			found = true
			continue
		}
		fmt.Fprintf(&src, "void %s(void) {}\n", n)
	}
	require.True(t, found, "%s is one of the shim's symbols", omit)
	if etcd {
		src.WriteString("int NewEtcdClient(void) { return 0; }\n")
	}
	engine := fakeWheel(t, version)
	dir := filepath.Dir(engine)
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	build := func(out string, code string, args ...string) {
		c := filepath.Join(t.TempDir(), "src.c")
		require.NoError(t, os.WriteFile(c, []byte(code), 0o644))
		cmd := exec.Command(cc, append([]string{"-shared", "-fPIC", "-o", out, c}, args...)...)
		msg, err := cmd.CombinedOutput()
		require.NoError(t, err, "%s", msg)
	}
	var link []string
	if cudart {
		build(filepath.Join(dir, "libcudart.so.13"), "int cudaMalloc(void **p, unsigned long n) { (void)p; (void)n; return 100; }\n",
			"-Wl,-soname,libcudart.so.13")
		// --no-as-needed: the fake engine calls nothing of it, and linkers
		// that default to --as-needed would drop it.
		link = []string{"-L" + dir, "-Wl,--no-as-needed", "-l:libcudart.so.13", "-Wl,-rpath,$ORIGIN"}
	}
	build(engine, src.String(), link...)
	return engine
}

// A wheel that lacks a function the shim calls is refused with the
// version, the function (readable and mangled) and the fix; the
// mangling carries the argument types, so a changed signature is
// refused the same way.
func TestShimRefusesAWheelMissingASymbol(t *testing.T) {
	const getStatus = "_ZN8mooncake14TransferEngine17getTransferStatusEmmRNS_9Transport14TransferStatusE"
	shim, err := mooncaketest.BuildShim(t.TempDir(), "libecmooncake_mooncake.so")
	require.NoError(t, err)
	engine := fakeEngine(t, shim, "0.3.13.post1", getStatus, false, false)
	_, err = New(Config{Library: shim, Engine: engine, Logger: quiet})
	require.ErrorIs(t, err, ErrUnavailable)
	for _, w := range []string{"Mooncake wheel 0.3.13.post1", "lacks mooncake::TransferEngine::getTransferStatus", getStatus,
		"pip install mooncake-transfer-engine-non-cuda=="} {
		require.Contains(t, err.Error(), w)
	}
}

// A wheel newer than the checked ones that exports every symbol loads,
// with a warning logged once and reported by Probe.
func TestShimLoadsANewerWheelWithAWarning(t *testing.T) {
	shim, err := mooncaketest.BuildShim(t.TempDir(), "libecmooncake_mooncake.so")
	require.NoError(t, err)
	engine := fakeEngine(t, shim, "0.3.15", "", false, false)
	var logged bytes.Buffer
	prev := slog.Default()
	slog.SetDefault(slog.New(slog.NewTextHandler(&logged, nil)))
	t.Cleanup(func() { slog.SetDefault(prev) })

	got := Probe(shim, engine)
	require.True(t, got.Available, got.Reason)
	require.NotNil(t, got.Wheel)
	require.Equal(t, "0.3.15", got.Wheel.Version)
	require.False(t, got.Wheel.Checked)
	require.Equal(t, 72, got.Wheel.RequestBytes, "the loaded engine uses the newest declarations")
	require.Contains(t, got.Wheel.Warning, "0.3.12.post1, 0.3.13, 0.3.13.post1, 0.3.14")
	require.Equal(t, "mooncake-transfer-engine-non-cuda", got.Distribution)
	require.False(t, got.CUDA, "no libcudart: not a CUDA build")
	require.Empty(t, got.CUDARuntime)
	require.False(t, got.Etcd, "no etcd client")
	require.Contains(t, logged.String(), "level=WARN")
	require.Contains(t, logged.String(), "0.3.15 is not one this shim was checked against")
	require.Equal(t, 1, strings.Count(logged.String(), "level=WARN"), "one warning per process and library")
	again := Probe(shim, engine)
	require.True(t, again.Available)
	require.Equal(t, 1, strings.Count(logged.String(), "level=WARN"))
}

// Probe says what a doctor needs about the engine: a CUDA build (it links
// libcudart, and can register GPU memory) and the etcd client.
func TestProbeSaysCUDAAndEtcd(t *testing.T) {
	shim, err := mooncaketest.BuildShim(t.TempDir(), "libecmooncake_mooncake.so")
	require.NoError(t, err)
	engine := fakeEngine(t, shim, "0.3.14", "", true, true)
	got := Probe(shim, engine)
	require.True(t, got.Available, got.Reason)
	require.True(t, got.Wheel.Checked)
	require.Equal(t, 72, got.Wheel.RequestBytes)
	require.True(t, got.CUDA)
	require.Equal(t, "libcudart.so.13", got.CUDARuntime)
	require.True(t, got.Etcd)
}
