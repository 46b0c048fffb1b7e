"""Hypothesis strategies for every registered message, built from the schema."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Annotated, Any, Union

import numpy as np
from hypothesis import strategies as st

from rollpool.protocol import message_types
from rollpool.protocol.codec import _FrameKind

_text = st.text(max_size=20)
_free = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False) | _text | st.binary(max_size=16),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(_text, children, max_size=3),
    max_leaves=8,
)


def strategy_for(tp: Any) -> st.SearchStrategy[Any]:  # noqa: C901 - grandfathered: one branch per annotation shape
    origin = typing.get_origin(tp)
    if origin is Annotated:
        base, *extra = typing.get_args(tp)
        for m in extra:
            if isinstance(m, _FrameKind):
                if m.dtype is None:
                    return st.binary(max_size=64)
                dt = m.dtype
                if dt.kind == "f":
                    elems = st.floats(width=32, allow_nan=False)
                elif dt.kind == "u":
                    elems = st.integers(0, 255)
                else:
                    elems = st.integers(-(2**31), 2**31 - 1)
                return st.lists(elems, max_size=32).map(lambda xs, dt=dt: np.array(xs, dtype=dt))
        return strategy_for(base)
    if origin in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return st.none() | strategy_for(args[0])
    if origin in (list, tuple):
        return st.lists(strategy_for(typing.get_args(tp)[0]), max_size=3).map(tuple)
    if origin is dict:
        return st.dictionaries(_text, _free, max_size=3)
    if tp is str:
        return _text
    if tp is int:
        return st.integers(-(2**63), 2**63 - 1)
    if tp is float:
        return st.floats(allow_nan=False)
    if tp is bool:
        return st.booleans()
    if tp is bytes:
        return st.binary(max_size=16)
    if dataclasses.is_dataclass(tp):
        return record_strategy(tp)
    raise TypeError(tp)


def record_strategy(cls: type[Any]) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls, include_extras=True)
    return st.builds(cls, **{f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(cls)})


def any_message() -> st.SearchStrategy[Any]:
    return st.one_of([record_strategy(cls) for cls in message_types().values()])
