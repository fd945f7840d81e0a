"""numpy and pandas scalars as the Python values they hold."""

from __future__ import annotations

from typing import Any

__all__ = ["plain"]


def plain(value: Any) -> Any:
    """``value`` as a Python scalar where it is a numpy (or pandas) scalar: ``np.int64(2)``
    is ``2``, so that dataclass validation sees an int as an int and JSON can write it.
    Anything else (a Python value, a list, an array of several values) is returned as is."""
    if hasattr(value, "item") and not isinstance(value, (list, tuple, dict, str, bytes)):
        try:
            return value.item()
        except (ValueError, TypeError, AttributeError):  # not one value
            return value
    return value
