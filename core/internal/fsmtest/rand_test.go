package fsmtest

import (
	"math/rand"
	"testing"

	"github.com/stretchr/testify/require"
)

// countingSource fails the test once a draw would be the limit-th: a
// rejection loop that a source can keep spinning forever is a fuzzing
// process that hangs.
type countingSource struct {
	t     *testing.T
	src   rand.Source
	n     int
	limit int
}

func (c *countingSource) Int63() int64 {
	c.n++
	if c.n >= c.limit {
		c.t.Fatalf("%d draws: the source keeps a rejection loop spinning", c.n)
	}
	return c.src.Int63()
}

func (c *countingSource) Seed(int64) {}

// Exhausted input must not stall math/rand's rejection sampling (Intn,
// Perm, Shuffle of three): every helper finishes in a handful of draws,
// whatever the input.
func TestByteSourceKeepsRejectionSamplingFinite(t *testing.T) {
	for _, in := range [][]byte{nil, {0}, make([]byte, 64), {0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}} {
		cs := &countingSource{t: t, src: &ByteSource{B: in}, limit: 10000}
		rng := rand.New(cs)
		for i := 0; i < 100; i++ {
			rng.Shuffle(3, func(int, int) {})
			_ = rng.Perm(3)
			_ = rng.Intn(3)
			_ = rng.Intn(100)
		}
		require.Less(t, cs.n, cs.limit)
	}
}

// The input still chooses: two inputs that differ in their first byte
// give different draws.
func TestByteSourceFollowsItsInput(t *testing.T) {
	a := rand.New(&ByteSource{B: []byte{1, 2, 3, 4, 5, 6, 7, 8}})
	b := rand.New(&ByteSource{B: []byte{9, 2, 3, 4, 5, 6, 7, 8}})
	require.NotEqual(t, a.Int63(), b.Int63())
	same := rand.New(&ByteSource{B: []byte{1, 2, 3, 4, 5, 6, 7, 8}})
	require.Equal(t, rand.New(&ByteSource{B: []byte{1, 2, 3, 4, 5, 6, 7, 8}}).Int63(), same.Int63())
}
