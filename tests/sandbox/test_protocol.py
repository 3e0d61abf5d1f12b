"""Frames between pool and workers: caps, splitting, validation."""
from __future__ import annotations

import random
import tracemalloc
from typing import Any

import msgpack
import pytest

from sandbox import frameshape, protocol
from sandbox.errors import PoolBusyError, ProtocolError, SandboxError

try:
    from sandbox import _frameshape
except ImportError:  # the extension did not build: its Python twin is tested alone
    _frameshape = None  # type: ignore[assignment]

RESULT = {"replied": True, "status": 200, "headers": [["X-A", "1"]], "body": b"{}",
          "contentType": "application/json", "output": "", "error": None}
REPLY = {"t": "res", "id": 7, "r": RESULT, "peak": 10, "over": False, "dur": 0.5, "exit": False}


def test_round_trip_keeps_bytes_and_str_apart() -> None:
    frame = protocol.encode(REPLY, protocol.MAX_REPLY_BYTES)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    (msg,) = list(protocol.FrameReader(protocol.MAX_REPLY_BYTES).feed(frame))
    assert protocol.check_reply(msg) == REPLY


def test_reader_splits_and_joins_chunks() -> None:
    frames = b"".join(protocol.encode({**REPLY, "id": i}, 1 << 20) for i in range(3))
    reader = protocol.FrameReader(1 << 20)
    got = []
    for i in range(0, len(frames), 5):
        got += [m["id"] for m in reader.feed(frames[i:i + 5])]
    assert got == [0, 1, 2]


def test_oversized_frames_are_refused_both_ways() -> None:
    with pytest.raises(ProtocolError):
        protocol.encode({"t": "job", "blob": b"x" * 2000}, 1000)
    reader = protocol.FrameReader(1000)
    with pytest.raises(ProtocolError):
        list(reader.feed((5000).to_bytes(4, "big") + b"x"))


def test_garbage_and_non_msgpack_are_protocol_errors() -> None:
    with pytest.raises(ProtocolError):
        list(protocol.FrameReader(100).feed(b"\x00\x00\x00\x02\xc1\xc1"))


@pytest.mark.parametrize("bad", [
    [], {"t": "res"}, {**REPLY, "id": "7"}, {**REPLY, "over": 0}, {**REPLY, "dur": 1},
    {**REPLY, "r": {**RESULT, "status": 99}}, {**REPLY, "r": {**RESULT, "status": True}},
    {**REPLY, "r": {**RESULT, "headers": [["a"]]}}, {**REPLY, "r": {**RESULT, "headers": [[1, "b"]]}},
    {**REPLY, "r": {**RESULT, "body": "text"}},
    {**REPLY, "r": {**RESULT, "error": {"kind": "pwned", "message": "", "line": None,
                                          "traceback": None}}},
    {"t": "ready", "pid": 1, "hard": {"x": 1}, "notes": []}, {"t": "boom"},
    # A worker that was taken over cannot put framing, hop-by-hop or the
    # service's own headers on the wire, nor split a header.
    {**REPLY, "r": {**RESULT, "headers": [["Content-Length", "0"]]}},
    {**REPLY, "r": {**RESULT, "headers": [["Transfer-Encoding", "chunked"]]}},
    {**REPLY, "r": {**RESULT, "headers": [["X-Request-Id", "forged"]]}},
    {**REPLY, "r": {**RESULT, "headers": [["Set-Cookie", "session=stolen"]]}},
    {**REPLY, "r": {**RESULT, "headers": [["X-A", "1\r\nSet-Cookie: a=b"]]}},
    {**REPLY, "r": {**RESULT, "headers": [["Bad Name", "v"]]}},
    {**REPLY, "r": {**RESULT, "headers": [["X-N", "v"]] * 65}},
    {**REPLY, "r": {**RESULT, "contentType": "text/html\r\nSet-Cookie: a=b"}},
    # Numbers the records store in integer columns: a line of 2**64-1 made
    # the records writer's whole batch fail (security review, session 16).
    {**REPLY, "r": {**RESULT, "error": {"kind": "script_error", "message": "m",
                                          "line": 2 ** 64 - 1, "traceback": None}}},
    {**REPLY, "r": {**RESULT, "error": {"kind": "script_error", "message": "m",
                                          "line": -1, "traceback": None}}},
    {"t": "where", "id": 7, "line": 2 ** 40, "tb": ""},
    {**REPLY, "rss": 2 ** 64}, {**REPLY, "rss": -1}, {**REPLY, "dur": 1.7e308},
    # Keys nothing reads (padding that made the service decode ~300 MB on every
    # reply, security review session 25), a result missing one, a meta with a
    # stranger in place of "err" (a KeyError in the service before).
    {**REPLY, "pad": [{}] * 10}, {**REPLY, "r": {**RESULT, "pad": 1}},
    {**REPLY, "r": {k: v for k, v in RESULT.items() if k != "error"}},
    {**REPLY, "r": {**RESULT, "error": {"kind": "script_error", "message": "m", "line": None,
                                          "traceback": None, "pad": 1}}},
    {"t": "code", "id": 7, "code": None, "exit": False,
     "meta": {"events": [], "endpoint": False, "gen": False, "pad": 1}},
    {"t": "need", "id": 7, "pad": 1}, {"t": "where", "id": 7, "line": 1, "tb": "", "x": 1},
    # A key left out: a KeyError in the service before (second review, session 25).
    {"t": "code", "id": 7, "exit": False,
     "meta": {"events": [], "endpoint": False, "gen": False, "err": None}},
    {"t": "where", "id": 7, "tb": ""}, {"t": "ready", "pid": 1, "hard": {}},
    {"t": "need"}, {"t": "xres", "id": 7},
    # Unhashable where a name is looked up: a TypeError in the service before.
    {"t": ["res"]}, {**REPLY, "r": {**RESULT, "error": {"kind": ["script_error"], "message": "m",
                                                         "line": None, "traceback": None}}},
])
def test_malformed_worker_messages_are_refused(bad: object) -> None:
    with pytest.raises(ProtocolError):
        protocol.check_reply(bad)


def _random_object(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(9 if depth < 4 else 6)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, 1, 127, 128, -1, -32, -33, 255, 256, 65535, 65536, 2 ** 32,
                           2 ** 63, -2 ** 63, 2 ** 64 - 1])
    if kind == 2:
        return rng.random() * 1e6
    if kind == 3:
        return "é" * rng.choice([0, 1, 31, 32, 255, 256, 70000])
    if kind in (4, 5):
        return b"x" * rng.choice([0, 1, 255, 256, 65536])
    if kind in (6, 7):
        return [_random_object(rng, depth + 1) for _ in range(rng.choice([0, 1, 15, 16, 40]))]
    return {f"k{i}": _random_object(rng, depth + 1) for i in range(rng.choice([0, 1, 15, 16, 20]))}


def _count(obj: object) -> int:
    if isinstance(obj, list):
        return 1 + sum(_count(x) for x in obj)
    if isinstance(obj, dict):
        return 1 + sum(1 + _count(v) for v in obj.values())
    return 1


def _depth(obj: object) -> int:
    if isinstance(obj, list):
        return 1 + max((_depth(x) for x in obj), default=0)
    if isinstance(obj, dict):
        return 1 + max((_depth(x) for x in obj.values()), default=0)
    return 0


WALKERS = [pytest.param(frameshape.items, id="python")]
if _frameshape is not None:
    WALKERS.append(pytest.param(_frameshape.items, id="c"))


@pytest.mark.parametrize("items", WALKERS)
def test_a_frames_objects_are_counted_before_it_is_decoded(items: Any) -> None:
    rng = random.Random(25)
    for _ in range(300):
        obj = _random_object(rng)
        body = msgpack.packb(obj, use_bin_type=True)
        n, depth = _count(obj), _depth(obj)
        assert items(body, 1 << 20, 64) == n
        assert items(body, n, depth) == n
        if n > 1:
            assert items(body, n - 1, 64) == -1
        if depth:
            assert items(body, 1 << 20, depth - 1) == -1
        # Truncated or followed by more bytes: not one msgpack object.
        assert items(body[:-1], 1 << 20, 64) == -1
        assert items(body + b"\xc0", 1 << 20, 64) == -1
    for bad in (b"", b"\xc1", b"\xd4\x01\x00", b"\xc7\x01\x01x", b"\xdd\xff\xff\xff\xff"):
        assert items(bad, 1 << 20, 64) == -1


@pytest.mark.skipif(_frameshape is None, reason="sandbox._frameshape did not build")
def test_the_c_walk_and_its_python_twin_agree_on_damaged_frames() -> None:
    rng = random.Random(2025)
    for _ in range(300):
        body = bytearray(msgpack.packb(_random_object(rng), use_bin_type=True))
        for _ in range(rng.randrange(1, 4)):
            body[rng.randrange(len(body))] = rng.randrange(256)
        for limits in ((1 << 20, 64), (50, 3)):
            assert _frameshape.items(bytes(body), *limits) == frameshape.items(bytes(body), *limits)


def test_a_frame_of_tiny_objects_is_refused_without_decoding_it() -> None:
    # One byte of msgpack (an empty map) is ~70 bytes of Python: a worker taken
    # over by its script made the service allocate ~300 MB per 4 MiB frame
    # (security review, session 25).
    n = protocol.MAX_REPLY_BYTES - 64
    body = b"\x82\xa1t\xa3res\xa3pad\xdd" + n.to_bytes(4, "big") + b"\x80" * n
    frame = len(body).to_bytes(4, "big") + body
    tracemalloc.start()
    try:
        with pytest.raises(ProtocolError, match="too many objects"):
            list(protocol.FrameReader(protocol.MAX_REPLY_BYTES, bounded=True).feed(frame))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * len(frame) + (1 << 20)
    # What a worker legitimately sends passes: 64 headers, a 1 MiB body, the
    # longest output and traceback.
    big = {**REPLY, "r": {**RESULT, "headers": [[f"X-H{i}", "v" * 100] for i in range(64)],
                          "body": b"b" * (1 << 20), "output": "o" * protocol.MAX_OUTPUT_CHARS,
                          "error": {"kind": "script_error", "message": "m" * 1000, "line": 3,
                                    "traceback": "t" * protocol.MAX_TRACEBACK_CHARS}},
           "rss": 1}
    frame = protocol.encode(big, protocol.MAX_REPLY_BYTES)
    (msg,) = list(protocol.FrameReader(protocol.MAX_REPLY_BYTES, bounded=True).feed(frame))
    assert protocol.check_reply(msg) == big


def test_a_worker_message_is_either_accepted_or_a_protocol_error() -> None:
    # Whatever a taken-over worker sends, the check answers with ProtocolError,
    # never another exception (which left the worker in place: see above).
    rng = random.Random(7)
    shapes = [REPLY, {"t": "code", "id": 7, "code": b"c", "exit": False,
                      "meta": {"events": ["endpoint"], "endpoint": True, "gen": False,
                               "err": None}},
              {"t": "where", "id": 7, "line": 1, "tb": ""}, {"t": "need", "id": 7},
              {"t": "compiled", "id": 7}, {"t": "ready", "pid": 1, "hard": {}, "notes": []},
              {"t": "xres", "id": 7, "ok": True}]
    for _ in range(3000):
        msg: Any = dict(rng.choice(shapes))
        for _ in range(rng.randrange(1, 3)):
            key = rng.choice([*msg, "pad"])
            if rng.random() < 0.3:
                msg.pop(key, None)
            else:
                msg[key] = _random_object(rng, 2)
        try:
            protocol.check_reply(msg)
        except ProtocolError:
            pass


def test_line_numbers_a_script_can_have_pass() -> None:
    error = {"kind": "script_error", "message": "m", "line": 262_145, "traceback": None}
    assert protocol.check_reply({**REPLY, "r": {**RESULT, "error": error}, "rss": 1 << 40})
    assert protocol.check_reply({"t": "where", "id": 7, "line": 1, "tb": ""})


def test_job_validation() -> None:
    job = {"t": "job", "id": 1, "key": "k", "ver": 1, "dig": b"d" * 32, "src": None,
           "event": {}, "ms": 5, "mem": 9, "until": 12.5}
    assert protocol.check_job(job) is job
    meta = {"events": ["endpoint"], "endpoint": True, "gen": False, "err": None}
    shipped = {**job, "src": "x", "code": b"c", "meta": meta}
    assert protocol.check_job(shipped) is shipped
    for bad in ({**job, "src": 3}, {**job, "event": []}, {**job, "t": "exec"}, {"t": "x"},
                {**job, "dig": None}, {**job, "code": "text"}, {**shipped, "src": None},
                {**shipped, "meta": {**meta, "endpoint": 1}},
                {**shipped, "meta": {**meta, "err": ["1", "x"]}}, {**job, "until": 12},
                {**job, "until": None}):
        with pytest.raises(ProtocolError):
            protocol.check_job(bad)


def test_ext_types_never_pass_validation() -> None:
    body = msgpack.packb({**REPLY, "r": msgpack.ExtType(1, b"x")}, use_bin_type=True)
    (msg,) = list(protocol.FrameReader(1 << 20).feed(len(body).to_bytes(4, "big") + body))
    with pytest.raises(ProtocolError):
        protocol.check_reply(msg)


def test_errors_cross_processes_as_dicts() -> None:
    err = SandboxError.from_dict(PoolBusyError("full").to_dict())
    assert type(err) is PoolBusyError and err.message == "full"
    assert type(SandboxError.from_dict({"code": "nope", "message": 3})) is SandboxError
    assert type(SandboxError.from_dict("junk")) is SandboxError
