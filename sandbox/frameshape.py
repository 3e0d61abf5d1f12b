"""The Python twin of ``sandbox/_frameshape.c`` (used when the extension did not build).

``items(buf, max_items, max_depth)``: how many objects the one msgpack object
in ``buf`` decodes to, or -1 past ``max_items`` objects or ``max_depth``
levels of containers, for trailing or missing bytes, and for types the
protocol never uses (ext). Nothing is allocated per object, so a worker's
frame is measured before it is decoded (see ``sandbox.protocol.decode``).
"""
from __future__ import annotations

#: Fixed-size scalars: first byte -> bytes that follow it.
_FIXED = {0xca: 4, 0xcb: 8, 0xcc: 1, 0xcd: 2, 0xce: 4, 0xcf: 8,
          0xd0: 1, 0xd1: 2, 0xd2: 4, 0xd3: 8}
#: str/bin: first byte -> width of the length that follows.
_SIZED = {0xc4: 1, 0xc5: 2, 0xc6: 4, 0xd9: 1, 0xda: 2, 0xdb: 4}
#: array16/32, map16/32: first byte -> (width of the count, objects per count).
_CONTAINERS = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}


def items(buf: bytes | bytearray | memoryview, max_items: int, max_depth: int) -> int:
    data = bytes(buf)
    end = len(data)
    left = [1]          # objects still to read in each open container
    pos = count = 0
    while True:
        while len(left) > 1 and left[-1] == 0:
            left.pop()
        if left[-1] == 0:
            return count if pos == end else -1
        left[-1] -= 1
        count += 1
        if count > max_items or pos >= end:
            return -1
        b = data[pos]
        pos += 1
        opened = -1
        if b <= 0x7f or b >= 0xe0 or b in (0xc0, 0xc2, 0xc3):
            continue
        if 0x80 <= b <= 0x8f:
            opened = 2 * (b & 0x0f)
        elif 0x90 <= b <= 0x9f:
            opened = b & 0x0f
        elif 0xa0 <= b <= 0xbf:
            skip = b & 0x1f
        elif b in _FIXED:
            skip = _FIXED[b]
        elif b in _SIZED or b in _CONTAINERS:
            width, per = _CONTAINERS.get(b, (_SIZED.get(b, 0), 0))
            if end - pos < width:
                return -1
            n = int.from_bytes(data[pos:pos + width], "big")
            pos += width
            if per:
                opened = n * per
            else:
                skip = n
        else:
            return -1     # 0xc1 (never used), ext and fixext
        if opened >= 0:
            if opened > max_items - count or len(left) > max_depth:
                return -1
            if opened:
                left.append(opened)
        else:
            if skip > end - pos:
                return -1
            pos += skip
