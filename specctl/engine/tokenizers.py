"""Tokenizers loaded once per content. A draft and its target usually ship the same tokenizer
files, and parsing a 150k-token tokenizer takes most of a second (hashing its vocabulary for the
handshake a quarter more): the second model of a pair gets the first one's tokenizer. Shared
tokenizers are only read (encode, decode, chat templates); a caller that changes one (a chat
template of its own) copies it first, as the embedded gateway does."""

from __future__ import annotations

import hashlib
import json
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import Any

# what in a checkpoint directory is not the tokenizer's (AutoTokenizer reads config.json only for
# the class to build: its model_type and tokenizer_class, which the key holds)
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt", ".pth", ".msgpack", ".h5", ".onnx", ".lock")
NOT_TOKENIZER = frozenset({"config.json", "generation_config.json", "specctl-model.json",
                           "model.safetensors.index.json", "pytorch_model.bin.index.json"})
KEPT = 4  # tokenizers held at once (a gateway of several drafters; tests load dozens of tiny ones)

_lock = threading.Lock()
_loaded: OrderedDict[str, Any] = OrderedDict()
_fingerprints: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def tokenizer_key(path: Path | str) -> str:
    """A digest of everything AutoTokenizer reads in ``path``: equal for two directories whose
    tokenizers are the same."""
    path, digest = Path(path), hashlib.sha256()
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    digest.update(json.dumps([config.get("model_type"), config.get("tokenizer_class")]).encode())
    for file in sorted(path.iterdir()):
        if file.is_file() and file.name not in NOT_TOKENIZER and not file.name.endswith(WEIGHT_SUFFIXES):
            digest.update(file.name.encode() + b"\0" + hashlib.sha256(file.read_bytes()).digest())
    return digest.hexdigest()


def load_tokenizer(path: Path | str) -> Any:
    """``path``'s tokenizer (transformers' AutoTokenizer), the same object for directories with
    the same tokenizer files."""
    key = tokenizer_key(path)
    with _lock:  # held while loading: a second caller of the same key waits and shares
        if key in _loaded:
            _loaded.move_to_end(key)
            return _loaded[key]
        tokenizer = read_tokenizer(path)
        _loaded[key] = tokenizer
        while len(_loaded) > KEPT:
            _loaded.popitem(last=False)
        return tokenizer


def read_tokenizer(path: Path | str) -> Any:
    """A fresh AutoTokenizer of ``path``; what transformers could not load said in one line."""
    from transformers import AutoTokenizer

    from specctl.engine.families import checkpoint_unreadable

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # missing or broken tokenizer files, a slow tokenizer without its library
        raise checkpoint_unreadable(path, exc, "load its tokenizer", "the checkpoint needs its tokenizer files "
                                    "(tokenizer.json; or tokenizer.model with sentencepiece installed)") from None


def vocab_fingerprint(tokenizer: Any) -> str:
    """A digest of the token -> id map: what draft, target and gateway compare at the handshake.
    Computed once per tokenizer object."""
    with _lock:
        known = _fingerprints.get(tokenizer)
    if known is not None:
        return known
    items = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    fingerprint = hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]
    with _lock:
        _fingerprints[tokenizer] = fingerprint
    return fingerprint
