package config

import (
	"fmt"
	"sort"
)

// LocalTransports are the values of local_transport: the data plane used
// for a consumer shard on the same host ("none" uses the network one).
var LocalTransports = []string{"cuda_ipc", "none"}

// Defaults of the GPU settings, applied where a field is zero.
const (
	DefaultStagingBytes   = 64 << 20
	DefaultLocalTransport = "cuda_ipc"
)

// GPU holds the settings of GPU memory transfers that a consumer shard and
// a producer share. Zero fields take the defaults above.
type GPU struct {
	// StagingBytes bounds the page-locked host memory that stages GPU
	// memory over a network transport (TCP), per consumer shard or
	// producer.
	StagingBytes int `json:"staging_bytes"`
}

// Staging is StagingBytes with its default.
func (g GPU) Staging() int {
	if g.StagingBytes == 0 {
		return DefaultStagingBytes
	}
	return g.StagingBytes
}

func (g GPU) validate() error {
	if g.StagingBytes == 0 {
		return nil
	}
	return inRange("staging_bytes", g.StagingBytes)
}

// Routing chooses a producer's data plane per consumer shard.
type Routing struct {
	// LocalTransport carries pushes to shards on this host (the same host
	// identity): "cuda_ipc" (the default), or "none" for the network
	// transport everywhere.
	LocalTransport string `json:"local_transport"`
	// TransportOverrides maps a shard's control endpoint, or a host
	// identity, to the transport that carries pushes to it.
	TransportOverrides map[string]string `json:"transport_overrides"`
}

// Local is LocalTransport with its default; "" means none.
func (r Routing) Local() string {
	switch r.LocalTransport {
	case "":
		return DefaultLocalTransport
	case "none":
		return ""
	}
	return r.LocalTransport
}

func (r Routing) validate() error {
	if r.LocalTransport != "" {
		if err := oneOf("local_transport", r.LocalTransport, LocalTransports); err != nil {
			return err
		}
	}
	keys := make([]string, 0, len(r.TransportOverrides))
	for k := range r.TransportOverrides {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	allowed := append(append([]string{}, Transports...), LocalTransports[0])
	for _, k := range keys {
		if k == "" {
			return fmt.Errorf("%w: transport_overrides has an empty key; want a shard control endpoint or a host identity", ErrInvalid)
		}
		if err := oneOf(fmt.Sprintf("transport_overrides[%q]", k), r.TransportOverrides[k], allowed); err != nil {
			return err
		}
	}
	return nil
}
