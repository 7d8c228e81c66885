"""``eagle3_jax.serve.responses``: waiting for a non-streamed request's result."""

from __future__ import annotations

import asyncio

import pytest

from eagle3_jax.serve.responses import wait_for_result
from eagle3_jax.serve.schemas import ApiError


def test_an_abandoned_request_is_cancelled_while_its_tokens_flow():
    """``wait_for_result`` looks for a departed client every ``poll_s`` even when events arrive more often
    than that (a non-streamed request that is generating): it cancels the request and answers 499."""

    class Req:
        def __init__(self):
            self.events, self.cancelled = asyncio.Queue(), False

        def cancel(self):
            self.cancelled = True

    class Client:
        async def is_disconnected(self):
            return True

    async def main():
        req = Req()

        async def tokens():  # a delta every 10 ms, never done
            while True:
                req.events.put_nowait(("delta", None))
                await asyncio.sleep(0.01)

        feeder = asyncio.create_task(tokens())
        try:
            with pytest.raises(ApiError) as e:
                await asyncio.wait_for(wait_for_result(req, Client(), poll_s=0.05), 5.0)
        finally:
            feeder.cancel()
        return req, e.value

    req, err = asyncio.run(main())
    assert err.status == 499 and req.cancelled
