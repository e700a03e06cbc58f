"""ecmooncake: moves encoder outputs from encode-only vLLM instances to the
prefill/decode instances that need them.

Importing the package does not load libecmooncake.so; the first call that
needs it does (see ``_ffi.lib``), so vLLM can import this package in a process
that forks afterwards.
"""

from .native import (
    Consumer,
    EcmError,
    EcmHandleError,
    EcmInternal,
    EcmInvalid,
    EcmIOError,
    EcmStateError,
    EcmTimeout,
    EcmUnavailable,
    MetadataServer,
    Producer,
    Scheduler,
    buffer_of,
    configure,
    gpu_info,
    memory_of,
    shared_slab,
)

__version__ = "0.1.0"

__all__ = [
    "Consumer",
    "EcmError",
    "EcmHandleError",
    "EcmIOError",
    "EcmInternal",
    "EcmInvalid",
    "EcmStateError",
    "EcmTimeout",
    "EcmUnavailable",
    "MetadataServer",
    "Producer",
    "Scheduler",
    "__version__",
    "buffer_of",
    "configure",
    "gpu_info",
    "memory_of",
    "shared_slab",
]
