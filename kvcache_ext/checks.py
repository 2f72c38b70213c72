"""Argument checks shared by every public entry point (docs/errors.md lists what each refuses).

A value is checked where it enters: a policy part when it is constructed, a store operation
when it is called. Every message names the argument, the value received and what is accepted.
Errors follow Python's convention: ``TypeError`` for a value of the wrong type (a string where
a number goes, a bool where an integer goes, a float where a bool goes), ``ValueError`` for a
value of the right type out of range (a negative size, NaN, 1.5 where an integer goes).

Integers: ``int`` and anything with ``__index__`` (NumPy integers); a float with an integral
value (``8.0``) is taken as that integer, any other float is refused. ``bool`` is never an
integer here, nor an integer a bool.

Policy parts are dataclasses: ``check_fields(obj, owner, field=Spec, ...)`` checks the fields
named and stores the normalized values back (``8.0`` becomes ``8``), frozen or not.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import operator
from dataclasses import dataclass

INT32_MAX = 2**31 - 1      # the largest size, budget or position the kernels read (int32)
INT64_MAX = 2**63 - 1


def _shown(value) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return text if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else f"{text} ({type(value).__name__})"


def _with_type(value) -> str:
    text = repr(value)
    return f"{text[:77] + '...' if len(text) > 80 else text} ({type(value).__name__})"


def _is_bool(value) -> bool:
    return isinstance(value, bool) or (type(value).__module__ == "numpy"
                                       and type(value).__name__ in ("bool", "bool_"))


def _big(n) -> str:
    return {INT32_MAX: "2^31 - 1", INT64_MAX: "2^63 - 1"}.get(n, f"{n:g}" if isinstance(n, float) else str(n))


def _range_text(low, high, low_open=False, high_open=False) -> str:
    if low is not None and high is not None:
        return f"in {'(' if low_open else '['}{_big(low)}, {_big(high)}{')' if high_open else ']'}"
    if low is not None:
        return f"{'>' if low_open else '>='} {_big(low)}"
    if high is not None:
        return f"{'<' if high_open else '<='} {_big(high)}"
    return ""


class Spec:
    """What one argument accepts: ``spec(value, label)`` returns the normalized value or raises."""

    def describe(self) -> str:
        raise NotImplementedError

    def __call__(self, value, label: str):
        raise NotImplementedError

    def _type_error(self, value, label):
        return TypeError(f"{label} must be {self.describe()}, got {_with_type(value)}")

    def _value_error(self, value, label):
        return ValueError(f"{label} must be {self.describe()}, got {_shown(value)}")


@dataclass(frozen=True)
class Int(Spec):
    """An integer in [low, high] (``high``: int32's largest by default: sizes the kernels read)."""

    low: int | None = None
    high: int | None = INT32_MAX
    odd: bool = False
    what: str | None = None      # a description instead of the generated one

    def describe(self) -> str:
        if self.what:
            return self.what
        kind = "an odd integer" if self.odd else "an integer"
        bounds = _range_text(self.low, self.high)
        return f"{kind} {bounds}" if bounds else kind

    def __call__(self, value, label):
        if _is_bool(value):
            raise self._type_error(value, label)
        if isinstance(value, float) or (isinstance(value, numbers.Real) and not isinstance(value, numbers.Integral)
                                        and not hasattr(value, "__index__")):
            f = float(value)
            if not math.isfinite(f) or f != int(f):
                raise self._value_error(value, label)
            n = int(f)
        else:
            try:
                n = operator.index(value)
            except TypeError:
                raise self._type_error(value, label) from None
        if (self.low is not None and n < self.low) or (self.high is not None and n > self.high) \
                or (self.odd and n % 2 == 0):
            raise self._value_error(value, label)
        return n


@dataclass(frozen=True)
class Real(Spec):
    """A real number (int or float, not bool) in the range given; NaN is always refused, an
    infinity unless ``allow_inf``."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    allow_inf: bool = False
    what: str | None = None

    def describe(self) -> str:
        if self.what:
            return self.what
        kind = "a number" if self.allow_inf else "a finite number"
        bounds = _range_text(self.low, self.high, self.low_open, self.high_open)
        return f"{kind} {bounds}" if bounds else kind

    def __call__(self, value, label):
        if _is_bool(value) or not isinstance(value, numbers.Real):
            raise self._type_error(value, label)
        f = float(value)
        if math.isnan(f) or (math.isinf(f) and not self.allow_inf):
            raise self._value_error(value, label)
        if self.low is not None and (f < self.low or (self.low_open and f == self.low)):
            raise self._value_error(value, label)
        if self.high is not None and (f > self.high or (self.high_open and f == self.high)):
            raise self._value_error(value, label)
        return f


@dataclass(frozen=True)
class Bool(Spec):
    """True or False (a NumPy bool too); 0 and 1 are refused."""

    def describe(self) -> str:
        return "True or False"

    def __call__(self, value, label):
        if not _is_bool(value):
            raise self._type_error(value, label)
        return bool(value)


@dataclass(frozen=True)
class Choice(Spec):
    """One of the strings in ``choices``."""

    choices: tuple

    def describe(self) -> str:
        return "one of " + ", ".join(repr(c) for c in self.choices)

    def __call__(self, value, label):
        if not isinstance(value, str):
            raise self._type_error(value, label)
        if value not in self.choices:
            raise self._value_error(value, label)
        return value


@dataclass(frozen=True)
class Instance(Spec):
    """An instance of ``cls`` (a class or a tuple of classes), described as ``what``."""

    cls: type | tuple
    what: str

    def describe(self) -> str:
        return self.what

    def __call__(self, value, label):
        if not isinstance(value, self.cls):
            raise self._type_error(value, label)
        return value


@dataclass(frozen=True)
class Optional(Spec):
    """None, or what ``spec`` accepts."""

    spec: Spec

    def describe(self) -> str:
        return f"None or {self.spec.describe()}"

    def __call__(self, value, label):
        if value is None:
            return None
        try:
            return self.spec(value, label)
        except (TypeError, ValueError) as err:   # name None among what is accepted
            shown = _with_type(value) if isinstance(err, TypeError) else _shown(value)
            raise type(err)(f"{label} must be {self.describe()}, got {shown}") from None


def check_fields(obj, owner: str, **specs: Spec) -> None:
    """Checks the fields of the dataclass ``obj`` named in ``specs`` (label: ``"{owner} {name}"``)
    and stores the normalized values back."""
    for name, spec in specs.items():
        value = getattr(obj, name)
        checked = spec(value, f"{owner} {name}")
        if checked is not value and (type(checked) is not type(value) or checked != value):
            object.__setattr__(obj, name, checked)   # frozen dataclasses too


def revalidate(obj) -> None:
    """Runs the checks of a policy part again, and of the parts it holds (a dataclass's
    ``__post_init__``): for a part changed after it was built (``policy.budget = 0``)."""
    if not dataclasses.is_dataclass(obj) or isinstance(obj, type):
        return
    for f in dataclasses.fields(obj):
        revalidate(getattr(obj, f.name, None))
    post_init = getattr(obj, "__post_init__", None)
    if post_init is not None:
        post_init()


# ------------------------------------------------------------------------------ plain calls
def integer(value, label: str, low: int | None = None, high: int | None = INT32_MAX, **kwargs) -> int:
    return Int(low, high, **kwargs)(value, label)


def real(value, label: str, low=None, high=None, **kwargs) -> float:
    return Real(low, high, **kwargs)(value, label)


def boolean(value, label: str) -> bool:
    return Bool()(value, label)


def choice(value, label: str, choices) -> str:
    return Choice(tuple(choices))(value, label)


def check_page_size(value, label: str = "page_size") -> int:
    """The page-size rule of every store, checked where a page size enters (the store, ``patch``,
    ``RaggedCache``): a power of two in [1, ``_C.MAX_PAGE_SIZE``] tokens per page. The bound is
    the extension's own (``ops::kMaxPageSize``, csrc/ops.h), which checks it again in C++."""
    from kvcache_ext import _C
    limit = _C.MAX_PAGE_SIZE
    rule = f"{label} must be a power of two in [1, {limit}] (tokens per page)"
    try:
        size = integer(value, label, 1, limit)
    except (TypeError, ValueError) as err:
        raise type(err)(f"{rule}, got {_shown(value)}") from None
    if size & (size - 1):
        raise ValueError(f"{rule}, got {size}")
    return size


KV_DTYPES = ("int8",)   # what pages may hold besides the model's own dtype


def kv_dtype(value, label: str = "kv_dtype", dtype=None):
    """The pages' element type asked for: None (the K/V dtype itself, ``dtype`` when given and
    equal) or torch.int8 (``"int8"`` or ``torch.int8``: pages quantized per token and head);
    anything else a clear error naming what is accepted."""
    import torch
    if value is None or (dtype is not None and value == dtype):
        return None
    if value in ("int8", torch.int8):
        return torch.int8
    raise (ValueError if isinstance(value, (str, torch.dtype)) else TypeError)(
        f"{label} must be None (pages in the model's dtype) or 'int8' (torch.int8: K and V quantized per "
        f"token and head, one float16 scale each), got {_with_type(value)}")


def store_arguments(batch, heads, head_dim, score_channels, page_size, dtype, device):
    """``RaggedKVStore``'s arguments checked and normalized (the store checks their product)."""
    import torch
    label = "RaggedKVStore {}".format
    batch = integer(batch, label("batch"), 1)
    heads = integer(heads, label("heads"), 1)
    head_dim = integer(head_dim, label("head_dim"), 1, 65536)
    score_channels = integer(score_channels, label("score_channels"), 0, 65536)
    page_size = check_page_size(page_size, label("page_size"))
    if batch * heads > INT32_MAX:
        raise ValueError(f"RaggedKVStore batch * heads must be below 2^31, got {batch} * {heads}")
    if not isinstance(dtype, torch.dtype) or dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"RaggedKVStore dtype must be torch.float32, torch.float16 or torch.bfloat16 "
                        f"(the store holds float32, float16 or bfloat16 K/V), got {_with_type(dtype)}")
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError) as err:
        raise (TypeError if isinstance(err, TypeError) else ValueError)(
            f"RaggedKVStore device must be a torch.device or a device string ('cpu', 'cuda', 'cuda:1'), "
            f"got {_with_type(device)}") from None
    return batch, heads, head_dim, score_channels, page_size, dtype, device


def tensor(value, label: str):
    """``value`` if it is a tensor, else a TypeError naming ``label``."""
    import torch
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{label} must be a tensor, got {_with_type(value)}")
    return value


def as_tensor(value, label: str):
    """A tensor from a tensor, a number or a (nested) list of numbers; a TypeError naming ``label``
    for anything else."""
    import torch
    if isinstance(value, torch.Tensor):
        return value
    try:
        return torch.as_tensor(value)
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise TypeError(f"{label} must be a tensor or a list of numbers, got {_with_type(value)}") from None
