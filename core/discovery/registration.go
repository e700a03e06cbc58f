package discovery

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Roles an instance can register under.
const (
	RoleEncode  = "encode"
	RolePD      = "pd"
	RolePrefill = "prefill"
	RoleDecode  = "decode"
)

// Roles lists every role, for messages.
var Roles = []string{RoleEncode, RolePD, RolePrefill, RoleDecode}

// Paths of the proxy's discovery endpoints.
const (
	RegisterPath   = "/v1/ecm/register"
	DeregisterPath = "/v1/ecm/deregister"
	BackendsPath   = "/v1/ecm/backends"
)

// ErrInvalid is wrapped by every validation error.
var ErrInvalid = errors.New("invalid registration")

// Registration is what an instance tells the proxy about itself.
type Registration struct {
	Role string `json:"role"`
	// URL is the instance's HTTP base URL, e.g. http://10.0.0.5:8100.
	URL string `json:"url"`
	// Consumer is the control endpoint of the first shard, tcp://host:port;
	// required for the roles that receive encoder outputs (pd, prefill).
	Consumer string `json:"consumer,omitempty"`
	TPSize   int    `json:"tp_size,omitempty"`
	DPSize   int    `json:"dp_size,omitempty"`
	// Host identifies the machine (for operators; not used for routing).
	Host string `json:"host,omitempty"`
	// TTLS is how long the proxy keeps the entry after this heartbeat.
	TTLS float64 `json:"ttl_s,omitempty"`
}

// TTL returns the entry's lifetime without a heartbeat.
func (r Registration) TTL() time.Duration { return time.Duration(r.TTLS * float64(time.Second)) }

// Receives reports whether the role receives encoder outputs.
func Receives(role string) bool { return role == RolePD || role == RolePrefill }

// Normalize fills defaults (sizes 1) and validates every field.
func (r *Registration) Normalize() error {
	if r.TPSize == 0 {
		r.TPSize = 1
	}
	if r.DPSize == 0 {
		r.DPSize = 1
	}
	switch r.Role {
	case RoleEncode, RolePD, RolePrefill, RoleDecode:
	default:
		return fmt.Errorf("%w: role %q; want one of %s", ErrInvalid, r.Role, strings.Join(Roles, ", "))
	}
	if _, err := HostPort(r.URL); err != nil {
		return err
	}
	if r.TPSize < 1 || r.TPSize > 1024 || r.DPSize < 1 || r.DPSize > 1024 {
		return fmt.Errorf("%w: tp_size = %d, dp_size = %d; want each in [1, 1024]", ErrInvalid, r.TPSize, r.DPSize)
	}
	if r.TTLS < 0 || r.TTLS > 3600 {
		return fmt.Errorf("%w: ttl_s = %g; want (0, 3600], or 0 for the proxy's default", ErrInvalid, r.TTLS)
	}
	if Receives(r.Role) {
		if r.Consumer == "" {
			return fmt.Errorf("%w: role %s receives encoder outputs, so consumer (tcp://host:ec_port) is required", ErrInvalid, r.Role)
		}
		if _, _, err := ControlHostPort(r.Consumer); err != nil {
			return err
		}
	}
	return nil
}

// HostPort checks an http:// base URL and returns its host:port.
func HostPort(raw string) (string, error) {
	u, err := url.Parse(raw)
	if err != nil || u.Scheme != "http" || u.Hostname() == "" {
		return "", fmt.Errorf("%w: url %q; want http://host:port", ErrInvalid, raw)
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return "", fmt.Errorf("%w: url %q: port %s; want one in [1, 65535]", ErrInvalid, raw, p)
		}
	}
	if u.Path != "" && u.Path != "/" || u.RawQuery != "" {
		return "", fmt.Errorf("%w: url %q; want a base URL with no path or query", ErrInvalid, raw)
	}
	host := u.Host
	if u.Port() == "" {
		host = net.JoinHostPort(u.Hostname(), "80")
	}
	return host, nil
}

// ControlHostPort splits tcp://host:port.
func ControlHostPort(ep string) (string, int, error) {
	rest, ok := strings.CutPrefix(ep, "tcp://")
	if !ok {
		return "", 0, fmt.Errorf("%w: consumer %q; want tcp://host:port", ErrInvalid, ep)
	}
	h, p, err := net.SplitHostPort(rest)
	port, perr := strconv.Atoi(p)
	if err != nil || perr != nil || h == "" || port < 1 || port > 65535 {
		return "", 0, fmt.Errorf("%w: consumer %q; want tcp://host:port", ErrInvalid, ep)
	}
	return h, port, nil
}

// RankEndpoint is the control endpoint of DP rank r of a consumer whose
// first shard listens at ep.
func RankEndpoint(ep string, tpSize, rank int) (string, error) {
	h, p, err := ControlHostPort(ep)
	if err != nil {
		return "", err
	}
	return "tcp://" + net.JoinHostPort(h, strconv.Itoa(p+rank*tpSize)), nil
}

// strictDecoder reads JSON from b, refusing unknown keys.
func strictDecoder(b []byte) *json.Decoder {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.DisallowUnknownFields()
	return dec
}

// Decode reads one registration from a request body, strictly: unknown
// keys are errors, so a typo does not register a half-described instance.
func Decode(body []byte) (Registration, error) {
	var r Registration
	dec := strictDecoder(body)
	if err := dec.Decode(&r); err != nil {
		return r, fmt.Errorf("%w: %v", ErrInvalid, err)
	}
	if dec.More() {
		return r, fmt.Errorf("%w: trailing data after the JSON object", ErrInvalid)
	}
	return r, r.Normalize()
}
