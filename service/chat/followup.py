"""The one outbound call: a deferred reply, sent to the platform afterwards.

When a command cannot be answered within the platform's 3-second budget the
service answers "deferred" (type 5) and, once the command is done, edits
that deferred message through the platform's webhook API:

    PATCH {api_url}/webhooks/{application_id}/{interaction_token}/messages/@original
    {"content": "...", "allowed_mentions": {"parse": []}}

The interaction token in the path authorises the call (valid 15 minutes;
no bot token is needed).  It is a credential: it never reaches a log line.
`FollowUps` is the interface; `WebhookFollowUps` the one implementation.
The tests run it against a local HTTP server playing the platform, since
the real platform cannot be reached from the test machine.
"""
from __future__ import annotations

import json
import logging
from typing import Any, Protocol
from urllib.parse import quote

from tornado.httpclient import AsyncHTTPClient, HTTPClientError, HTTPRequest

log = logging.getLogger("logic.chat")

#: Seconds the platform gets to take a follow-up.
FOLLOW_UP_TIMEOUT_S = 10.0


class FollowUps(Protocol):
    async def edit_original(self, application_id: str, token: str,
                            data: dict[str, Any]) -> bool:
        """Replace the deferred message with `data`; False if the platform refused it."""


class WebhookFollowUps:
    """`FollowUps` over the platform's HTTP webhook API at `api_url`."""

    def __init__(self, api_url: str, user_agent: str = "LogicEndpoints (chat command, 1)") -> None:
        self._api_url = api_url.rstrip("/")
        self._user_agent = user_agent

    def url(self, application_id: str, token: str) -> str:
        return (f"{self._api_url}/webhooks/{quote(application_id, safe='')}/"
                f"{quote(token, safe='')}/messages/@original")

    async def edit_original(self, application_id: str, token: str,
                            data: dict[str, Any]) -> bool:
        # The flags of a deferred message are fixed when it is deferred; an
        # edit cannot change them, so only content and mentions are sent.
        body = {k: v for k, v in data.items() if k in ("content", "allowed_mentions")}
        request = HTTPRequest(self.url(application_id, token), method="PATCH",
                              body=json.dumps(body),
                              headers={"Content-Type": "application/json",
                                       "User-Agent": self._user_agent},
                              request_timeout=FOLLOW_UP_TIMEOUT_S, follow_redirects=False)
        try:
            await AsyncHTTPClient().fetch(request)
        except HTTPClientError as err:
            log.warning("chat follow-up refused by the platform: HTTP %d", err.code)
            return False
        except OSError as err:
            log.warning("chat follow-up could not reach the platform: %s", err.strerror or err)
            return False
        return True
