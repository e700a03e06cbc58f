package config

import (
	"encoding/json"
	"fmt"
	"math"
	"reflect"
	"sort"
	"strings"
)

//go:generate go test -run TestSchemaFileIsCurrent -update .

// SchemaFile is where the schema is checked in for the Python package,
// relative to the repository root. The package reads it instead of asking
// the library, which must not load before vLLM forks.
const SchemaFile = "python/ecmooncake/settings.json"

// SchemaVersion changes when the shape of SchemaJSON's document does.
const SchemaVersion = 1

// SchemaJSON is the schema as the Python package reads it: the settings,
// and the secret rules that a string's kind alone does not say.
func SchemaJSON() ([]byte, error) {
	settings, err := Schema()
	if err != nil {
		return nil, err
	}
	doc := struct {
		Version  int       `json:"version"`
		Comment  string    `json:"comment"`
		Settings []Setting `json:"settings"`
		Secret   struct {
			MinLen      int    `json:"min_len"`
			MinDistinct int    `json:"min_distinct"`
			Fix         string `json:"fix"`
		} `json:"secret"`
	}{Version: SchemaVersion, Comment: "generated from core/config/schema.go by `go generate ./core/config`; do not edit", Settings: settings}
	doc.Secret.MinLen, doc.Secret.MinDistinct, doc.Secret.Fix = MinSecretLen, MinSecretDistinct, SecretFix
	b, err := json.MarshalIndent(doc, "", "  ")
	if err != nil {
		return nil, fmt.Errorf("config schema: %w", err)
	}
	return append(b, '\n'), nil
}

// Kinds of setting values, as the schema names them.
const (
	KindInt     = "int"     // an integer in [min, max] (either bound may be absent)
	KindSeconds = "seconds" // a number of seconds in (0, MaxSeconds]
	KindEnum    = "enum"    // one of choices
	KindHost    = "host"    // an IP address or hostname; "" only where the default is ""
	KindText    = "text"    // free text, checked by its own rule where it has one
	KindPath    = "path"    // a file path without surrounding spaces
	KindSecret  = "secret"  // a deployment secret (see MinSecretLen)
	KindBool    = "bool"
	KindList    = "list"    // a JSON array of strings
	KindMap     = "map"     // a JSON object of strings
	KindRemoved = "removed" // refused when set; the help says what replaced it
)

// MaxSeconds bounds every duration setting: beyond it a typo (ms given as
// s) rather than a choice.
const MaxSeconds = 1e7

// Setting describes one key of one settings object. Schema lists them.
type Setting struct {
	// Object is consumer, producer, scheduler or runtime: the JSON object
	// (ecm_*_open, ecm_configure) that takes the key.
	Object string `json:"object"`
	Key    string `json:"key"`
	Kind   string `json:"kind"`
	// Default is the value the key takes when absent, as JSON; where a
	// zero in the struct means "the default", the effective value.
	Default any      `json:"default"`
	Min     *float64 `json:"min,omitempty"`
	Max     *float64 `json:"max,omitempty"`
	Choices []string `json:"choices,omitempty"`
	Help    string   `json:"help"`
}

// spec is what the schema knows of a key beyond its struct field. A key
// shared by several objects (transport, host) has one spec: one meaning,
// one range.
type spec struct {
	kind     string
	min, max *float64
	choices  []string
	// zeroMeans is the effective default of a field whose zero value
	// means "the default" (GPU, Routing).
	zeroMeans any
	help      string
}

func bound(v float64) *float64 { return &v }

func ints(lo, hi float64) spec { return spec{kind: KindInt, min: bound(lo), max: bound(hi)} }

func (s spec) with(help string) spec { s.help = help; return s }

var portRange = ints(0, 65535)

// specs is the one table of names, kinds, ranges and meanings. Validate
// draws its ranges from here (inRange); schema_test.go proves every
// bound listed is the bound Validate enforces, and that every JSON field
// of every object has an entry. A new setting needs a struct field, an
// entry here, `go generate ./core/config` and a README row.
var specs = map[string]spec{
	"ec_ip":                {kind: KindHost, help: "address the consumer's shards bind and the scheduler reaches them at"},
	"ec_port":              ints(1, 65535).with("base port; shard i's control server listens at ec_port + dp_rank*tp_size + tp_rank"),
	"tp_rank":              {kind: KindInt, min: bound(0), help: "this shard's TP rank, below tp_size"},
	"tp_size":              {kind: KindInt, min: bound(1), help: "TP shards of the consumer instance"},
	"dp_rank":              {kind: KindInt, min: bound(0), help: "DP rank of the consumer instance"},
	"transport":            {kind: KindEnum, choices: Transports, help: "data plane: tcp, mooncake or shm"},
	"data_port":            portRange.with("first TCP data-plane port (0: any free port)"),
	"lease_s":              {kind: KindSeconds, help: "a reservation not completed, or a ready item never loaded, is reclaimed after this"},
	"max_data_conns":       ints(1, 1<<16).with("data-plane connections a shard serves at once; at the cap an idle one makes room"),
	"data_idle_timeout_s":  {kind: KindSeconds, help: "a data-plane connection with no frame in flight is closed after this"},
	"data_frame_timeout_s": {kind: KindSeconds, help: "one data-plane frame must arrive within this (at most lease_s)"},
	// A longer deadline gives a peer that connects and stalls that much
	// longer on a place among the unproven connections.
	"data_handshake_timeout_s":   {kind: KindSeconds, max: bound(60), help: "a new data-plane connection must prove itself within this; until then it holds a place among the unproven ones"},
	"host":                       {kind: KindHost, help: "this machine's identity, to pick a same-host transport (empty: the hostname)"},
	"max_resident_bytes":         ints(0, 1<<50).with("bytes of a shard's slab kept as resident copies after the engine freed them (0: the slab is the cap)"),
	"credit_window_bytes":        ints(0, 1<<40).with("standing credit: the slab room a shard grants each producer ahead (consumer; capped at a quarter of the slab), or asks each shard for (producer), so that a batch over shm or mooncake moves with no reserve round trip and one claim per shard (cuda_ipc and tcp complete in-band and keep reserving); both ends must set it (0: off, every batch reserves)"),
	"slab_fd":                    {kind: KindInt, help: "with shm: the descriptor of the sealed memfd the slab is mapped from (-1: none)"},
	"slab_path":                  {kind: KindRemoved, help: "refused: producers no longer map a file a consumer names; pass slab_fd"},
	"mooncake_library":           {kind: KindText, help: "path of libtransfer_engine.so (empty: the loader's search path)"},
	"mooncake_engine":            {kind: KindText, help: "a Mooncake pip wheel's mooncake/engine.so, carried by the shim mooncake_library names (empty: none)"},
	"mooncake_metadata":          {kind: KindText, help: "P2PHANDSHAKE, http(s)://host:port/path or etcd://host:port[,host:port] (empty: P2PHANDSHAKE, or the shard's own metadata server)"},
	"mooncake_protocol":          {kind: KindEnum, choices: MooncakeProtocols, help: "Mooncake transport; both ends must name the same one"},
	"mooncake_local_server_name": {kind: KindText, help: "the engine's segment name in HTTP metadata mode (empty: host:port)"},
	"mooncake_host":              {kind: KindHost, help: "address peers reach the Mooncake engine at (empty: ec_ip on a consumer, the outbound address on a producer)"},
	"staging_bytes":              ints(1<<20, 1<<40).with("page-locked host memory that stages GPU memory over TCP (0: the default)"),
	"auth_secret":                {kind: KindSecret, help: "the deployment's secret: the control plane is authenticated and encrypted with keys derived from it"},
	"auth_secret_file":           {kind: KindPath, help: "a file holding the secret, read when the object opens"},
	"control_unix":               {kind: KindBool, help: "same-host control calls and readiness events over Unix-domain sockets (uid checked by the kernel, the secret still required); cross-host peers keep ZeroMQ with CURVE; false puts same-host peers on ZeroMQ too"},
	"allow_unauthenticated":      {kind: KindBool, help: "run with no secret at all, not even the per-user one; without it and without a secret, a consumer bound beyond loopback does not start"},
	"auth_secret_dir":            {kind: KindPath, help: "the directory of the per-user secret used when no secret is configured (the Python package passes $XDG_RUNTIME_DIR/ecmooncake or ~/.cache/ecmooncake)"},
	"mooncake_metadata_server":   {kind: KindText, help: "host:port at which a consumer shard serves a Mooncake metadata store"},
	"mooncake_metadata_token":    {kind: KindSecret, help: "bearer token that metadata store requires (the Python package fills it from MC_METADATA_HTTP_TOKEN)"},
	"mooncake_metadata_open":     {kind: KindBool, help: "serve that store without a token (logged loudly)"},
	"control_timeout_s":          {kind: KindSeconds, help: "deadline of one control round trip"},
	"push_wait_timeout_s":        {kind: KindSeconds, help: "producer: how long a push waits for its source and its write; scheduler: an expected item not here by then fails"},
	"tcp_conns":                  ints(1, 64).with("TCP connections from a producer to each consumer shard"),
	"tcp_chunk_bytes":            ints(64<<10, 1<<30).with("large items are split into chunks of at most this many bytes"),
	"complete_window":            ints(1, 1<<16).with("completes a producer has out to one shard and unanswered, over the planes that complete by message (cuda_ipc, shm, mooncake; TCP completes in-band and sends none); it never waits for an answer below this, and at it the shard's next completes wait (their deadline still runs)"),
	"local_transport":            {kind: KindEnum, choices: LocalTransports, zeroMeans: DefaultLocalTransport, help: "data plane to shards on this host with a GPU slab; none uses transport everywhere"},
	"transport_overrides":        {kind: KindMap, help: "shard control endpoint or host identity -> the transport that carries pushes to it"},
	"mooncake_staging_bytes":     ints(1<<20, 1<<40).with("registered staging memory sources are copied into before a write: host memory, and as much GPU memory of each device sources come from with a CUDA build of the engine"),
	"load_timeout_s":             {kind: KindSeconds, help: "a load handed to the workers and not reported back by then fails"},
	"shards":                     {kind: KindList, help: "explicit shard control endpoints, one per TP rank (empty: derived from ec_ip, ec_port, tp_size, dp_rank)"},
	"gomaxprocs":                 ints(1, 1024).with("Go runtime threads; small, so that Go leaves the cores to PyTorch"),
	"log_level":                  {kind: KindEnum, choices: LogLevels, help: "the library's log level (stderr)"},
	"metrics_port":               portRange.with("serve Prometheus /metrics of this process here (0: off)"),
	"metrics_ip":                 {kind: KindHost, help: "address of the metrics port"},
	// The store object (store.go).
	"enabled":            {kind: KindBool, help: "store: put completed items into Mooncake Store and get missing ones from it"},
	"master_address":     {kind: KindText, help: "store: mooncake_master's host:port (its --rpc_port)"},
	"metadata_address":   {kind: KindText, help: "store: the Store's metadata service: http://host:port/metadata (the master's --enable_http_metadata_server), etcd://host:port or P2PHANDSHAKE"},
	"local_hostname":     {kind: KindHost, help: "store: the address other Store clients reach this process's segment at; needed when enabled (Mooncake refuses an empty one)"},
	"segment_bytes":      ints(0, 1<<44).with("store: host memory this process lends to the Store's pool (0: none)"),
	"local_buffer_bytes": ints(1<<20, 1<<40).with("store: the Store client's own transfer buffer"),
	"put_inflight_bytes": ints(1<<20, 1<<40).with("store: registered host memory puts are staged in; the bound on bytes of puts in flight (a put beyond it is dropped, counted)"),
	"put_rate_bytes_s":   ints(0, 1<<40).with("store: bytes put per second (0: no bound); a put beyond it is dropped, counted"),
	"get_staging_bytes":  ints(1<<20, 1<<40).with("store: registered host memory gets land in before the copy into the caller's buffer; the bound on bytes of gets in flight"),
	"max_gets":           ints(1, 64).with("store: gets in flight at once; beyond it a get falls back at once, counted"),
	"get_timeout_s":      {kind: KindSeconds, max: bound(600), help: "store: a get not answered by then falls back to a local encode, counted"},
	"put_timeout_s":      {kind: KindSeconds, max: bound(3600), help: "store: a put not answered by then counts as failed"},
	"retry_after_s":      {kind: KindSeconds, max: bound(3600), help: "store: after a call fails or times out, calls fall back at once for this long (the master may be gone)"},
}

func init() {
	s := specs["staging_bytes"]
	s.zeroMeans = DefaultStagingBytes
	specs["staging_bytes"] = s
	for k, s := range specs {
		if s.kind == KindSeconds {
			s.min = bound(0)
			if s.max == nil {
				s.max = bound(MaxSeconds)
			}
			specs[k] = s
		}
	}
}

// LogLevels are the values of log_level.
var LogLevels = []string{"debug", "info", "warn", "error"}

// Schema lists every setting of every object, in object order and then
// key order, with the defaults Default* return. It errs when a JSON field
// has no spec, which schema_test.go turns into a failing test.
func Schema() ([]Setting, error) {
	objects := []struct {
		name string
		def  any
	}{
		{"consumer", DefaultConsumer()},
		{"producer", DefaultProducer()},
		{"scheduler", DefaultScheduler()},
		{"runtime", DefaultRuntime()},
		{"store", DefaultStore()},
	}
	var out []Setting
	for _, o := range objects {
		fields := map[string]reflect.Value{}
		jsonFields(reflect.ValueOf(o.def), fields)
		keys := make([]string, 0, len(fields))
		for k := range fields {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			s, ok := specs[k]
			if !ok {
				return nil, fmt.Errorf("config schema: %s key %q has no entry in specs (schema.go)", o.name, k)
			}
			def := fields[k].Interface()
			if s.zeroMeans != nil && fields[k].IsZero() {
				def = s.zeroMeans
			}
			out = append(out, Setting{Object: o.name, Key: k, Kind: s.kind, Default: jsonDefault(def),
				Min: s.min, Max: s.max, Choices: s.choices, Help: s.help})
		}
	}
	return out, nil
}

// jsonDefault gives nil slices and maps their JSON empty form and unwraps
// Secret, so that the schema says [] and {} rather than null.
func jsonDefault(v any) any {
	switch t := v.(type) {
	case []string:
		if t == nil {
			return []string{}
		}
	case map[string]string:
		if t == nil {
			return map[string]string{}
		}
	case Secret:
		return string(t)
	}
	return v
}

// jsonFields collects the fields of struct v by JSON name, descending
// into embedded structs as encoding/json does.
func jsonFields(v reflect.Value, into map[string]reflect.Value) {
	t := v.Type()
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		if f.Anonymous && f.Type.Kind() == reflect.Struct {
			jsonFields(v.Field(i), into)
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name != "" && name != "-" {
			into[name] = v.Field(i)
		}
	}
}

// inRange checks v against the bounds specs lists for key.
func inRange[T int | int64 | uint64](key string, v T) error {
	s, ok := specs[key]
	if !ok || s.kind != KindInt {
		return fmt.Errorf("%w: %s: no integer range in the schema", ErrInvalid, key)
	}
	f := float64(v)
	switch {
	case s.min != nil && s.max != nil && (f < *s.min || f > *s.max):
		return fmt.Errorf("%w: %s = %d; want a value in [%.0f, %.0f]", ErrInvalid, key, v, *s.min, *s.max)
	case s.min != nil && f < *s.min:
		return fmt.Errorf("%w: %s = %d; want at least %.0f", ErrInvalid, key, v, *s.min)
	case s.max != nil && f > *s.max:
		return fmt.Errorf("%w: %s = %d; want at most %.0f", ErrInvalid, key, v, *s.max)
	}
	return nil
}

// secondsIn checks a duration against its spec: (0, max], where max is
// MaxSeconds unless the spec names a lower one.
func secondsIn(key string, v float64) error {
	s, ok := specs[key]
	if !ok || s.kind != KindSeconds {
		return fmt.Errorf("%w: %s: no duration in the schema", ErrInvalid, key)
	}
	if !(v > 0) || v > *s.max {
		return fmt.Errorf("%w: %s = %v; want seconds in (0, %g]", ErrInvalid, key, v, *s.max)
	}
	return nil
}

func positive(key string, v float64) error {
	if !(v > 0) || math.IsInf(v, 0) || v > MaxSeconds {
		return fmt.Errorf("%w: %s = %v; want a positive number of seconds, at most %g", ErrInvalid, key, v, float64(MaxSeconds))
	}
	return nil
}
