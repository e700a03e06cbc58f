package config

import (
	"os"
	"path/filepath"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestPerUserSecretIsMadeOnceAndSharedByRacers(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "a", "ecmooncake")
	const racers = 8
	got := make([]string, racers)
	var wg sync.WaitGroup
	for i := range racers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var err error
			got[i], err = PerUserSecret(dir)
			require.NoError(t, err)
		}()
	}
	wg.Wait()
	for _, s := range got {
		require.Equal(t, got[0], s, "every process of this uid derives the same keys")
	}
	require.Len(t, got[0], 44, "32 random bytes, base64")
	st, err := os.Stat(PerUserSecretPath(dir))
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o600), st.Mode().Perm())
	dst, err := os.Stat(dir)
	require.NoError(t, err)
	require.Equal(t, os.FileMode(0o700), dst.Mode().Perm())
	left, err := filepath.Glob(filepath.Join(dir, ".secret-*"))
	require.NoError(t, err)
	require.Empty(t, left, "no temporary file is left behind")

	other := filepath.Join(t.TempDir(), "ecmooncake")
	again, err := PerUserSecret(other)
	require.NoError(t, err)
	require.NotEqual(t, got[0], again, "a fresh directory gets a fresh secret")
}

func TestPerUserSecretRefusesWhatOthersCouldReadOrSwap(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ecmooncake")
	_, err := PerUserSecret(dir)
	require.NoError(t, err)
	path := PerUserSecretPath(dir)

	require.NoError(t, os.Chmod(path, 0o640))
	_, err = PerUserSecret(dir)
	require.ErrorIs(t, err, ErrInvalid)
	require.ErrorContains(t, err, "chmod 600")
	require.NoError(t, os.Chmod(path, 0o600))

	require.NoError(t, os.Chmod(dir, 0o755))
	_, err = PerUserSecret(dir)
	require.ErrorContains(t, err, "chmod 700")
	require.NoError(t, os.Chmod(dir, 0o700))

	// A link planted where the secret goes is not followed.
	require.NoError(t, os.Remove(path))
	target := filepath.Join(t.TempDir(), "chosen")
	require.NoError(t, os.WriteFile(target, []byte("attacker-chosen-secret-0123456789"), 0o600))
	require.NoError(t, os.Symlink(target, path))
	_, err = PerUserSecret(dir)
	require.ErrorContains(t, err, "not a regular file")

	if os.Geteuid() == 0 {
		theirs := filepath.Join(t.TempDir(), "ecmooncake")
		require.NoError(t, os.Mkdir(theirs, 0o700))
		require.NoError(t, os.Chown(theirs, 65534, 65534))
		_, err = PerUserSecret(theirs)
		require.ErrorContains(t, err, "belongs to uid 65534")
	}
	_, err = PerUserSecret("relative/dir")
	require.ErrorContains(t, err, "absolute")
}

func TestAuthModes(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "ecmooncake")
	for _, tc := range []struct {
		auth Auth
		mode AuthMode
		says string
	}{
		{Auth{Secret: "0123456789abcdefghij"}, AuthConfigured, "configured secret"},
		{Auth{SecretFile: "/run/secrets/ecm", SecretDir: dir}, AuthConfigured, "configured secret"},
		{Auth{SecretDir: dir}, AuthPerUser, "per-user secret at " + filepath.Join(dir, "secret")},
		{Auth{SecretDir: dir, AllowUnauthenticated: true}, AuthNone, "unauthenticated"},
		{Auth{}, AuthNone, "unauthenticated"},
	} {
		require.Equal(t, tc.mode, tc.auth.Mode(), "%+v", tc.auth)
		require.Equal(t, tc.says, tc.auth.Describe())
	}
	secret, err := Auth{SecretDir: dir}.LoadSecret()
	require.NoError(t, err)
	require.NotEmpty(t, secret)
	secret, err = Auth{SecretDir: dir, AllowUnauthenticated: true}.LoadSecret()
	require.NoError(t, err)
	require.Empty(t, secret, "allow_unauthenticated uses no secret at all")
	_, err = DecodeProducer([]byte(`{"auth_secret_dir": "rel"}`))
	require.ErrorContains(t, err, "auth_secret_dir")
	p, err := DecodeProducer([]byte(`{"allow_unauthenticated": true}`))
	require.NoError(t, err)
	require.True(t, p.AllowUnauthenticated, "every role takes allow_unauthenticated")
}
