"""The exceptions a failed library call raises, one per ECM_ERR_* status."""

from __future__ import annotations

from . import _ffi


# Status -> the subclass raised for it, filled as each subclass is defined.
ERRORS: dict[int, type[EcmError]] = {}


class EcmError(RuntimeError):
    """A failed library call; ``code`` is the ECM_ERR_* status."""

    code = _ffi.ECM_ERR_INTERNAL

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code

    def __init_subclass__(cls, *, status: int | None = None, **kwargs: object) -> None:
        # One subclass a status: the class states its status once, and
        # error_for finds it here. A subclass naming none (a caller's own
        # refinement) keeps its parent's code.
        super().__init_subclass__(**kwargs)
        if status is None:
            return
        if status in ERRORS:
            raise TypeError(f"{cls.__name__}: status {status} is already {ERRORS[status].__name__}'s")
        cls.code = status
        ERRORS[status] = cls


class EcmInvalid(EcmError, ValueError, status=_ffi.ECM_ERR_INVALID):
    """A bad argument, config or JSON (ECM_ERR_INVALID)."""


class EcmHandleError(EcmError, status=_ffi.ECM_ERR_HANDLE):
    """An unknown, closed or wrong-kind handle (ECM_ERR_HANDLE)."""


class EcmStateError(EcmError, status=_ffi.ECM_ERR_STATE):
    """The object cannot do that now, as after a fork (ECM_ERR_STATE)."""


class EcmIOError(EcmError, status=_ffi.ECM_ERR_IO):
    """A network or transport failure (ECM_ERR_IO)."""


class EcmTimeout(EcmError, TimeoutError, status=_ffi.ECM_ERR_TIMEOUT):
    """A deadline passed (ECM_ERR_TIMEOUT)."""


class EcmInternal(EcmError, status=_ffi.ECM_ERR_INTERNAL):
    """A recovered panic or a broken invariant: a bug (ECM_ERR_INTERNAL)."""


class EcmUnavailable(EcmError, status=_ffi.ECM_ERR_UNAVAILABLE):
    """A feature this build or host lacks (ECM_ERR_UNAVAILABLE)."""


# Refusals of a reservation that a producer reports by name, at the start
# of a failed push's reason ("reserve refused: over_quota: ..."), as the
# shard names them (core/wire GrantInProgress, GrantOverQuota).
REFUSED_IN_PROGRESS = "in_progress"  # another producer holds this transfer's write grant
REFUSED_OVER_QUOTA = "over_quota"  # this producer holds its share of the shard's reservations
REFUSALS = (REFUSED_IN_PROGRESS, REFUSED_OVER_QUOTA)


def refusal_of(reason: str) -> str | None:
    """The named refusal of a failed push's reason, or None."""
    head = reason.removeprefix("reserve refused: ")
    name, sep, _ = head.partition(":")
    return name if sep and head is not reason and name in REFUSALS else None


def error_for(code: int, message: str) -> EcmError:
    """The EcmError subclass for a status code (plain EcmError if unknown)."""
    cls = ERRORS.get(code)
    if cls is None:
        return EcmError(message, code)
    return cls(message)
