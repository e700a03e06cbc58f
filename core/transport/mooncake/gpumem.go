package mooncake

import (
	"debug/elf"
	"fmt"
	"path/filepath"
	"strings"
)

// linksCUDARuntime reports whether the engine library at path is a CUDA build,
// which is what lets it register GPU memory: Mooncake's CUDA wheels
// (mooncake-transfer-engine, -cuda13) link the CUDA runtime, the non-CUDA
// wheel does not, and a non-CUDA build handed a device address would read
// it as host memory. why says what was found, for logs and errors.
func linksCUDARuntime(path string) (ok bool, why string) {
	if path == "" || !filepath.IsAbs(path) && !strings.Contains(path, "/") {
		return false, fmt.Sprintf("%s is found by the loader's search path; name it by its path to let its build be read", displayName(path))
	}
	f, err := elf.Open(path)
	if err != nil {
		return false, fmt.Sprintf("cannot read %s: %v", path, err)
	}
	defer f.Close()
	libs, err := f.ImportedLibraries()
	if err != nil {
		return false, fmt.Sprintf("cannot read the libraries %s needs: %v", path, err)
	}
	for _, l := range libs {
		if strings.HasPrefix(l, "libcudart") {
			return true, fmt.Sprintf("%s links %s", path, l)
		}
	}
	return false, fmt.Sprintf("%s links no CUDA runtime (a non-CUDA build)", path)
}

func displayName(path string) string {
	if path == "" {
		return DefaultLibrary
	}
	return path
}

// gpuSupport decides whether the engine registers GPU memory: Config's
// GPUMemory when set, else what the engine library's build says.
func gpuSupport(cfg Config) (bool, string) {
	if cfg.GPUMemory != nil {
		if *cfg.GPUMemory {
			return true, "mooncake GPU memory set on"
		}
		return false, "mooncake GPU memory set off"
	}
	lib := cfg.Engine
	if lib == "" {
		lib = cfg.Library
	}
	return linksCUDARuntime(lib)
}

// RegistersGPU reports whether this transport's engine registers GPU
// memory, and so whether its writer takes device sources itself (through
// a registered staging slab on their GPU) or the producer must stage them
// in host memory first; why says how that was decided.
func (t *Transport) RegistersGPU() (ok bool, why string) { return t.gpu, t.gpuWhy }
