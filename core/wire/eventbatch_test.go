package wire

import (
	"encoding/binary"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// eventMessages are valid messages of every shape: one record, a batch
// of a flush, every kind, the bounds.
func eventMessages() map[string][]Event {
	batch := make([]Event, 8)
	for i := range batch {
		batch[i] = Event{V: Version, Shard: 1, Seq: 100 + uint64(i), TransferID: fmt.Sprintf("t%d", i), MMHash: fmt.Sprintf("h%d", i),
			Ready: true, NBytes: 4 << 20, SentNS: 1_764_000_000_123_456_789}
	}
	most := make([]Event, MaxEventRecords)
	for i := range most {
		most[i] = Event{V: Version, Shard: 0, Seq: 1 + uint64(i), TransferID: fmt.Sprint(i), MMHash: "h", Ready: true, NBytes: 1}
	}
	long := strings.Repeat("x", MaxIDLen)
	return map[string][]Event{
		"one ready": {{V: Version, Shard: 0, Seq: 1, TransferID: "t1", MMHash: "h1", Ready: true, NBytes: 1 << 20}},
		"a batch":   batch,
		"failed, then gone": {
			{V: Version, Shard: 3, Seq: 42, TransferID: "t2", MMHash: "h2", Reason: "writer abandoned: encoder failed"},
			{V: Version, Kind: EventGone, Shard: 3, Seq: 43, MMHash: "h2", NBytes: 1 << 20, Reason: "evicted"},
		},
		"longest fields": {{V: Version, Shard: 7, Seq: 1<<64 - 1, TransferID: long, MMHash: long, Ready: true, NBytes: 1<<64 - 1,
			Reason: strings.Repeat("r", MaxEventReason), SentNS: 1<<63 - 1}},
		"most records": most,
	}
}

func TestEventMessageRoundTrip(t *testing.T) {
	for name, evs := range eventMessages() {
		t.Run(name, func(t *testing.T) {
			b, err := EncodeEvents(evs)
			require.NoError(t, err)
			size := EventHeaderSize
			for _, ev := range evs {
				size += EventRecordSize(ev)
			}
			require.Len(t, b, size, "EventRecordSize is what a record adds")
			got, err := DecodeEvents(b)
			require.NoError(t, err)
			require.Equal(t, evs, got)
		})
	}
}

// Encoding refuses what decoding would, and decoding refuses it from the
// bytes too (written here without the encoder's checks).
func TestEventMessageRejects(t *testing.T) {
	ok := func() []Event {
		return []Event{
			{V: Version, Shard: 1, Seq: 5, TransferID: "t", MMHash: "h", Ready: true, NBytes: 1},
			{V: Version, Shard: 1, Seq: 6, TransferID: "u", MMHash: "g", Reason: "slab full"},
		}
	}
	long := strings.Repeat("h", MaxIDLen+1)
	for _, tc := range []struct {
		name  string
		edit  func([]Event)
		want  error
		field string
	}{
		{"wrong version", func(e []Event) { e[0].V, e[1].V = 2, 2 }, ErrVersion, "v2"},
		{"negative shard", func(e []Event) { e[0].Shard, e[1].Shard = -1, -1 }, ErrInvalid, "shard"},
		{"zero seq", func(e []Event) { e[0].Seq, e[1].Seq = 0, 1 }, ErrInvalid, "seq"},
		{"no transfer id", func(e []Event) { e[1].TransferID = "" }, ErrInvalid, "transfer_id"},
		{"no mm hash", func(e []Event) { e[0].MMHash = "" }, ErrInvalid, "mm_hash"},
		{"mm hash too long", func(e []Event) { e[0].MMHash = long }, ErrInvalid, "mm_hash"},
		{"reason too long", func(e []Event) { e[1].Reason = strings.Repeat("r", MaxEventReason+1) }, ErrInvalid, "reason"},
		{"ready without size", func(e []Event) { e[0].NBytes = 0 }, ErrInvalid, "nbytes"},
		{"negative send time", func(e []Event) { e[0].SentNS, e[1].SentNS = -1, -1 }, ErrInvalid, "sent_ns"},
		{"gone naming a transfer", func(e []Event) { e[0].Kind, e[0].Ready = EventGone, false }, ErrInvalid, "transfer_id"},
		{"gone and ready", func(e []Event) { e[0].Kind, e[0].TransferID = EventGone, "" }, ErrInvalid, "ready"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			evs := ok()
			tc.edit(evs)
			_, err := EncodeEvents(evs)
			require.ErrorIs(t, err, tc.want, "encoding refuses it")
			_, err = DecodeEvents(appendEvents(nil, evs))
			require.ErrorIs(t, err, tc.want, "decoding refuses it")
			require.Contains(t, err.Error(), tc.field)
		})
	}

	t.Run("records that do not follow", func(t *testing.T) {
		for _, edit := range []func([]Event){
			func(e []Event) { e[1].Seq = 7 },
			func(e []Event) { e[1].Shard = 2 },
			func(e []Event) { e[1].SentNS = 9 },
		} {
			evs := ok()
			edit(evs)
			_, err := EncodeEvents(evs)
			require.ErrorIs(t, err, ErrInvalid)
			require.Contains(t, err.Error(), "does not follow")
		}
	})
	t.Run("record count", func(t *testing.T) {
		_, err := EncodeEvents(nil)
		require.ErrorIs(t, err, ErrInvalid)
		over := make([]Event, MaxEventRecords+1)
		_, err = EncodeEvents(over)
		require.ErrorIs(t, err, ErrInvalid)
	})

	good := appendEvents(nil, ok())
	bytesCase := func(name string, want error, field string, edit func([]byte) []byte) {
		t.Run(name, func(t *testing.T) {
			b := edit(append([]byte(nil), good...))
			_, err := DecodeEvents(b)
			require.ErrorIs(t, err, want)
			require.Contains(t, err.Error(), field)
		})
	}
	bytesCase("empty", ErrMalformed, "header", func(b []byte) []byte { return nil })
	bytesCase("cut in the header", ErrMalformed, "header", func(b []byte) []byte { return b[:EventHeaderSize-1] })
	bytesCase("cut in a record's head", ErrMalformed, "record 1", func(b []byte) []byte { return b[:len(b)-len("ugslab full")-3] })
	bytesCase("cut in a record's strings", ErrMalformed, "record 1", func(b []byte) []byte { return b[:len(b)-1] })
	bytesCase("bytes after the last record", ErrMalformed, "after the last record", func(b []byte) []byte { return append(b, 0) })
	bytesCase("not an event message", ErrMalformed, "tag", func(b []byte) []byte { b[0] = 0x01; return b })
	bytesCase("no records", ErrInvalid, "records", func(b []byte) []byte { binary.BigEndian.PutUint16(b[2:], 0); return b })
	bytesCase("more records than sent", ErrMalformed, "record 2", func(b []byte) []byte { binary.BigEndian.PutUint16(b[2:], 3); return b })
	bytesCase("too many records", ErrInvalid, "records", func(b []byte) []byte { binary.BigEndian.PutUint16(b[2:], MaxEventRecords+1); return b })
	bytesCase("seq runs past its end", ErrInvalid, "seq", func(b []byte) []byte { binary.BigEndian.PutUint64(b[8:], 1<<64-1); return b })
	bytesCase("unknown kind", ErrInvalid, "kind", func(b []byte) []byte { b[EventHeaderSize] = 2; return b })
	bytesCase("unknown flags", ErrInvalid, "flags", func(b []byte) []byte { b[EventHeaderSize+1] = 0x80; return b })
	bytesCase("id length over the bound", ErrInvalid, "transfer_id: length", func(b []byte) []byte {
		binary.BigEndian.PutUint16(b[EventHeaderSize+10:], MaxIDLen+1)
		return b
	})
	bytesCase("too large", ErrTooLarge, "limit", func(b []byte) []byte { return make([]byte, MaxMessage+1) })
}

// A JSON event is what builds before event messages sent: it is refused
// as a version mismatch that says so, never read as something else.
func TestJSONEventIsRefusedAsLegacy(t *testing.T) {
	old := []byte(`{"v":1,"shard":0,"seq":7,"transfer_id":"t","mm_hash":"h","ready":true,"nbytes":9}`)
	_, err := DecodeEvents(old)
	require.ErrorIs(t, err, ErrLegacyEvent)
	require.ErrorIs(t, err, ErrVersion)
	require.Contains(t, err.Error(), "JSON event")
}

func TestCutReason(t *testing.T) {
	require.Equal(t, "short", CutReason("short"))
	exact := strings.Repeat("a", MaxEventReason)
	require.Equal(t, exact, CutReason(exact))
	// A 2-byte rune straddling the bound is left out whole.
	straddle := strings.Repeat("a", MaxEventReason-1) + "é" + "tail"
	got := CutReason(straddle)
	require.Equal(t, strings.Repeat("a", MaxEventReason-1), got)
	ev := Event{V: Version, Seq: 1, TransferID: "t", MMHash: "h", Reason: CutReason(strings.Repeat("é", MaxEventReason))}
	require.NoError(t, ev.Validate())
}
