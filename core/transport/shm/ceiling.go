package shm

import (
	"fmt"
	"time"
)

// CopyCeiling measures the shm plane's copy without the plane: count items
// of itemBytes copied by parallelCopy, the plane's own copy, from one
// untouched source (zero pages, as a producer that hands over slices of
// one fresh buffer) into distinct destinations touched beforehand, rounds
// times after one warm round. It returns each round's bytes/s; the caller
// keeps the fastest. The copy runs on the caller's GOMAXPROCS, as the
// producer's does.
func CopyCeiling(itemBytes, count, rounds int) ([]float64, error) {
	if itemBytes < 1 || count < 1 || rounds < 1 || itemBytes > (1<<40)/count {
		return nil, fmt.Errorf("shm copy ceiling: %d items of %d bytes, %d rounds: want positive sizes below 1 TiB in all", count, itemBytes, rounds)
	}
	src := make([]byte, itemBytes)
	dst := make([]byte, itemBytes*count)
	for i := range dst {
		dst[i] = 1
	}
	batch := func() time.Duration {
		start := time.Now()
		for i := range count {
			parallelCopy(dst[i*itemBytes:(i+1)*itemBytes], src)
		}
		return time.Since(start)
	}
	batch()
	rates := make([]float64, 0, rounds)
	for range rounds {
		d := batch()
		rates = append(rates, float64(itemBytes*count)/max(d.Seconds(), 1e-9))
	}
	return rates, nil
}
