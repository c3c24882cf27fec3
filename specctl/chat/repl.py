"""``specctl chat``: an interactive client of a gateway. Streams the reply as tokens are
accepted, prints a one-line statistic after it, and keeps the conversation."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

import aiohttp
from rich.console import Console

from specctl.chat.commands import HELP, ChatState, Quit, command, retry_point

MULTILINE = '"""'  # a message of several lines begins and ends with it (Ollama's REPL's)
from specctl.errors import unreachable_reason

def stat_line(usage: dict, spec: dict, first_s: float | None, last_s: float | None) -> str:
    """tokens/s counts from the first streamed text to the last, so the prompt's prefill
    (reported as "first after") does not dilute the decoding speed."""
    tokens = usage.get("completion_tokens", 0)
    decoding = (last_s - first_s) if first_s is not None and last_s is not None else 0.0
    rate = f"{(tokens - 1) / decoding:.1f} tok/s" if tokens > 1 and decoding > 0 else "- tok/s"
    first = f", first after {first_s:.1f}s" if first_s is not None else ""
    predicted = usage.get("completion_tokens_details") or {}
    prediction = (f", prediction {predicted['accepted_prediction_tokens']} accepted "
                  f"{predicted.get('rejected_prediction_tokens', 0)} rejected"
                  if "accepted_prediction_tokens" in predicted else "")
    return (f"{tokens} token{'' if tokens == 1 else 's'}{first}, {rate}, mean accepted length {spec.get('mean_accepted_length', 0):.2f}, "
            f"acceptance {spec.get('acceptance_rate', 0):.0%}{prediction}")


async def stream_reply(url: str, state: ChatState, on_text: Callable[[str], None],
                       api_key: str | None = None, on_thought: Callable[[str], None] | None = None,
                       on_progress: Callable[[dict], None] | None = None) -> tuple[str, dict, dict]:
    """One streamed chat completion: (text, usage, specctl stats); the model's thinking, where
    the gateway's reasoning parser sends it apart, to ``on_thought``; how far the prompt is
    read (its prompt_progress) to ``on_progress``. Errors raise RuntimeError. A gateway that
    refuses return_progress by name (a 400, as OpenAI's refuses fields it does not know) is
    asked again without it, and the state stops asking."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    text, usage, spec = [], {}, {}
    async with aiohttp.ClientSession() as session:
        while True:
            response = await session.post(url.rstrip("/") + "/v1/chat/completions", json=state.request_body(),
                                          headers=headers)
            if response.status == 200:
                break
            try:
                message = (await response.json())["error"]["message"]
            except Exception:  # noqa: BLE001
                message = await response.text()
            response.release()
            if not (response.status == 400 and state.ask_progress and "return_progress" in message):
                raise RuntimeError(f"gateway answered {response.status}: {message}")
            state.ask_progress = False
        async with response:
            async for raw in response.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"]["message"])
                usage = chunk.get("usage") or usage
                spec = chunk.get("specctl") or spec
                if "prompt_progress" in chunk and on_progress is not None:
                    on_progress(chunk["prompt_progress"])
                for choice in chunk.get("choices", []):
                    thought = choice.get("delta", {}).get("reasoning")
                    if thought and on_thought is not None:
                        on_thought(thought)
                    delta = choice.get("delta", {}).get("content")
                    if delta:
                        text.append(delta)
                        on_text(delta)
    return "".join(text), usage, spec


async def fetch_feed(url: str, api_key: str | None = None) -> dict:
    from specctl.monitor.source import gateway_feed

    async with aiohttp.ClientSession() as session:
        return await gateway_feed(session, url, api_key)


class Replies:
    """Runs one reply at a time on its own event loop and lets another thread stop it:
    when the REPL is not in the main thread, Ctrl-C reaches the main thread's handler,
    which calls ``interrupt()``. In the main thread asyncio.run's own Ctrl-C handling does it."""

    def __init__(self) -> None:
        self._current: tuple[asyncio.AbstractEventLoop, asyncio.Task] | None = None

    def run(self, coro):
        async def main():
            self._current = (asyncio.get_running_loop(), asyncio.current_task())
            try:
                return await coro
            finally:
                self._current = None

        try:
            return asyncio.run(main())
        except asyncio.CancelledError:
            raise KeyboardInterrupt from None

    def interrupt(self) -> bool:
        """Stop the running reply; False when none is running."""
        current = self._current
        if current is None:
            return False
        loop, task = current
        loop.call_soon_threadsafe(task.cancel)
        return True


def repl(url: str, console: Console, state: ChatState | None = None, api_key: str | None = None,
         read: Callable[[], str] | None = None, replies: Replies | None = None,
         read_more: Callable[[], str] | None = None) -> None:
    """``read``: the next line typed; ``read_more``: the next line of a message begun with \"\"\"
    (``read`` when not given, a "..." prompt by default)."""
    state = state or ChatState()
    replies = replies or Replies()
    read_more = read_more or read or (lambda: console.input("[dim]...[/] "))
    read = read or (lambda: console.input("[bold green]you>[/] "))
    console.print(f"[dim]{HELP}[/]")
    while True:
        try:
            line = read()
            block = line.lstrip().startswith(MULTILINE)  # a message, whatever it begins with
            if block:
                line = multiline(line, read_more)
        except EOFError:
            break
        except KeyboardInterrupt:
            console.print("\n[dim](Ctrl-D or /quit to leave)[/]")
            continue
        if not line.strip():
            continue
        retry = not block and line.strip() == "/retry"
        if retry:
            if not retry_point(state):
                console.print("[dim]nothing to retry[/]")
                continue
        elif not block and line.startswith("/"):
            if line.strip() == "/stats":
                show_stats(url, console, api_key)
                continue
            try:
                console.print(f"[dim]{command(line, state)}[/]")
            except Quit:
                break
            continue
        else:
            state.messages.append({"role": "user", "content": line})
        reply(url, console, state, api_key, replies, keep_on_error=retry)


def multiline(first: str, read_more: Callable[[], str]) -> str:
    """A message typed over several lines between \"\"\" and \"\"\" (Ollama's REPL's rule): the lines
    between, as typed; one line may hold both. EOFError when input ends before the closing quotes."""
    lines = [first.lstrip()[len(MULTILINE):]]
    while not lines[-1].rstrip().endswith(MULTILINE) or (len(lines) == 1 and not lines[0].strip()):
        lines.append(read_more())
    lines[-1] = lines[-1].rstrip()[:-len(MULTILINE)]
    return "\n".join(lines).strip("\n")


def reading_line(progress: dict | None, elapsed_s: float) -> str:
    """The status shown until a reply's first text: how far the gateway has read the prompt
    (its last prompt_progress), or that the reply is awaited."""
    if not progress or not progress.get("total"):
        return f"waiting for the reply ({elapsed_s:.0f} s)"
    total, done = progress["total"], progress.get("processed", 0)
    cached = f", {progress['cache']:,} from the cache" if progress.get("cache") else ""
    return f"reading the prompt: {done:,} of {total:,} tokens{cached} ({done / total:.0%}, {elapsed_s:.0f} s)"


class Reading:
    """The status line's text, rendered afresh at each refresh: its seconds count on between
    two prompt_progress chunks (a 512-token chunk of the 1.5B target is seconds on a CPU)."""

    def __init__(self) -> None:
        self.started, self.progress = time.perf_counter(), None

    def __rich__(self) -> str:
        return reading_line(self.progress, time.perf_counter() - self.started)


def reply(url: str, console: Console, state: ChatState, api_key: str | None, replies: Replies,
          keep_on_error: bool = False) -> None:
    """The reply to the conversation's last (user) message, streamed, then its statistic. On an
    error that message is dropped (it can be sent again), unless ``keep_on_error`` (/retry). On
    a terminal a status line says how far the prompt is read until the first text comes."""
    started = time.perf_counter()
    pieces: list[str] = []
    first_s = last_s = None  # when the first and the latest text arrived
    reading = Reading()
    status = console.status(reading) if console.is_terminal else None
    if status is not None:
        status.start()
    else:
        console.print("[bold cyan]assistant>[/] ", end="")

    def begin() -> None:  # the status gives way to the reply, once
        nonlocal status
        if status is not None:
            status.stop()
            status = None
            console.print("[bold cyan]assistant>[/] ", end="")

    def progressed(progress: dict) -> None:
        reading.progress = progress

    def arrived() -> None:
        nonlocal first_s, last_s
        begin()
        last_s = time.perf_counter() - started
        first_s = last_s if first_s is None else first_s

    def show(delta: str) -> None:
        arrived()
        pieces.append(delta)
        console.print(delta, end="", markup=False, highlight=False, soft_wrap=True)

    def think(delta: str) -> None:  # shown dimmed, kept out of the conversation (templates drop past thinking)
        arrived()
        console.print(delta, end="", style="dim italic", markup=False, highlight=False, soft_wrap=True)

    try:
        try:
            text, usage, spec = replies.run(stream_reply(url, state, show, api_key, think, progressed))
        finally:
            begin()
    except KeyboardInterrupt:  # asyncio.run cancelled the stream: the gateway cancels the generation
        state.prediction = None
        state.messages.append({"role": "assistant", "content": "".join(pieces)})
        console.print("\n[yellow](stopped)[/]")
        return
    except (RuntimeError, aiohttp.ClientError, OSError) as exc:
        if not keep_on_error:
            state.messages.pop()
        console.print(f"\n[red]error: {failure_message(url, exc)}[/]", markup=True, highlight=False)
        return  # a /predict is kept for the message sent again
    state.prediction = None  # one reply's
    state.messages.append({"role": "assistant", "content": text})
    console.print()
    console.print(f"[dim]{stat_line(usage, spec, first_s, last_s)}[/]")


def failure_message(url: str, exc: BaseException) -> str:
    """What went wrong with a reply, and for a gateway that cannot be reached, what to do."""
    reason = unreachable_reason(exc)
    if reason:
        return (f"cannot reach the gateway at {url} ({reason}): start one "
                "(`specctl up` or `specctl gateway`), or leave out --gateway to chat with an embedded cluster")
    return str(exc)


GREETING_TIMEOUT_S = 5.0


async def served_model(url: str, api_key: str | None = None) -> str:
    """The model the gateway serves (the first of its /v1/models)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with aiohttp.ClientSession() as session:
        async with session.get(url.rstrip("/") + "/v1/models", headers=headers,
                               timeout=aiohttp.ClientTimeout(total=GREETING_TIMEOUT_S)) as response:
            if response.status == 401:
                raise PermissionError("it refused the API key: pass --api-key (or set SPECCTL_API_KEY)")
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]


def greeting(url: str, api_key: str | None = None) -> str:
    """The line a chat with a gateway starts with: the model it serves, or why it does not
    answer. The chat starts either way (a gateway may come up later; /save and /load work
    without one), but a user should not find out only after typing a message."""
    try:
        return f"[dim]chatting with {url} (model {asyncio.run(served_model(url, api_key))})[/]"
    except PermissionError as exc:
        return f"[yellow]the gateway at {url}: {exc}[/]"
    except asyncio.TimeoutError:
        why = f"the gateway at {url} gave no answer within {GREETING_TIMEOUT_S:g} s"
    except Exception as exc:  # noqa: BLE001 - said, and the chat goes on
        why = failure_message(url, exc) or type(exc).__name__
    return f"[yellow]{why}; messages go out once it answers[/]"


def show_stats(url: str, console: Console, api_key: str | None = None) -> None:
    from specctl.monitor.render import dashboard
    from specctl.monitor.view import MonitorState, advance

    try:
        feed = asyncio.run(fetch_feed(url, api_key))
    except Exception as exc:  # noqa: BLE001
        console.print(f"[red]cannot read stats from {url}: {exc}[/]")
        return
    console.print(dashboard(advance(MonitorState(url), feed, time.time())))
