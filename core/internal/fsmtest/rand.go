package fsmtest

// ByteSource feeds math/rand from fuzz input, so that the fuzzer's bytes
// choose every call of a random model; exhausted, it yields zeros.
type ByteSource struct {
	B []byte
	i int
}

// Int63 takes the next eight bytes.
func (s *ByteSource) Int63() int64 {
	var v uint64
	for k := 0; k < 8; k++ {
		v <<= 8
		if s.i < len(s.B) {
			v |= uint64(s.B[s.i])
			s.i++
		}
	}
	return int64(v >> 1)
}

// Seed is a no-op: the input is the seed.
func (s *ByteSource) Seed(int64) {}
