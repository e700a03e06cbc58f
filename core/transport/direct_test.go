package transport

import (
	"math"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestPlaceInSlab(t *testing.T) {
	const base, size = 0x10000, 4096
	src := make([]byte, 16)
	for _, tc := range []struct {
		name string
		it   WriteItem
		off  uint64
		want error
	}{
		{"start of the slab", WriteItem{Src: src, Addr: base, Size: 16}, 0, nil},
		{"an offset into the region", WriteItem{Src: src[:8], Addr: base + 256, Size: 16, Off: 8}, 264, nil},
		{"the slab's last bytes", WriteItem{Src: src, Addr: base + size - 16, Size: 16}, size - 16, nil},
		{"past the region", WriteItem{Src: src, Addr: base, Size: 8}, 0, ErrWriteBounds},
		{"offset past the region", WriteItem{Src: src[:1], Addr: base, Size: 16, Off: 17}, 0, ErrWriteBounds},
		{"offset that wraps", WriteItem{Src: src, Addr: base, Size: 16, Off: math.MaxUint64}, 0, ErrWriteBounds},
		{"before the slab", WriteItem{Src: src, Addr: base - 16, Size: 16}, 0, ErrStaleAddr},
		{"region past the slab", WriteItem{Src: src, Addr: base + size - 8, Size: 16}, 0, ErrStaleAddr},
		{"region far past the slab", WriteItem{Src: src, Addr: math.MaxUint64 - 4, Size: 16}, 0, ErrStaleAddr},
		{"region larger than the slab", WriteItem{Src: src, Addr: base, Size: math.MaxUint64}, 0, ErrStaleAddr},
	} {
		t.Run(tc.name, func(t *testing.T) {
			off, err := PlaceInSlab(tc.it, base, size, "shard")
			if tc.want != nil {
				require.ErrorIs(t, err, tc.want)
				return
			}
			require.NoError(t, err)
			require.Equal(t, tc.off, off)
		})
	}
	_, err := PlaceInSlab(WriteItem{Src: src, Addr: base - 16, Size: 16}, base, size, "consumer")
	require.ErrorContains(t, err, "outside the consumer's 4096-byte slab")
}
