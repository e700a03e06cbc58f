package mooncake

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// Which wheel versions load is the shim's decision (ecm_mooncake_shim_check,
// CheckWheel): it knows the declarations it carries. The versions below
// are what build/setup.sh installs and CI runs against the real engine.
const (
	// NewestWheel is the newest non-CUDA wheel the shim was checked
	// against: build/setup.sh installs it into python3.
	NewestWheel = "0.3.13.post1"
	// OldestWheel is the oldest version the shim loads: build/setup.sh
	// installs it into a --target folder, and build/test_mooncake_real.sh
	// runs the real-engine tests against both.
	OldestWheel = "0.3.12.post1"
	// InstallHint is the fix where no wheel is installed.
	InstallHint = "pip install mooncake-transfer-engine-non-cuda==" + NewestWheel +
		" (host memory) or mooncake-transfer-engine / mooncake-transfer-engine-cuda13 (CUDA builds, for GPU memory)"
)

// WheelVersion is the version of the installed Mooncake wheel that owns
// engine (site-packages/mooncake/engine.so), read from the name of its
// dist-info folder beside the package, as pip writes it.
func WheelVersion(engine string) (string, error) {
	_, v, err := Wheel(engine)
	return v, err
}

// Wheel is the name (as pip spells the project: dashes) and version of
// the installed Mooncake wheel that owns engine.
func Wheel(engine string) (name, version string, err error) {
	site := filepath.Dir(filepath.Dir(engine))
	infos, err := filepath.Glob(filepath.Join(site, "mooncake_transfer_engine*.dist-info"))
	if err != nil {
		return "", "", fmt.Errorf("mooncake: look for the wheel of %s: %w", engine, err)
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
		return "", "", fmt.Errorf("mooncake: %s belongs to no installed Mooncake wheel (no mooncake_transfer_engine*.dist-info in %s): %s",
			engine, site, InstallHint)
	case 1:
		for n, v := range versions {
			return strings.ReplaceAll(n, "_", "-"), v, nil
		}
	}
	var names []string
	for n, v := range versions {
		names = append(names, n+" "+v)
	}
	sort.Strings(names)
	return "", "", fmt.Errorf("mooncake: more than one Mooncake wheel in %s (%s) share mooncake/engine.so: pip uninstall all but one",
		site, strings.Join(names, ", "))
}
