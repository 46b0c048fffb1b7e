"""Typed construction of protocol messages and records.

The codec's ``@record``/``@message`` decorators make frozen dataclasses at run
time, but mypy cannot see their fields (the decorators carry no
``typing.dataclass_transform``), so a keyword construction such as
``Fetch(request_id=...)`` fails strict type checking. `build` keeps the result
typed while the fields are checked by the dataclass at run time.
"""

from __future__ import annotations

from typing import Any, TypeVar

__all__ = ["build"]

T = TypeVar("T")


def build(cls: type[T], **fields: Any) -> T:
    """``cls(**fields)``, typed as `cls`."""
    return cls(**fields)
