"""Frames between pool and workers: caps, splitting, validation."""
from __future__ import annotations

import msgpack
import pytest

from sandbox import protocol
from sandbox.errors import PoolBusyError, ProtocolError, SandboxError

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
])
def test_malformed_worker_messages_are_refused(bad: object) -> None:
    with pytest.raises(ProtocolError):
        protocol.check_reply(bad)


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
