package config

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestGPUSettings(t *testing.T) {
	p, err := DecodeProducer(nil)
	require.NoError(t, err)
	require.Equal(t, DefaultStagingBytes, p.Staging())
	require.Equal(t, "cuda_ipc", p.Local(), "same-host shards get cuda_ipc unless told otherwise")

	p, err = DecodeProducer([]byte(`{"staging_bytes": 16777216, "local_transport": "none", "transport_overrides": {"gpu-host-7": "tcp", "tcp://10.0.0.5:14579": "cuda_ipc"}}`))
	require.NoError(t, err)
	require.Equal(t, 16<<20, p.Staging())
	require.Equal(t, "", p.Local())
	require.Equal(t, map[string]string{"gpu-host-7": "tcp", "tcp://10.0.0.5:14579": "cuda_ipc"}, p.TransportOverrides)

	c, err := DecodeConsumer([]byte(`{"staging_bytes": 2097152}`))
	require.NoError(t, err)
	require.Equal(t, 2<<20, c.Staging())
}

func TestGPUSettingsRefused(t *testing.T) {
	cases := []struct {
		name   string
		decode func([]byte) error
		in     string
		want   string
	}{
		{"staging too small", producer, `{"staging_bytes": 1000}`, "staging_bytes = 1000"},
		{"consumer staging negative", consumer, `{"staging_bytes": -1}`, "staging_bytes = -1"},
		{"unknown local transport", producer, `{"local_transport": "shm"}`, `local_transport = "shm"; want one of cuda_ipc, none`},
		{"unknown override", producer, `{"transport_overrides": {"h": "udp"}}`, `transport_overrides["h"] = "udp"`},
		{"empty override key", producer, `{"transport_overrides": {"": "tcp"}}`, "empty key"},
		{"routing is the producer's", consumer, `{"local_transport": "none"}`, `unknown key "local_transport"`},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.decode([]byte(tc.in))
			require.ErrorIs(t, err, ErrInvalid)
			require.ErrorContains(t, err, tc.want)
		})
	}
}
