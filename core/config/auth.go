package config

import (
	"fmt"
	"os"
	"strings"
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
type Auth struct {
	Secret     Secret `json:"auth_secret"`
	SecretFile string `json:"auth_secret_file"`
	// ControlUnix calls same-host peers' control servers over an abstract
	// Unix socket (uid-checked, the secret still required) instead of
	// ZeroMQ, and serves it beside ZeroMQ. Off by default: readiness
	// events still travel over ZeroMQ.
	ControlUnix bool `json:"control_unix"`
}

func (a Auth) validate() error {
	switch {
	case a.Secret != "" && a.SecretFile != "":
		return fmt.Errorf("%w: auth_secret and auth_secret_file are both set; set one", ErrInvalid)
	case a.Secret != "":
		return secretStrength("auth_secret", string(a.Secret))
	case a.SecretFile != "" && strings.TrimSpace(a.SecretFile) != a.SecretFile:
		return fmt.Errorf("%w: auth_secret_file = %q has leading or trailing spaces", ErrInvalid, a.SecretFile)
	}
	return nil
}

// LoadSecret returns the secret: auth_secret, or the contents of
// auth_secret_file without its trailing line break and spaces. Empty
// means none is configured. Errors name the file, never its contents.
func (a Auth) LoadSecret() (string, error) {
	if err := a.validate(); err != nil {
		return "", err
	}
	if a.SecretFile == "" {
		return string(a.Secret), nil
	}
	f, err := os.Open(a.SecretFile)
	if err != nil {
		return "", fmt.Errorf("%w: auth_secret_file: %v", ErrInvalid, err)
	}
	defer f.Close()
	// Whoever reads the file holds the deployment's keys, and whoever
	// writes it chooses them: only its owner may do either.
	if st, err := f.Stat(); err != nil {
		return "", fmt.Errorf("%w: auth_secret_file %s: %v", ErrInvalid, a.SecretFile, err)
	} else if perm := st.Mode().Perm(); perm&0o066 != 0 {
		return "", fmt.Errorf("%w: auth_secret_file %s has mode %04o: other users of the host can read or change it; make it the owner's alone (chmod 600 %s)",
			ErrInvalid, a.SecretFile, perm, a.SecretFile)
	}
	buf := make([]byte, maxSecretFile+1)
	n, err := f.Read(buf)
	if err != nil && n == 0 {
		return "", fmt.Errorf("%w: auth_secret_file %s: %v (is it empty?)", ErrInvalid, a.SecretFile, err)
	}
	if n > maxSecretFile {
		return "", fmt.Errorf("%w: auth_secret_file %s holds more than %d bytes; want the secret alone", ErrInvalid, a.SecretFile, maxSecretFile)
	}
	secret := strings.TrimRight(string(buf[:n]), " \t\r\n")
	if err := secretStrength("auth_secret_file "+a.SecretFile, secret); err != nil {
		return "", err
	}
	return secret, nil
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
