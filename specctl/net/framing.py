"""Reading and writing frames on asyncio streams, with the size limit enforced before the
body is read (a huge length prefix never allocates)."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os

from specctl.net.protocol import MAX_FRAME_BYTES, Message, ProtocolError, decode, encode


async def read_message(reader: asyncio.StreamReader, max_bytes: int = MAX_FRAME_BYTES) -> Message:
    """Next message; EOF raises asyncio.IncompleteReadError, bad frames ProtocolError."""
    header = await reader.readexactly(4)
    length = int.from_bytes(header, "big")
    if length > max_bytes:
        raise ProtocolError(f"frame of {length} bytes exceeds the limit of {max_bytes} bytes")
    return decode(await reader.readexactly(length))


async def write_message(writer: asyncio.StreamWriter, message: Message) -> None:
    writer.write(encode(message))
    await writer.drain()


def new_nonce() -> bytes:
    return os.urandom(32)


def sign(token: str, nonce: bytes) -> bytes:
    return hmac.new(token.encode(), nonce, hashlib.sha256).digest()


def verify_signature(token: str, nonce: bytes, signature: bytes) -> bool:
    return hmac.compare_digest(sign(token, nonce), signature)
