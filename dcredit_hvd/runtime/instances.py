"""The live ``DistributedOptimizer`` instances of this process.

Two things depend on which other optimizers exist (``docs/design.md``, "Several optimizers"):

* **Collective names.**  Horovod refuses a second in-flight all-reduce with a name already in
  flight, and sums whatever two ranks send under one name.  Two optimizers (a GAN's generator
  and discriminator, two parameter groups of one model) may be in flight at once, so every
  name an optimizer issues starts with its own prefix: a digest of its process set and its
  parameters' names and shapes, which every rank computes alike, plus ``.k`` for the k-th
  optimizer created with the same digest (two models with identical names, an optimizer
  rebuilt on the same model).  A creation count, not the live optimizers: which optimizers are
  still alive depends on when each rank's garbage collector ran.  And the count is agreed, the
  largest over the ranks: a rank's process may be younger than the others' (Fabric's script
  launcher starts a fresh rank-1 process for each ``launch()`` while rank 0's process lives on),
  so its own count would be smaller.  The largest is one that no live optimizer of any rank
  uses, and every later creation counts from it.
* **Ownership of parameters.**  An optimizer's hooks fire on every backward for as long as it
  lives.  A new optimizer over parameters that a live one still holds (the user rebound the
  variable, or dropped it while its last updates were in flight) takes them over: the old one
  is closed (``holders``), so no gradient is ever counted twice.
"""
from __future__ import annotations

import hashlib
import weakref
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Any, Callable, NamedTuple, Optional

#: digest -> optimizers created with it so far
_created: Counter[str] = Counter()
#: optimizer -> (prefix, ids of the parameters whose gradients it hooks)
_live: weakref.WeakKeyDictionary[Any, tuple[str, frozenset[int]]] = weakref.WeakKeyDictionary()


class Prefix(NamedTuple):
    """An optimizer's collective-name prefix and the two parts it is made of."""
    digest: str     # ``dcredit.<digest>``: the process set and the parameters' names and shapes
    k: int          # the creation count (0 for the first)

    @property
    def name(self) -> str:
        return self.digest if self.k == 0 else f"{self.digest}.{self.k}"


def prefix_for(process_set_id: Any, described: Sequence[tuple],
               agree: Optional[Callable[[int], list]] = None) -> Prefix:
    """``dcredit.<digest>[.<k>]``: ``described`` holds ``(name, shape)`` of each parameter.
    ``k`` counts the optimizers with this digest that were built (``register``) before, the
    largest over the ranks when ``agree`` (every rank's count, all-gathered) is given; a
    construction that failed (ranks disagreed) counts on no rank."""
    text = repr((process_set_id, tuple(described)))
    digest = "dcredit." + hashlib.sha256(text.encode()).hexdigest()[:10]
    k = _created[digest]
    if agree is not None:
        k = max(agree(k))
    return Prefix(digest, k)


def register(optimizer: Any, prefix: Prefix, params: Iterable[Any]) -> None:
    """``optimizer`` was built under ``prefix``: it hooks ``params``, and its digest's next
    creation counts from the prefix's ``k``."""
    _created[prefix.digest] = max(_created[prefix.digest], prefix.k + 1)
    _live[optimizer] = (prefix.name, frozenset(id(p) for p in params))


def unregister(optimizer: Any) -> None:
    _live.pop(optimizer, None)


def holders(params: Iterable[Any]) -> list:
    """Live optimizers that hook any of ``params``, oldest first."""
    wanted = {id(p) for p in params}
    return [opt for opt, (_, ids) in list(_live.items()) if ids & wanted]


def live() -> int:
    return len(_live)
