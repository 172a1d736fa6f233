"""Headless Chromium for the tests that look at a page as a person would: Debian's
chromium (.ci/run installs it when missing; ``FLEET_CHROMIUM`` names another), and a
PNG reader for the screenshots it takes (no imaging library needed)."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("FLEET_CHROMIUM", "/usr/bin/chromium")


def chromium(*args: str) -> subprocess.CompletedProcess[bytes]:
    if not Path(CHROMIUM).exists() and shutil.which("chromium") is None:
        pytest.fail("headless Chromium renders the Fleet page: apt-get install -y chromium "
                    "(.ci/run does it), or set FLEET_CHROMIUM")
    binary = CHROMIUM if Path(CHROMIUM).exists() else str(shutil.which("chromium"))
    return subprocess.run([binary, "--headless", "--no-sandbox", "--disable-gpu",
                           "--hide-scrollbars", "--disable-dev-shm-usage",
                           "--virtual-time-budget=3000", *args],
                          capture_output=True, timeout=120)


def png_pixels(data: bytes) -> tuple[int, int, list[tuple[int, int, int]]]:
    """(width, height, RGB pixels) of an 8-bit RGB/RGBA non-interlaced PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    height = depth = color = 0
    while pos < len(data):
        length, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    assert depth == 8
    assert color in (2, 6)
    step = 3 if color == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * step
    rows: list[bytearray] = []
    prev = bytearray(stride)
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1:start + 1 + stride])
        for i in range(stride):
            a = line[i - step] if i >= step else 0
            b, c = prev[i], prev[i - step] if i >= step else 0
            if kind == 1:
                line[i] = (line[i] + a) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + b) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (a + b) // 2) & 0xFF
            elif kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else c)
                line[i] = (line[i] + pred) & 0xFF
        rows.append(line)
        prev = line
    pixels = [(row[x], row[x + 1], row[x + 2]) for row in rows for x in range(0, stride, step)]
    return width, height, pixels
