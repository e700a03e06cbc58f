package transport

import (
	"go/parser"
	"go/token"
	"io/fs"
	"path"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const module = "github.com/ecmooncake/ecmooncake/"

// planes are the data planes: each lives in its own folder and reaches
// the others only through the root's interfaces, so that changing one
// touches that folder alone.
var planes = []string{"core/transport/tcp", "core/transport/shm", "core/transport/cudaipc", "core/transport/mooncake"}

// imports lists, for every package under dir, the packages its non-test
// files import, those of this module by path inside the module. It parses
// import clauses only, so it sees what the build sees without building.
func imports(t *testing.T, dir string) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() && d.Name() == "testdata" {
			return filepath.SkipDir
		}
		if d.IsDir() || !strings.HasSuffix(p, ".go") || strings.HasSuffix(p, "_test.go") {
			return nil
		}
		f, err := parser.ParseFile(token.NewFileSet(), p, nil, parser.ImportsOnly)
		if err != nil {
			return err
		}
		pkg := path.Join("core/transport", filepath.ToSlash(filepath.Dir(p)))
		for _, is := range f.Imports {
			ip, err := strconv.Unquote(is.Path.Value)
			if err != nil {
				return err
			}
			out[pkg] = append(out[pkg], strings.TrimPrefix(ip, module))
		}
		return nil
	})
	require.NoError(t, err)
	return out
}

func under(p, dir string) bool { return p == dir || strings.HasPrefix(p, dir+"/") }

// layoutViolations checks the import rules of core/transport's folders:
//   - no package imports one of its ancestors, save the root, whose
//     interfaces are the contract every plane implements;
//   - the root imports nothing under it but internal/ packages, and no
//     networking package: sockets belong to the planes, so a helper that
//     the planes would reach back up for cannot grow there again;
//   - an internal/ package (what the planes and the root share: the
//     accept loop, the connection set) imports nothing under
//     core/transport, so sharing it never reaches back up;
//   - a plane imports no other plane and nothing that composes planes.
func layoutViolations(deps map[string][]string) []string {
	var bad []string
	for pkg, ims := range deps {
		for _, ip := range ims {
			if pkg == "core/transport" && (under(ip, "net") || ip == "syscall" || ip == "golang.org/x/sys/unix") {
				bad = append(bad, pkg+" (the interfaces) imports "+ip)
			}
			if !under(ip, "core/transport") {
				continue
			}
			switch {
			case ip != "core/transport" && under(pkg, ip) && pkg != ip:
				bad = append(bad, pkg+" imports its ancestor "+ip)
			case pkg == "core/transport" && !under(ip, "core/transport/internal"):
				bad = append(bad, pkg+" (the interfaces) imports "+ip)
			case strings.Contains(pkg+"/", "core/transport/internal/") && !under(ip, pkg):
				bad = append(bad, pkg+" (shared by every plane) imports "+ip)
			}
			for _, p := range planes {
				if under(pkg, p) && ip != "core/transport" && !under(ip, p) && !strings.Contains(ip+"/", "/internal/") && ip != "core/transport/transporttest" {
					bad = append(bad, pkg+" (a plane) imports "+ip)
				}
			}
		}
	}
	sort.Strings(bad)
	return bad
}

func TestLayoutNoUpwardImports(t *testing.T) {
	deps := imports(t, ".")
	require.Empty(t, layoutViolations(deps))
	for _, p := range planes {
		_, found := deps[p]
		require.True(t, found, "the walk found plane %s", p)
	}
}

// TestLayoutRulesCatch feeds the rules the imports that the tree had
// before the TCP plane left the root, and others, to show each is caught.
func TestLayoutRulesCatch(t *testing.T) {
	cases := map[string][]string{
		"core/transport/mooncake/internal/dl": {"core/transport/mooncake"},
		"core/transport":                      {"core/transport/tcp"},
		"core/transport/internal/serve":       {"core/transport"},
		"core/transport/shm":                  {"core/transport/tcp"},
		"core/transport/cudaipc":              {"core/transport/route"},
	}
	for pkg, ims := range cases {
		require.Len(t, layoutViolations(map[string][]string{pkg: ims}), 1, "%s importing %v", pkg, ims)
	}
	require.Len(t, layoutViolations(map[string][]string{"core/transport": {"net"}}), 1, "the accept loop back in the root")
	ok := map[string][]string{
		"core/transport/tcp":      {"core/transport", "core/transport/internal/serve", "core/ids"},
		"core/transport/mooncake": {"core/transport", "core/transport/mooncake/internal/dl"},
		"core/transport/route":    {"core/transport", "core/transport/shm", "core/transport/cudaipc"},
	}
	require.Empty(t, layoutViolations(ok))
}
