package mooncake

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// SupportedWheels are the versions of the Mooncake pip wheels
// (mooncake-transfer-engine, -non-cuda) whose engine.so the shim's
// declarations match; the shim keeps the same list and refuses others.
var SupportedWheels = []string{"0.3.12.post1"}

// WheelVersion is the version of the installed Mooncake wheel that owns
// engine (site-packages/mooncake/engine.so), read from the name of its
// dist-info folder beside the package, as pip writes it.
func WheelVersion(engine string) (string, error) {
	site := filepath.Dir(filepath.Dir(engine))
	infos, err := filepath.Glob(filepath.Join(site, "mooncake_transfer_engine*.dist-info"))
	if err != nil {
		return "", fmt.Errorf("mooncake: look for the wheel of %s: %w", engine, err)
	}
	versions := map[string]string{}
	for _, info := range infos {
		if st, err := os.Stat(info); err != nil || !st.IsDir() {
			continue
		}
		name, version, ok := strings.Cut(strings.TrimSuffix(filepath.Base(info), ".dist-info"), "-")
		if ok && version != "" {
			versions[name] = version
		}
	}
	switch len(versions) {
	case 0:
		return "", fmt.Errorf("mooncake: %s belongs to no installed Mooncake wheel (no mooncake_transfer_engine*.dist-info in %s): pip install mooncake-transfer-engine-non-cuda==%s",
			engine, site, SupportedWheels[0])
	case 1:
		for _, v := range versions {
			return v, nil
		}
	}
	var names []string
	for n, v := range versions {
		names = append(names, n+" "+v)
	}
	sort.Strings(names)
	return "", fmt.Errorf("mooncake: more than one Mooncake wheel in %s (%s) share mooncake/engine.so: pip uninstall all but one",
		site, strings.Join(names, ", "))
}
