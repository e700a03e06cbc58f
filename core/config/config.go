package config

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

// ErrInvalid is wrapped by every validation error.
var ErrInvalid = errors.New("invalid config")

// Transports the core knows by name.
var Transports = []string{"tcp", "mooncake", "shm"}

// MooncakeProtocols are the Mooncake transports a user may install with
// mooncake_protocol; both ends of a transfer must name the same one.
var MooncakeProtocols = []string{"rdma", "tcp", "efa", "barex", "nvlink", "nvlink_intra", "hip"}

// Mooncake holds the settings of the mooncake transport that a consumer
// shard and a producer share. Empty fields take the defaults documented on
// each.
type Mooncake struct {
	// Library is the path of libtransfer_engine.so; empty means the
	// loader's default search path.
	Library string `json:"mooncake_library"`
	// Engine is the path of a Mooncake pip wheel's mooncake/engine.so,
	// reached through ecmooncake's shim, which Library then names; empty
	// means Library is a TransferEngine C API library of its own.
	Engine string `json:"mooncake_engine"`
	// Metadata is P2PHANDSHAKE, http(s)://host:port/path or
	// etcd://host:port[,host:port...]; empty means
	// P2PHANDSHAKE, or this shard's own metadata server when it starts one.
	Metadata string `json:"mooncake_metadata"`
	// Protocol is the Mooncake transport installed on the engine.
	Protocol string `json:"mooncake_protocol"`
	// LocalServerName names the engine's segment in HTTP metadata mode;
	// empty means host:port with a port this process holds.
	LocalServerName string `json:"mooncake_local_server_name"`
	// Host is the address peers reach the engine at; empty means ec_ip on
	// a consumer and the host's outbound address on a producer.
	Host string `json:"mooncake_host"`
}

// P2PHandshake is Mooncake's metadata mode without a metadata service.
const P2PHandshake = "P2PHANDSHAKE"

// Consumer configures one consumer shard (one TP rank of a consumer instance).
type Consumer struct {
	IP        string `json:"ec_ip"`
	Port      int    `json:"ec_port"`
	TPRank    int    `json:"tp_rank"`
	TPSize    int    `json:"tp_size"`
	DPRank    int    `json:"dp_rank"`
	Transport string `json:"transport"`
	// DataPort is the first port of the data-plane listener; 0 picks a free one.
	DataPort int     `json:"data_port"`
	LeaseS   float64 `json:"lease_s"`
	// MaxDataConns caps the data-plane connections the shard serves at
	// once (tcp, shm); at the cap an idle one makes room, else the new one
	// is closed at once.
	MaxDataConns int `json:"max_data_conns"`
	// DataIdleTimeoutS closes a data-plane connection with no frame in
	// flight for this long.
	DataIdleTimeoutS float64 `json:"data_idle_timeout_s"`
	// DataFrameTimeoutS bounds one data-plane frame; a writer that stalls
	// mid-frame loses it and the region is reclaimed by its lease. Capped
	// at lease_s (see DataFrameTimeout).
	DataFrameTimeoutS float64 `json:"data_frame_timeout_s"`
	// DataHandshakeTimeoutS is how long a new data-plane connection may
	// take to prove itself; until then it holds a place among the unproven
	// ones, so a peer that connects and stalls holds one no longer.
	DataHandshakeTimeoutS float64 `json:"data_handshake_timeout_s"`
	// Host identifies the machine; producers use it to choose a same-host
	// transport. Empty means the hostname.
	Host string `json:"host"`
	// MaxResidentBytes caps resident copies; 0 means the slab is the cap.
	MaxResidentBytes uint64 `json:"max_resident_bytes"`
	// CreditWindowBytes is the most slab room the shard grants one
	// producer ahead as a standing credit window (capped at a quarter of
	// the slab); 0 grants none and every batch reserves.
	CreditWindowBytes uint64 `json:"credit_window_bytes"`
	// SlabFD is the descriptor, in this process, of the sealed memfd the
	// slab is mapped from; the shm transport hands it to producers on this
	// host. -1 means none.
	SlabFD int `json:"slab_fd"`
	// SlabPath is refused with a pointer to SlabFD: producers no longer
	// map a file that a consumer names.
	SlabPath string `json:"slab_path"`
	Mooncake
	GPU
	Auth
	// MooncakeMetadataServer, "host:port", makes the shard serve a
	// Mooncake metadata store there (or use the one already serving there).
	MooncakeMetadataServer string `json:"mooncake_metadata_server"`
	// MooncakeMetadataToken is the bearer token that store requires. The
	// Python package fills it from MC_METADATA_HTTP_TOKEN, which Mooncake's
	// engines read themselves and send with every metadata request.
	MooncakeMetadataToken string `json:"mooncake_metadata_token"`
	// MooncakeMetadataOpen serves that store without a token (logged
	// loudly); without a token and without it, the shard does not start.
	MooncakeMetadataOpen bool `json:"mooncake_metadata_open"`
}

// MooncakeMetadataURL is the metadata connection string the shard's engine
// uses: the configured one, else its own metadata server, else P2PHANDSHAKE.
func (c Consumer) MooncakeMetadataURL() string {
	switch {
	case c.Metadata != "":
		return c.Metadata
	case c.MooncakeMetadataServer != "":
		h, p, _ := net.SplitHostPort(c.MooncakeMetadataServer)
		if ip := net.ParseIP(h); h == "" || ip != nil && ip.IsUnspecified() {
			h = "127.0.0.1" // a server bound to every address is reached locally
		}
		return "http://" + net.JoinHostPort(h, p) + "/metadata"
	}
	return P2PHandshake
}

// ControlPort is the port of this shard's control server: vLLM's
// convention of one port per (dp_rank, tp_rank) above ec_port.
func (c Consumer) ControlPort() int { return ShardPort(c.Port, c.DPRank, c.TPSize, c.TPRank) }

// Lease is the reservation lease as a duration.
func (c Consumer) Lease() time.Duration { return seconds(c.LeaseS) }

// DataIdleTimeout is data_idle_timeout_s as a duration.
func (c Consumer) DataIdleTimeout() time.Duration { return seconds(c.DataIdleTimeoutS) }

// DataFrameTimeout is data_frame_timeout_s, capped at the lease so that a
// region a writer stalls in is reclaimed within one lease of the stall.
func (c Consumer) DataFrameTimeout() time.Duration {
	return min(seconds(c.DataFrameTimeoutS), c.Lease())
}

// DataHandshakeTimeout is data_handshake_timeout_s as a duration.
func (c Consumer) DataHandshakeTimeout() time.Duration { return seconds(c.DataHandshakeTimeoutS) }

// ShardPort is ec_port + dp_rank*tp_size + tp_rank.
func ShardPort(base, dpRank, tpSize, tpRank int) int { return base + dpRank*tpSize + tpRank }

// Producer configures the producer (encoder instance worker).
type Producer struct {
	Transport     string `json:"transport"`
	TCPConns      int    `json:"tcp_conns"`
	TCPChunkBytes int    `json:"tcp_chunk_bytes"`
	Host          string `json:"host"`
	// CompleteWindow bounds the completes a producer has out to one shard
	// and unanswered; it never waits for an answer below it.
	CompleteWindow int `json:"complete_window"`
	// CreditWindowBytes is the standing credit window the producer asks
	// each shard for, on the one-sided planes (cuda_ipc, shm, mooncake):
	// a batch that fits its window writes with no reserve round trip and
	// one claim_batch; 0 asks for none.
	CreditWindowBytes uint64 `json:"credit_window_bytes"`
	Deadlines
	Mooncake
	GPU
	Routing
	Auth
	// MooncakeStagingBytes sizes the registered staging slab that sources
	// are copied into before an RDMA write.
	MooncakeStagingBytes int64 `json:"mooncake_staging_bytes"`
}

// MooncakeMetadataURL is the metadata connection string of the producer's
// engine: the configured one, else P2PHANDSHAKE.
func (p Producer) MooncakeMetadataURL() string {
	if p.Metadata != "" {
		return p.Metadata
	}
	return P2PHandshake
}

// Deadlines are the two bounds the producer and the scheduler both keep,
// each with defaults of its own.
type Deadlines struct {
	ControlTimeoutS float64 `json:"control_timeout_s"`
	PushWaitS       float64 `json:"push_wait_timeout_s"`
}

// ControlTimeout bounds every control round trip (the scheduler's are
// those of its background loop).
func (d Deadlines) ControlTimeout() time.Duration { return seconds(d.ControlTimeoutS) }

// PushWait bounds how long a push waits: on the producer for its source
// or its write, on the scheduler in WAITING_EVENT.
func (d Deadlines) PushWait() time.Duration { return seconds(d.PushWaitS) }

func (d Deadlines) validate() error {
	return first(
		positive("control_timeout_s", d.ControlTimeoutS),
		positive("push_wait_timeout_s", d.PushWaitS),
	)
}

// Scheduler configures the consumer scheduler (the engine core's view).
type Scheduler struct {
	IP           string  `json:"ec_ip"`
	Port         int     `json:"ec_port"`
	TPSize       int     `json:"tp_size"`
	DPRank       int     `json:"dp_rank"`
	LoadTimeoutS float64 `json:"load_timeout_s"`
	Deadlines
	// Shards lists the shards' control endpoints explicitly; empty means
	// derive them from ec_ip, ec_port, tp_size and dp_rank.
	Shards []string `json:"shards"`
	Auth
}

// LoadTimeout bounds LOADING.
func (s Scheduler) LoadTimeout() time.Duration { return seconds(s.LoadTimeoutS) }

// Runtime holds process-wide settings.
type Runtime struct {
	GOMAXPROCS int    `json:"gomaxprocs"`
	LogLevel   string `json:"log_level"`
	// MetricsPort, when not 0, serves this process's metrics (Prometheus
	// text on /metrics) on MetricsIP:MetricsPort. Opt-in: every vLLM
	// process that loads the library needs a port of its own.
	MetricsPort int    `json:"metrics_port"`
	MetricsIP   string `json:"metrics_ip"`
}

// DefaultConsumer returns the defaults a JSON document overrides.
func DefaultConsumer() Consumer {
	return Consumer{Auth: defaultAuth(), IP: "127.0.0.1", Port: 14579, TPSize: 1, Transport: "tcp", LeaseS: 300, SlabFD: -1,
		MaxDataConns: 256, DataIdleTimeoutS: 300, DataFrameTimeoutS: 30, DataHandshakeTimeoutS: 1,
		Mooncake: defaultMooncake()}
}

// DefaultProducer returns the producer defaults.
func DefaultProducer() Producer {
	return Producer{Auth: defaultAuth(), Transport: "tcp", Deadlines: Deadlines{ControlTimeoutS: 30, PushWaitS: 60}, TCPConns: 4, TCPChunkBytes: 8 << 20,
		CompleteWindow: 1024, Mooncake: defaultMooncake(), MooncakeStagingBytes: 256 << 20}
}

// defaultAuth takes the Unix path to same-host peers: calls and readiness
// events both go over it, and cross-host peers still over ZeroMQ.
func defaultAuth() Auth { return Auth{ControlUnix: true} }

func defaultMooncake() Mooncake { return Mooncake{Protocol: "rdma"} }

// DefaultScheduler returns the scheduler defaults.
func DefaultScheduler() Scheduler {
	return Scheduler{Auth: defaultAuth(), IP: "127.0.0.1", Port: 14579, TPSize: 1, LoadTimeoutS: 30,
		Deadlines: Deadlines{ControlTimeoutS: 5, PushWaitS: 60}}
}

// DefaultRuntime keeps the Go runtime small beside PyTorch.
func DefaultRuntime() Runtime { return Runtime{GOMAXPROCS: 2, LogLevel: "info", MetricsIP: "0.0.0.0"} }

// DecodeConsumer decodes and validates a consumer shard's settings.
func DecodeConsumer(raw []byte) (Consumer, error) {
	return decodeOver("consumer", DefaultConsumer(), raw)
}

// DecodeProducer decodes and validates the producer's settings.
func DecodeProducer(raw []byte) (Producer, error) {
	return decodeOver("producer", DefaultProducer(), raw)
}

// DecodeScheduler decodes and validates the consumer scheduler's settings.
func DecodeScheduler(raw []byte) (Scheduler, error) {
	return decodeOver("scheduler", DefaultScheduler(), raw)
}

// DecodeRuntime decodes and validates process-wide settings.
func DecodeRuntime(raw []byte) (Runtime, error) { return decodeOver("runtime", DefaultRuntime(), raw) }

// decodeOver decodes raw over the defaults def, then validates the result.
func decodeOver[T interface{ Validate() error }](what string, def T, raw []byte) (T, error) {
	if err := decode(what, raw, &def); err != nil {
		return def, err
	}
	return def, def.Validate()
}

// Validate checks every field.
func (c Consumer) Validate() error {
	return first(
		host("ec_ip", c.IP),
		inRange("ec_port", c.Port),
		inRange("tp_size", c.TPSize),
		inRange("tp_rank", c.TPRank),
		rangeInt("tp_rank", c.TPRank, 0, c.TPSize-1),
		inRange("dp_rank", c.DPRank),
		port("ec_port + dp_rank*tp_size + tp_rank", c.ControlPort(), false),
		oneOf("transport", c.Transport, Transports),
		inRange("data_port", c.DataPort),
		positive("lease_s", c.LeaseS),
		inRange("max_data_conns", c.MaxDataConns),
		positive("data_idle_timeout_s", c.DataIdleTimeoutS),
		positive("data_frame_timeout_s", c.DataFrameTimeoutS),
		optionalHost("host", c.Host),
		inRange("max_resident_bytes", c.MaxResidentBytes),
		inRange("credit_window_bytes", c.CreditWindowBytes),
		secondsIn("data_handshake_timeout_s", c.DataHandshakeTimeoutS),
		slabFD(c.Transport, c.SlabFD, c.SlabPath),
		c.Mooncake.validate(),
		hostPort("mooncake_metadata_server", c.MooncakeMetadataServer),
		c.GPU.validate(),
		c.Auth.validate(),
	)
}

// Validate checks every field.
func (p Producer) Validate() error {
	return first(
		oneOf("transport", p.Transport, Transports),
		p.Deadlines.validate(),
		inRange("tcp_conns", p.TCPConns),
		inRange("tcp_chunk_bytes", p.TCPChunkBytes),
		inRange("complete_window", p.CompleteWindow),
		inRange("credit_window_bytes", p.CreditWindowBytes),
		optionalHost("host", p.Host),
		p.Mooncake.validate(),
		inRange("mooncake_staging_bytes", p.MooncakeStagingBytes),
		p.GPU.validate(),
		p.Routing.validate(),
		p.Auth.validate(),
	)
}

func (m Mooncake) validate() error {
	errs := []error{
		oneOf("mooncake_protocol", m.Protocol, MooncakeProtocols),
		MooncakeMetadata(m.Metadata),
	}
	errs = append(errs, optionalHost("mooncake_host", m.Host))
	if len(m.LocalServerName) > 200 || strings.ContainsAny(m.LocalServerName, " \t\n\r\x00") {
		errs = append(errs, fmt.Errorf("%w: mooncake_local_server_name = %q; want at most 200 characters without spaces", ErrInvalid, m.LocalServerName))
	}
	return first(errs...)
}

// MooncakeMetadata checks a Mooncake metadata connection string before it
// can reach Mooncake, which aborts the whole process on a scheme it was not
// built with. Allowed: P2PHANDSHAKE and HTTP (the default build's
// USE_HTTP), and etcd://host:port[,host:port...] (USE_ETCD, which every
// pip wheel has: whether the loaded engine has the etcd client is the
// transport's check, when it loads it); empty means the default.
func MooncakeMetadata(s string) error {
	const key = "mooncake_metadata"
	const allowed = `"P2PHANDSHAKE", "http://host:port/metadata" (also https) or "etcd://host:port" (endpoints separated by commas)`
	if s == "" || s == P2PHandshake {
		return nil
	}
	if rest, ok := strings.CutPrefix(s, EtcdScheme); ok {
		return etcdEndpoints(key, s, rest, allowed)
	}
	u, err := url.Parse(s)
	if err != nil || !strings.Contains(s, "://") {
		return fmt.Errorf("%w: %s = %q is not a URL; want %s", ErrInvalid, key, s, allowed)
	}
	if u.Scheme != "http" && u.Scheme != "https" {
		return fmt.Errorf("%w: %s = %q: scheme %q is not supported (Mooncake aborts the process on a scheme its build lacks); want %s",
			ErrInvalid, key, s, u.Scheme, allowed)
	}
	if u.Hostname() == "" || u.User != nil || u.Fragment != "" || u.RawQuery != "" {
		return fmt.Errorf("%w: %s = %q: want a host, optional port and path, nothing else; want %s", ErrInvalid, key, s, allowed)
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return fmt.Errorf("%w: %s = %q: port %q is not in [1, 65535]", ErrInvalid, key, s, p)
		}
	}
	return nil
}

// EtcdScheme starts a Mooncake metadata string that names etcd endpoints.
const EtcdScheme = "etcd://"

// etcdEndpoints checks the endpoints of an etcd:// metadata string as
// Mooncake's etcd client splits them (on commas or semicolons): each a
// host and a port, no user (a password there would show in every log
// line and process listing that prints the setting), path or scheme.
func etcdEndpoints(key, s, rest, allowed string) error {
	eps := strings.FieldsFunc(rest, func(r rune) bool { return r == ',' || r == ';' })
	if len(eps) == 0 {
		return fmt.Errorf("%w: %s = %q names no etcd endpoint; want %s", ErrInvalid, key, s, allowed)
	}
	for _, ep := range eps {
		ep = strings.TrimSpace(ep)
		h, p, err := net.SplitHostPort(ep)
		if err != nil || h == "" || strings.ContainsAny(ep, "/@?#") {
			return fmt.Errorf("%w: %s = %q: etcd endpoint %q is not host:port (no user, path or scheme); want %s",
				ErrInvalid, key, s, ep, allowed)
		}
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return fmt.Errorf("%w: %s = %q: port %q is not in [1, 65535]", ErrInvalid, key, s, p)
		}
	}
	return nil
}

// Validate checks every field.
func (s Scheduler) Validate() error {
	errs := []error{
		s.Deadlines.validate(),
		positive("load_timeout_s", s.LoadTimeoutS),
		inRange("tp_size", s.TPSize),
		inRange("dp_rank", s.DPRank),
		s.Auth.validate(),
	}
	if len(s.Shards) == 0 {
		errs = append(errs, host("ec_ip", s.IP), inRange("ec_port", s.Port),
			port("ec_port + dp_rank*tp_size + tp_size-1", ShardPort(s.Port, s.DPRank, s.TPSize, s.TPSize-1), false))
	} else if len(s.Shards) != s.TPSize {
		errs = append(errs, fmt.Errorf("%w: shards lists %d endpoints but tp_size is %d; give one per TP rank", ErrInvalid, len(s.Shards), s.TPSize))
	}
	return first(errs...)
}

// Validate checks every field.
func (r Runtime) Validate() error {
	return first(
		inRange("gomaxprocs", r.GOMAXPROCS),
		oneOf("log_level", r.LogLevel, LogLevels),
		inRange("metrics_port", r.MetricsPort),
		host("metrics_ip", r.MetricsIP),
	)
}

func decode(what string, raw []byte, into any) error {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 {
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(into); err != nil {
		return fmt.Errorf("%w: %s settings: %v", ErrInvalid, what, cleanJSONError(err))
	}
	if dec.More() {
		return fmt.Errorf("%w: %s settings: trailing data after the JSON object", ErrInvalid, what)
	}
	return nil
}

// cleanJSONError rewrites encoding/json's messages so that they name the
// key the way the user wrote it.
// jsonKey drops the Go names of embedded structs (Auth, GPU) from a
// decoder's field path: settings keys are snake_case, so a capital starts
// a Go name.
func jsonKey(field string) string {
	parts := strings.Split(field, ".")
	kept := parts[:0]
	for _, p := range parts {
		if p != "" && (p[0] < 'A' || p[0] > 'Z') {
			kept = append(kept, p)
		}
	}
	return strings.Join(kept, ".")
}

func cleanJSONError(err error) string {
	var te *json.UnmarshalTypeError
	if errors.As(err, &te) {
		return fmt.Sprintf("key %q: got a JSON %s, want %s", jsonKey(te.Field), te.Value, te.Type)
	}
	msg := err.Error()
	if strings.HasPrefix(msg, "json: unknown field ") {
		return "unknown key " + strings.TrimPrefix(msg, "json: unknown field ")
	}
	return msg
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

func first(errs ...error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

func host(key, v string) error {
	if v == "" {
		return fmt.Errorf("%w: %s is empty; want an IPv4 or IPv6 address or a hostname", ErrInvalid, key)
	}
	if net.ParseIP(strings.Trim(v, "[]")) != nil {
		return nil
	}
	for _, r := range v {
		if !(r == '-' || r == '.' || r == '_' || r >= '0' && r <= '9' || r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z') {
			return fmt.Errorf("%w: %s = %q is neither an IP address nor a hostname", ErrInvalid, key, v)
		}
	}
	return nil
}

// optionalHost checks a host setting whose empty value means "derive it".
func optionalHost(key, v string) error {
	if v == "" {
		return nil
	}
	return host(key, v)
}

// hostPort checks an optional "host:port" listen address.
func hostPort(key, v string) error {
	if v == "" {
		return nil
	}
	h, p, err := net.SplitHostPort(v)
	if err != nil {
		return fmt.Errorf("%w: %s = %q is not host:port: %v", ErrInvalid, key, v, err)
	}
	if h != "" {
		if err := host(key+" host", h); err != nil {
			return err
		}
	}
	n, err := strconv.Atoi(p)
	if err != nil || n < 0 || n > 65535 {
		return fmt.Errorf("%w: %s = %q: port %q is not in [0, 65535]", ErrInvalid, key, v, p)
	}
	return nil
}

// slabFD checks that shm has a slab descriptor and nothing else does; the
// shm transport checks the memfd itself, against the slab, when the shard
// listens.
func slabFD(transport string, fd int, path string) error {
	switch {
	case path != "":
		return fmt.Errorf("%w: slab_path is no longer supported: the shm slab is a sealed memfd whose descriptor producers receive over a Unix socket; allocate it with ecmooncake.native.shared_slab and pass slab_fd", ErrInvalid)
	case fd < 0 && transport == "shm":
		return fmt.Errorf("%w: slab_fd is not set; transport shm needs the descriptor of the slab's memfd (allocate the slab with shared_slab)", ErrInvalid)
	case fd >= 0 && transport != "shm":
		return fmt.Errorf("%w: slab_fd is set but transport is %q; only shm hands the slab to producers", ErrInvalid, transport)
	}
	return nil
}

func port(key string, v int, zeroOK bool) error {
	lo := 1
	if zeroOK {
		lo = 0
	}
	if v < lo || v > 65535 {
		return fmt.Errorf("%w: %s = %d; want a TCP port in [%d, 65535]", ErrInvalid, key, v, lo)
	}
	return nil
}

func rangeInt(key string, v, lo, hi int) error {
	if v < lo || v > hi {
		return fmt.Errorf("%w: %s = %d; want a value in [%d, %d]", ErrInvalid, key, v, lo, hi)
	}
	return nil
}

func oneOf(key, v string, allowed []string) error {
	for _, a := range allowed {
		if v == a {
			return nil
		}
	}
	return fmt.Errorf("%w: %s = %q; want one of %s", ErrInvalid, key, v, strings.Join(allowed, ", "))
}
