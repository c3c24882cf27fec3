"""``specctl generate``: one prompt, streamed, in one process."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Optional

import typer
from rich.console import Console

from specctl.cli import logprob_report
from specctl.cli.prompt_reading import prompt_bar, prompt_note, remote_statistic
from specctl.cli.sampling_flags import (
    stop_patterns, structured_flags, text_of, with_bad_words, with_prediction_text, with_samplers,
    with_thinking_budget,
)
from specctl.config import build_config
from specctl.engine import text


class TextStreamer:
    """Prints only the new, complete characters of the growing output (``out`` None: keeps
    them), up to a stop string or through a stop pattern's match: ``stopped`` then turns true."""

    def __init__(self, tokenizer, out=sys.stdout, stop: tuple[str, ...] = (), stop_regex: tuple = ()) -> None:
        self.text, self.out, self.seen = text.IncrementalText(tokenizer, stop, stop_regex=stop_regex), out, 0

    @property
    def stopped(self) -> bool:
        return self.text.stopped

    def update(self, tokens: list[int]) -> None:
        delta = self.text.push(tokens[self.seen :])
        self.seen = len(tokens)
        if self.out is not None:
            self.out.write(delta)
            self.out.flush()

    def kept(self, tokens: list[int]) -> list[int]:
        """The output's tokens up to the one that completed a stop (a round's rest is not the output's)."""
        return tokens if self.text.stop_tokens is None else tokens[: self.text.stop_tokens]

    def finish(self) -> str:
        """The whole text handed out (cut before a stop string)."""
        rest = self.text.finish()
        if self.out is not None:
            self.out.write(rest + "\n")
        return self.text.text


def generate(
    prompt_text: Optional[str] = typer.Argument(None, metavar="PROMPT", show_default=False,
                                                help="the prompt text (or --prompt/-p)"),
    prompt: Optional[str] = typer.Option(None, "--prompt", "-p", help="the prompt text"),
    target: Optional[str] = typer.Option(None, help="target model: packaged name, HF directory or .gguf"),
    draft: Optional[str] = typer.Option(None, help="draft model; NAME@N = the first N layers of NAME"),
    chat: bool = typer.Option(False, "--chat", help="wrap the prompt in the target's chat template"),
    suffix: Optional[str] = typer.Option(None, "--suffix", help="fill in the middle: write the text between the "
                                         "prompt and this text (a code model with FIM tokens, as Qwen2.5-Coder, "
                                         "StarCoder2, DeepSeek-Coder, Codestral; OpenAI's suffix)"),
    max_tokens: int = typer.Option(128, "--max-tokens", "-n", help="most new tokens"),
    temperature: float = typer.Option(0.0, help="0 = greedy (exactly the target's greedy output)"),
    top_p: float = typer.Option(1.0, "--top-p", help="nucleus sampling mass"),
    top_k: int = typer.Option(0, "--top-k", help="keep the k most likely tokens (0 = off)"),
    min_p: float = typer.Option(0.0, "--min-p", help="drop tokens below min_p times the likeliest one's "
                                "probability (0 = off)"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help="divide the logits of tokens already "
                                             "in prompt or output (transformers' rule; 1 = off)"),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help="subtract from tokens already in the "
                                           "output (OpenAI's; -2..2)"),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help="subtract per earlier occurrence in "
                                            "the output (OpenAI's; -2..2)"),
    repeat_last_n: int = typer.Option(0, "--repeat-last-n", help="count the three penalties over the text's last N "
                                      "tokens, the prompt's included, as llama.cpp does (0 = vLLM's: repetition over "
                                      "prompt and output, presence and frequency over the output)"),
    json_schema: Optional[str] = typer.Option(None, "--json-schema", help="constrain the output to this JSON schema "
                                              "(its text, or @FILE)"),
    json_object: bool = typer.Option(False, "--json-object", help="constrain the output to a JSON object"),
    regex: Optional[str] = typer.Option(None, "--regex", help="constrain the output to this regular expression"),
    choice: Optional[list[str]] = typer.Option(None, "--choice", help="constrain the output to one of these strings "
                                               "(repeat the flag)"),
    grammar: Optional[str] = typer.Option(None, "--grammar", help="constrain the output to this Lark or GBNF "
                                          "grammar (its text, or @FILE)"),
    bad_words: Optional[list[str]] = typer.Option(None, "--bad-words", help="never write this word (vLLM's "
                                                  "bad_words; repeat the flag)"),
    stop: Optional[list[str]] = typer.Option(None, "--stop", help="end the output before this text (OpenAI's stop; "
                                             "repeat the flag)"),
    stop_regex: Optional[list[str]] = typer.Option(None, "--stop-regex", help="end the output with this regular "
                                                   "expression's first match, the match kept (SGLang's stop_regex; "
                                                   "repeat the flag)"),
    samplers: Optional[str] = typer.Option(None, "--samplers", help="llama.cpp's sampler order: names separated by "
                                           "';' (top_k;top_p;min_p;temperature) or their letters (kpmt); a sampler "
                                           "left out does not run (default: temperature first, as vLLM)"),
    prediction: Optional[str] = typer.Option(None, "--prediction", help="text the output is expected to resemble "
                                             "(its text, or @FILE; OpenAI's Predicted Outputs): drafted from where "
                                             "the output follows it, the output still the target's own"),
    thinking_budget: Optional[int] = typer.Option(None, "--thinking-budget", help="end a reasoning model's thought "
                                                  "(<think> ... </think>) after N tokens by forcing its </think> "
                                                  "(vLLM's thinking_token_budget; 0 ends it at once)"),
    cache_salt: Optional[str] = typer.Option(None, "--cache-salt", help="with --remote: reuse the instance's cached "
                                             "prefixes only among requests with this salt (vLLM's cache_salt)"),
    logprobs: Optional[int] = typer.Option(None, "--logprobs", help="each output token's log-probability under the "
                                           "target and its N likeliest alternatives (0-20; vLLM's logprobs): a "
                                           "table after the text, or the JSON's logprobs"),
    prompt_logprobs: Optional[int] = typer.Option(None, "--prompt-logprobs", help="the same for the prompt's tokens, "
                                                  "with each one's rank (vLLM's prompt_logprobs; a second pass over "
                                                  "the prompt)"),
    mode: Optional[str] = typer.Option(None, help="ar | chain | tree | ngram | suffix | multi (several drafters: "
                                       "--drafters)"),
    drafters: Optional[str] = typer.Option(None, help="mode multi: comma-separated drafters, routed per session and "
                                           "fused into one tree (model names, NAME@N, ngram, suffix)"),
    draft_stop: Optional[float] = typer.Option(None, "--draft-stop", help="adaptive depth: stop drafting once the draft's probability of its path is below this (0 = off)"),
    depth: Optional[int] = typer.Option(None, help="proposal depth d"),
    width: Optional[int] = typer.Option(None, help="tree width w (nodes kept per level)"),
    topk: Optional[int] = typer.Option(None, help="tree top-k children per node"),
    dtype: Optional[str] = typer.Option(None, help="fp32 | bf16 | fp16 (exactness is asserted in fp32)"),
    draft_quant: Optional[str] = typer.Option(None, "--draft-quant", help="none | int8: quantize the draft (CPU; still lossless)"),
    target_quant: Optional[str] = typer.Option(None, "--target-quant", help="none | int8: serve the int8 model as the target (CPU)"),
    seed: Optional[int] = typer.Option(None, help="sampling seed"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads (0 = default)"),
    profile: Optional[str] = typer.Option(None, help="hardware profile: desktop | server | jetson | FILE.toml"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object (ids, text, stats) instead of streaming"),
    remote: Optional[str] = typer.Option(None, help="HOST:PORT of a target instance (`specctl verify`) to generate on"),
    auth_token: Optional[str] = typer.Option(None, "--auth-token", envvar="SPECCTL_AUTH_TOKEN", help="auth token for --remote"),
    tls_ca: Optional[str] = typer.Option(None, "--tls-ca", help="CA file: talk TLS to --remote"),
) -> None:
    """Generate text with speculative decoding in one process (draft and target together)."""
    # torch loads here, not when the CLI starts: --help and flag errors stay quick
    from specctl.spec.factory import apply_threads, load_pair, make_drafter, make_multi_drafter
    from specctl.errors import ConfigError
    from specctl.spec.rounds import run_to_end
    from specctl.spec.params import SamplingParams

    prompt = one_prompt(prompt_text, prompt)
    if bad_words and not all(word.strip() for word in bad_words):  # before the models load
        raise ConfigError("--bad-words must not be empty: give a word")
    if stop and not all(stop):
        raise ConfigError("--stop must not be empty: give the text to stop before")
    if cache_salt is not None and not cache_salt:
        raise ConfigError("--cache-salt must not be empty: leave it out to share the prefix cache")
    if thinking_budget is not None and thinking_budget < 0:
        raise ConfigError(f"--thinking-budget must be 0 or more tokens, got {thinking_budget}")
    patterns = stop_patterns(stop_regex)
    prediction = text_of(prediction) if prediction is not None else None  # read before the models load
    if suffix is not None and chat:
        raise ConfigError("--suffix cannot go with --chat: an infill is a plain prompt in the model's FIM tokens")
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens, seed=seed,
                            repetition_penalty=repetition_penalty, presence_penalty=presence_penalty,
                            frequency_penalty=frequency_penalty, min_p=min_p, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs, penalty_last_n=repeat_last_n,
                            structured=structured_flags(json_schema, json_object, regex, choice, grammar),
                            cache_salt=cache_salt or "")
    params = with_samplers(params, samplers)
    config = build_config(
        profile, target=target, draft=draft, mode=mode, drafters=drafters, depth=depth, draft_stop=draft_stop, width=width, topk=topk, dtype=dtype, threads=threads,
        draft_quant=draft_quant, target_quant=target_quant,
    )
    apply_threads(config)
    console = Console(stderr=True)
    if remote:
        return _generate_remote(remote, target, prompt, chat, params, bad_words, as_json, auth_token, tls_ca,
                                console, tuple(stop or ()), suffix, patterns, prediction, thinking_budget)
    target_model, draft_model = load_pair(config, console)
    drafter = (make_multi_drafter(config, target_model, console) if config.mode == "multi"
               else make_drafter(config, draft_model))
    params = with_thinking_budget(with_prediction_text(with_bad_words(params, bad_words, target_model.tokenizer),
                                                       prediction, target_model.tokenizer),
                                  thinking_budget, target_model.tokenizer)
    ids, params = prompt_ids(target_model.tokenizer, prompt, chat, suffix, params)
    streamer = TextStreamer(target_model.tokenizer, None if as_json else sys.stdout, tuple(stop or ()), patterns)
    output: list[int] = []

    def on_tokens(tokens: list[int], _round) -> None:
        output.extend(tokens)
        streamer.update(output)

    with prompt_bar(console, len(ids)) as prefilled:
        session = run_to_end(target_model.decoder, ids, params, drafter, eos_token_ids=target_model.eos_token_ids,
                             on_tokens=on_tokens, tokenizer=target_model.tokenizer, until=lambda: streamer.stopped,
                             prefilled=prefilled)
    output, stats, finish_reason = session.output, session.stats, session.finish_reason
    output_text = streamer.finish()
    output = streamer.kept(output)
    scores = logprob_report.local_scores(ids, output, session.logprobs, session.prompt_logprobs)
    if as_json:
        print(json.dumps({
            "mode": config.mode, "target": config.target, "draft": config.draft if draft_model else None,
            "dtype": config.dtype, "token_ids": output,
            "text": output_text,
            "finish_reason": finish_reason, "stop_reason": streamer.text.matched, "stats": stats.to_dict(),
            **({"drafters": drafter.snapshot()} if config.mode == "multi" else {}),
            **logprob_report.as_json(scores, logprobs, prompt_logprobs, token_text(target_model.tokenizer)),
        }))
    else:
        print_logprobs(console, scores, params, token_text(target_model.tokenizer))
        predicted = (f", prediction {stats.prediction_accepted} tokens accepted, {stats.prediction_rejected} rejected"
                     if params.prediction else "")
        console.print(
            f"[dim]{stats.new_tokens} tokens, {stats.tokens_per_s:.2f} tok/s, mode {config.mode}, "
            f"mean accepted length {stats.mean_accepted_length:.2f}, acceptance {stats.acceptance_rate:.0%}{predicted}"
            f"{prompt_note(stats)}[/]"
        )


def one_prompt(argument: str | None, option: str | None) -> str:
    """The prompt, given as the argument (as ``llm "..."`` or ``ollama run M "..."`` take it) or
    as -p (llama.cpp's), once; a usage error otherwise (printed with the usage, exit 2)."""
    if argument is not None and option is not None:
        raise typer.BadParameter("given twice, as the argument and as --prompt/-p: give it once", param_hint="PROMPT")
    if argument is None and option is None:
        raise typer.BadParameter('none given: specctl generate "TEXT" (or --prompt/-p TEXT)', param_hint="PROMPT")
    return argument if argument is not None else option


def prompt_ids(tokenizer, prompt: str, chat: bool, suffix: str | None, params):
    """The prompt's token ids, and the sampling parameters with an infill's end tokens among
    their stop tokens when ``suffix`` asks for one (engine.fim)."""
    import dataclasses

    from specctl.engine.fim import encode_infill, infill_stops
    from specctl.errors import BadRequest, ConfigError

    if suffix is None:
        return text.encode_user_text(tokenizer, prompt, chat), params
    try:
        ids = encode_infill(tokenizer, prompt, suffix)
    except BadRequest as exc:
        raise ConfigError(f"--suffix: {exc}") from None
    return ids, dataclasses.replace(params, stop_token_ids=infill_stops(tokenizer, params.stop_token_ids))


def token_text(tokenizer):
    """A token's own text (vLLM's decoded_token)."""
    return lambda token: tokenizer.decode([token])


def print_logprobs(console: Console, scores: logprob_report.Scores, params, token_text) -> None:
    """The tables ``--prompt-logprobs`` and ``--logprobs`` ask for, after the text (on stderr, as the stats line)."""
    if params.prompt_logprobs is not None and scores.prompt_entries is not None:
        console.print(logprob_report.table("prompt logprobs", scores.prompt_entries, token_text))
    if params.logprobs is not None:
        console.print(logprob_report.table("logprobs", scores.output, token_text))


def _generate_remote(remote, requested_target, prompt, chat, params, bad_words, as_json, auth_token, tls_ca,
                     console, stop: tuple[str, ...] = (), suffix: str | None = None, stop_regex: tuple = (),
                     prediction: str | None = None, thinking_budget: int | None = None) -> None:
    """Same output as local mode. The tokenizer is the one of the model the target instance
    says it serves (its handshake), never a local default: text encoded for another
    vocabulary would come back as fluent garbage. A stop string cancels the generation there."""
    import time

    from transformers import AutoTokenizer

    from specctl.engine.tokenizers import vocab_fingerprint
    from specctl.errors import ConfigError
    from specctl.runtime.loop import parse_hostport, run
    from specctl.runtime.tls import client_context
    from specctl.spec.factory import split_model_name
    from specctl.store import resolve_model
    from specctl.verify.client import probe, remote_generate

    host, port = parse_hostport(remote)
    ssl = client_context(tls_ca)
    welcome, _ = asyncio.run(probe(host, port, auth_token, ssl))
    served = welcome.model
    if requested_target is not None and requested_target != served:
        raise ConfigError(f"the target instance at {remote} serves {served!r}, not {requested_target!r}: "
                          "leave --target out (the tokenizer follows the instance) or connect to another instance")
    path = resolve_model(split_model_name(served)[0], console)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if welcome.fingerprint and vocab_fingerprint(tokenizer) != welcome.fingerprint:
        raise ConfigError(f"the local copy of {served!r} has another vocabulary than the one {remote} serves")
    params = with_thinking_budget(with_prediction_text(with_bad_words(params, bad_words, tokenizer), prediction,
                                                       tokenizer), thinking_budget, tokenizer)
    ids, params = prompt_ids(tokenizer, prompt, chat, suffix, params)
    streamer = TextStreamer(tokenizer, None if as_json else sys.stdout, stop, stop_regex)
    scores = logprob_report.Scores(ids)
    result = {}

    async def main(bar) -> None:
        start = time.perf_counter()
        result["out"] = await remote_generate(host, port, ids, params, streamer.update, auth_token=auth_token, ssl=ssl,
                                              until=lambda: streamer.stopped, on_scores=scores.add,
                                              on_progress=(lambda p: bar.at(p.processed, p.total)) if bar.bar else None)
        result["wall"] = time.perf_counter() - start

    with prompt_bar(console, len(ids)) as bar:
        run(main(bar))
    tokens, finish_reason, stats = result["out"]
    output_text = streamer.finish()
    tokens = streamer.kept(tokens)
    scores.output = scores.output[: len(tokens)]
    if as_json:
        print(json.dumps({"mode": "remote", "remote": remote, "target": served, "token_ids": tokens, "text": output_text,
                          "finish_reason": finish_reason, "stop_reason": streamer.text.matched, "stats": stats,
                          **logprob_report.as_json(scores, params.logprobs, params.prompt_logprobs,
                                                   token_text(tokenizer))}))
    else:
        print_logprobs(console, scores, params, token_text(tokenizer))
        console.print(f"[dim]{remote_statistic(len(tokens), result['wall'], remote, served, stats)}[/]")
