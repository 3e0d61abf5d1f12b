"""`POST {chat.path}` (default `/interactions`): the platform's interactions endpoint.

Order, each step ending the request when it fails:
1. the signature, its headers and the timestamp (`service.chat.signature`):
   401 `unauthorized` before the body is parsed or the database touched;
2. the body parses as an interaction: 400 `invalid_body`;
3. PING is answered PONG; an interaction id seen before in this process's
   memory is 401 (a replay);
4. a command is dispatched through the command table (`service.chat.commands`)
   to the service layer on the chat thread pool, where its id is first
   recorded in the database, so a replay sent to another front process or
   node, or after a restart, is refused too (`service.core.interactions`;
   401 when that answer comes within the budget). The reply goes back inline
   when it is ready within `chat.answer_within_ms` (default 2 s; the platform
   allows 3), counted from the request's arrival, so a busy database or busy
   chat threads delay the answer past it never; otherwise the answer is
   "deferred" (type 5, ephemeral) and the reply follows through
   `service.chat.followup` when the command is done (a replay found late
   gets no follow-up, and its command never runs);
5. autocomplete (type 4) answers choices within the same budget, or none.

The route exists only when `chat.public_key` is set: without a key every
request to the path is 404, never an unsigned command.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from service.chat import commands, protocol
from service.chat.commands import LOGIC, Reply, Subcommand
from service.chat.followup import FollowUps, WebhookFollowUps
from service.chat.signature import SignatureError, SignatureVerifier
from service.chat.subcommands import Call
from service.core import interactions
from service.core.access import Actor
from service.core.errors import CoreError
from service.http.base import BaseHandler
from service.http.context import AppContext
from service.http.errors import InvalidBodyError, PayloadTooLargeError, UnauthorizedError
from service.settings import Settings

log = logging.getLogger("logic.chat")

#: Interactions are small; anything bigger is not one.
MAX_BODY_BYTES = 64 * 1024
#: Autocomplete cannot be deferred: past this, no choices this time.
AUTOCOMPLETE_BUDGET_S = 2.0
FAILED = Reply("Something went wrong on the service's side; the operator's log has the details.",
               True)


class SignatureRefusedError(UnauthorizedError):
    message = "Invalid request signature."


class ChatFront:
    """What the interactions handler shares between requests."""

    def __init__(self, settings: Settings, followups: FollowUps | None = None) -> None:
        self.settings = settings
        self.verifier = SignatureVerifier(settings.chat.public_key)
        self.followups: FollowUps = followups or WebhookFollowUps(settings.chat.api_url)
        self.budget_s = settings.chat.answer_within_ms / 1000.0
        # Service-layer calls are blocking database work: off the event loop,
        # on threads of their own (each with its own database connection).
        self.executor = ThreadPoolExecutor(max_workers=2, thread_name_prefix="logic-chat")
        self._pending: set[asyncio.Task[None]] = set()

    def first_seen(self, interaction_id: str) -> bool:
        """Whether no process or node sharing the database answered this id before
        (blocking: on the chat threads)."""
        return interactions.first_seen(interaction_id, self.verifier.max_age_s)

    def execute(self, interaction_id: str, subcommand: Subcommand | None,
                call: Call | Reply) -> Reply | None:
        """Record the id, then run the command; None for a replay (nothing runs)."""
        if not self.first_seen(interaction_id):
            return None
        if isinstance(call, Reply) or subcommand is None:
            return call if isinstance(call, Reply) else FAILED
        try:
            return commands.run(subcommand, call)
        except Exception:  # noqa: BLE001 - the member gets an answer, the log the trace
            log.exception("chat command %s failed", subcommand.name)
            return FAILED

    def complete(self, interaction_id: str, subcommand: Subcommand | None, call: Call | Reply,
                 focused: str | None) -> list[tuple[str, str]] | None:
        """Record the id, then find the choices; None for a replay."""
        if not self.first_seen(interaction_id):
            return None
        if isinstance(call, Reply) or subcommand is None:
            return []
        try:
            return commands.complete(subcommand, call, focused)
        except Exception:  # noqa: BLE001
            log.exception("chat autocomplete failed")
            return []

    def follow_up_later(self, interaction: protocol.Interaction,
                        reply: asyncio.Future[Reply | None], context: AppContext) -> None:
        """Send the command's reply when it is ready. It counts as a request in
        flight until it is sent: a stop or a reload drains it like an answer
        (review, session 27: a reload dropped the follow-up of a secret the
        command had already made, the old one dead)."""
        task = asyncio.ensure_future(self._follow_up(interaction, reply))
        context.request_started()
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        task.add_done_callback(lambda _: context.request_ended())

    async def _follow_up(self, interaction: protocol.Interaction,
                         reply: asyncio.Future[Reply | None]) -> None:
        try:
            done = await reply
        except Exception as err:  # noqa: BLE001 - the id could not be recorded: nothing ran
            log.error("chat interaction not answered: %s", type(err).__name__)
            return
        if done is None:
            return  # a replay, found after the deferred answer: it gets nothing more
        try:
            await self.followups.edit_original(interaction.application_id, interaction.token,
                                               protocol.message_data(done.content, done.ephemeral))
        except Exception as err:  # noqa: BLE001 - a lost follow-up must not kill anything else
            # No traceback: its messages could hold the URL, and the URL the token.
            log.error("chat follow-up failed: %s", type(err).__name__)


def _no_form_parsing() -> None:
    return None


class InteractionsHandler(BaseHandler):
    """Verify, parse, dispatch, answer."""

    def initialize(self, context: AppContext, front: ChatFront) -> None:  # type: ignore[override]
        super().initialize(context)
        self.front = front
        # The body is the platform's signed bytes, read only once verified: the
        # framework's form parsing (run for every handler before its method)
        # refused an unsigned multipart or coded body with 400 before the
        # signature check could answer 401 (review, session 33).
        self.request._parse_body = _no_form_parsing  # type: ignore[method-assign]

    def check_xsrf_cookie(self) -> None:
        """No XSRF token here: the platform's signature authenticates every request."""
        return None

    async def post(self) -> None:
        front = self.front
        # The platform's clock for the answer started when the request arrived.
        arrived = asyncio.get_running_loop().time() - self.request.request_time()
        body = self.request.body
        if len(body) > MAX_BODY_BYTES:
            raise PayloadTooLargeError()
        try:
            front.verifier.verify(self.request.headers.get("X-Signature-Ed25519"),
                                  self.request.headers.get("X-Signature-Timestamp"), body)
        except SignatureError as err:
            raise SignatureRefusedError(log_message=f"interaction refused: {err}") from None
        try:
            interaction = protocol.parse(json.loads(body))
        except (ValueError, RecursionError, protocol.InteractionError):  # nested too deep too
            raise InvalidBodyError("The body is not an interaction.") from None
        if interaction.type == protocol.PING:
            self.write_json(protocol.pong())
            return
        if not front.verifier.first_time(interaction.id):
            raise self._replayed()
        if interaction.type == protocol.APPLICATION_COMMAND:
            await self._command(interaction, arrived + front.budget_s)
        elif interaction.type == protocol.AUTOCOMPLETE:
            await self._autocomplete(interaction, arrived + AUTOCOMPLETE_BUDGET_S)
        else:
            if not await asyncio.get_running_loop().run_in_executor(
                    front.executor, front.first_seen, interaction.id):
                raise self._replayed()
            raise InvalidBodyError("This interaction type is not handled here.")

    @staticmethod
    def _replayed() -> SignatureRefusedError:
        return SignatureRefusedError(log_message="interaction refused: replayed id")

    def _call(self, interaction: protocol.Interaction) -> Call | Reply:
        if interaction.guild_id is None or interaction.user_id is None:
            return commands.NOT_IN_GUILD
        try:
            actor = Actor.user(interaction.user_id, via="chat")
        except CoreError as err:
            return Reply(commands.refusal(err), True)
        return Call(actor, interaction.guild_id, interaction.options, self.front.settings)

    async def _command(self, interaction: protocol.Interaction, deadline: float) -> None:
        subcommand = LOGIC.find(interaction.path)
        call: Call | Reply = self._call(interaction)
        if subcommand is None and isinstance(call, Call):
            call = commands.unknown(interaction.path)
        if isinstance(call, Call) and subcommand is not None:
            log.debug("%s chat /%s by %s in guild %s", self.request_id,
                      " ".join(interaction.path), call.actor.label, call.guild_id)
        loop = asyncio.get_running_loop()
        # The id is recorded on the chat threads, inside the budget: a database
        # that makes the insert wait (or busy chat threads) defers the answer.
        running = loop.run_in_executor(self.front.executor, self.front.execute,
                                       interaction.id, subcommand, call)
        try:
            done = await asyncio.wait_for(asyncio.shield(running),
                                          max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            # Ephemeral whatever the subcommand: the flag is fixed now, before
            # the outcome (maybe a secret, maybe a refusal) is known.
            self.write_json(protocol.deferred(ephemeral=True))
            self.front.follow_up_later(interaction, running, self.context)
            return
        if done is None:
            raise self._replayed()
        self.write_json(protocol.message(done.content, done.ephemeral))

    async def _autocomplete(self, interaction: protocol.Interaction, deadline: float) -> None:
        subcommand = LOGIC.find(interaction.path)
        call = self._call(interaction)
        loop = asyncio.get_running_loop()
        running = loop.run_in_executor(self.front.executor, self.front.complete, interaction.id,
                                       subcommand, call, interaction.focused)
        try:
            found = await asyncio.wait_for(asyncio.shield(running),
                                           max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            running.add_done_callback(_retrieved)   # late, and maybe failed: nobody waits
            found = []  # autocomplete cannot be deferred: no choices this time
        if found is None:
            raise self._replayed()
        self.write_json(protocol.choices(found))


def _retrieved(future: asyncio.Future[Any]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.error("chat interaction not answered: %s", type(future.exception()).__name__)


def routes(context: AppContext) -> list[tuple[str, type[BaseHandler], dict[str, Any]]]:
    """The interactions route, or none while `chat.public_key` is empty."""
    chat = context.settings.chat
    if not chat.public_key:
        log.info("chat command off: [chat] public_key is empty, %s answers 404", chat.path)
        return []
    front = ChatFront(context.settings)
    return [(re.escape(chat.path), InteractionsHandler, {"context": context, "front": front})]
