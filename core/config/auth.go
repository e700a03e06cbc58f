package config

import (
	"crypto/rand"
	"encoding/base64"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"
)

// MinSecretLen is the shortest auth secret accepted (the control package
// derives keys from it and enforces the same bound).
const MinSecretLen = 16

// MinSecretDistinct is the fewest distinct bytes a secret may hold: one
// repeated letter, or a short cycle of them, has the length of a secret and
// almost none of its entropy. Ten admits the hex of 16 random bytes (14
// distinct on average) and refuses the patterns people type.
const MinSecretDistinct = 10

// SecretFix is how to make a good secret file, named by every refusal.
const SecretFix = "head -c 32 /dev/urandom | base64 > FILE && chmod 600 FILE"

// maxSecretFile bounds what auth_secret_file may hold: a secret is a line,
// and a path pointing at something large is a mistake.
const maxSecretFile = 4096

// Secret is a deployment secret. It prints as a placeholder, so that a
// settings struct logged with %v or %+v never shows it.
type Secret string

// String hides the value.
func (s Secret) String() string {
	if s == "" {
		return ""
	}
	return "[redacted]"
}

// GoString hides the value from %#v too.
func (s Secret) GoString() string { return `"` + s.String() + `"` }

// Auth holds the control plane's security settings, which every producer,
// consumer shard and scheduler of a deployment shares. With a secret the
// control plane is authenticated and encrypted (libzmq CURVE, keys derived
// from it); without one it is plain, and a consumer bound beyond loopback
// serves loopback peers only. A secret comes as the value itself or as a
// file that holds it; never both. The vLLM connector also reads it from
// ECMOONCAKE_SECRET and passes it down as auth_secret: Go reads no
// environment (see the package doc).
//
// Without a configured secret, SecretDir (auth_secret_dir) names the
// directory of a per-user secret, which LoadSecret creates on first use
// (PerUserSecret): every process of this uid derives the same keys from
// it, and the kernel's file permissions keep everyone else out. The
// Python package always sets it, resolved from XDG_RUNTIME_DIR or HOME,
// unless allow_unauthenticated is set.
type Auth struct {
	Secret     Secret `json:"auth_secret"`
	SecretFile string `json:"auth_secret_file"`
	// ControlUnix calls same-host peers' control servers, and follows
	// same-host shards' readiness events, over abstract Unix sockets
	// (uid-checked, the secret still required) instead of ZeroMQ, and
	// serves both beside ZeroMQ, which cross-host peers keep using with
	// CURVE. On by default.
	ControlUnix bool   `json:"control_unix"`
	SecretDir   string `json:"auth_secret_dir"`
	// AllowUnauthenticated runs without a secret: no per-user secret, and
	// a consumer bound beyond loopback serves anybody who reaches its
	// ports, who can then reserve, complete and read events. Its peers
	// must set it too, or they present a per-user secret it does not
	// expect.
	AllowUnauthenticated bool `json:"allow_unauthenticated"`
}

// AuthMode says where an object's control-plane keys come from.
type AuthMode int

const (
	// AuthConfigured: auth_secret or auth_secret_file, shared by the
	// deployment across hosts.
	AuthConfigured AuthMode = iota
	// AuthPerUser: the per-user secret of auth_secret_dir; this host and
	// this uid only.
	AuthPerUser
	// AuthNone: no secret at all (allow_unauthenticated, or a caller of
	// the library that set no auth setting).
	AuthNone
)

// Mode reports the object's AuthMode.
func (a Auth) Mode() AuthMode {
	switch {
	case a.Secret != "" || a.SecretFile != "":
		return AuthConfigured
	case a.SecretDir != "" && !a.AllowUnauthenticated:
		return AuthPerUser
	default:
		return AuthNone
	}
}

// Describe names the mode for startup lines and stats: never the secret,
// the per-user secret's path.
func (a Auth) Describe() string {
	switch a.Mode() {
	case AuthConfigured:
		return "configured secret"
	case AuthPerUser:
		return "per-user secret at " + PerUserSecretPath(a.SecretDir)
	default:
		return "unauthenticated"
	}
}

func (a Auth) validate() error {
	switch {
	case a.Secret != "" && a.SecretFile != "":
		return fmt.Errorf("%w: auth_secret and auth_secret_file are both set; set one", ErrInvalid)
	case a.Secret != "":
		return secretStrength("auth_secret", string(a.Secret))
	case a.SecretFile != "" && strings.TrimSpace(a.SecretFile) != a.SecretFile:
		return fmt.Errorf("%w: auth_secret_file = %q has leading or trailing spaces", ErrInvalid, a.SecretFile)
	case a.SecretDir != "" && !filepath.IsAbs(a.SecretDir):
		return fmt.Errorf("%w: auth_secret_dir = %q is not an absolute path", ErrInvalid, a.SecretDir)
	}
	return nil
}

// LoadSecret returns the secret: auth_secret, or the contents of
// auth_secret_file without its trailing line break and spaces, or the
// per-user secret of auth_secret_dir (created on first use). Empty
// means none. Errors name the file, never its contents.
func (a Auth) LoadSecret() (string, error) {
	if err := a.validate(); err != nil {
		return "", err
	}
	switch a.Mode() {
	case AuthNone:
		return "", nil
	case AuthPerUser:
		return PerUserSecret(a.SecretDir)
	}
	if a.SecretFile == "" {
		return string(a.Secret), nil
	}
	return readSecretFile("auth_secret_file", a.SecretFile)
}

// readSecretFile reads a secret file that only its owner, this uid, may
// read or change; key names it in errors.
func readSecretFile(key, path string) (string, error) {
	f, err := os.Open(path)
	if err != nil {
		return "", fmt.Errorf("%w: %s: %v", ErrInvalid, key, err)
	}
	defer f.Close()
	// Whoever reads the file holds the deployment's keys, and whoever
	// writes it chooses them: only its owner may do either.
	st, err := f.Stat()
	if err != nil {
		return "", fmt.Errorf("%w: %s %s: %v", ErrInvalid, key, path, err)
	}
	if perm := st.Mode().Perm(); perm&0o066 != 0 {
		return "", fmt.Errorf("%w: %s %s has mode %04o: other users of the host can read or change it; make it the owner's alone (chmod 600 %s)",
			ErrInvalid, key, path, perm, path)
	}
	if !st.Mode().IsRegular() {
		return "", fmt.Errorf("%w: %s %s is not a regular file", ErrInvalid, key, path)
	}
	buf := make([]byte, maxSecretFile+1)
	n, err := f.Read(buf)
	if err != nil && n == 0 {
		return "", fmt.Errorf("%w: %s %s: %v (is it empty?)", ErrInvalid, key, path, err)
	}
	if n > maxSecretFile {
		return "", fmt.Errorf("%w: %s %s holds more than %d bytes; want the secret alone", ErrInvalid, key, path, maxSecretFile)
	}
	secret := strings.TrimRight(string(buf[:n]), " \t\r\n")
	if err := secretStrength(key+" "+path, secret); err != nil {
		return "", err
	}
	return secret, nil
}

// PerUserSecretPath is the per-user secret's file in dir.
func PerUserSecretPath(dir string) string { return filepath.Join(dir, "secret") }

// perUserSecretBytes is the randomness of a per-user secret.
const perUserSecretBytes = 32

// PerUserSecret returns the per-user secret of dir, creating dir (0700)
// and the secret (0600, 32 random bytes in base64) on first use. Both must
// belong to this uid and be closed to everyone else: the kernel's
// permissions are the whole of the protection, so a directory or file
// that another uid could read or swap is refused, never repaired.
//
// The file is written under a temporary name and linked into place, so a
// process racing to create it either wins or reads the winner's whole
// secret, never a half-written one.
func PerUserSecret(dir string) (string, error) {
	const key = "auth_secret_dir"
	if !filepath.IsAbs(dir) {
		return "", fmt.Errorf("%w: %s = %q is not an absolute path", ErrInvalid, key, dir)
	}
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("%w: %s: create %s: %v", ErrInvalid, key, dir, err)
	}
	if err := ownedAndPrivate(dir, true); err != nil {
		return "", fmt.Errorf("%w: %s %s: %v", ErrInvalid, key, dir, err)
	}
	path := PerUserSecretPath(dir)
	if _, err := os.Lstat(path); errors.Is(err, fs.ErrNotExist) {
		if err := createSecret(dir, path); err != nil {
			return "", fmt.Errorf("%w: %s: create %s: %v", ErrInvalid, key, path, err)
		}
	}
	if err := ownedAndPrivate(path, false); err != nil {
		return "", fmt.Errorf("%w: per-user secret %s: %v", ErrInvalid, path, err)
	}
	return readSecretFile("per-user secret", path)
}

func createSecret(dir, path string) error {
	raw := make([]byte, perUserSecretBytes)
	if _, err := rand.Read(raw); err != nil {
		return err
	}
	tmp, err := os.CreateTemp(dir, ".secret-*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name())
	_, werr := tmp.WriteString(base64.StdEncoding.EncodeToString(raw) + "\n")
	if err := errors.Join(werr, tmp.Chmod(0o600), tmp.Sync(), tmp.Close()); err != nil {
		return err
	}
	// link, unlike rename, fails when another process won the race.
	if err := os.Link(tmp.Name(), path); err != nil && !errors.Is(err, fs.ErrExist) {
		return err
	}
	return nil
}

// ownedAndPrivate checks that path (not followed if a link) belongs to
// this uid and that no other uid may read or write it; a directory is
// searchable by its owner alone too.
func ownedAndPrivate(path string, dir bool) error {
	st, err := os.Lstat(path)
	if err != nil {
		return err
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	switch {
	case dir && !st.IsDir():
		return errors.New("is not a directory")
	case !dir && !st.Mode().IsRegular():
		return errors.New("is not a regular file")
	case !ok:
		return errors.New("has no owner to check")
	case int(sys.Uid) != os.Geteuid():
		return fmt.Errorf("belongs to uid %d, not to this process's uid %d; remove it or set auth_secret_dir", sys.Uid, os.Geteuid())
	}
	if dir && st.Mode().Perm()&0o077 != 0 {
		return fmt.Errorf("has mode %04o: other users of the host can enter it; make it the owner's alone (chmod 700 %s)", st.Mode().Perm(), path)
	}
	if !dir && st.Mode().Perm()&0o077 != 0 {
		return fmt.Errorf("has mode %04o: other users of the host can read or change it; make it the owner's alone (chmod 600 %s)", st.Mode().Perm(), path)
	}
	return nil
}

// secretStrength refuses a secret too short or too repetitive to resist
// offline guessing. The error names the key and the fix, never the value.
func secretStrength(key, secret string) error {
	if len(secret) < MinSecretLen {
		return fmt.Errorf("%w: %s holds %d bytes; want at least %d (e.g. `%s`)", ErrInvalid, key, len(secret), MinSecretLen, SecretFix)
	}
	var seen [256]bool
	distinct := 0
	for i := 0; i < len(secret); i++ {
		if !seen[secret[i]] {
			seen[secret[i]] = true
			distinct++
		}
	}
	if distinct < MinSecretDistinct {
		return fmt.Errorf("%w: %s is weak: %d distinct bytes in %d; want at least %d, from a random source (e.g. `%s`)",
			ErrInvalid, key, distinct, len(secret), MinSecretDistinct, SecretFix)
	}
	return nil
}
