"""The link from one pipeline stage to the next: one TCP connection, the usual handshake
(role "stage", the model's vocabulary fingerprint, auth, TLS), frames written in the order
they are posted. Replies (StageOutput, Error) come back on the same connection.

This is the whole transport interface the pipeline uses (connect, post, replies, closed):
an NCCL link for GPU boxes would implement the same four things."""

from __future__ import annotations

import asyncio
import logging
import ssl as ssl_module
from typing import Callable

from specctl.net.framing import read_message
from specctl.net.handshake import open_peer
from specctl.net.protocol import Message, encode

log = logging.getLogger("specctl.pipeline")
STAGE_FRAME_BYTES = 1 << 30  # hidden states of a long prompt and logits rows over a large vocabulary


class StageLink:
    def __init__(self, host: str, port: int, *, model: str, fingerprint: str, on_reply: Callable[[Message], None],
                 auth_token: str | None = None, ssl: ssl_module.SSLContext | None = None,
                 layers: tuple[int, int] | None = None) -> None:
        self.host, self.port, self.model, self.fingerprint = host, port, model, fingerprint
        self.layers = layers  # the sending stage's layers: the next stage checks that it starts where they end
        self.on_reply, self.auth_token, self.ssl = on_reply, auth_token, ssl
        self.closed = asyncio.Event()
        self.error: str | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._reader_task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def connect(self) -> None:
        """Connect and shake hands; raises what the connection or the handshake raised."""
        reader, writer, _ = await open_peer(self.host, self.port, role="stage", model=self.model,
                                            fingerprint=self.fingerprint, auth_token=self.auth_token, ssl=self.ssl,
                                            layers=list(self.layers) if self.layers else None)
        self._writer = writer
        self._reader_task = asyncio.create_task(self._read(reader))

    def post(self, message: Message) -> None:
        """Queue one frame (loop thread only). Frames leave in posting order."""
        if self._writer is None or self.closed.is_set():
            return
        self._writer.write(encode(message))

    async def _read(self, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                self.on_reply(await read_message(reader, STAGE_FRAME_BYTES))
        except asyncio.CancelledError:
            raise
        except (asyncio.IncompleteReadError, ConnectionError):
            self.error = f"the stage at {self.address} closed the connection"
        except Exception as exc:  # noqa: BLE001 - a bad frame, ...: the link is gone either way
            self.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        finally:
            self._shut()

    def give_up(self, error: str) -> None:
        """Close it from this side (a peer that stopped answering), ``error`` saying why."""
        self.error = error
        self._shut()

    def _shut(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self.closed.set()

    async def close(self) -> None:
        if self._reader_task is not None:
            self._reader_task.cancel()
            await asyncio.gather(self._reader_task, return_exceptions=True)
        self._shut()
