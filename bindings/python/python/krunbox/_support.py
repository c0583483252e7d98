"""Helpers the native module calls (not API)."""

from typing import Awaitable, TypeVar

_T = TypeVar("_T")


async def awaited(awaitable: Awaitable[_T]) -> _T:
    """``awaitable``'s result, as a coroutine (``asyncio.run`` takes nothing else)."""
    return await awaitable


__all__: list[str] = []

