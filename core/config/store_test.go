package config

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestStoreIsOffByDefaultAndNeedsItsServicesWhenOn(t *testing.T) {
	s, err := DecodeStore(nil)
	require.NoError(t, err)
	require.False(t, s.Enabled)

	_, err = DecodeStore([]byte(`{"enabled": true}`))
	require.ErrorIs(t, err, ErrInvalid)
	require.Contains(t, err.Error(), "master_address")

	// Mooncake's client refuses an empty local_hostname at setup.
	_, err = DecodeStore([]byte(`{"enabled": true, "master_address": "10.0.0.5:50051", "metadata_address": "http://10.0.0.5:8080/metadata"}`))
	require.ErrorIs(t, err, ErrInvalid)
	require.Contains(t, err.Error(), "local_hostname")

	on := `{"enabled": true, "master_address": "10.0.0.5:50051", "metadata_address": "http://10.0.0.5:8080/metadata", "local_hostname": "10.0.0.7"}`
	s, err = DecodeStore([]byte(on))
	require.NoError(t, err)
	require.Equal(t, "10.0.0.5:50051", s.MasterAddress)
}

func TestStoreRefusesWhatMooncakeCannotTake(t *testing.T) {
	for _, tc := range []struct{ doc, key string }{
		{`{"master_address": "10.0.0.5"}`, "master_address"},
		{`{"master_address": "10.0.0.5:0"}`, "master_address"},
		{`{"master_address": ":50051"}`, "master_address"},
		// Mooncake aborts the process on a metadata scheme its build lacks.
		{`{"metadata_address": "redis://10.0.0.5:6379"}`, "metadata_address"},
		{`{"mooncake_protocol": "carrier-pigeon"}`, "mooncake_protocol"},
		{`{"segment_bytes": -1}`, "segment_bytes"},
		{`{"get_timeout_s": 0}`, "get_timeout_s"},
		{`{"master": "10.0.0.5:50051"}`, "master"},
	} {
		_, err := DecodeStore([]byte(tc.doc))
		require.ErrorIs(t, err, ErrInvalid, tc.doc)
		require.Contains(t, err.Error(), tc.key, tc.doc)
	}
}
