"""The EPD proxy and consumer discovery, driven through the library.

:class:`Proxy` runs the Go proxy in this process, :class:`Registrar` keeps
an instance registered with proxies; both serve in the background until
closed. Their command lines (``python -m ecmooncake proxy``, ``register``
and the ``ecmooncake-proxy`` script) are :mod:`ecmooncake.tools.proxy`.
"""

from __future__ import annotations

from .native import _encode, _Handle


class Proxy(_Handle):
    """A running EPD proxy; serves in the background until :meth:`close`."""

    kind = "proxy"

    def __init__(self, config: dict | str):
        super().__init__()
        self._open("ecm_proxy_open", _encode(config, "proxy config"))

    @property
    def address(self) -> str:
        """host:port the proxy listens on."""
        return self.stats()["addr"]

    def backends(self) -> dict:
        return self.stats()["backends"]


class Registrar(_Handle):
    """Keeps one instance registered with proxies until :meth:`close`."""

    kind = "registrar"

    def __init__(self, config: dict | str):
        super().__init__()
        self._open("ecm_registrar_open", _encode(config, "registrar config"))


def metrics_text() -> str:
    """This process's metrics in the Prometheus text format."""
    from . import _ffi
    from ctypes import byref, c_void_p

    dll = _ffi.lib()
    out, err = c_void_p(), c_void_p()
    rc = dll.ecm_metrics_text(byref(out), byref(err))
    message = _ffi.take_string(dll, err)
    text = _ffi.take_string(dll, out)
    if rc != _ffi.ECM_OK:
        from .errors import error_for

        raise error_for(rc, f"ecm_metrics_text: {message}")
    return text or ""


__all__ = ["Proxy", "Registrar", "metrics_text"]
