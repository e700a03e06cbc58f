package node

import (
	"go/parser"
	"go/token"
	"io/fs"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const module = "github.com/ecmooncake/ecmooncake/"

// producerSide are the folders (under core/) and this package's files
// that build or serve the producer role, or choose its data plane. None
// may import core/consumer: what both roles need (the host identity, the
// engine construction) lives in core/ids and core/node, so the producer
// never links the consumer shard in.
var producerSide = []string{"producer", "fsm/push", "transport", "node/producer.go", "node/mooncake.go"}

// fileImports lists, for every non-test Go file under root's entries
// (a folder, walked, or one file), the imports its clause names, those of
// this module by path inside the module.
func fileImports(t *testing.T, root string, entries []string) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	add := func(p string) error {
		f, err := parser.ParseFile(token.NewFileSet(), p, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		rel, err := filepath.Rel(root, p)
		if err != nil {
			return err
		}
		key := "core/" + filepath.ToSlash(rel)
		out[key] = []string{}
		for _, is := range f.Imports {
			ip, err := strconv.Unquote(is.Path.Value)
			if err != nil {
				return err
			}
			out[key] = append(out[key], strings.TrimPrefix(ip, module))
		}
		return nil
	}
	for _, e := range entries {
		err := filepath.WalkDir(filepath.Join(root, e), func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if d.IsDir() && d.Name() == "testdata" {
				return filepath.SkipDir
			}
			if d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
				return nil
			}
			return add(p)
		})
		require.NoError(t, err, e)
	}
	return out
}

// consumerImports names each file that imports core/consumer or a
// package under it.
func consumerImports(deps map[string][]string) []string {
	var bad []string
	for file, ims := range deps {
		for _, ip := range ims {
			if ip == "core/consumer" || strings.HasPrefix(ip, "core/consumer/") {
				bad = append(bad, file+" imports "+ip)
			}
		}
	}
	sort.Strings(bad)
	return bad
}

func TestLayoutProducerSideImportsNoConsumer(t *testing.T) {
	deps := fileImports(t, "..", producerSide)
	require.Empty(t, consumerImports(deps))
	for _, f := range []string{"core/node/producer.go", "core/node/mooncake.go", "core/producer/driver.go", "core/fsm/push/manager.go", "core/transport/route/route.go"} {
		_, found := deps[f]
		require.True(t, found, "the walk found %s", f)
	}
}

// TestLayoutConsumerRuleCatches feeds the rule the import the producer
// side had while the host identity lived in core/consumer.
func TestLayoutConsumerRuleCatches(t *testing.T) {
	require.Len(t, consumerImports(map[string][]string{"core/node/producer.go": {"core/config", "core/consumer"}}), 1)
	require.Len(t, consumerImports(map[string][]string{"core/producer/x.go": {"core/consumer/internal/y"}}), 1)
	require.Empty(t, consumerImports(map[string][]string{"core/node/producer.go": {"core/ids", "core/consumers"}}))
}
