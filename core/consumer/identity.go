package consumer

import (
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"os"
	"time"
)

// A shard names itself twice: by host, so that a producer on the same host
// can choose a same-host data plane, and by epoch, so that a producer can
// tell a restarted shard from the one that granted its reservations.

// HostIdentity is what a shard reports as its host, and what a producer
// compares with it to choose a same-host data plane: the configured name,
// else the host name.
func HostIdentity(configured string) string {
	if configured != "" {
		return configured
	}
	if h, err := os.Hostname(); err == nil {
		return h
	}
	return "unknown"
}

// newEpoch is the start time and 32 random bits: unique across restarts
// even when two incarnations start within the clock's resolution.
func newEpoch() string {
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%x-%s", time.Now().UnixNano(), hex.EncodeToString(b[:]))
}
