package gotests

import (
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// TestEveryPackageHasDocGo keeps the house rule that each package says
// what it is for in a doc.go of its own, where a newcomer looks first,
// rather than atop whichever file happens to be first.
func TestEveryPackageHasDocGo(t *testing.T) {
	root, err := filepath.Abs(filepath.Join("..", ".."))
	require.NoError(t, err)
	var missing []string
	for _, top := range []string{"core", "capi", "export", "tests/go"} {
		err := filepath.WalkDir(filepath.Join(root, top), func(p string, d fs.DirEntry, err error) error {
			if err != nil {
				return err
			}
			if !d.IsDir() {
				return nil
			}
			if d.Name() == "testdata" {
				return filepath.SkipDir
			}
			entries, err := os.ReadDir(p)
			if err != nil {
				return err
			}
			hasGo, hasDoc := false, false
			for _, e := range entries {
				n := e.Name()
				if strings.HasSuffix(n, ".go") && !strings.HasSuffix(n, "_test.go") {
					hasGo = true
					hasDoc = hasDoc || n == "doc.go"
				}
			}
			if hasGo && !hasDoc {
				rel, _ := filepath.Rel(root, p)
				missing = append(missing, rel)
			}
			return nil
		})
		require.NoError(t, err)
	}
	sort.Strings(missing)
	require.Empty(t, missing, "packages without a doc.go")
}
