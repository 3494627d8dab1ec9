"""A tallier round's own event loop: MPyC's runtime takes the current loop, and a round that ends, however it
ends, leaves nothing behind for the next (a connection, a pending step, a callback)."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Iterator

__all__ = ["round_loop"]


@contextlib.contextmanager
def round_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A round's own event loop (MPyC's runtime takes the current one), closed with all of the round."""
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    try:
        yield loop
    finally:
        _close(loop)
        asyncio.set_event_loop(None)  # whatever needs a loop next makes its own, as MPyC does


def _close(loop: asyncio.AbstractEventLoop) -> None:
    """End a round's event loop: abort its connections (a peer sees the round end at once), cancel
    every step still pending, let them unwind, and close the loop."""
    for transport in list(getattr(loop, "_transports", {}).values()):
        if transport is not None and not transport.is_closing():
            transport.abort()
    pending = [task for task in asyncio.all_tasks(loop) if not task.done()]
    for task in pending:
        task.cancel()
    loop.set_exception_handler(lambda loop, context: None)  # what unwinds now belongs to a round that is over
    with contextlib.suppress(RuntimeError):  # the loop stopped by a step that ended the round as it unwound
        loop.run_until_complete(asyncio.gather(*pending, asyncio.sleep(0), return_exceptions=True))
    loop.close()
