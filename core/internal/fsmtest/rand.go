package fsmtest

import (
	"fmt"
	"math/rand"
	"testing"
)

// ByteSource feeds math/rand from fuzz input, so that the fuzzer's bytes
// choose every call of a random model. Exhausted, it goes on with a
// splitmix64 sequence seeded by what it read, never a constant: math/rand
// draws again until a value is unbiased (Shuffle, Perm, Intn), and a
// constant it rejects would spin that loop forever, a fuzzing process
// that hangs.
type ByteSource struct {
	B     []byte
	i     int
	state uint64
}

// Int63 takes the next eight bytes, or the next value of the sequence
// once the bytes have run out.
func (s *ByteSource) Int63() int64 {
	if s.i >= len(s.B) {
		s.state += 0x9e3779b97f4a7c15
		z := s.state
		z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
		z = (z ^ (z >> 27)) * 0x94d049bb133111eb
		return int64((z ^ (z >> 31)) >> 1)
	}
	var v uint64
	for k := 0; k < 8; k++ {
		v <<= 8
		if s.i < len(s.B) {
			v |= uint64(s.B[s.i])
			s.i++
		}
	}
	s.state = s.state*31 + v
	return int64(v >> 1)
}

// Seed is a no-op: the input is the seed.
func (s *ByteSource) Seed(int64) {}

// Seeds runs model once for each of the fixed seeds 1 to 8, each a subtest
// with a generator of its own, so that a failure names its seed.
func Seeds(t *testing.T, model func(t *testing.T, rng *rand.Rand)) {
	t.Helper()
	seeds(t, 8, model)
}

// SeedsUnderRace is Seeds, but under the race detector it runs only the
// first n seeds, each at full length. It is for a model whose checks grow
// with the run, so that all eight seeds under -race take minutes on a
// loaded machine: the state machines are single-threaded, the race
// detector has nothing to find in them, and without it every seed runs.
func SeedsUnderRace(t *testing.T, n int, model func(t *testing.T, rng *rand.Rand)) {
	t.Helper()
	if Race {
		seeds(t, int64(n), model)
		return
	}
	seeds(t, 8, model)
}

func seeds(t *testing.T, n int64, model func(t *testing.T, rng *rand.Rand)) {
	t.Helper()
	for seed := int64(1); seed <= n; seed++ {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) {
			model(t, rand.New(rand.NewSource(seed)))
		})
	}
}

// FuzzModel runs model with the fuzzer's bytes choosing every call, so
// that coverage guidance can steer towards rare interleavings: one step a
// two bytes of input, at most 400. name seeds the corpus.
func FuzzModel(f *testing.F, name string, model func(t *testing.T, rng *rand.Rand, steps int)) {
	f.Add([]byte("ecmooncake " + name + " model seed"))
	f.Add(make([]byte, 64))
	f.Fuzz(func(t *testing.T, data []byte) {
		model(t, rand.New(&ByteSource{B: data}), min(len(data)/2, 400))
	})
}
