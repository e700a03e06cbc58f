package capi

import (
	"bytes"
	"encoding/json"
	"errors"
	"log/slog"
	"net"
	"strconv"
	"strings"

	"github.com/ecmooncake/ecmooncake/core/metadata"
	"github.com/ecmooncake/ecmooncake/core/transport/mooncake"
)

// MooncakeInfo says whether the TransferEngine library in {"library": path}
// (empty: the loader's search path), with {"engine": path} a Mooncake
// wheel's engine.so carried by the shim that library then is, loads and
// has every function the transport calls; a library that does not is an
// answer, not an error.
func MooncakeInfo(raw []byte) ([]byte, error) {
	setup()
	var in struct {
		Library string `json:"library"`
		Engine  string `json:"engine"`
	}
	if err := unmarshal("mooncake_info", raw, &in); err != nil {
		return nil, err
	}
	return marshal(mooncake.Probe(in.Library, in.Engine))
}

// metadata server --------------------------------------------------------------

var metadataServers = &kind[*metadata.Server]{"metadata server", func(s *metadata.Server) any { return s.Stats() }}

type metadataIn struct {
	Host          string `json:"host"`
	Port          int    `json:"port"`
	Token         string `json:"token"`
	Open          bool   `json:"open"`
	MaxKeys       int    `json:"max_keys"`
	MaxValueBytes int    `json:"max_value_bytes"`
	MaxTotalBytes int64  `json:"max_total_bytes"`
	MaxConns      int    `json:"max_conns"`
	MaxConnsPeer  int    `json:"max_conns_per_peer"`
}

// MetadataServerOpen serves a Mooncake-compatible metadata store until the
// handle is closed. config: {"host": "127.0.0.1", "port": 8080, "token":
// "", "open": false, "max_keys", "max_value_bytes", "max_total_bytes",
// "max_conns", "max_conns_per_peer"}: a
// token is required unless open is true; loopback unless
// the caller names another address, since the store tells engines where
// to write.
func MetadataServerOpen(raw []byte) (uint64, error) {
	setup()
	in := metadataIn{Host: "127.0.0.1", Port: 8080}
	if len(bytes.TrimSpace(raw)) > 0 {
		dec := json.NewDecoder(bytes.NewReader(raw))
		dec.DisallowUnknownFields()
		if err := dec.Decode(&in); err != nil {
			return 0, statusErr(StatusInvalid, "metadata server config: %v (keys: host, port, token, open, max_keys, max_value_bytes, max_total_bytes, max_conns, max_conns_per_peer)", err)
		}
	}
	if in.Port < 0 || in.Port > 65535 {
		return 0, statusErr(StatusInvalid, "metadata server: port = %d; want a TCP port in [0, 65535] (0 picks a free one)", in.Port)
	}
	if in.Host == "" || strings.ContainsAny(in.Host, " /?#") {
		return 0, statusErr(StatusInvalid, "metadata server: host = %q; want an IP address or a hostname", in.Host)
	}
	s, err := metadata.Listen(metadata.Config{
		Addr: net.JoinHostPort(in.Host, strconv.Itoa(in.Port)), Token: in.Token, Open: in.Open, Logger: slog.Default(),
		MaxKeys: in.MaxKeys, MaxValueBytes: in.MaxValueBytes, MaxTotalBytes: in.MaxTotalBytes,
		MaxConns: in.MaxConns, MaxConnsPerPeer: in.MaxConnsPeer,
	})
	if errors.Is(err, metadata.ErrInvalid) {
		return 0, statusErr(StatusInvalid, "metadata server: %v", err)
	}
	if err != nil {
		return 0, statusErr(StatusIO, "%v", err)
	}
	return metadataServers.add(s), nil
}
