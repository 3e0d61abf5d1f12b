"""The one outbound call: a deferred reply, sent to the platform afterwards.

When a command cannot be answered within the platform's 3-second budget the
service answers "deferred" (type 5) and, once the command is done, edits
that deferred message through the platform's webhook API:

    PATCH {api_url}/webhooks/{application_id}/{interaction_token}/messages/@original
    {"content": "...", "allowed_mentions": {"parse": []}}

A 429, a 5xx or no answer at all is tried again with the same body (an
edit: twice is the same as once), three attempts in all, after the wait
its `Retry-After` names (at most 5 s) or 1 s; the command never runs again.
The platform's answer is never read, so it is not kept either.

At most `MAX_IN_FLIGHT` edits are on the wire at once; the others wait for
a place before their attempt starts, so a burst of deferred commands (they
come in bursts: a database that stalled and recovered) costs waiting, never
an attempt: the HTTP client's own queue counted its waiting against the
10 s timeout and lost replies (with a secret just made) that the platform
never saw (review, session 25).

The interaction token in the path authorises the call (valid 15 minutes;
no bot token is needed).  It is a credential: it never reaches a log line.
`FollowUps` is the interface; `WebhookFollowUps` the one implementation.
The tests run it against a local HTTP server playing the platform, since
the real platform cannot be reached from the test machine.
"""
from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Protocol
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

log = logging.getLogger("logic.chat")

#: Seconds the platform gets to take a follow-up.
FOLLOW_UP_TIMEOUT_S = 10.0
#: Attempts at one follow-up: the platform answered 429 or 5xx, or not at all.
ATTEMPTS = 3
#: Seconds between attempts when the platform names no wait; the most it may name.
RETRY_WAIT_S = 1.0
MAX_RETRY_WAIT_S = 5.0
#: Edits on the wire at once (outbound connections to the platform).
MAX_IN_FLIGHT = 32


class FollowUps(Protocol):
    async def edit_original(self, application_id: str, token: str,
                            data: dict[str, Any]) -> bool:
        """Replace the deferred message with `data`; False if the platform refused it."""


class WebhookFollowUps:
    """`FollowUps` over the platform's HTTP webhook API at `api_url`."""

    def __init__(self, api_url: str, user_agent: str = "LogicEndpoints (chat command, 1)") -> None:
        self._api_url = api_url.rstrip("/")
        self._user_agent = user_agent
        #: The places on the wire and the client, of the loop they belong to.
        self._wire: tuple[asyncio.AbstractEventLoop, asyncio.Semaphore, AsyncHTTPClient] | None \
            = None

    def url(self, application_id: str, token: str) -> str:
        return (f"{self._api_url}/webhooks/{quote(application_id, safe='')}/"
                f"{quote(token, safe='')}/messages/@original")

    async def edit_original(self, application_id: str, token: str,
                            data: dict[str, Any]) -> bool:
        # The flags of a deferred message are fixed when it is deferred; an
        # edit cannot change them, so only content and mentions are sent.
        body = json.dumps({k: v for k, v in data.items() if k in ("content", "allowed_mentions")})
        url = self.url(application_id, token)
        for attempt in range(1, ATTEMPTS + 1):
            wait = await self._attempt(url, body)
            if wait is None:
                return True
            if wait < 0 or attempt == ATTEMPTS:
                return False
            # The same edit again (it replaces the message: sending it twice
            # changes nothing); the command itself never runs again.
            await asyncio.sleep(wait)
        return False

    async def _attempt(self, url: str, body: str) -> float | None:
        """One PATCH: None when taken, else the seconds to wait before trying
        again (429, 5xx, no answer), or -1 for a refusal not worth repeating."""
        request = HTTPRequest(url, method="PATCH", body=body,
                              headers={"Content-Type": "application/json",
                                       "User-Agent": self._user_agent},
                              request_timeout=FOLLOW_UP_TIMEOUT_S, follow_redirects=False,
                              # Its answer is never read: not kept either.
                              streaming_callback=_discard)
        loop = asyncio.get_running_loop()
        if self._wire is None or self._wire[0] is not loop:
            # A client of our own: as many places as the semaphore, so no fetch
            # ever waits in the client's queue (where waiting counts as time).
            self._wire = (loop, asyncio.Semaphore(MAX_IN_FLIGHT),
                          AsyncHTTPClient(force_instance=True, max_clients=MAX_IN_FLIGHT))
        _, places, client = self._wire
        try:
            async with places:
                await client.fetch(request)
        except HTTPClientError as err:
            if err.code == 599:
                log.warning("chat follow-up: the platform did not answer within %g s",
                            FOLLOW_UP_TIMEOUT_S)
            else:
                log.warning("chat follow-up refused by the platform: HTTP %d", err.code)
            if err.code == 429 or err.code >= 500:   # 599: no answer in time
                return _retry_after(err.response.headers if err.response else None)
            return -1.0
        except OSError as err:
            log.warning("chat follow-up could not reach the platform: %s", err.strerror or err)
            return RETRY_WAIT_S
        return None


def _discard(chunk: bytes) -> None:
    """The platform's answer to an edit: nothing in it is used."""


def _retry_after(headers: Any) -> float:
    """The wait a 429 or 5xx asks for (`Retry-After` in seconds), within bounds."""
    try:
        wait = float(headers.get("Retry-After", RETRY_WAIT_S)) if headers is not None \
            else RETRY_WAIT_S
    except (TypeError, ValueError):
        wait = RETRY_WAIT_S
    if not wait >= 0:   # NaN too
        wait = RETRY_WAIT_S
    return min(wait, MAX_RETRY_WAIT_S)
