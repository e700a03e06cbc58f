package discovery

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func TestDecode(t *testing.T) {
	cases := map[string]struct{ body, err string }{
		"pd":               {`{"role":"pd","url":"http://h:8100","consumer":"tcp://h:14579","tp_size":2,"dp_size":2}`, ""},
		"encode":           {`{"role":"encode","url":"http://h:8100"}`, ""},
		"ipv6":             {`{"role":"pd","url":"http://[::1]:8100","consumer":"tcp://[::1]:14579"}`, ""},
		"bad role":         {`{"role":"x","url":"http://h:1"}`, "role"},
		"no consumer":      {`{"role":"prefill","url":"http://h:1"}`, "consumer"},
		"trailing":         {`{"role":"encode","url":"http://h:1"} {}`, "trailing"},
		"unknown key":      {`{"role":"encode","url":"http://h:1","x":1}`, "unknown field"},
		"huge tp":          {`{"role":"encode","url":"http://h:1","tp_size":5000}`, "tp_size"},
		"negative ttl":     {`{"role":"encode","url":"http://h:1","ttl_s":-1}`, "ttl_s"},
		"url with a query": {`{"role":"encode","url":"http://h:1?a=b"}`, "no path or query"},
		"url without host": {`{"role":"encode","url":"http://:8000"}`, "want http://host:port"},
		"port zero":        {`{"role":"encode","url":"http://h:0"}`, "port 0"},
		"port past range":  {`{"role":"encode","url":"http://h:65536"}`, "port 65536"},
		"default port":     {`{"role":"encode","url":"http://h"}`, ""},
	}
	for name, tc := range cases {
		t.Run(name, func(t *testing.T) {
			r, err := Decode([]byte(tc.body))
			if tc.err != "" {
				require.ErrorIs(t, err, ErrInvalid)
				require.ErrorContains(t, err, tc.err)
				return
			}
			require.NoError(t, err)
			require.GreaterOrEqual(t, r.TPSize, 1)
		})
	}
}

// A backend URL names a host the proxy can dial: one with no host or a
// port out of range would be admitted and then fail every request.
func TestHostPort(t *testing.T) {
	for raw, want := range map[string]string{"http://h:8100": "h:8100", "http://h": "h:80", "http://[::1]:1": "[::1]:1", "http://h:65535/": "h:65535"} {
		got, err := HostPort(raw)
		require.NoError(t, err, raw)
		require.Equal(t, want, got, raw)
	}
	for _, raw := range []string{"http://:8000", "http://h:0", "http://h:65536", "http://h:99999999999999999999", "https://h:1", "http://"} {
		_, err := HostPort(raw)
		require.ErrorIs(t, err, ErrInvalid, raw)
	}
}

func TestRankEndpoint(t *testing.T) {
	for _, tc := range []struct {
		ep       string
		tp, rank int
		want     string
	}{
		{"tcp://10.0.0.1:14579", 1, 0, "tcp://10.0.0.1:14579"},
		{"tcp://10.0.0.1:14579", 2, 3, "tcp://10.0.0.1:14585"},
		{"tcp://[fe80::1]:100", 4, 1, "tcp://[fe80::1]:104"},
	} {
		got, err := RankEndpoint(tc.ep, tc.tp, tc.rank)
		require.NoError(t, err)
		require.Equal(t, tc.want, got)
	}
}

func TestRegistrarConfig(t *testing.T) {
	_, err := DecodeRegistrarConfig([]byte(`{"proxies":["http://p:8000"],"role":"pd","url":"http://h:1","consumer":"tcp://h:2"}`))
	require.NoError(t, err)
	_, err = DecodeRegistrarConfig([]byte(`{"role":"pd","url":"http://h:1","consumer":"tcp://h:2"}`))
	require.ErrorContains(t, err, "proxies is empty")
	_, err = DecodeRegistrarConfig([]byte(`{"proxies":["http://p:8000"],"role":"encode","url":"http://h:1","ttl_s":3,"interval_s":5}`))
	require.ErrorContains(t, err, "below ttl_s")
}

func FuzzDecode(f *testing.F) {
	f.Add([]byte(`{"role":"pd","url":"http://h:8100","consumer":"tcp://h:14579"}`))
	f.Fuzz(func(t *testing.T, body []byte) {
		r, err := Decode(body)
		if err == nil && (r.TPSize < 1 || r.DPSize < 1) {
			t.Fatalf("accepted a registration with sizes %d, %d", r.TPSize, r.DPSize)
		}
	})
}
