package config

import (
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"
)

var update = flag.Bool("update", false, "rewrite "+SchemaFile+" from Schema()")

func decoderOf(object string) func([]byte) error {
	return map[string]func([]byte) error{"consumer": consumer, "producer": producer, "scheduler": scheduler, "runtime": runtime, "store": store}[object]
}

func schema(t *testing.T) []Setting {
	t.Helper()
	s, err := Schema()
	require.NoError(t, err, "every JSON field needs an entry in specs")
	return s
}

// The schema and the structs must not drift: every JSON field of every
// object is listed, and no spec is left unused.
func TestSchemaCoversEveryFieldAndNothingElse(t *testing.T) {
	used := map[string]bool{}
	perObject := map[string]int{}
	for _, s := range schema(t) {
		used[s.Key] = true
		perObject[s.Object]++
		require.NotEmpty(t, s.Help, s.Key)
		require.Contains(t, []string{KindInt, KindSeconds, KindEnum, KindHost, KindText, KindPath, KindSecret, KindBool, KindList, KindMap, KindRemoved}, s.Kind, s.Key)
	}
	for k := range specs {
		require.True(t, used[k], "spec %q names no field of any object", k)
	}
	for _, o := range []string{"consumer", "producer", "scheduler", "runtime", "store"} {
		require.Positive(t, perObject[o], o)
	}
}

// Decoding the schema's defaults explicitly gives the same object as
// decoding nothing: the defaults listed are the defaults applied.
func TestSchemaDefaultsAreTheDecodedDefaults(t *testing.T) {
	byObject := map[string]map[string]any{}
	for _, s := range schema(t) {
		if s.Kind == KindRemoved {
			require.Equal(t, "", s.Default, s.Key)
			continue
		}
		if byObject[s.Object] == nil {
			byObject[s.Object] = map[string]any{}
		}
		byObject[s.Object][s.Key] = s.Default
	}
	raw := func(o string) []byte { b, err := json.Marshal(byObject[o]); require.NoError(t, err); return b }
	c, err := DecodeConsumer(raw("consumer"))
	require.NoError(t, err)
	want := DefaultConsumer()
	want.StagingBytes = DefaultStagingBytes // the schema lists effective defaults
	require.Equal(t, want, c)
	p, err := DecodeProducer(raw("producer"))
	require.NoError(t, err)
	wantP := DefaultProducer()
	wantP.StagingBytes, wantP.LocalTransport, wantP.TransportOverrides = DefaultStagingBytes, DefaultLocalTransport, map[string]string{}
	require.Equal(t, wantP, p)
	s, err := DecodeScheduler(raw("scheduler"))
	require.NoError(t, err)
	wantS := DefaultScheduler()
	wantS.Shards = []string{}
	require.Equal(t, wantS, s)
	r, err := DecodeRuntime(raw("runtime"))
	require.NoError(t, err)
	require.Equal(t, DefaultRuntime(), r)
	st, err := DecodeStore(raw("store"))
	require.NoError(t, err)
	require.Equal(t, DefaultStore(), st)
}

// Every bound the schema lists is the bound Validate enforces: the bound
// itself is accepted and one step beyond it is refused with an error that
// names the key, for every object that takes the key.
func TestSchemaBoundsAreTheValidatedBounds(t *testing.T) {
	checked := 0
	for _, s := range schema(t) {
		decode := decoderOf(s.Object)
		doc := func(v any) []byte {
			m := map[string]any{s.Key: v}
			if s.Object == "consumer" && s.Key == "transport" && v == "shm" {
				m["slab_fd"] = 3 // shm needs its slab's descriptor
			}
			b, err := json.Marshal(m)
			require.NoError(t, err)
			return b
		}
		accept := func(v any) {
			require.NoError(t, decode(doc(v)), "%s %s = %v is within the schema's bounds", s.Object, s.Key, v)
		}
		refuse := func(v any) {
			err := decode(doc(v))
			require.ErrorIs(t, err, ErrInvalid, "%s %s = %v is outside the schema's bounds", s.Object, s.Key, v)
			require.Contains(t, err.Error(), s.Key)
		}
		switch s.Kind {
		case KindInt:
			if s.Min != nil {
				accept(int64(*s.Min))
				refuse(int64(*s.Min) - 1)
				checked++
			}
			if s.Max != nil {
				accept(int64(*s.Max))
				refuse(int64(*s.Max) + 1)
				checked++
			}
		case KindSeconds:
			require.Equal(t, 0.0, *s.Min)
			require.LessOrEqual(t, *s.Max, float64(MaxSeconds))
			refuse(0)
			refuse(-1)
			accept(0.001)
			accept(*s.Max)
			refuse(*s.Max * 1.001)
			checked++
		case KindEnum:
			require.NotEmpty(t, s.Choices, s.Key)
			for _, c := range s.Choices {
				accept(c)
			}
			refuse("no-such-" + s.Key)
			checked++
		case KindHost:
			accept("127.0.0.1")
			accept("::1")
			refuse("a b")
			if s.Default == "" {
				accept("")
			} else {
				refuse("")
			}
			checked++
		case KindRemoved:
			refuse("anything")
		}
	}
	require.Greater(t, checked, 30, "the bounds of most settings are checked")
}

func TestSchemaFileIsCurrent(t *testing.T) {
	want, err := SchemaJSON()
	require.NoError(t, err)
	path := filepath.Join("..", "..", filepath.FromSlash(SchemaFile))
	if *update {
		require.NoError(t, os.WriteFile(path, want, 0o644))
	}
	got, err := os.ReadFile(path)
	require.NoError(t, err)
	require.Equal(t, string(want), string(got), "%s is stale: run `go generate ./core/config`", SchemaFile)
}

func TestSchemaJSONRoundTrips(t *testing.T) {
	b, err := SchemaJSON()
	require.NoError(t, err)
	var doc struct {
		Version  int       `json:"version"`
		Settings []Setting `json:"settings"`
		Secret   struct {
			MinLen      int `json:"min_len"`
			MinDistinct int `json:"min_distinct"`
		} `json:"secret"`
	}
	require.NoError(t, json.Unmarshal(b, &doc))
	require.Equal(t, SchemaVersion, doc.Version)
	require.Len(t, doc.Settings, len(schema(t)))
	require.Equal(t, MinSecretLen, doc.Secret.MinLen)
	require.Equal(t, MinSecretDistinct, doc.Secret.MinDistinct)
	want, err := json.Marshal(schema(t))
	require.NoError(t, err)
	got, err := json.Marshal(doc.Settings)
	require.NoError(t, err)
	require.JSONEq(t, string(want), string(got))
}
