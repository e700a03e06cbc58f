package transporttest

import (
	"log/slog"
	"math/rand/v2"
)

// Quiet is a logger that drops everything, for transports under test.
func Quiet() *slog.Logger { return slog.New(slog.DiscardHandler) }

// RandBytes returns n reproducible pseudo-random bytes: the same seed
// gives the same bytes.
func RandBytes(seed uint64, n int) []byte {
	b := make([]byte, n)
	r := rand.NewChaCha8([32]byte{byte(seed), byte(seed >> 8), byte(seed >> 16), byte(seed >> 24)})
	_, _ = r.Read(b)
	return b
}
