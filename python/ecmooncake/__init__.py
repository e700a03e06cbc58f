"""ecmooncake: moves encoder outputs from encode-only vLLM instances to the
prefill/decode instances that need them.

Importing the package does not load libecmooncake.so; the first call that
needs it does (see ``_ffi.lib``), so vLLM can import this package in a process
that forks afterwards.
"""

from types import ModuleType as _ModuleType

from .buffers import buffer_of, memory_of, shared_slab
from .errors import EcmError, EcmHandleError, EcmInternal, EcmInvalid, EcmIOError, EcmStateError, EcmTimeout, EcmUnavailable
from .native import Consumer, MetadataServer, Producer, Scheduler, configure, gpu_info

__version__ = "0.1.0"

# Everything imported above (not the submodules importing binds).
__all__ = [n for n, v in list(globals().items()) if not n.startswith("_") and not isinstance(v, _ModuleType)] + ["__version__"]
