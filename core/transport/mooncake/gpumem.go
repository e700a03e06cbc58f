package mooncake

// gpuSupport decides whether the engine registers GPU memory: Config's
// GPUMemory when set, else whether the loaded engine is a CUDA build (it
// resolves the CUDA runtime, see load): a non-CUDA build handed a device
// address would read it as host memory. why says how it was decided, for
// logs and errors.
func gpuSupport(cfg Config, lib *library) (ok bool, why string) {
	switch {
	case cfg.GPUMemory != nil && *cfg.GPUMemory:
		return true, "mooncake GPU memory set on"
	case cfg.GPUMemory != nil:
		return false, "mooncake GPU memory set off"
	case lib.cuda:
		return true, lib.describe() + " is a CUDA build (it resolves " + cudaSymbol + ")"
	}
	return false, lib.describe() + " is no CUDA build (it does not resolve " + cudaSymbol + ")"
}

// RegistersGPU reports whether this transport's engine registers GPU
// memory, and so whether its writer takes device sources itself (through
// a registered staging slab on their GPU) or the producer must stage them
// in host memory first; why says how that was decided.
func (t *Transport) RegistersGPU() (ok bool, why string) { return t.gpu, t.gpuWhy }
