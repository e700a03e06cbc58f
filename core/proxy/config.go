package proxy

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net/url"
	"strconv"
	"strings"
	"time"

	"github.com/ecmooncake/ecmooncake/core/discovery"
)

// ErrInvalid is wrapped by every validation error.
var ErrInvalid = errors.New("invalid proxy config")

// Config holds the proxy's settings; JSON keys are what the C ABI and the
// command line pass.
type Config struct {
	Host        string `json:"host"`
	Port        int    `json:"port"`
	MetricsPort int    `json:"metrics_port"`
	// Encode, PD, Prefill and Decode list backends by base URL. A PD or
	// prefill URL may carry its consumer layout in the fragment:
	// http://h:8100#ec=tcp://h:14579&tp_size=2&dp_size=2 (ec defaults to
	// tcp://<url host>:<ec_port>).
	Encode  []string `json:"encode"`
	PD      []string `json:"pd"`
	Prefill []string `json:"prefill"`
	Decode  []string `json:"decode"`
	// Retries is how many times a request whose consumer failed before the
	// first streamed byte is encoded again and resent.
	Retries int `json:"retries"`
	// ECPort is the consumers' ec_port assumed for static URLs without ec=.
	ECPort          int     `json:"ec_port"`
	EncodeTimeoutS  float64 `json:"encode_timeout_s"`
	RequestTimeoutS float64 `json:"request_timeout_s"`
	HealthIntervalS float64 `json:"health_interval_s"`
	// HealthTimeoutS bounds one health check; 0 means the interval, at
	// most 5 s. A check that times out counts as a failure, so a loaded
	// host wants it well above its scheduling jitter.
	HealthTimeoutS float64 `json:"health_timeout_s"`
	// FailThreshold consecutive failures (health checks or calls) drop a
	// backend until a health check passes again.
	FailThreshold int `json:"fail_threshold"`
	// UpstreamIdleTimeoutS closes a backend connection idle this long. It
	// must stay below the backends' own keep-alive (vLLM's is 5 s), so that
	// the proxy never picks a connection the backend is closing.
	UpstreamIdleTimeoutS float64 `json:"upstream_idle_timeout_s"`
	DefaultTTLS          float64 `json:"registration_ttl_s"`
	MaxBodyBytes         int     `json:"max_body_bytes"`
	// MaxBodiesInFlight × MaxBodyBytes is the budget of request-body bytes
	// the proxy holds across all requests at once; a body that would take
	// it over is refused with 503 and Retry-After.
	MaxBodiesInFlight int `json:"max_bodies_in_flight"`
	// MaxBodyBytesPerClient is the most of that budget the requests of one
	// client (peer address) hold at once; a body past it is refused with
	// 503 and Retry-After. 0 means half the budget, and never less than
	// max_body_bytes.
	MaxBodyBytesPerClient int64 `json:"max_body_bytes_per_client"`
	// AllowRegister enables POST /v1/ecm/register and /v1/ecm/deregister
	// once RegisterToken is set; false keeps them off even with a token.
	AllowRegister bool `json:"allow_register"`
	// RegisterToken is the bearer token every registration and
	// deregistration must carry. Empty turns discovery off: an instance
	// that can reach the proxy is not thereby one of this deployment.
	RegisterToken string `json:"register_token"`
	// AdminPort, when set, serves register, deregister and backends on a
	// port of their own (on AdminHost, default Host) and takes them off
	// the user-facing port, so that the user port can be exposed alone.
	AdminPort int    `json:"admin_port"`
	AdminHost string `json:"admin_host"`
	// ClientMediaKeys says what becomes of a cache key a client names for
	// a media part (its "uuid"): namespace (kept apart per tenant, the
	// default), refuse (400) or trust (passed unchanged). keys.go says why.
	ClientMediaKeys string `json:"client_media_keys"`
	// TenantHeader names the request header that carries the tenant, set
	// by a gateway that authenticates clients in front of the proxy. Empty:
	// the tenant is a digest of the request's Authorization header.
	TenantHeader string `json:"tenant_header"`
	// AffinityEntries bounds the items the proxy remembers the PD of, to
	// send a repeated image back where it is (affinity.go); 0 turns
	// routing by affinity off. AffinityTTLS is how long an entry counts,
	// and AffinitySlack how many more requests in flight than the least
	// loaded PD its holder may have and still be picked.
	AffinityEntries int     `json:"affinity_entries"`
	AffinityTTLS    float64 `json:"affinity_ttl_s"`
	AffinitySlack   int     `json:"affinity_slack"`
	// AffinityReuse sends an item the picked PD is known to hold to it
	// without encoding it again (affinity.go).
	AffinityReuse bool `json:"affinity_reuse"`
	// StoreReuse sends an item an encoder encoded before (the affinity
	// table knows its identifier) to a picked PD that is not known to hold
	// it as an item the PD gets from Mooncake Store itself, with no encoder
	// call (affinity.go). Off by default: it needs the PD's "store"
	// setting, and an encoder that puts into the same Store.
	StoreReuse bool `json:"store_reuse"`
}

// DefaultConfig returns the defaults a JSON document overrides.
func DefaultConfig() Config {
	return Config{
		Host: "0.0.0.0", Port: 8000, Retries: 2, ECPort: 14579,
		EncodeTimeoutS: 60, RequestTimeoutS: 600, HealthIntervalS: 2, FailThreshold: 3, UpstreamIdleTimeoutS: 4,
		DefaultTTLS: discovery.DefaultTTL.Seconds(), MaxBodyBytes: 256 << 20, MaxBodiesInFlight: 8, AllowRegister: true,
		ClientMediaKeys: KeysNamespace,
		AffinityEntries: 1 << 16, AffinityTTLS: 300, AffinitySlack: 2, AffinityReuse: true,
	}
}

// DecodeConfig decodes and validates settings.
func DecodeConfig(raw []byte) (Config, error) {
	c := DefaultConfig()
	raw = bytes.TrimSpace(raw)
	if len(raw) > 0 {
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&c); err != nil {
			return c, fmt.Errorf("%w: %v", ErrInvalid, err)
		}
	}
	return c, c.Validate()
}

// bodyBudget is the bytes of request bodies held at once, all requests together.
func (c Config) bodyBudget() int64 { return int64(c.MaxBodiesInFlight) * int64(c.MaxBodyBytes) }

// maxBodyBytesPerClient is one client's share of bodyBudget.
func (c Config) maxBodyBytesPerClient() int64 {
	if c.MaxBodyBytesPerClient > 0 {
		return c.MaxBodyBytesPerClient
	}
	return max(c.bodyBudget()/2, int64(c.MaxBodyBytes))
}

func (c Config) encodeTimeout() time.Duration  { return secs(c.EncodeTimeoutS) }
func (c Config) requestTimeout() time.Duration { return secs(c.RequestTimeoutS) }
func (c Config) healthInterval() time.Duration { return secs(c.HealthIntervalS) }
func (c Config) healthTimeout() time.Duration {
	if c.HealthTimeoutS > 0 {
		return secs(c.HealthTimeoutS)
	}
	return min(c.healthInterval(), 5*time.Second)
}
func (c Config) defaultTTL() time.Duration { return secs(c.DefaultTTLS) }
func (c Config) upstreamIdleTimeout() time.Duration {
	return secs(c.UpstreamIdleTimeoutS)
}

// Discovery reports whether registration is on: allowed and a token set.
func (c Config) Discovery() bool { return c.AllowRegister && c.RegisterToken != "" }

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// Split reports whether prefill and decode run on separate instances.
func (c Config) Split() bool { return len(c.Prefill) > 0 || len(c.Decode) > 0 }

// Validate checks every field and every static backend.
func (c Config) Validate() error {
	switch {
	case c.Host == "":
		return fmt.Errorf("%w: host is empty", ErrInvalid)
	case c.Port < 0 || c.Port > 65535:
		return fmt.Errorf("%w: port = %d; want [0, 65535] (0 picks a free port)", ErrInvalid, c.Port)
	case c.MetricsPort < 0 || c.MetricsPort > 65535:
		return fmt.Errorf("%w: metrics_port = %d; want [0, 65535] (0 serves /metrics on the main port only)", ErrInvalid, c.MetricsPort)
	case c.AdminPort < 0 || c.AdminPort > 65535:
		return fmt.Errorf("%w: admin_port = %d; want [0, 65535] (0 serves discovery on the main port)", ErrInvalid, c.AdminPort)
	case c.AdminPort != 0 && c.AdminPort == c.Port && (c.AdminHost == "" || c.AdminHost == c.Host):
		return fmt.Errorf("%w: admin_port = %d is the user-facing port; give it a port of its own", ErrInvalid, c.AdminPort)
	case !validToken(c.RegisterToken):
		return fmt.Errorf("%w: register_token has whitespace or control characters (it must travel as one HTTP header value; a token file's trailing newline is stripped by the command line)", ErrInvalid)
	case c.ClientMediaKeys != KeysNamespace && c.ClientMediaKeys != KeysRefuse && c.ClientMediaKeys != KeysTrust:
		return fmt.Errorf("%w: client_media_keys = %q; want %q, %q or %q", ErrInvalid, c.ClientMediaKeys, KeysNamespace, KeysRefuse, KeysTrust)
	case c.AffinityEntries < 0 || c.AffinityEntries > 1<<22:
		return fmt.Errorf("%w: affinity_entries = %d; want [0, %d] (0 turns routing by affinity off)", ErrInvalid, c.AffinityEntries, 1<<22)
	case c.AffinityTTLS < 0 || c.AffinitySlack < 0:
		return fmt.Errorf("%w: affinity_ttl_s = %v, affinity_slack = %d; want both >= 0", ErrInvalid, c.AffinityTTLS, c.AffinitySlack)
	case c.TenantHeader != "" && !validHeaderName(c.TenantHeader):
		return fmt.Errorf("%w: tenant_header = %q is not an HTTP header name", ErrInvalid, c.TenantHeader)
	case c.Retries < 0 || c.Retries > 10:
		return fmt.Errorf("%w: retries = %d; want [0, 10]", ErrInvalid, c.Retries)
	case c.ECPort < 1 || c.ECPort > 65535:
		return fmt.Errorf("%w: ec_port = %d; want [1, 65535]", ErrInvalid, c.ECPort)
	case c.EncodeTimeoutS <= 0 || c.RequestTimeoutS <= 0 || c.HealthIntervalS <= 0 || c.DefaultTTLS <= 0 || c.UpstreamIdleTimeoutS <= 0:
		return fmt.Errorf("%w: encode_timeout_s, request_timeout_s, health_interval_s, registration_ttl_s and upstream_idle_timeout_s must be positive", ErrInvalid)
	case c.HealthTimeoutS < 0:
		return fmt.Errorf("%w: health_timeout_s = %g; want at least 0 (0 means health_interval_s, at most 5 s)", ErrInvalid, c.HealthTimeoutS)
	case c.FailThreshold < 1:
		return fmt.Errorf("%w: fail_threshold = %d; want at least 1", ErrInvalid, c.FailThreshold)
	case c.MaxBodyBytes < 1<<10:
		return fmt.Errorf("%w: max_body_bytes = %d; want at least 1024", ErrInvalid, c.MaxBodyBytes)
	case c.MaxBodiesInFlight < 1 || int64(c.MaxBodiesInFlight)*int64(c.MaxBodyBytes) > 1<<40:
		return fmt.Errorf("%w: max_bodies_in_flight = %d; want at least 1, and max_bodies_in_flight × max_body_bytes at most 1 TiB", ErrInvalid, c.MaxBodiesInFlight)
	case c.MaxBodyBytesPerClient != 0 && (c.MaxBodyBytesPerClient < int64(c.MaxBodyBytes) || c.MaxBodyBytesPerClient > c.bodyBudget()):
		return fmt.Errorf("%w: max_body_bytes_per_client = %d; want 0 (half the budget) or from max_body_bytes (%d) to max_body_bytes × max_bodies_in_flight (%d)",
			ErrInvalid, c.MaxBodyBytesPerClient, c.MaxBodyBytes, c.bodyBudget())
	case c.Split() && len(c.PD) > 0:
		return fmt.Errorf("%w: give either pd or prefill+decode backends, not both", ErrInvalid)
	case c.Split() && (len(c.Prefill) == 0) != (len(c.Decode) == 0):
		return fmt.Errorf("%w: prefill and decode backends go together (got %d prefill, %d decode)", ErrInvalid, len(c.Prefill), len(c.Decode))
	case len(c.PD)+len(c.Prefill) == 0 && !c.Discovery():
		return fmt.Errorf("%w: no pd or prefill backend and registration is off (it needs register_token: --register-token-file FILE or $ECMOONCAKE_REGISTER_TOKEN on the command line): nothing could serve a request", ErrInvalid)
	}
	for role, urls := range map[string][]string{discovery.RoleEncode: c.Encode, discovery.RolePD: c.PD, discovery.RolePrefill: c.Prefill, discovery.RoleDecode: c.Decode} {
		for _, u := range urls {
			if _, err := c.static(role, u); err != nil {
				return err
			}
		}
	}
	return nil
}

// validToken accepts printable ASCII without spaces, the characters a
// bearer token can carry in a header unchanged.
func validToken(tok string) bool {
	for i := 0; i < len(tok); i++ {
		if tok[i] <= ' ' || tok[i] >= 0x7f {
			return false
		}
	}
	return true
}

// static turns one command-line URL into a registration.
func (c Config) static(role, raw string) (discovery.Registration, error) {
	base, frag, _ := strings.Cut(raw, "#")
	r := discovery.Registration{Role: role, URL: strings.TrimSuffix(base, "/")}
	if frag != "" {
		q, err := url.ParseQuery(frag)
		if err != nil {
			return r, fmt.Errorf("%w: %s backend %q: fragment: %v", ErrInvalid, role, raw, err)
		}
		for k, vs := range q {
			v := vs[len(vs)-1]
			switch k {
			case "ec":
				r.Consumer = v
			case "tp_size", "dp_size":
				n, err := strconv.Atoi(v)
				if err != nil {
					return r, fmt.Errorf("%w: %s backend %q: %s = %q is not an integer", ErrInvalid, role, raw, k, v)
				}
				if k == "tp_size" {
					r.TPSize = n
				} else {
					r.DPSize = n
				}
			default:
				return r, fmt.Errorf("%w: %s backend %q: unknown fragment key %q (want ec, tp_size, dp_size)", ErrInvalid, role, raw, k)
			}
		}
	}
	if discovery.Receives(role) && r.Consumer == "" {
		u, err := url.Parse(r.URL)
		if err == nil {
			r.Consumer = fmt.Sprintf("tcp://%s:%d", u.Hostname(), c.ECPort)
			if strings.Contains(u.Hostname(), ":") {
				r.Consumer = fmt.Sprintf("tcp://[%s]:%d", u.Hostname(), c.ECPort)
			}
		}
	}
	if err := r.Normalize(); err != nil {
		return r, fmt.Errorf("%s backend %q: %w", role, raw, err)
	}
	return r, nil
}

// validHeaderName reports whether s is an HTTP field name (RFC 9110 token).
func validHeaderName(s string) bool {
	for _, r := range s {
		switch {
		case r >= 'a' && r <= 'z', r >= 'A' && r <= 'Z', r >= '0' && r <= '9', strings.ContainsRune("!#$%&'*+-.^_`|~", r):
		default:
			return false
		}
	}
	return s != ""
}
