"""While ``specctl generate`` reads a long prompt (a 3,245-token prompt is 40 s of the 1.5B
target on a 2-core CPU): a transient progress bar on a terminal, chunk by chunk, and the
statistic's note of what the prompt took, so that the rate after it is not hidden."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from specctl.spec.stats import GenerationStats  # no torch: `specctl --help` must not import it

if TYPE_CHECKING:  # annotations only: `specctl --help` must not import torch
    from specctl.spec.decode import DecodeSession


class PromptBar:
    """What to give ``run_to_end(prefilled=)``: a bar of the prompt's tokens moved chunk by
    chunk, stopped (and wiped) with the last chunk, before the first token is written."""

    def __init__(self, bar: Progress | None, total: int) -> None:
        self.bar = bar
        self.task = bar.add_task("prompt", total=total) if bar is not None else None

    @property
    def showing(self) -> bool:
        return self.bar is not None and self.bar.live.is_started

    def __call__(self, session: DecodeSession) -> None:
        self.at(session.prefilled, session.prompt_len)

    def at(self, processed: int, total: int) -> None:
        """``processed`` of the prompt's ``total`` tokens are in (a remote target's PROMPT_PROGRESS)."""
        if self.bar is None:
            return
        self.bar.update(self.task, completed=processed, total=total)
        if processed >= total:
            self.bar.stop()


@contextmanager
def prompt_bar(console: Console, total: int) -> Iterator[PromptBar]:
    """A PromptBar over ``total`` tokens: drawn on a terminal only (piped, it does nothing)."""
    if not console.is_terminal:
        yield PromptBar(None, total)
        return
    bar = Progress(SpinnerColumn(), TextColumn("reading the prompt"), BarColumn(), MofNCompleteColumn(),
                   TimeElapsedColumn(), console=console, transient=True)
    with bar:
        yield PromptBar(bar, total)


def prompt_note(stats: GenerationStats) -> str:
    """The statistic's note when reading the prompt took a second or more: its tokens, that
    time, and the rate of the output after it."""
    if stats.prefill_s < 1.0:
        return ""
    after = stats.wall_s - stats.prefill_s
    rate = f"; {stats.new_tokens / after:.2f} tok/s after it" if after > 0 and stats.new_tokens else ""
    return f" (prompt {stats.prompt_tokens:,} tokens read in {stats.prefill_s:.1f} s{rate})"


def remote_statistic(count: int, wall_s: float, remote: str, served: str, stats: dict) -> str:
    """``generate --remote``'s closing line: the target's stats (GenerationStats.to_dict), with
    the prompt's note when the target took a second or more to read it."""
    read = GenerationStats(prompt_tokens=stats.get("prompt_tokens", 0), new_tokens=count,
                           prefill_s=stats.get("prefill_ms", 0.0) / 1e3, wall_s=wall_s)
    return (f"{count} tokens in {wall_s:.2f}s via {remote} ({served}), "
            f"mean accepted length {stats.get('mean_accepted_length', 0):.2f}{prompt_note(read)}")
