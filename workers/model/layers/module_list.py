"""An nn.ModuleList that knows the type of its items.

nn.ModuleList hands back plain nn.Module, so every attribute read through it (a decoder layer's
self_attn, its k_cache) types as `Tensor | Module` and each use site would need a cast. The
model builds the list once from items of one type, so the type is stated once here instead.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Generic, TypeVar, cast, overload

from torch import nn

M = TypeVar("M", bound=nn.Module)


class TypedModuleList(nn.ModuleList, Generic[M]):
    """Registers its items as submodules exactly like nn.ModuleList (state-dict names
    `<attr>.<i>` are unchanged); only the static item type differs."""

    def __init__(self, modules: Iterable[M] = ()) -> None:
        super().__init__(modules)

    @overload
    def __getitem__(self, idx: slice) -> TypedModuleList[M]: ...

    @overload
    def __getitem__(self, idx: int) -> M: ...

    def __getitem__(self, idx: int | slice) -> M | TypedModuleList[M]:
        # every item came in through __init__ as an M; nn.ModuleList builds a slice with
        # self.__class__, so a slice is a TypedModuleList too
        return cast("M | TypedModuleList[M]", super().__getitem__(idx))

    def __iter__(self) -> Iterator[M]:
        return cast("Iterator[M]", super().__iter__())
