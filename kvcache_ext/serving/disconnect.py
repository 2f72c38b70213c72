"""A non-streamed request whose client goes away: its work stops.

A streamed answer notices a client that left when it next writes, and transformers' handler
then cancels the request in the engine. A non-streamed one writes only at its end, and the HTTP
server does not stop a handler whose client left, so the request would decode on to its end,
holding its pages. ``KeepReceive`` keeps each HTTP request's ASGI ``receive`` (where the server
reports a disconnect) where its handler can reach it, and ``unless_client_leaves`` runs the
handler beside a wait for that disconnect, cancelling the request when it comes first.
"""
from __future__ import annotations

import asyncio
import contextvars
from typing import Awaitable, Callable

RECEIVE: contextvars.ContextVar = contextvars.ContextVar("kvcache_ext_receive", default=None)
CLIENT_CLOSED_REQUEST = 499     # nginx's status for a request its client closed: nobody reads it


class KeepReceive:
    """ASGI middleware: each HTTP request's ``receive`` in ``RECEIVE``, for the tasks of that
    request (each request is served in a task of its own, which the context var follows)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            RECEIVE.set(receive)
        await self.app(scope, receive, send)


async def until_disconnected(receive) -> None:
    """Returns when the client has gone. Called once the body is read: nothing else reads
    ``receive`` while a non-streamed request is answered."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_client_leaves(work: Awaitable, cancel: Callable[[], None]):
    """What ``work`` returns; or, if the client goes first, ``cancel()`` called, ``work``
    cancelled, and a bare response with status 499."""
    from starlette.responses import Response

    task = asyncio.ensure_future(work)
    receive = RECEIVE.get()
    if receive is None:
        return await task
    watcher = asyncio.ensure_future(until_disconnected(receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done() and not watcher.done():    # this handler was cancelled itself
            task.cancel()
        watcher.cancel()
    if task.done():
        return task.result()
    cancel()
    task.cancel()
    return Response(status_code=CLIENT_CLOSED_REQUEST)
