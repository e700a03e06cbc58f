package mooncake

import (
	"os"
	"path/filepath"
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
		{"no wheel", nil, "", []string{"no installed Mooncake wheel", "pip install mooncake-transfer-engine-non-cuda==0.3.12.post1"}},
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
		{"unsupported version", shim, fakeWheel(t, "0.3.99"),
			[]string{"version 0.3.99", "supported: 0.3.12.post1", "pip install mooncake-transfer-engine-non-cuda==0.3.12.post1", "libtransfer_engine.so"}},
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
