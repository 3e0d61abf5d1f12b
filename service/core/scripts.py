"""Scripts: create, update, delete, show, list; source validation.

Source is compiled at save time by `sandbox.compile_gate.check_source` (a
sandboxed one-shot process with a CPU and memory budget) when the sandbox
package provides it, and always checked for size and UTF-8.  Every script gets its
endpoint, disabled, in the same transaction (DESIGN section 4: 404 only for an
unknown guild or script).  Deleting keeps a tombstone so the ID is not
reused (the newest `KEPT_TOMBSTONES` per guild; an older ID, 132 random bits,
is as unlikely to come again as any collision).  User source is never logged.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import logging
import re
import secrets
import string
import unicodedata
from typing import Any, Callable, Iterable, Mapping, cast

from peewee import IntegrityError

from models import (Endpoint, ErrorRecord, RequestRecord, Script, ScriptVersion, StatBucket,
                    StatIp, StatSketch, database)
from models.clock import iso, utcnow
from service.core import audit, script_checks, versions
from service.core.access import EDITORS, Actor, get_guild, guild_and_script, require_role
from service.core.errors import (CompileError, ConflictError, QuotaError, ValidationError,
                                 VersionMismatchError)
from service.plans import DEFAULT_PLANS, Plan, resolve_plan

log = logging.getLogger("logic.core")

MAX_SOURCE_BYTES = 262144
MAX_NAME_CHARS = 100
#: Deleted scripts kept per guild as tombstones (their IDs refused by the unique
#: index); older ones are removed, their IDs as unguessable as any new one.
KEPT_TOMBSTONES = 1000
#: Older tombstones removed at most per delete.
TOMBSTONES_DROPPED = 500
SCRIPT_ID_PREFIX = "logic_"
_ID_ALPHABET = string.ascii_letters + string.digits + "-_"


def new_script_id() -> str:
    """`logic_` + 22 URL-safe characters from the OS CSPRNG (~131 bits)."""
    return SCRIPT_ID_PREFIX + "".join(secrets.choice(_ID_ALPHABET) for _ in range(22))


def _compiler() -> Callable[..., Any] | None:
    # The sandbox is optional at this layer: when it is absent we fall back
    # to size/encoding checks.  find_spec keeps a real ImportError *inside*
    # the sandbox visible instead of silently skipping it.
    try:
        if importlib.util.find_spec("sandbox.compile_gate") is None:
            return None
    except ModuleNotFoundError:
        return None
    module = importlib.import_module("sandbox.compile_gate")
    return getattr(module, "check_source", None)


def validate_source(source: str | bytes, guild_id: str = "") -> str:
    """Return the source as text; raises `ValidationError` when it is too big
    or not UTF-8, `CompileError` (a `ValidationError`, with every error's
    line, column and message) when it does not compile, or not within the
    compile budget ("script takes too long to compile: ...")."""
    return checked_source(source, guild_id)[0]


def checked_source(source: str | bytes, guild_id: str = "") -> tuple[str, list[dict[str, Any]]]:
    """`validate_source`'s text and the save-time checks' warnings
    (`[{"line", "column", "message"}]`), found by the same sandboxed compile."""
    if isinstance(source, bytes):
        raw = source
        try:
            text = source.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValidationError(f"source is not valid UTF-8 (byte {err.start})",
                                  code="invalid_source") from None
    else:
        text = source
        try:
            raw = source.encode("utf-8")
        except UnicodeEncodeError:
            raise ValidationError("source is not valid UTF-8", code="invalid_source") from None
    if len(raw) > MAX_SOURCE_BYTES:
        raise ValidationError(f"source is {len(raw)} bytes; the limit is {MAX_SOURCE_BYTES}",
                              code="source_too_large")
    if "\x00" in text:
        raise ValidationError("source contains a NUL character", code="invalid_source")
    check_source = _compiler()
    if check_source is not None:
        # Compiled once, here, in a sandboxed one-shot process within a CPU
        # and memory budget: a source that does not compile in budget never
        # reaches a worker.
        # The guild keys the verdicts it remembers: another guild saving the
        # same text is compiled for itself (no answer at once to tell it).
        # Its save-time checks (imports, builtins, empty script) ran there too,
        # within the same budget: they parse the source again, which cost the
        # service 1.5 s of CPU a save of a hostile source (red-team pass,
        # session 34). Their errors refuse the save in the same shape.
        result = check_source(text, guild_id)
        if not result.ok:
            lines = [f"{e.line}:{e.column}: {e.message}" for e in result.errors]
            raise CompileError("script does not compile: " + "; ".join(lines),
                               [{"line": e.line, "column": e.column, "message": e.message}
                                for e in result.errors])
        return text, [{"line": w.line, "column": w.column, "message": w.message}
                      for w in result.warnings]
    # Without the sandbox (a build without it): the checks in this process.
    script_checks.refuse_errors(text)
    return text, script_checks.warnings_of(text)


#: Unicode categories refused in names: controls (C0, C1: NEL, CSI), format
#: characters (right-to-left override, zero-width space), line and paragraph
#: separators, surrogates, private use, unassigned. A name is shown in chat
#: messages and pages; these reorder or hide what is around it (review,
#: session 27: a right-to-left override reversed the rest of a channel line).
_REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})
#: Characters that show nothing although they are letters or marks (Unicode's
#: default-ignorable code points outside Cf, Hangul fillers, the braille
#: blank): two names must not differ only by something nobody can see.
_INVISIBLE = re.compile("[\u034f\u115f\u1160\u17b4\u17b5\u180b-\u180f\u2800\u3164"
                        "\ufe00-\ufe0f\uffa0\U000e0100-\U000e01ef]")
#: Combining marks in a row past this pile up over the lines around the name.
_MAX_MARKS_IN_A_ROW = 4
_MARKS = re.compile("[%s]{%d,}" % ("".join(
    chr(c) for c in range(0x300, 0x370)) + "\u0483-\u0489\u1ab0-\u1aff\u1dc0-\u1dff"
    "\u20d0-\u20ff\ufe20-\ufe2f", _MAX_MARKS_IN_A_ROW + 1))


def name_key(name: str) -> str:
    """What two names are compared by: NFKC, case-folded ("Deploy", "deploy"
    and "ｄｅｐｌｏｙ" are one name to a guild; so are names stored before names
    were normalised, in any form)."""
    return unicodedata.normalize("NFKC", name).casefold()


def _validate_name(name: str) -> str:
    """The name, NFC-normalised; refused: control, format, separator (a space
    other than U+0020), private-use and unassigned characters, characters that
    show nothing, more than four combining marks in a row."""
    name = unicodedata.normalize("NFC", (name or "").strip())
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        name = ""
    if (not name or len(name) > MAX_NAME_CHARS or _INVISIBLE.search(name)
            or _MARKS.search(name) or any(
                unicodedata.category(c) in _REFUSED_CATEGORIES
                or (unicodedata.category(c) == "Zs" and c != " ") for c in name)):
        raise ValidationError(f"script name must be 1-{MAX_NAME_CHARS} printable characters",
                              code="invalid_name")
    return name


def _refuse_duplicate_name(guild_id: str, name: str, except_id: int | None = None) -> None:
    """Names are unique among a guild's live scripts (a chat command looks scripts up
    by name), compared by `name_key`."""
    key = name_key(name)
    query = Script.select(Script.public_id, Script.name).where(
        (Script.guild == guild_id) & Script.deleted_at.is_null())
    if except_id is not None:
        query = query.where(Script.id != except_id)
    clash = next((row for row in query if name_key(str(row.name)) == key), None)
    if clash is not None:
        raise ConflictError(f"guild {guild_id} already has a script named {clash.name!r} "
                            f"({clash.public_id})", code="script_name_taken")


def script_view(script: Script, guild_id: str, with_source: bool = False) -> dict[str, Any]:
    """The JSON shape of a script."""
    endpoint = Endpoint.get(Endpoint.script == script.id)
    view: dict[str, Any] = {
        "logicScriptId": script.public_id, "guildId": guild_id, "name": script.name,
        "version": script.version, "createdAt": iso(script.created_at),
        "updatedAt": iso(script.updated_at), "endpointEnabled": bool(endpoint.enabled),
        "sourceBytes": len(script.source.encode("utf-8")),
        "warnings": script_checks.stored_warnings(script.warnings),
    }
    if with_source:
        view["source"] = script.source
    return view


def create_script(actor: Actor, guild_id: str, name: str, source: str | bytes, *,
                  plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """Create a script and its disabled endpoint.  Raises `ValidationError`,
    `ConflictError` (`script_name_taken`), `QuotaError` (`script_quota`: the
    plan's live scripts per guild), `NotFoundError`, `PermissionDeniedError`."""
    name = _validate_name(name)
    # Who may create is settled before the compile (a sandboxed process): a
    # stranger to the guild costs the host nothing and learns nothing.
    require_role(actor, get_guild(guild_id), EDITORS, "create scripts")
    text, found = checked_source(source, guild_id)
    warnings = json.dumps(found)
    with database.atomic():
        guild = get_guild(guild_id, lock=True)    # serialises the name check
        require_role(actor, guild, EDITORS, "create scripts")
        plan = resolve_plan(plans, guild.plan)
        live = (Script.select().where((Script.guild == guild.id) & Script.deleted_at.is_null())
                .count())
        if live >= plan.scripts:
            raise QuotaError(f"plan {plan.name} allows {plan.scripts} script(s) and guild "
                             f"{guild.id} has {live}: delete one first", code="script_quota")
        _refuse_duplicate_name(guild.id, name)
        now = utcnow()
        for _ in range(5):       # a collision is ~impossible; retry, never reuse
            try:
                with database.atomic():
                    script = Script.create(public_id=new_script_id(), guild=guild.id, name=name,
                                           source=text, version=1, created_at=now, updated_at=now,
                                           warnings=warnings)
                break
            except IntegrityError:
                continue
        else:  # pragma: no cover - needs five 131-bit collisions in a row
            raise RuntimeError("could not allocate a script id")
        Endpoint.create(script=script.id, enabled=False, created_at=now)
        versions.keep(actor, script, plan)
        audit.record(actor, "script.created", guild_id=guild.id, script_id=script.public_id,
                     name=name)
    log.info("script %s created in guild %s by %s", script.public_id, guild.id, actor.label)
    return script_view(script, guild.id)


_REVISION = re.compile(r"([0-9]{1,18})(?:-([0-9a-f]{8}))?")


def _name_tag(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def revision(view: Mapping[str, Any]) -> str:
    """What an editor read, as the admin API's `ETag` and the dashboard's form
    carry it: the version and a tag of the name ("3-1a2b3c4d"), so it changes
    with every save and every rename (review, session 27: a rename kept the
    version, and a save made against the old name undid it)."""
    return f"{view['version']}-{_name_tag(str(view['name']))}"


def _refuse_stale(script: Script, expected: re.Match[str] | None) -> None:
    """`VersionMismatchError` when the script is no longer at the revision read."""
    if expected is None:
        return
    if expected[2] is not None and expected[2] != _name_tag(script.name):
        raise VersionMismatchError(f"script {script.public_id} was renamed since it was read: "
                                   "reload and retry")
    if script.version != int(expected[1]):
        raise VersionMismatchError(
            f"script {script.public_id} changed since it was read (it is at version "
            f"{script.version}): someone else saved first; reload and retry")


def update_script(actor: Actor, guild_id: str, script_id: str, source: str | bytes | None = None,
                  name: str | None = None, *, expected_revision: str | None = None,
                  plans: Mapping[str, Plan] = DEFAULT_PLANS) -> dict[str, Any]:
    """Replace the source (version + 1, the old one kept) and/or rename.  With
    `expected_revision` (`revision()` of what the editor read; a bare version
    checks the version alone), only if the script is still as read (one
    conditional UPDATE, so two editors cannot both win).  Raises
    `ValidationError`, `VersionMismatchError`, `ConflictError`
    (`script_name_taken`), `NotFoundError`,
    `PermissionDeniedError`."""
    expected = _REVISION.fullmatch(expected_revision or "")
    if expected_revision is not None and expected is None:
        raise VersionMismatchError(f"{expected_revision[:40]!r} is not a revision of a script "
                                   "(the ETag of a read, e.g. \"3-1a2b3c4d\")")
    text = None
    found: list[dict[str, Any]] = []
    if source is not None:
        # Before the compile: who may edit, and whether the save is stale (a
        # compile for a save that is refused anyway would be wasted).
        _, script, _ = guild_and_script(actor, guild_id, script_id, "edit scripts")
        _refuse_stale(script, expected)
        text, found = checked_source(source, guild_id)
    new_name = _validate_name(name) if name is not None else None
    with database.atomic():
        # Locked, as a delete is: a save racing one on PostgreSQL wrote its
        # source into the tombstone and kept a version of it (red team,
        # session 35); it also serialises the name check of a rename.
        guild, script, _ = guild_and_script(actor, guild_id, script_id, "edit scripts",
                                            lock=True)
        old_name = script.name
        _refuse_stale(script, expected)
        changes: dict[str, Any] = {"updated_at": utcnow()}
        if text is not None:
            changes["source"] = text
            changes["version"] = Script.version + 1
            changes["warnings"] = json.dumps(found)
        if new_name is not None:
            _refuse_duplicate_name(guild.id, new_name, except_id=script.id)
            changes["name"] = new_name
        where = Script.id == script.id
        if expected is not None:
            # Conditional: a save committed since the read above loses nothing.
            where = where & (Script.version == int(expected[1]))
            if expected[2] is not None:
                where = where & (Script.name == old_name)   # and not renamed meanwhile
        if not Script.update(**changes).where(where).execute():
            raise VersionMismatchError(
                f"script {script.public_id} changed since it was read (it is at version "
                f"{script.version}): someone else saved first; reload and retry")
        script = Script.get_by_id(script.id)
        if text is not None:
            versions.keep(actor, script, resolve_plan(plans, guild.plan))
        audit.record(actor, "script.updated", guild_id=guild.id, script_id=script.public_id,
                     version=script.version, renamed=new_name is not None,
                     **({"old": old_name, "new": new_name} if new_name is not None else {}))
    return script_view(script, guild.id)


def delete_script(actor: Actor, guild_id: str, script_id: str) -> dict[str, Any]:
    """Delete a script: tombstone the row (its ID refused while the tombstone is
    kept, see `KEPT_TOMBSTONES`), drop its source, secret, history, errors and
    statistics.  Raises `NotFoundError`, `PermissionDeniedError`."""
    with database.atomic():
        # Locked: the guild's deletes are serialised, so the tombstone bound holds.
        guild, script, _ = guild_and_script(actor, guild_id, script_id, "delete scripts",
                                            lock=True)
        endpoint = Endpoint.get(Endpoint.script == script.id)
        for model in (RequestRecord, ErrorRecord, StatBucket, StatIp, StatSketch):
            model.delete().where(model.endpoint == endpoint.id).execute()
        ScriptVersion.delete().where(ScriptVersion.script == script.id).execute()
        Endpoint.update(enabled=False, secret_hash=None, secret_hint=None,
                        whitelist="[]").where(Endpoint.id == endpoint.id).execute()
        Script.update(deleted_at=utcnow(), source="").where(Script.id == script.id).execute()
        _drop_old_tombstones(guild.id)
        audit.record(actor, "script.deleted", guild_id=guild.id, script_id=script.public_id)
    return {"logicScriptId": script.public_id, "guildId": guild.id, "deleted": True}


def _drop_old_tombstones(guild_id: str) -> None:
    """Keep the guild's newest `KEPT_TOMBSTONES` deleted scripts: creating and
    deleting in a loop must not grow the database for ever. Whatever a late
    record writer added to an old tombstone goes with it (foreign keys cascade).
    At most `TOMBSTONES_DROPPED` at a time, so one delete stays short: a backlog
    from a release without the bound goes over the guild's next deletes."""
    old = [row.id for row in Script.select(Script.id)
           .where((Script.guild == guild_id) & Script.deleted_at.is_null(False))
           .order_by(Script.deleted_at.desc(), Script.id.desc())
           .offset(KEPT_TOMBSTONES).limit(TOMBSTONES_DROPPED)]
    if old:
        Script.delete().where(Script.id.in_(old)).execute()


def show_script(actor: Actor, guild_id: str, script_id: str) -> dict[str, Any]:
    """The script with its source.  Raises `NotFoundError`, `PermissionDeniedError`."""
    guild, script, _ = guild_and_script(actor, guild_id, script_id, "view scripts")
    return script_view(script, guild.id, with_source=True)


def list_scripts(actor: Actor, guild_id: str) -> dict[str, Any]:
    """`{"scripts": [...]}` of live scripts, oldest first.  Raises
    `NotFoundError`, `PermissionDeniedError`."""
    guild = get_guild(guild_id)
    require_role(actor, guild, EDITORS, "list scripts")
    query = (Script.select(Script.public_id, Script.name, Script.version, Script.updated_at,
                           Endpoint.enabled)
             .join(Endpoint, on=(Endpoint.script == Script.id))
             .where((Script.guild == guild.id) & Script.deleted_at.is_null())
             .order_by(Script.id).dicts())
    rows = cast(Iterable[dict[str, Any]], query)
    return {"scripts": [{"logicScriptId": s["public_id"], "name": s["name"], "version": s["version"],
                         "endpointEnabled": bool(s["enabled"]), "updatedAt": iso(s["updated_at"])}
                        for s in rows]}
