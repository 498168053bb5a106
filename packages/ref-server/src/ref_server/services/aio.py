"""Small asyncio pieces the services share."""

from __future__ import annotations

import asyncio

_running: set[asyncio.Task] = set()


def background(coroutine) -> asyncio.Task:
    """Run a coroutine nobody awaits, kept referenced until it ends (the event loop keeps only
    weak references to tasks)."""
    task = asyncio.ensure_future(coroutine)
    _running.add(task)
    task.add_done_callback(_running.discard)
    return task


class Events:
    """A request's events from the engine thread, as an asyncio queue of this event loop."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, event: tuple) -> None:  # called on the engine thread
        self.loop.call_soon_threadsafe(self.queue.put_nowait, event)

    async def get(self) -> tuple:
        return await self.queue.get()

    async def batch(self) -> list[tuple]:
        """The next event and every one already behind it (a lagging reader sends fewer,
        larger messages instead of falling further behind)."""
        return await drained(self.queue)


async def drained(queue: asyncio.Queue) -> list:
    """The queue's next item, then every item already in it."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items
