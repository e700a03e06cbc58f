package mooncake

import (
	"debug/elf"
	"strings"
)

// Availability says whether a TransferEngine library can serve this
// transport, for tools that check a host before anything is configured.
type Availability struct {
	Library   string   `json:"library"`
	Engine    string   `json:"engine,omitempty"`
	Version   string   `json:"version,omitempty"`
	Available bool     `json:"available"`
	Reason    string   `json:"reason,omitempty"`
	Symbols   []string `json:"symbols"`
	// Wheel is what the shim decided about the wheel's version (whether
	// it was checked against it, the warning it loaded with); nil without
	// a wheel or before the shim got to decide.
	Wheel *WheelCheck `json:"wheel,omitempty"`
	// Distribution is the wheel's name (mooncake-transfer-engine-non-cuda,
	// mooncake-transfer-engine, mooncake-transfer-engine-cuda13, ...).
	Distribution string `json:"distribution,omitempty"`
	// CUDA says whether the engine is a CUDA build, which can register GPU
	// memory; CUDARuntime names the libcudart it links, where its file
	// says.
	CUDA        bool   `json:"cuda"`
	CUDARuntime string `json:"cuda_runtime,omitempty"`
	// Etcd says whether the engine has Mooncake's etcd client, which
	// mooncake_metadata etcd://... needs.
	Etcd bool `json:"etcd"`
}

// Probe loads the library at path (empty: DefaultLibrary on the loader's
// search path), and the wheel's engine.so through it when engine is set,
// the way New does, once per process and path, and reports whether it has
// every function the transport calls. It creates no engine.
func Probe(path, engine string) Availability {
	if path == "" {
		path = DefaultLibrary
	}
	out := Availability{Library: path, Engine: engine, Symbols: append([]string(nil), symbols...)}
	if engine != "" {
		out.Distribution, out.Version, _ = Wheel(engine)
	}
	l, err := load(path, engine)
	if err != nil {
		out.Reason = err.Error()
		return out
	}
	out.Available = true
	out.CUDA, out.Etcd = l.cuda, l.etcd
	file := path
	if engine != "" {
		wc := l.wheel
		out.Wheel = &wc
		file = engine
	}
	if strings.Contains(file, "/") {
		out.CUDARuntime = cudaRuntime(file)
	}
	return out
}

// cudaRuntime is the libcudart a library file links (its DT_NEEDED), ""
// for none or an unreadable file.
func cudaRuntime(file string) string {
	f, err := elf.Open(file)
	if err != nil {
		return ""
	}
	defer f.Close()
	libs, err := f.ImportedLibraries()
	if err != nil {
		return ""
	}
	for _, lib := range libs {
		if strings.HasPrefix(lib, "libcudart.so") {
			return lib
		}
	}
	return ""
}
