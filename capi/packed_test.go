package capi

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"testing"
	"unsafe"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/producer"
)

// packPush is the layout python/ecmooncake/native.py writes.
func packPush(b []byte, p producer.Push) []byte {
	le := binary.LittleEndian
	b = le.AppendUint64(b, p.NBytes)
	for _, s := range []string{p.TransferID, p.MMHash, p.Consumer, p.Meta} {
		b = le.AppendUint32(b, uint32(len(s)))
	}
	return append(append(append(append(b, p.TransferID...), p.MMHash...), p.Consumer...), p.Meta...)
}

func packSource(b []byte, s PackedSource) []byte {
	le := binary.LittleEndian
	b = le.AppendUint64(b, uint64(s.Ptr))
	b = le.AppendUint64(b, s.N)
	b = le.AppendUint64(b, uint64(s.Stream))
	b = le.AppendUint32(b, uint32(s.Device))
	b = le.AppendUint32(b, uint32(len(s.MMHash)))
	return append(b, s.MMHash...)
}

func TestDecodePushesRoundTrips(t *testing.T) {
	want := []producer.Push{
		{TransferID: "t-1", MMHash: "aa", NBytes: 4096, Consumer: "tcp://127.0.0.1:5000", Meta: `{"dtype":"float16","shape":[4,8]}`},
		{TransferID: "t-2 é", MMHash: "bb", NBytes: 1 << 40, Consumer: "tcp://127.0.0.1:5000"},
		{}, // empty strings decode; the producer refuses them with its own reason
	}
	var b []byte
	for _, p := range want {
		b = packPush(b, p)
	}
	got, err := DecodePushes("f", len(want), b)
	require.NoError(t, err)
	require.Equal(t, want, got)

	none, err := DecodePushes("f", 0, nil)
	require.NoError(t, err)
	require.Empty(t, none)
}

func TestDecodeSourcesRoundTrips(t *testing.T) {
	want := []PackedSource{
		{MMHash: "aa", Ptr: 0x7f0000001000, N: 4096, Device: -1},
		{MMHash: "bb", Ptr: 0x7f0000100000, N: 32 << 20, Stream: 0x55aa, Device: 3},
		{MMHash: "cc", Device: -1}, // empty: the producer refuses it with its own reason
	}
	var b []byte
	for _, s := range want {
		b = packSource(b, s)
	}
	got, err := DecodeSources("f", len(want), b)
	require.NoError(t, err)
	require.Equal(t, want, got)
}

func TestPackedRefusals(t *testing.T) {
	one := packPush(nil, producer.Push{TransferID: "t", MMHash: "h", NBytes: 1, Consumer: "c"})
	src := packSource(nil, PackedSource{MMHash: "h", Ptr: 0x1000, N: 16, Device: -1})
	longHash := append([]byte(nil), one...)
	binary.LittleEndian.PutUint32(longHash[12:], 1<<31)
	hugeSrc := append([]byte(nil), src...)
	binary.LittleEndian.PutUint64(hugeSrc[8:], ^uint64(0))
	nullSrc := append([]byte(nil), src...)
	binary.LittleEndian.PutUint64(nullSrc[0:], 0)
	notUTF8 := packPush(nil, producer.Push{TransferID: "\xff\xfe", MMHash: "h", NBytes: 1, Consumer: "c"})
	for name, tc := range map[string]struct {
		sources bool
		n       int
		b       []byte
		want    string
	}{
		"count beyond the bytes":  {n: 2, b: one, want: "2 items need at least 48 bytes, got 27"},
		"lying count":             {n: MaxSources, b: one, want: "items need at least"},
		"truncated head":          {n: 1, b: one[:10], want: "items need at least"},
		"truncated string":        {n: 1, b: one[:len(one)-1], want: "item 0 at byte 26: consumer is 1 bytes, 0 remain"},
		"string past the end":     {n: 1, b: longHash, want: "mm_hash is 2147483648 bytes"},
		"trailing bytes":          {n: 1, b: append(append([]byte(nil), one...), 0), want: "1 bytes after the last item"},
		"second record truncated": {n: 2, b: append(append([]byte(nil), one...), one[:22]...), want: "item 1 at byte 27: record head needs 24 bytes, 22 remain"},
		"not UTF-8":               {n: 1, b: notUTF8, want: "transfer_id is not UTF-8"},
		"too large":               {n: 1, b: make([]byte, MaxPackedBytes+1), want: "at most 67108864 per batch"},
		"source beyond memory":    {sources: true, n: 1, b: hugeSrc, want: "item 0 (h): nbytes = 18446744073709551615"},
		"source NULL":             {sources: true, n: 1, b: nullSrc, want: "item 0 (h) is NULL but its length is 16 bytes"},
		"source truncated":        {sources: true, n: 1, b: src[:len(src)-1], want: "mm_hash is 1 bytes, 0 remain"},
	} {
		var err error
		if tc.sources {
			_, err = DecodeSources("ecm_f", tc.n, tc.b)
		} else {
			_, err = DecodePushes("ecm_f", tc.n, tc.b)
		}
		require.ErrorContains(t, err, tc.want, name)
		require.ErrorContains(t, err, "ecm_f: ", name)
		require.Equal(t, StatusInvalid, Classify(err), name)
	}
}

// FuzzDecodePacked: no input panics, reads out of bounds or sizes an
// allocation beyond its bytes, and whatever decodes packs back to the
// same bytes.
func FuzzDecodePacked(f *testing.F) {
	f.Add(uint16(1), packPush(nil, producer.Push{TransferID: "t", MMHash: "h", NBytes: 7, Consumer: "tcp://127.0.0.1:1", Meta: "{}"}))
	f.Add(uint16(1), packSource(nil, PackedSource{MMHash: "h", Ptr: 0x1000, N: 16, Device: -1}))
	f.Add(uint16(2), append(packPush(nil, producer.Push{TransferID: "a"}), packPush(nil, producer.Push{MMHash: "b"})...))
	f.Add(uint16(3), []byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, n uint16, b []byte) {
		// Compared as bytes: an empty batch (n = 0, no bytes) decodes to
		// no records and packs back to no bytes, nil or not.
		if pushes, err := DecodePushes("f", int(n), b); err == nil {
			var again []byte
			for _, p := range pushes {
				again = packPush(again, p)
			}
			require.True(t, bytes.Equal(b, again), "%x packed back as %x", b, again)
		} else {
			require.Equal(t, StatusInvalid, Classify(err))
		}
		if srcs, err := DecodeSources("f", int(n), b); err == nil {
			var again []byte
			for _, s := range srcs {
				again = packSource(again, s)
			}
			require.True(t, bytes.Equal(b, again), "%x packed back as %x", b, again)
		} else {
			require.Equal(t, StatusInvalid, Classify(err))
		}
	})
}

// The pushes of a batch share their consumer and mostly their meta: the
// decoder hands out one string for each run of equal ones, and still
// checks every one that differs.
func TestDecodePushesSharesRepeatedStrings(t *testing.T) {
	const consumer, meta = "tcp://127.0.0.1:5000", `{"dtype":"uint8","shape":[1,4096]}`
	var b []byte
	for i := range 8 {
		b = packPush(b, producer.Push{TransferID: fmt.Sprint("t-", i), MMHash: fmt.Sprint("h", i), NBytes: 1, Consumer: consumer, Meta: meta})
	}
	got, err := DecodePushes("f", 8, b)
	require.NoError(t, err)
	for _, p := range got {
		require.Equal(t, consumer, p.Consumer)
		require.Equal(t, meta, p.Meta)
		require.Same(t, unsafe.StringData(got[0].Consumer), unsafe.StringData(p.Consumer))
	}
	// Against a batch whose consumers and metas all differ, the first
	// record's two strings are the only ones made.
	var distinct []byte
	for i := range 8 {
		distinct = packPush(distinct, producer.Push{TransferID: fmt.Sprint("t-", i), MMHash: fmt.Sprint("h", i), NBytes: 1,
			Consumer: fmt.Sprint(consumer, i), Meta: fmt.Sprint(meta, i)})
	}
	shared := testing.AllocsPerRun(100, func() { _, _ = DecodePushes("f", 8, b) })
	each := testing.AllocsPerRun(100, func() { _, _ = DecodePushes("f", 8, distinct) })
	require.Equal(t, float64(2*(8-1)), each-shared, "allocations: %v shared, %v distinct", shared, each)

	// A record whose consumer differs from the one before is still checked.
	bad := packPush(packPush(nil, producer.Push{TransferID: "a", MMHash: "h", Consumer: consumer}),
		producer.Push{TransferID: "b", MMHash: "h", Consumer: "tcp://\xff"})
	_, err = DecodePushes("f", 2, bad)
	require.ErrorContains(t, err, "item 1 at byte")
	require.ErrorContains(t, err, "consumer is not UTF-8")
}
