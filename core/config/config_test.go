package config

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

func TestConsumerDefaultsAndPorts(t *testing.T) {
	c, err := DecodeConsumer([]byte(`{"ec_port": 20000, "tp_size": 2, "tp_rank": 1, "dp_rank": 3}`))
	require.NoError(t, err)
	require.Equal(t, 20000+3*2+1, c.ControlPort())
	require.Equal(t, "tcp", c.Transport)
	require.Equal(t, 300*time.Second, c.Lease())

	c, err = DecodeConsumer(nil)
	require.NoError(t, err, "empty settings mean defaults")
	require.Equal(t, DefaultConsumer(), c)
}

func TestDecodeErrorsNameKeyValueAndAllowed(t *testing.T) {
	cases := []struct {
		name   string
		decode func([]byte) error
		in     string
		want   []string
	}{
		{"unknown key", consumer, `{"ec_prot": 1}`, []string{`unknown key "ec_prot"`}},
		{"wrong type", consumer, `{"ec_port": "x"}`, []string{`"ec_port"`, "string", "int"}},
		{"tp_rank out of range", consumer, `{"tp_size": 2, "tp_rank": 2}`, []string{"tp_rank = 2", "[0, 1]"}},
		{"bad transport", consumer, `{"transport": "udp"}`, []string{`transport = "udp"`, "want one of tcp"}},
		{"port beyond range", consumer, `{"ec_port": 65535, "tp_size": 2, "tp_rank": 1}`, []string{"65536", "[1, 65535]"}},
		{"bad host", consumer, `{"ec_ip": "a b"}`, []string{`ec_ip = "a b"`}},
		{"negative lease", consumer, `{"lease_s": -1}`, []string{"lease_s = -1", "positive"}},
		{"trailing data", consumer, `{} {}`, []string{"trailing data"}},
		{"not json", consumer, `{`, []string{"consumer settings"}},
		{"producer conns", producer, `{"tcp_conns": 0}`, []string{"tcp_conns = 0", "[1, 64]"}},
		{"producer timeout", producer, `{"control_timeout_s": 0}`, []string{"control_timeout_s = 0"}},
		{"scheduler shards mismatch", scheduler, `{"tp_size": 2, "shards": ["tcp://a:1"]}`, []string{"1 endpoints", "tp_size is 2"}},
		{"runtime level", runtime, `{"log_level": "loud"}`, []string{`log_level = "loud"`, "debug, info, warn, error"}},
		{"runtime procs", runtime, `{"gomaxprocs": 0}`, []string{"gomaxprocs = 0"}},
		{"mooncake protocol", producer, `{"mooncake_protocol": "ucx"}`, []string{`mooncake_protocol = "ucx"`, "rdma, tcp"}},
		{"mooncake metadata scheme", consumer, `{"mooncake_metadata": "redis://h:6379"}`, []string{`mooncake_metadata = "redis://h:6379"`, `scheme "redis"`, "P2PHANDSHAKE", "etcd://host:port"}},
		{"etcd no endpoint", consumer, `{"mooncake_metadata": "etcd://"}`, []string{"names no etcd endpoint"}},
		{"etcd no port", producer, `{"mooncake_metadata": "etcd://h"}`, []string{`etcd endpoint "h" is not host:port`}},
		{"etcd user", producer, `{"mooncake_metadata": "etcd://u:secret@h:2379"}`, []string{"is not host:port (no user, path or scheme)"}},
		{"etcd path", producer, `{"mooncake_metadata": "etcd://h:2379/x"}`, []string{"is not host:port"}},
		{"etcd scheme in endpoint", producer, `{"mooncake_metadata": "etcd://http://h:2379"}`, []string{"is not host:port"}},
		{"etcd port", producer, `{"mooncake_metadata": "etcd://h:1,g:0"}`, []string{`port "0" is not in [1, 65535]`}},
		{"mooncake metadata no scheme", producer, `{"mooncake_metadata": "h:2379"}`, []string{`mooncake_metadata = "h:2379"`, "not a URL"}},
		{"mooncake metadata port", producer, `{"mooncake_metadata": "http://h:0/metadata"}`, []string{"port", "[1, 65535]"}},
		{"mooncake metadata query", producer, `{"mooncake_metadata": "http://h:1/metadata?x=1"}`, []string{"nothing else"}},
		{"mooncake host", consumer, `{"mooncake_host": "a b"}`, []string{`mooncake_host = "a b"`}},
		{"mooncake server name", consumer, `{"mooncake_local_server_name": "a b"}`, []string{"mooncake_local_server_name", "without spaces"}},
		{"metadata server addr", consumer, `{"mooncake_metadata_server": "8090"}`, []string{`mooncake_metadata_server = "8090"`, "host:port"}},
		{"metadata server port", consumer, `{"mooncake_metadata_server": ":70000"}`, []string{"[0, 65535]"}},
		{"staging bytes", producer, `{"mooncake_staging_bytes": 1024}`, []string{"mooncake_staging_bytes = 1024", "[1048576,"}},
		{"shm without slab_fd", consumer, `{"transport": "shm"}`, []string{"slab_fd is not set", "shared_slab"}},
		{"slab_path", consumer, `{"transport": "shm", "slab_fd": 3, "slab_path": "/dev/shm/x"}`, []string{"slab_path is no longer supported", "slab_fd"}},
		{"max_data_conns zero", consumer, `{"max_data_conns": 0}`, []string{"max_data_conns = 0", "[1, 65536]"}},
		{"data_idle_timeout_s negative", consumer, `{"data_idle_timeout_s": -1}`, []string{"data_idle_timeout_s", "positive"}},
		{"data_frame_timeout_s zero", consumer, `{"data_frame_timeout_s": 0}`, []string{"data_frame_timeout_s", "positive"}},
		{"data_handshake_timeout_s zero", consumer, `{"data_handshake_timeout_s": 0}`, []string{"data_handshake_timeout_s = 0", "(0, 60]"}},
		{"data_handshake_timeout_s long", consumer, `{"data_handshake_timeout_s": 61}`, []string{"data_handshake_timeout_s = 61", "(0, 60]"}},
		{"slab_fd without shm", consumer, `{"slab_fd": 3}`, []string{"slab_fd is set", `"tcp"`}},
		{"short secret", consumer, `{"auth_secret": "hunter2"}`, []string{"auth_secret holds 7 bytes", "at least 16"}},
		{"secret and file", producer, `{"auth_secret": "0123456789abcdef", "auth_secret_file": "/s"}`, []string{"both set"}},
		{"scheduler short secret", scheduler, `{"auth_secret": "x"}`, []string{"auth_secret holds 1 bytes"}},
		{"allow is a boolean", consumer, `{"allow_unauthenticated": "yes"}`, []string{`"allow_unauthenticated"`, "bool"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.decode([]byte(tc.in))
			require.Error(t, err)
			require.True(t, errors.Is(err, ErrInvalid))
			require.NotContains(t, err.Error(), "hunter2", "a secret never appears in an error")
			for _, w := range tc.want {
				require.Contains(t, err.Error(), w)
			}
		})
	}
}

func TestDataPlaneBounds(t *testing.T) {
	c, err := DecodeConsumer(nil)
	require.NoError(t, err)
	require.Equal(t, 256, c.MaxDataConns)
	require.Equal(t, 5*time.Minute, c.DataIdleTimeout())
	require.Equal(t, 30*time.Second, c.DataFrameTimeout())
	require.Equal(t, time.Second, c.DataHandshakeTimeout())
	c, err = DecodeConsumer([]byte(`{"data_handshake_timeout_s": 0.25}`))
	require.NoError(t, err)
	require.Equal(t, 250*time.Millisecond, c.DataHandshakeTimeout())
	c, err = DecodeConsumer([]byte(`{"lease_s": 2, "data_frame_timeout_s": 10}`))
	require.NoError(t, err)
	require.Equal(t, 2*time.Second, c.DataFrameTimeout(), "a stalled frame cannot outlast the lease")
}

func TestShmConsumerSettings(t *testing.T) {
	c, err := DecodeConsumer([]byte(`{"transport": "shm", "slab_fd": 7}`))
	require.NoError(t, err)
	require.Equal(t, 7, c.SlabFD)
	_, err = DecodeProducer([]byte(`{"transport": "shm"}`))
	require.NoError(t, err)
}

func TestValidHosts(t *testing.T) {
	for _, h := range []string{"127.0.0.1", "::1", "[::1]", "localhost", "enc-0.cluster.local"} {
		_, err := DecodeConsumer([]byte(`{"ec_ip": "` + h + `"}`))
		require.NoError(t, err, h)
	}
}

func TestMooncakeDefaultsAndMetadataURL(t *testing.T) {
	p, err := DecodeProducer([]byte(`{"transport": "mooncake"}`))
	require.NoError(t, err)
	require.Equal(t, "rdma", p.Protocol)
	require.Equal(t, P2PHandshake, p.MooncakeMetadataURL())
	require.Equal(t, int64(256<<20), p.MooncakeStagingBytes)

	cases := []struct{ in, want string }{
		{`{}`, P2PHandshake},
		{`{"mooncake_metadata_server": "0.0.0.0:8090"}`, "http://127.0.0.1:8090/metadata"},
		{`{"mooncake_metadata_server": "10.0.0.5:8090"}`, "http://10.0.0.5:8090/metadata"},
		{`{"mooncake_metadata_server": "[::]:8090"}`, "http://127.0.0.1:8090/metadata"},
		{`{"mooncake_metadata_server": ":8090", "mooncake_metadata": "http://store:1/metadata"}`, "http://store:1/metadata"},
		{`{"mooncake_metadata": "P2PHANDSHAKE"}`, P2PHandshake},
		{`{"mooncake_metadata": "etcd://10.0.0.5:2379"}`, "etcd://10.0.0.5:2379"},
		{`{"mooncake_metadata": "etcd://a:2379,b:2379;[::1]:2379"}`, "etcd://a:2379,b:2379;[::1]:2379"},
		{`{"mooncake_metadata_server": ":8090", "mooncake_metadata": "etcd://store:2379"}`, "etcd://store:2379"},
	}
	for _, tc := range cases {
		c, err := DecodeConsumer([]byte(tc.in))
		require.NoError(t, err, tc.in)
		require.Equal(t, tc.want, c.MooncakeMetadataURL(), tc.in)
	}
}

func consumer(b []byte) error  { _, err := DecodeConsumer(b); return err }
func producer(b []byte) error  { _, err := DecodeProducer(b); return err }
func scheduler(b []byte) error { _, err := DecodeScheduler(b); return err }
func runtime(b []byte) error   { _, err := DecodeRuntime(b); return err }
func store(b []byte) error     { _, err := DecodeStore(b); return err }

func TestAuthSettings(t *testing.T) {
	const secret = "0123456789abcdef-deployment"
	c, err := DecodeConsumer([]byte(`{"ec_ip": "0.0.0.0", "auth_secret": "` + secret + `", "allow_unauthenticated": true}`))
	require.NoError(t, err)
	got, err := c.LoadSecret()
	require.NoError(t, err)
	require.Equal(t, secret, got)
	require.True(t, c.AllowUnauthenticated)
	for _, format := range []string{"%v", "%+v", "%#v", "%s"} {
		require.NotContains(t, fmt.Sprintf(format, c), secret, "settings print without their secret (%s)", format)
	}

	dir := t.TempDir()
	path := filepath.Join(dir, "secret")
	require.NoError(t, os.WriteFile(path, []byte(secret+"\n"), 0o600))
	p, err := DecodeProducer([]byte(`{"auth_secret_file": "` + path + `"}`))
	require.NoError(t, err)
	got, err = p.LoadSecret()
	require.NoError(t, err)
	require.Equal(t, secret, got, "the trailing line break is not part of the secret")

	short := filepath.Join(dir, "short")
	require.NoError(t, os.WriteFile(short, []byte("hunter2\n"), 0o600))
	s, err := DecodeScheduler([]byte(`{"auth_secret_file": "` + short + `"}`))
	require.NoError(t, err, "the file is read when the object opens, not when settings decode")
	_, err = s.LoadSecret()
	require.ErrorIs(t, err, ErrInvalid)
	require.ErrorContains(t, err, short)
	require.NotContains(t, err.Error(), "hunter2")

	_, err = Auth{SecretFile: filepath.Join(dir, "missing")}.LoadSecret()
	require.ErrorIs(t, err, ErrInvalid)
	require.ErrorContains(t, err, "auth_secret_file")

	none, err := DecodeConsumer(nil)
	require.NoError(t, err)
	got, err = none.LoadSecret()
	require.NoError(t, err)
	require.Empty(t, got, "no secret by default")
}

// An attacker who can read the secret file (another user of the host) or
// guess a weak secret holds the deployment's keys: both are refused when
// the object opens, naming the fix and never the secret.
func TestWeakOrExposedSecretsAreRefused(t *testing.T) {
	const good = "tests-go-deployment-secret-0123"
	dir := t.TempDir()
	write := func(name, content string, mode os.FileMode) string {
		path := filepath.Join(dir, name)
		require.NoError(t, os.WriteFile(path, []byte(content), mode))
		require.NoError(t, os.Chmod(path, mode), "the umask must not soften the mode under test")
		return path
	}
	for _, c := range []struct {
		name string
		auth Auth
		want []string
	}{
		{"world-readable file", Auth{SecretFile: write("world", good+"\n", 0o644)}, []string{"0644", "chmod 600"}},
		{"group-readable file", Auth{SecretFile: write("group", good+"\n", 0o640)}, []string{"0640", "chmod 600"}},
		{"group-writable file", Auth{SecretFile: write("gw", good+"\n", 0o620)}, []string{"0620", "chmod 600"}},
		{"one repeated letter", Auth{Secret: Secret("aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa")}, []string{"distinct", "/dev/urandom"}},
		{"two letters in turn", Auth{Secret: Secret("abababababababababababababababab")}, []string{"distinct", "/dev/urandom"}},
		{"weak secret in a private file", Auth{SecretFile: write("weak", "zzzzzzzzzzzzzzzzzzzz\n", 0o600)}, []string{"distinct", "weak"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := c.auth.LoadSecret()
			require.ErrorIs(t, err, ErrInvalid)
			for _, w := range c.want {
				require.ErrorContains(t, err, w)
			}
			require.NotContains(t, err.Error(), good)
			require.NotContains(t, err.Error(), "aaaaaaaa")
			require.NotContains(t, err.Error(), "zzzzzzzz")
		})
	}
	for _, ok := range []struct {
		auth Auth
		want string
	}{
		{Auth{SecretFile: write("owner", good+"\n", 0o600)}, good},
		{Auth{SecretFile: write("readonly", good+"\n", 0o400)}, good},
		{Auth{Secret: Secret(good)}, good},
		{Auth{Secret: Secret("0123456789abcdef")}, "0123456789abcdef"},
	} {
		got, err := ok.auth.LoadSecret()
		require.NoError(t, err, "%+v", ok.auth)
		require.Equal(t, ok.want, got)
	}
}
