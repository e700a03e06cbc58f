package config

import (
	"fmt"
	"net"
)

// Store holds the settings of the optional second tier in Mooncake Store
// (ec_connector_extra_config's "store" object). The tier's client is the
// Python package's (ecmooncake.store, over the wheel's
// MooncakeDistributedStore); these settings live here so that the one
// schema (settings.json) checks them like every other key, and so that a
// later Go client takes the same document.
type Store struct {
	// Enabled turns the tier on; off, nothing of Mooncake Store loads.
	Enabled bool `json:"enabled"`
	// MasterAddress is mooncake_master's RPC endpoint (its --rpc_port).
	MasterAddress string `json:"master_address"`
	// MetadataAddress is where the Store's transfer engines find each
	// other: the master's HTTP metadata server, etcd, or P2PHANDSHAKE.
	MetadataAddress string `json:"metadata_address"`
	LocalHostname   string `json:"local_hostname"`
	Protocol        string `json:"mooncake_protocol"`
	// SegmentBytes is host memory this process lends to the Store's pool;
	// 0 lends none (the process only reads and writes others' segments).
	SegmentBytes     int64 `json:"segment_bytes"`
	LocalBufferBytes int64 `json:"local_buffer_bytes"`
	// PutInflightBytes is the registered staging memory puts are copied
	// into: the bound on bytes of puts in flight.
	PutInflightBytes int64 `json:"put_inflight_bytes"`
	// PutRateBytesS bounds the bytes put per second (0: no bound).
	PutRateBytesS   int64   `json:"put_rate_bytes_s"`
	GetStagingBytes int64   `json:"get_staging_bytes"`
	MaxGets         int     `json:"max_gets"`
	GetTimeoutS     float64 `json:"get_timeout_s"`
	PutTimeoutS     float64 `json:"put_timeout_s"`
	RetryAfterS     float64 `json:"retry_after_s"`
}

// DefaultStore is off; the sizes are what one PD's share of a small
// fleet's Store would be.
func DefaultStore() Store {
	return Store{Protocol: "tcp", SegmentBytes: 512 << 20, LocalBufferBytes: 16 << 20,
		PutInflightBytes: 256 << 20, GetStagingBytes: 256 << 20, MaxGets: 4,
		GetTimeoutS: 2, PutTimeoutS: 10, RetryAfterS: 5}
}

// DecodeStore decodes and validates the store settings.
func DecodeStore(raw []byte) (Store, error) { return decodeOver("store", DefaultStore(), raw) }

// Validate checks every field; an enabled tier needs its master and its
// metadata service.
func (s Store) Validate() error {
	errs := []error{
		storeEndpoint("master_address", s.MasterAddress),
		storeMetadata(s.MetadataAddress),
		optionalHost("local_hostname", s.LocalHostname),
		oneOf("mooncake_protocol", s.Protocol, MooncakeProtocols),
		inRange("segment_bytes", s.SegmentBytes),
		inRange("local_buffer_bytes", s.LocalBufferBytes),
		inRange("put_inflight_bytes", s.PutInflightBytes),
		inRange("put_rate_bytes_s", s.PutRateBytesS),
		inRange("get_staging_bytes", s.GetStagingBytes),
		inRange("max_gets", s.MaxGets),
		secondsIn("get_timeout_s", s.GetTimeoutS),
		secondsIn("put_timeout_s", s.PutTimeoutS),
		secondsIn("retry_after_s", s.RetryAfterS),
	}
	if s.Enabled && (s.MasterAddress == "" || s.MetadataAddress == "" || s.LocalHostname == "") {
		errs = append(errs, fmt.Errorf("%w: store enabled without master_address, metadata_address and local_hostname; name mooncake_master's host:port, its metadata service and this host's address", ErrInvalid))
	}
	return first(errs...)
}

// storeEndpoint checks an optional host:port the client dials (a port
// of 0 cannot be dialed).
func storeEndpoint(key, v string) error {
	if err := hostPort(key, v); err != nil || v == "" {
		return err
	}
	if h, p, _ := net.SplitHostPort(v); h == "" || p == "0" {
		return fmt.Errorf("%w: %s = %q; want host:port with a host and a port above 0", ErrInvalid, key, v)
	}
	return nil
}

func storeMetadata(v string) error {
	if err := MooncakeMetadata(v); err != nil {
		return fmt.Errorf("metadata_address: %w", err)
	}
	return nil
}
