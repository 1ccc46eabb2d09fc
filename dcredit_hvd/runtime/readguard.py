"""The read guard: no read of a parameter sees it before its overlapped update.

With ``model=``, ``step()`` returns before its updates are applied: each parameter is updated by
the completion thread as soon as its gradient is reduced, while the training thread goes on into
the next forward pass (D-Credit's phase 2, spec §4).  Every read of a parameter whose update is
still owed must therefore wait for that update, wherever the read happens: in the module that
owns it, in a parent that uses a child's weight, in a second module that shares a tied weight,
in the root module's own forward (a position embedding, a class token), in an expert that only
some steps use, or outside the forward (an EMA of the weights, ``parameters_to_vector``, a
logger, ``p.data``).  Waiting in the owning module's forward pre-hook misses most of these.

The rule (``docs/design.md``, "The read guard"): while its update is owed, a parameter's class
is switched to a subclass of its own class whose ``__torch_function__`` waits for the update
before it runs the operation.  Every PyTorch operation, method and attribute that reads a
tensor's values (``F.linear``, ``p.t()``, ``p.data``, ``p.detach()``, ``torch.cat``, the
``_foreach`` kernels, ``copy.deepcopy``) dispatches ``__torch_function__`` on a tensor subclass,
so the first read of each parameter, and only a read of a parameter that is still owed, pays
the wait; the class is switched back the moment the update is applied, and later reads run at
full speed.  Reads of metadata only (shape, dtype, device, ...) never wait.  The thread that
applies the updates reads without waiting (``applying()``).  A parameter held for its values
only (its all-gathered shards landing, ``gathers.py``: its update is done) does not make
``.grad`` wait.

The same mechanism observes, in the first forward pass, the order in which forward first reads
each parameter: the priority order of spec §2 ("the order in which forward first uses them").

Limits, stated in ``docs/troubleshooting.md``: a tensor that aliases a parameter's storage and
was taken before ``step()`` (``alias = p.data`` kept from an earlier iteration) is not the
parameter and is not guarded; code that bypasses ``__torch_function__`` (TorchScript, C++
extensions handed the tensor earlier) is not seen.  Parameters whose class defines its own
``__torch_function__`` cannot be guarded this way; ``hold`` returns them and the optimizer
updates them before ``step()`` returns.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch
from torch._C import DisableTorchFunctionSubclass

_BASE = torch._C.TensorBase

#: Operations that read a tensor's metadata only: they never wait for an update.
_METADATA = frozenset(
    [getattr(_BASE, name).__get__ for name in (
        "shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "layout", "ndim",
        "is_cuda", "is_sparse", "is_meta", "is_quantized", "is_mkldnn", "is_nested", "names")
     if hasattr(_BASE, name)]
    + [getattr(_BASE, name) for name in (
        "size", "dim", "numel", "element_size", "is_contiguous", "stride", "is_complex",
        "is_floating_point", "get_device", "nelement", "ndimension", "storage_offset")
       if hasattr(_BASE, name)])

#: Access to ``.grad`` (read, set, delete): it waits for an owed update (the update reads the
#: gradient), not for values landing in the parameter (``hold(values_only=True)``).
_GRAD = frozenset([_BASE.grad.__get__, _BASE.grad.__set__, _BASE.grad.__delete__])


def _tensors(obj: Any, out: list) -> list:
    """Append the tensors in an operation's arguments to ``out`` (lists for ``torch.cat`` and
    ``_foreach``); a loop, not a generator: it runs on every guarded operation."""
    if isinstance(obj, torch.Tensor):
        out.append(obj)
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            if isinstance(item, torch.Tensor):
                out.append(item)
            elif isinstance(item, (list, tuple, dict)):
                _tensors(item, out)
    elif isinstance(obj, dict):
        _tensors(list(obj.values()), out)
    return out


def guardable(p: torch.Tensor) -> bool:
    """Whether ``p`` can be guarded: a ``Parameter`` (or subclass) whose class keeps
    ``Parameter``'s plain-tensor ``__torch_function__`` (results of its operations are plain
    tensors), which the guard class reproduces exactly."""
    cls = type(p)
    return (isinstance(p, torch.nn.Parameter)
            and cls.__torch_function__ is torch._C._disabled_torch_function_impl)


class ReadGuard:
    """Holds parameters whose update is owed; a read of a held parameter calls ``wait``.

    ``wait(params)`` must block until none of ``params`` owes its update (or raise: then the
    read raises, and the parameter stays held, so no later read sees a stale value either).
    """

    def __init__(self, wait: Callable[[list[torch.Tensor]], None]) -> None:
        self._wait = wait
        self._held: dict[int, torch.Tensor] = {}       # id -> parameter whose update is owed
        self._values_only: set[int] = set()            # held for their values, not .grad
        self._observed: dict[int, torch.Tensor] = {}   # id -> parameter whose first read is awaited
        self._original: dict[int, type] = {}           # id -> the class it had before
        self._classes: dict[type, type] = {}           # original class -> its guard class
        self._lock = threading.Lock()                  # class switches and the maps above
        self._local = threading.local()                # .applying: this thread updates
        self._forward_thread: Optional[int] = None     # the thread inside the model's forward
        self._first_reads: list[torch.Tensor] = []

    # -- owed updates ----------------------------------------------------------------------
    def hold(self, params: Iterable[torch.Tensor], values_only: bool = False) -> list[torch.Tensor]:
        """Guard ``params`` until ``release``; returns those that cannot be guarded.

        ``values_only``: only the parameters' values are owed (all-gathered shards landing,
        ``gathers.py``), their gradients are not read any more, so ``.grad`` is reached without
        waiting: ``zero_grad()`` before the next forward must not wait for every all-gather."""
        refused = []
        with self._lock:
            for p in params:
                if not guardable(p) and id(p) not in self._original:
                    refused.append(p)
                    continue
                self._held[id(p)] = p
                if values_only:
                    self._values_only.add(id(p))
                else:
                    self._values_only.discard(id(p))
                self._switch(p)
        return refused

    def release(self, params: Iterable[torch.Tensor]) -> None:
        """``params`` are updated: reads no longer wait (called under the updater's lock)."""
        with self._lock:
            for p in params:
                if self._held.pop(id(p), None) is not None:
                    self._values_only.discard(id(p))
                    self._restore_if_free(p)

    def release_all(self) -> None:
        with self._lock:
            for p in list(self._held.values()):
                del self._held[id(p)]
                self._restore_if_free(p)
            self._values_only.clear()

    def held(self, p: torch.Tensor) -> bool:
        return id(p) in self._held

    @contextmanager
    def applying(self):
        """The current thread applies updates: its reads of held parameters do not wait."""
        before = getattr(self._local, "applying", False)
        self._local.applying = True
        try:
            yield
        finally:
            self._local.applying = before

    # -- first-read order --------------------------------------------------------------------
    def observe(self, params: Iterable[torch.Tensor]) -> None:
        """Record the order of the first read of each of ``params`` inside the model's forward
        (between ``forward_started`` and ``forward_ended``, in that thread)."""
        with self._lock:
            for p in params:
                if guardable(p) or id(p) in self._original:
                    self._observed[id(p)] = p
                    self._switch(p)

    def forward_started(self) -> None:
        self._forward_thread = threading.get_ident()

    def forward_ended(self) -> None:
        self._forward_thread = None

    def stop_observing(self) -> list[torch.Tensor]:
        """End observation; returns the parameters in the order forward first read them."""
        with self._lock:
            for p in list(self._observed.values()):
                del self._observed[id(p)]
                self._restore_if_free(p)
            order, self._first_reads = self._first_reads, []
        return order

    # -- the check every operation on a guarded parameter runs ------------------------------------
    def before(self, func: Any, args: tuple, kwargs: dict) -> None:
        # The updating thread's own operations (many per update) never wait or observe: it is
        # never inside the model's forward.
        if func in _METADATA or getattr(self._local, "applying", False):
            return
        owed, grad = [], func in _GRAD
        for t in _tensors(args, _tensors(kwargs, []) if kwargs else []):
            key = id(t)
            if key in self._observed and self._forward_thread == threading.get_ident():
                with self._lock:
                    if self._observed.pop(key, None) is not None:
                        self._first_reads.append(t)
                        self._restore_if_free(t)
            if key in self._held and not (grad and key in self._values_only):
                owed.append(t)
        if owed:
            self._wait(owed)

    # -- internals (lock held) -----------------------------------------------------------------
    def _switch(self, p: torch.Tensor) -> None:
        if id(p) in self._original:
            return
        original = type(p)
        self._original[id(p)] = original
        p.__class__ = self._guard_class(original)

    def _restore_if_free(self, p: torch.Tensor) -> None:
        key = id(p)
        if key in self._held or key in self._observed:
            return
        original = self._original.pop(key, None)
        if original is not None:
            p.__class__ = original

    def _guard_class(self, original: type) -> type:
        cls = self._classes.get(original)
        if cls is None:
            guard = self

            def __torch_function__(cls, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                guard.before(func, args, kwargs)
                with DisableTorchFunctionSubclass():
                    return func(*args, **kwargs)

            def __deepcopy__(self, memo):
                # Parameter.__deepcopy__ copies type(self): the copy must be of the user's class.
                if id(self) in memo:
                    return memo[id(self)]
                result = original(self.data.clone(memory_format=torch.preserve_format),
                                  self.requires_grad)
                memo[id(self)] = result
                return result

            cls = type(original.__name__, (original,), {
                "__torch_function__": classmethod(__torch_function__),
                "__deepcopy__": __deepcopy__,
                "__module__": original.__module__,
                "__qualname__": original.__qualname__,
                "_dcredit_guarded": original,
            })
            self._classes[original] = cls
        return cls
