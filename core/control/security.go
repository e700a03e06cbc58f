package control

import (
	"crypto/hkdf"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"

	zmq "github.com/pebbe/zmq4"
)

// MinSecretLen is the shortest deployment secret accepted. Anyone who
// records a handshake can test guesses of the secret offline, so a short
// one would be found by brute force.
const MinSecretLen = 16

// ErrAuth: the peer and this end do not share a secret (or one of them
// has none), so the security handshake failed.
var ErrAuth = errors.New("control: authentication failed")

// Labels of the key derivation. Changing one changes every key, so they
// carry a version: a deployment upgrades all its ends at once anyway.
const (
	kdfSalt         = "ecmooncake control plane"
	kdfServerInfo   = "curve25519 server key v1"
	kdfClientInfo   = "curve25519 client key v1"
	mechanismCurve  = "CURVE"
	mechanismNull   = "NULL"
	curveKeyRawSize = 32
)

// Keys are the CURVE key pairs that every holder of one secret derives:
// one pair for servers (every shard's ROUTER and event PUSH), one for
// clients (producers' and schedulers' DEALERs, schedulers' event PULL).
// All are Z85 text, as libzmq takes them.
type Keys struct {
	ServerPublic, ServerSecret string
	ClientPublic, ClientSecret string
}

// DeriveKeys computes the key pairs of a secret: each secret key is
// HKDF-SHA256(secret, salt, label), the public key libzmq's Curve25519
// base-point multiplication of it (zmq_curve_public). No randomness, so
// every process given the secret computes the same keys and none need
// be distributed.
func DeriveKeys(secret string) (Keys, error) {
	if len(secret) < MinSecretLen {
		return Keys{}, fmt.Errorf("control: auth secret of %d bytes is too short; want at least %d (e.g. 32 random bytes, base64)", len(secret), MinSecretLen)
	}
	if !zmq.HasCurve() {
		major, minor, patch := zmq.Version()
		return Keys{}, fmt.Errorf("control: an auth secret needs CURVE, which this libzmq %d.%d.%d lacks (build it with libsodium)", major, minor, patch)
	}
	pair := func(info string) (public, secretKey string, err error) {
		raw, err := hkdf.Key(sha256.New, []byte(secret), []byte(kdfSalt), info, curveKeyRawSize)
		if err != nil {
			return "", "", fmt.Errorf("control: derive %s: %w", info, err)
		}
		secretKey = zmq.Z85encode(string(raw))
		public, err = zmq.AuthCurvePublic(secretKey)
		if err != nil {
			return "", "", fmt.Errorf("control: derive %s: public key: %w", info, err)
		}
		return public, secretKey, nil
	}
	var k Keys
	var err error
	if k.ServerPublic, k.ServerSecret, err = pair(kdfServerInfo); err != nil {
		return Keys{}, err
	}
	if k.ClientPublic, k.ClientSecret, err = pair(kdfClientInfo); err != nil {
		return Keys{}, err
	}
	return k, nil
}

// Security is how a control socket treats its peers. The zero value has
// no secret: plain ZMTP, and a server bound beyond loopback serves
// loopback peers only (protected mode).
type Security struct {
	keys *Keys // nil: no secret
	// allowRemote lifts protected mode for a server without a secret.
	allowRemote bool
}

// NewSecurity derives the keys of secret (empty: none). allowUnauthenticated
// lets a server without a secret serve peers beyond loopback; it is
// ignored when a secret is set, and by clients.
func NewSecurity(secret string, allowUnauthenticated bool) (Security, error) {
	s := Security{allowRemote: allowUnauthenticated}
	if secret == "" {
		return s, nil
	}
	k, err := DeriveKeys(secret)
	if err != nil {
		return Security{}, err
	}
	s.keys = &k
	return s, nil
}

// Curve reports whether a secret is set, so every socket uses CURVE.
func (s Security) Curve() bool { return s.keys != nil }

// AllowUnauthenticated reports the protected-mode opt-out.
func (s Security) AllowUnauthenticated() bool { return s.allowRemote }

// String names the mode and never a key, so that a Security can be logged.
func (s Security) String() string {
	switch {
	case s.Curve():
		return "curve"
	case s.allowRemote:
		return "none (allow_unauthenticated)"
	default:
		return "none (loopback peers only beyond a loopback bind)"
	}
}

// LogValue keeps keys out of structured logs too.
func (s Security) LogValue() slog.Value { return slog.StringValue(s.String()) }

// IsLoopbackHost reports whether every address host stands for is a
// loopback address: "*" and unspecified addresses are not, and a name is
// when all its addresses are.
func IsLoopbackHost(host string) bool {
	if host == "*" {
		return false
	}
	for _, a := range resolve(host) {
		ip, _, _ := strings.Cut(a, "%")
		if p := net.ParseIP(ip); p == nil || !p.IsLoopback() {
			return false
		}
	}
	return true
}

// refusal names why a peer was turned away. The values are metric labels
// (ecm_failures_total{component="control",reason=...}), so the set is
// fixed.
type refusal string

const (
	admitted refusal = ""
	// A CURVE peer whose key is not the one derived from the secret.
	refusedWrongKey refusal = "auth_wrong_key"
	// A CURVE hello that does not decrypt: the peer derived another
	// server key, so it holds another secret.
	refusedWrongSecret refusal = "auth_wrong_secret"
	// A plain-ZMTP peer on a server that has a secret.
	refusedNoSecret refusal = "auth_no_secret"
	// A CURVE peer on a server that has no secret.
	refusedUnexpectedSecret refusal = "auth_unexpected_secret"
	// Protected mode: no secret, bound beyond loopback, a remote peer.
	refusedNotLoopback refusal = "auth_not_loopback"
	// Any other handshake failure libzmq reports.
	refusedProtocol refusal = "auth_protocol"
	// The peer hung up during the handshake, before its mechanism was
	// known.
	refusedAborted refusal = "auth_aborted"
	// The socket's connection cap closed a connection (connCap); logged
	// once, counted apart from the refusals.
	refusedConnCap refusal = "conn_cap"
)

// policy is what a server socket admits. It is built once per socket and
// consulted by the ZAP handler for each new connection.
type policy struct {
	curve        bool
	clientKey    string // Z85; the public key every holder of the secret derives
	allowRemote  bool
	loopbackBind bool
	bind         string // for messages
}

func newPolicy(sec Security, bindHost string) policy {
	p := policy{curve: sec.Curve(), allowRemote: sec.allowRemote, loopbackBind: IsLoopbackHost(bindHost), bind: bindHost}
	if p.curve {
		p.clientKey = sec.keys.ClientPublic
	}
	return p
}

// zap reports whether the socket needs the ZAP handler. A loopback-bound
// server without a secret can only be reached from this host, so it
// serves as it always did, with no handler in the way; neither does an
// operator's explicit allow_unauthenticated.
func (p policy) zap() bool { return p.curve || !p.allowRemote && !p.loopbackBind }

// decide is the whole admission rule: given the peer's address (IP text
// as ZAP reports it, IPv4-mapped or not), its mechanism and, for CURVE,
// its public key (Z85), admit it or say why not.
func (p policy) decide(address, mechanism, clientKey string) refusal {
	if !p.zap() {
		return admitted
	}
	if p.curve {
		if mechanism != mechanismCurve {
			return refusedNoSecret
		}
		// Public keys are not secret; the constant-time compare is free.
		if subtle.ConstantTimeCompare([]byte(clientKey), []byte(p.clientKey)) != 1 {
			return refusedWrongKey
		}
		return admitted
	}
	if mechanism != mechanismNull {
		return refusedUnexpectedSecret
	}
	if p.allowRemote {
		return admitted
	}
	ip, _, _ := strings.Cut(address, "%")
	if peer := net.ParseIP(ip); peer != nil && peer.IsLoopback() {
		return admitted
	}
	return refusedNotLoopback
}

// explain is the log line for a refusal: what happened and which setting
// fixes it.
func (p policy) explain(r refusal, peer string) string {
	from := "a peer"
	if peer != "" {
		from = "a peer at " + peer
	}
	switch r {
	case refusedNotLoopback:
		return fmt.Sprintf("refused %s: this shard listens on %s, beyond loopback, without auth_secret, so it serves loopback peers only; "+
			"set the same auth_secret (or auth_secret_file; ECMOONCAKE_SECRET for the vLLM connector) on every producer, consumer and scheduler, "+
			"or set allow_unauthenticated: true on the consumer to serve anybody", from, p.bind)
	case refusedWrongKey:
		return fmt.Sprintf("refused %s: its CURVE key is not derived from this deployment's auth_secret", from)
	case refusedWrongSecret:
		return fmt.Sprintf("refused %s: its CURVE handshake does not decrypt, so it holds a different auth_secret", from)
	case refusedNoSecret:
		return fmt.Sprintf("refused %s: it has no auth_secret (plain ZMTP) but this shard requires one; set the same auth_secret on every producer and scheduler", from)
	case refusedUnexpectedSecret:
		return fmt.Sprintf("refused %s: it uses CURVE (it has an auth_secret) but this shard has none; set the same auth_secret on the consumer", from)
	case refusedAborted:
		likely := "it has no auth_secret (plain ZMTP) and found that this shard requires one"
		if !p.curve {
			likely = "it has an auth_secret (CURVE) and found that this shard has none"
		}
		return fmt.Sprintf("refused %s: it hung up during the security handshake, before its mechanism was known: most likely %s, else it went away; "+
			"set the same auth_secret on every producer, consumer and scheduler", from, likely)
	default:
		return fmt.Sprintf("refused %s: the security handshake failed (%s)", from, r)
	}
}

// clientKeys returns the keys a client socket presents; nil without a
// secret.
func (s Security) clientKeys() *Keys { return s.keys }

// applyServer configures sock as a CURVE server when a secret is set and
// sets the ZAP domain when the policy needs the handler. Before bind.
func applyServer(sock *zmq.Socket, sec Security, p policy, domain string) error {
	if sec.Curve() {
		if err := sock.ServerAuthCurve(domain, sec.keys.ServerSecret); err != nil {
			return fmt.Errorf("control: CURVE server: %w", err)
		}
		return nil
	}
	if p.zap() {
		if err := sock.SetZapDomain(domain); err != nil {
			return fmt.Errorf("control: ZAP domain: %w", err)
		}
	}
	return nil
}

// applyClient configures sock as a CURVE client when a secret is set.
// Before connect.
func applyClient(sock *zmq.Socket, sec Security) error {
	k := sec.clientKeys()
	if k == nil {
		return nil
	}
	if err := sock.ClientAuthCurve(k.ServerPublic, k.ClientPublic, k.ClientSecret); err != nil {
		return fmt.Errorf("control: CURVE client: %w", err)
	}
	return nil
}
