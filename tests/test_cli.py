"""The command line as a user meets it: JSON output, and one-line errors without tracebacks."""

import json
import os
import re
import subprocess
import sys

import pytest

from tests.conftest import run_here


def run(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "specctl", *args], capture_output=True, text=True, timeout=timeout)


def _generate(tiny_dir, *extra):
    return run("generate", "--target", str(tiny_dir["llama"]), "--draft", str(tiny_dir["llama-draft"]),
               "--prompt", "hello world", "--max-tokens", "12", "--dtype", "fp32", "--json", *extra)


@pytest.mark.parametrize("modes", [("ar", "tree"), pytest.param(("ar", "chain", "ngram", "suffix"), marks=pytest.mark.slow)])
def test_generate_json_is_identical_across_modes(tiny_dir, modes):
    results = {}
    for mode in modes:
        proc = _generate(tiny_dir, "--mode", mode)
        assert proc.returncode == 0, proc.stderr
        results[mode] = json.loads(proc.stdout)
    reference = results["ar"]["token_ids"]
    assert len(reference) > 0
    for mode, result in results.items():
        assert result["token_ids"] == reference, mode
        assert result["text"] == results["ar"]["text"]
        assert set(result["stats"]) >= {"rounds", "drafted", "accepted", "mean_accepted_length", "acceptance_rate",
                                        "tokens_per_s", "draft_ms", "verify_ms"}


def test_the_prompt_may_be_the_argument_given_once(tiny_dir):
    by_option = _generate(tiny_dir, "--mode", "ar")
    assert by_option.returncode == 0, by_option.stderr
    by_argument = run("generate", "hello world", "--target", str(tiny_dir["llama"]), "--draft",
                      str(tiny_dir["llama-draft"]), "--max-tokens", "12", "--dtype", "fp32", "--json", "--mode", "ar")
    assert by_argument.returncode == 0, by_argument.stderr
    assert json.loads(by_argument.stdout)["token_ids"] == json.loads(by_option.stdout)["token_ids"]
    for args, why in ((("x", "-p", "y"), "given twice, as the argument and as --prompt/-p: give it once"),
                      (("--max-tokens", "3"), 'none given: specctl generate "TEXT" (or --prompt/-p TEXT)')):
        proc = run_here("generate", *args)  # a usage error: the usage, then why; exit 2
        assert proc.returncode == 2 and "generate [OPTIONS] [PROMPT]" in proc.stderr  # in-process: argv[0] is pytest
        assert "Invalid value for PROMPT: " + why in " ".join(re.sub(r"[│╭╮╰╯─]", " ", proc.stderr).split())
        assert "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.slow  # 3 processes, 22 s; penalties in every mode are tested in-process in the default run
def test_generate_with_penalties_is_the_same_in_every_mode_and_differs_from_without(tiny_dir):
    penalties = ("--repetition-penalty", "1.6", "--presence-penalty", "0.5", "--frequency-penalty", "0.4")
    outputs = {}
    for mode in ("ar", "chain"):
        proc = _generate(tiny_dir, "--mode", mode, *penalties)
        assert proc.returncode == 0, proc.stderr
        outputs[mode] = json.loads(proc.stdout)["token_ids"]
    assert outputs["chain"] == outputs["ar"]
    assert outputs["ar"] != json.loads(_generate(tiny_dir, "--mode", "ar").stdout)["token_ids"]
    # llama.cpp's window: the same penalties over the last 4 tokens, another text
    windowed = json.loads(_generate(tiny_dir, "--mode", "chain", *penalties, "--repeat-last-n", "4").stdout)["token_ids"]
    assert windowed != outputs["ar"]


@pytest.mark.slow  # 2 processes, 13 s; structured output in every mode is tested in-process in the default run
def test_generate_with_a_choice_is_one_of_them_in_every_mode(tiny_dir):
    texts = {mode: json.loads(_generate(tiny_dir, "--mode", mode, "--choice", "north", "--choice", "south").stdout)
             for mode in ("ar", "chain")}
    assert texts["ar"]["text"] in ("north", "south") and texts["ar"]["finish_reason"] == "stop"
    assert texts["chain"]["token_ids"] == texts["ar"]["token_ids"]


def test_generate_bad_words_gives_the_target_alones_text_without_them(tiny_dir):
    from specctl.engine import text
    from specctl.engine.loader import load_model
    from specctl.spec.params import SamplingParams
    from specctl.spec.rounds import generate

    model = load_model("tiny", tiny_dir["llama"], "fp32")
    tok, ids = model.tokenizer, text.encode_user_text(model.tokenizer, "hello world", False)
    free = generate(model.decoder, ids, SamplingParams(max_tokens=12), eos_token_ids=model.eos_token_ids)[0]
    word = next(tok.decode(free[i:i + 2]) for i in range(len(free) - 1)  # a pair of tokens that is a word
                if tok.encode(tok.decode(free[i:i + 2]).lstrip(), add_special_tokens=False) == free[i:i + 2])
    barred = text.bad_word_sequences(tok, [word])
    reference = generate(model.decoder, ids, SamplingParams(max_tokens=12, bad_words=barred),
                         eos_token_ids=model.eos_token_ids)[0]
    assert reference != free
    proc = _generate(tiny_dir, "--mode", "chain", "--bad-words", word)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["token_ids"] == reference  # chain mode, the target alone's with the same bar
    _assert_one_line_error(run("generate", "--prompt", "x", "--bad-words", " "),
                           "--bad-words must not be empty: give a word")


def test_generate_stop_ends_the_text_before_the_stop_string_and_the_generation_with_it(tiny_dir):
    from specctl.engine import text
    from specctl.engine.loader import load_model
    from specctl.spec.params import SamplingParams
    from specctl.spec.rounds import generate

    model = load_model("tiny", tiny_dir["llama"], "fp32")
    ids = text.encode_user_text(model.tokenizer, "hello world", False)
    free_ids = generate(model.decoder, ids, SamplingParams(max_tokens=40), eos_token_ids=model.eos_token_ids)[0]
    free = model.tokenizer.decode(free_ids, skip_special_tokens=True)
    stop = free[len(free) // 3:][:3]  # several rounds in
    # the target alone's tokens up to the one that completed the stop (a round's rest is not the output's)
    through = next(n for n in range(len(free_ids) + 1)
                   if stop in model.tokenizer.decode(free_ids[:n], skip_special_tokens=True))
    # its own draft, drafting its whole depth: rounds of six tokens, the stop among them
    proc = run("generate", "--target", str(tiny_dir["llama"]), "--draft", str(tiny_dir["llama"]), "--prompt",
               "hello world", "--dtype", "fp32", "--json", "--mode", "chain", "--depth", "5", "--draft-stop", "0",
               "--max-tokens", "40", "--stop", stop, "--stop", "never there")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["text"] == free[:free.index(stop)] and result["finish_reason"] == "stop"
    assert result["token_ids"] == free_ids[:through] and result["stats"]["new_tokens"] > through  # a round went past
    streamed = run("generate", "--target", str(tiny_dir["llama"]), "--draft", str(tiny_dir["llama-draft"]), "--prompt",
                   "hello world", "--max-tokens", "40", "--dtype", "fp32", "--mode", "chain", "--stop", stop)
    assert streamed.returncode == 0 and streamed.stdout == free[:free.index(stop)] + "\n", streamed.stderr
    # the round loop's ``until``: asked after every emit, it ends the session as a stop
    out, _, reason = generate(model.decoder, ids, SamplingParams(max_tokens=40, ignore_eos=True),
                              until=lambda: True)
    assert (len(out), reason) == (1, "stop")  # the prefill's token, then nothing more
    _assert_one_line_error(run("generate", "--prompt", "x", "--stop", ""),
                           "--stop must not be empty: give the text to stop before")


def test_generate_stop_regex_ends_the_text_with_the_first_match_and_the_generation_with_it(tiny_dir):
    """SGLang's stop_regex as ``--stop-regex``: the target alone's text through the end of the
    pattern's first match (the match kept), named as vLLM's stop_reason; bad patterns refused."""
    from specctl.engine import text
    from specctl.engine.loader import load_model
    from specctl.spec.params import SamplingParams
    from specctl.spec.rounds import generate

    model = load_model("tiny", tiny_dir["llama"], "fp32")
    ids = text.encode_user_text(model.tokenizer, "hello world", False)
    free = model.tokenizer.decode(generate(model.decoder, ids, SamplingParams(max_tokens=40),
                                           eos_token_ids=model.eos_token_ids)[0], skip_special_tokens=True)
    pattern = re.escape(free[len(free) // 3:][:2]) + "."  # several rounds in
    proc = run_here("generate", "--target", str(tiny_dir["llama"]), "--draft", str(tiny_dir["llama-draft"]), "--prompt",
                    "hello world", "--max-tokens", "40", "--dtype", "fp32", "--json", "--mode", "chain",
                    "--stop-regex", pattern, "--stop-regex", "never there")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["text"] == free[:re.search(pattern, free).end()]
    assert (result["finish_reason"], result["stop_reason"]) == ("stop", pattern)
    assert len(result["token_ids"]) < 40  # the generation ended there, not at max_tokens
    _assert_one_line_error(run_here("generate", "--prompt", "x", "--stop-regex", "a*"),
                           "--stop-regex: stop_regex 'a*' matches the empty text, so it would end every output")
    _assert_one_line_error(run_here("generate", "--prompt", "x", "--stop-regex", "(ab"),
                           "--stop-regex: stop_regex '(ab' is not a valid regular expression")


def test_generate_samplers_applies_llama_cpp_s_order_and_turns_off_those_left_out(tiny_dir):
    """``--samplers`` as llama.cpp's (names separated by ';', or letters): the seeded text of the
    target alone sampled in that order — top-p on the unscaled distribution — which differs from
    vLLM's order (the default); a sampler left out does not run."""
    from specctl.engine import text
    from specctl.engine.loader import load_model
    from specctl.spec.params import SamplingParams
    from specctl.spec.rounds import generate

    model = load_model("tiny", tiny_dir["llama"], "fp32")
    ids = text.encode_user_text(model.tokenizer, "hello world", False)
    asked = dict(max_tokens=12, temperature=0.6, top_p=0.3, seed=3)

    def alone(**params) -> list[int]:
        return generate(model.decoder, ids, SamplingParams(**params), eos_token_ids=model.eos_token_ids)[0]

    def cli(*flags) -> list[int]:
        proc = run_here("generate", "--target", str(tiny_dir["llama"]), "--prompt", "hello world", "--mode", "ar",
                        "--max-tokens", "12", "--dtype", "fp32", "--json", "--temperature", "0.6", "--top-p", "0.3",
                        "--seed", "3", *flags)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)["token_ids"]

    llama_order = ("top_k", "top_p", "min_p", "temperature")
    ordered = alone(**asked, sampler_order=llama_order)
    assert ordered != alone(**asked) == cli()  # vLLM's order unless asked
    assert cli("--samplers", "kpmt") == cli("--samplers", "top_k;top_p;min_p;temperature") == ordered
    # top-p left out: it does not run (the served samplers it leaves out go last, off)
    assert cli("--samplers", "top_k,temperature") == alone(**{**asked, "top_p": 1.0},
                                                       sampler_order=("top_k", "temperature", "top_p", "min_p"))
    _assert_one_line_error(run_here("generate", "--prompt", "x", "--samplers", "kqt"),
                           "--samplers: samplers names 'q', which is not one of llama.cpp's samplers")


async def test_a_stop_string_cancels_a_remote_generation_on_its_target(cluster, tiny_dir):
    """`generate --remote --stop`: the text is the target alone's cut before the stop string, and
    the generation is cancelled there (its session freed) rather than run to max_tokens."""
    import asyncio

    from specctl.cli.generate import TextStreamer
    from specctl.engine import text
    from specctl.engine.loader import load_model
    from specctl.spec.params import SamplingParams
    from specctl.spec.rounds import generate
    from specctl.verify.client import remote_generate, remote_stats

    model = load_model("tiny", tiny_dir["llama"], "fp32")
    ids = text.encode_user_text(model.tokenizer, "hello world", False)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    free = model.tokenizer.decode(generate(model.decoder, ids, params)[0], skip_special_tokens=True)
    stop = free[len(free) // 3:][:3]
    host, port = cluster[1]["targets"][0].rsplit(":", 1)
    streamer = TextStreamer(model.tokenizer, None, (stop,))
    tokens, reason, stats = await remote_generate(host, int(port), ids, params, streamer.update,
                                                  until=lambda: streamer.stopped)
    assert streamer.finish() == free[:free.index(stop)] and reason == "stop"
    assert len(tokens) < 40 and stats["new_tokens"] == len(tokens)  # the statistics so far, from the cancel
    for _ in range(50):  # the cancelled session is freed on the target
        if (await remote_stats(host, int(port)))["sessions"] == 0:
            break
        await asyncio.sleep(0.05)
    assert (await remote_stats(host, int(port)))["sessions"] == 0


def test_generate_logprobs_are_the_targets_for_output_and_prompt_in_vllms_shape(tiny_dir):
    """`generate --json --logprobs 2 --prompt-logprobs 1` in chain mode: per output token the
    target's log-probability (one forward over prompt + output says it) and its 2 likeliest, per
    prompt token its own, its rank and the likeliest, the prompt's first None; the same tokens."""
    import torch

    from specctl.engine import text
    from specctl.engine.loader import load_model

    proc = _generate(tiny_dir, "--mode", "chain", "--logprobs", "2", "--prompt-logprobs", "1")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["token_ids"] == json.loads(_generate(tiny_dir, "--mode", "ar").stdout)["token_ids"]
    model = load_model("tiny", tiny_dir["llama"], "fp32")
    prompt = text.encode_user_text(model.tokenizer, "hello world", False)
    whole = prompt + result["token_ids"]
    logits = model.decoder(torch.tensor(whole[:-1]), torch.arange(len(whole) - 1), model.decoder.new_cache(len(whole)))
    expected = logits.float().log_softmax(-1)
    assert len(result["logprobs"]) == len(result["token_ids"]) == 12
    assert len(result["prompt_logprobs"]) == len(prompt) and result["prompt_logprobs"][0] is None
    for row, (token, entry) in enumerate(zip(whole[1:], result["prompt_logprobs"][1:] + result["logprobs"])):
        alternatives = 1 if row < len(prompt) - 1 else 2
        top = expected[row].topk(alternatives)
        assert list(entry)[0] == str(token)  # the token first, then its alternatives (vLLM's order)
        assert entry[str(token)]["logprob"] == pytest.approx(float(expected[row, token]), abs=1e-4)
        assert entry[str(token)]["decoded_token"] == model.tokenizer.decode([token])
        assert {int(t) for t in entry} == {token, *top.indices.tolist()}
        if row < len(prompt) - 1:
            assert entry[str(token)]["rank"] == int((expected[row] >= expected[row, token]).sum())
        else:  # greedy: each output token is its row's likeliest
            assert entry[str(token)]["rank"] == 1 and token == int(top.indices[0])


async def test_remote_logprobs_are_the_same_as_a_local_runs(cluster, tiny_dir):
    """`generate --remote --logprobs`: what the target instance's frames carry, collected, gives
    the local session's entries (the same tokens, values within fp32 rounding)."""
    from specctl.cli import logprob_report
    from specctl.engine import text
    from specctl.engine.loader import load_model
    from specctl.spec.params import SamplingParams
    from specctl.spec.rounds import run_to_end
    from specctl.verify.client import remote_generate

    model = load_model("tiny", tiny_dir["llama"], "fp32")
    ids = text.encode_user_text(model.tokenizer, "hello world", False)
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    session = run_to_end(model.decoder, ids, params)
    local = logprob_report.local_scores(ids, session.output, session.logprobs, session.prompt_logprobs)
    host, port = cluster[1]["targets"][0].rsplit(":", 1)
    remote = logprob_report.Scores(ids)
    tokens, _, _ = await remote_generate(host, int(port), ids, params, on_scores=remote.add)
    assert tokens == session.output
    for mine, theirs in ((local.output, remote.output), (local.prompt_entries, remote.prompt_entries)):
        assert len(mine) == len(theirs) > 1
        for a, b in zip(mine, theirs):
            assert (a.token, a.top_ids, a.rank) == (b.token, b.top_ids, b.rank)
            assert [a.logprob, *a.top_logprobs] == pytest.approx([b.logprob, *b.top_logprobs], abs=1e-4)


@pytest.mark.slow  # a cluster and a subprocess, 24 s; bench serve's own variants run in the default pass
def test_bench_serve_measures_a_running_gateway(cluster, tmp_path):
    from specctl.bench.processes import free_port

    out = tmp_path / "serve.json"
    proc = run("bench", "serve", "--gateway", cluster[1]["gateway"], "--concurrency", "1,2", "--max-tokens", "4",
               "--requests-per-client", "1", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(r["variant"], r["clients"], r["requests"], r["tokens"]) for r in rows] == [("gateway", 1, 1, 4),
                                                                                       ("gateway", 2, 2, 8)]
    assert all(r["tokens_per_s"] > 0 and r["ttft_p50_ms"] > 0 for r in rows)
    assert "bench serve: the gateway at" in proc.stdout
    _assert_one_line_error(run("bench", "serve", "--gateway", f"http://127.0.0.1:{free_port()}", "--concurrency", "1"),
                           "cannot reach the gateway at")


def _assert_one_line_error(proc, expected: str):
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and expected in lines[0], proc.stderr


def test_unknown_model_error():
    _assert_one_line_error(run_here("generate", "--target", "no-such-model", "--prompt", "x"), "unknown model 'no-such-model'")


def test_vocabulary_mismatch_error(tiny_dir):
    proc = run_here("generate", "--target", str(tiny_dir["llama"]), "--draft", str(tiny_dir["llama-other-vocab"]),
               "--mode", "chain", "--prompt", "x", "--dtype", "fp32")
    _assert_one_line_error(proc, "have different vocabularies (384 vs 320 tokens")
    assert "drafts with the target's own first N layers) or use --mode ngram, which needs no draft model" in proc.stderr


def test_prompt_longer_than_context_error(tiny_dir):
    proc = run_here("generate", "--target", str(tiny_dir["llama"]), "--mode", "ar", "--prompt", "y" * 600, "--dtype", "fp32")
    _assert_one_line_error(proc, "prompt of 600 tokens plus max_tokens 128 exceeds the context of 512 tokens")


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--temperature", "-1"], "temperature must be between 0 and 100, got -1.0"),
        (["--top-p", "1.5"], "top_p must be in (0, 1], got 1.5"),
        (["--top-k", "-2"], "top_k must be a non-negative integer (0 = off), got -2"),
        (["--max-tokens", "0"], "max_tokens must be a positive integer, got 0"),
        (["--mode", "warp"], "mode must be one of ar, chain, tree, ngram, suffix, multi, got 'warp'"),
        (["--repetition-penalty", "0"], "repetition_penalty must be in (0, 100] (1 = off), got 0.0"),
        (["--presence-penalty", "2.5"], "presence_penalty must be between -2 and 2, got 2.5"),
        (["--repeat-last-n", "-3"], "penalty_last_n must be an integer between 0 (vLLM's penalties) and 1048576, got -3"),
        (["--regex", "a+", "--json-object"], "give one of --json-schema, --json-object, --regex, --choice, --grammar"),
        (["--regex", "(ab"], 'structured output (regex) is invalid: at 1(8): invalid regex "(ab" (in regex): regex '
                             'parse error: error: unclosed group'),
        (["--json-schema", "@/no/such/schema.json"], "cannot read /no/such/schema.json: No such file or directory"),
        (["--logprobs", "21"], "logprobs must be between 0 and 20 (the alternatives listed beside each token), got 21"),
        (["--cache-salt", ""], "--cache-salt must not be empty: leave it out to share the prefix cache"),
    ],
)
def test_bad_parameters_error(tiny_dir, flags, expected):
    _assert_one_line_error(run_here("generate", "--target", str(tiny_dir["llama"]), "--prompt", "x", *flags), expected)


@pytest.mark.parametrize("mode", ["ar", "multi", "warp"])
def test_a_draft_server_of_a_mode_that_proposes_nothing_is_refused_in_its_own_words(mode):
    _assert_one_line_error(run_here("draft", "--mode", mode, "--port", "0"),
                           f"a draft server proposes: --mode must be chain, tree, ngram or suffix, got '{mode}'")


def test_help_explains_every_role_command():
    proc = run_here("--help")
    assert proc.returncode == 0
    for command in ("generate", "draft", "verify", "plan", "gateway", "up", "chat", "monitor", "models", "bench"):
        assert f"│ {command} " in proc.stdout, command
    assert "--version" in proc.stdout


def test_version_names_specctl_and_the_libraries_a_bug_report_needs():
    import platform
    from importlib import metadata

    import specctl

    for flag in ("--version", "-V"):
        proc = run_here(flag)
        assert (proc.returncode, proc.stdout) == (0, (
            f"specctl {specctl.__version__} (Python {platform.python_version()}, torch {metadata.version('torch')}, "
            f"transformers {metadata.version('transformers')})\n"))


def test_command_lists_show_each_summary_unbroken():
    """A docstring's first paragraph spans source lines; the command list joins them (typer's
    rich mode would break the sentence where the source line ends)."""
    wide = subprocess.run([sys.executable, "-m", "specctl", "bench", "--help"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "400"}, timeout=60)
    assert wide.returncode == 0
    assert ("pipeline  Time between tokens of plain PP, PP + chain speculation and SpecPipe at each stage count, "
            "outputs checked against the target alone, SpecPipe's E(T) prediction beside it.") in wide.stdout
    from specctl.cli import app, bench, models

    for sub in (app, bench.app, models.app):
        for info in sub.registered_commands:
            assert "\n" not in info.short_help and info.short_help.endswith((".", ")")), info.short_help


def test_every_help_text_shows_as_written():
    """typer renders help through rich markup, which takes ``[word ...]`` for a style tag and
    drops it (``--tool-call-parser``'s "[name(key=value), ...]" vanished): every command's and
    option's help must read the same once rendered (brackets written ``\\[``)."""
    import typer
    from rich.text import Text

    from specctl.cli import app

    def walk(command, path):
        yield path, command
        for name, sub in getattr(command, "commands", {}).items():
            yield from walk(sub, [*path, name])

    commands = list(walk(typer.main.get_command(app), ["specctl"]))
    assert len(commands) > 20
    for path, command in commands:
        for text in (command.help, *(getattr(param, "help", None) for param in command.params)):
            if text:
                assert Text.from_markup(text).plain == text.replace("\\[", "["), (path, text)
    wide = subprocess.run([sys.executable, "-m", "specctl", "gateway", "--help"], capture_output=True, text=True,
                          env={**os.environ, "COLUMNS": "400"}, timeout=60)
    assert "pythonic (Llama 3.2, Llama 4: [name(key=value), ...]) | mistral (content, then [TOOL_CALLS]" in wide.stdout


def test_bench_local_writes_json(tiny_dir, tmp_path):
    out = tmp_path / "bench.json"
    proc = run("bench", "local", "--target", str(tiny_dir["llama"]), "--draft", str(tiny_dir["llama-draft"]),
               "--max-tokens", "8", "--limit", "2", "--modes", "ar,chain,tree,ngram,hf-assisted", "--dtype", "fp32",
               "--repeats", "2", "--prompts", "heldout", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert list(report["modes"]) == ["ar", "chain", "tree", "ngram", "hf-assisted"]
    for mode, result in report["modes"].items():
        assert {"tokens_per_s", "speedup_vs_ar", "mean_accepted_length", "acceptance_rate"} <= set(result)
        assert result["outputs_equal_to_ar"] == 1.0, mode  # fp32: every mode is exact
        assert len(result["speedup_per_repeat"]) == 2 and list(result["per_kind"]) == ["code"]
        low, median, high = result["speedup_min_median_max"]
        assert low <= median <= high and result["per_kind"]["code"]["outputs_equal_to_ar"] == 1.0
    assert report["modes"]["ar"]["speedup_vs_ar"] == 1.0 and report["modes"]["ar"]["speedup_per_repeat"] == [1.0, 1.0]
    assert report["settings"]["max_tokens"] == 8 and report["settings"]["prompts"] == 2
    assert "bench local" in proc.stdout and "by class of prompt" in proc.stdout


@pytest.mark.parametrize("stop, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_a_benchmark_stopped_by_ctrl_c_or_kill_says_it_wrote_no_report(tiny_dir, tmp_path, stop, code):
    """typer turns Ctrl-C into a silent exit 130, SIGTERM killed at once; every bench command
    says why it stopped."""
    import signal

    from specctl.cli.bench import app as bench_app

    assert all(hasattr(info.callback, "__wrapped__") for info in bench_app.registered_commands)
    out = tmp_path / "bench.json"
    proc = subprocess.Popen([sys.executable, "-m", "specctl", "bench", "local", "--target", str(tiny_dir["llama"]),
                             "--draft", str(tiny_dir["llama-draft"]), "--max-tokens", "64", "--repeats", "50",
                             "--modes", "ar,chain", "--dtype", "fp32", "--json", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            # a shell's background job (CI run with &) ignores SIGINT, and so would the child
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        seen = ""
        while "preparing" not in seen:
            line = proc.stderr.readline()
            assert line, seen
            seen += line
        proc.send_signal(getattr(signal, stop))
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == code
    assert err.strip().splitlines()[-1] == \
        "interrupted: no report written (the models and processes it started are closed)"
    assert not out.exists()


def test_bench_local_runs_a_mode_with_each_prompt_s_prediction_beside_it_without(tiny_dir, tmp_path):
    """MODE+prediction (spec.prediction) on the shipped edits, whose prompts carry their code
    as the prediction: the target alone's outputs, one ratio per repeat."""
    from specctl.bench.prompts import load_prompts

    edits = load_prompts("edits")
    assert len(edits) == 8 and all(p.chat and p.kind == "edit" and p.prediction in p.prompt for p in edits)
    long_edits = load_prompts("long-edits")
    assert len(long_edits) == 6 and all(p.chat and p.kind == "edit" and p.prediction in p.prompt
                                        and p.prediction.count("\n") >= 40 for p in long_edits)
    out = tmp_path / "bench.json"
    proc = run_here("bench", "local", "--target", str(tiny_dir["llama"]), "--draft", str(tiny_dir["llama-draft"]),
                    "--max-tokens", "12", "--limit", "2", "--modes", "ar,chain,chain+prediction,ar+prediction",
                    "--dtype", "fp32", "--prompts", "edits", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert list(report["modes"]) == ["ar", "chain", "chain+prediction", "ar+prediction"]
    assert all(result["outputs_equal_to_ar"] == 1.0 for result in report["modes"].values())
    _assert_one_line_error(run_here("bench", "local", "--modes", "ar,hf-assisted+prediction"),
                           "unknown modes hf-assisted+prediction")


def test_bench_rejects_unknown_modes():
    _assert_one_line_error(run_here("bench", "local", "--modes", "ar,teleport"), "unknown modes teleport")


@pytest.mark.parametrize("args, message", [
    (["--repeats", "0"], "--requests-per-client, --max-tokens, --max-batch and --repeats must be at least 1"),
    (["--concurrency", "0"], "--concurrency must be between 1 and 64"),
    (["--variants", "ar,warp"], "--variants: choose from ar, ar batched, spec, spec batched, spec by load"),
    (["--variants", "ar,spec by load", "--profile", "server"],
     "the 'spec by load' variant needs --spec-max-sessions N (N >= 1) or --spec-depth-by-load SESSIONS:DEPTH (the "
     "profile gives neither)"),
    (["--prompts", "no-such-prompts.jsonl"], "prompt file 'no-such-prompts.jsonl' not found (use builtin, heldout, "
                                             "mixed, infill, edits, long-edits or a JSON-lines file)"),
    (["--variants", "spec by load", "--spec-depth-by-load", "4:4,3:2"],
     "spec_depth_by_load must be SESSIONS:DEPTH pairs (depth 1-64), the sessions ascending, e.g. 4:4,6:2, or auto; got '4:4,3:2'"),
    (["--variants", "spec by load", "--spec-max-sessions", "-1"],
     "spec_max_sessions must be an integer in [0, 1048576], got -1")])
def test_bench_serve_refuses_bad_flags_before_loading_anything(args, message):
    _assert_one_line_error(run_here("bench", "serve", *args), message)


def test_bench_serve_runs_every_variant_with_identical_texts(tiny_dir, tmp_path):
    out = tmp_path / "serve.json"
    proc = run("bench", "serve", "--target", str(tiny_dir["llama"]), "--draft", f"{tiny_dir['llama']}@2", "--mode", "chain",
               "--depth", "3", "--dtype", "fp32", "--draft-quant", "none", "--concurrency", "1,3", "-n", "6",
               "--requests-per-client", "1", "--repeats", "2", "--json", str(out), "--spec-max-sessions", "2",
               "--variants", "ar,ar batched,spec,spec batched,spec by load,spec auto")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [(r["variant"], r["clients"]) for r in report["rows"]] == [
        (v, c) for v in ("ar", "ar batched", "spec", "spec batched", "spec by load", "spec auto") for c in (1, 3)]
    assert report["settings"]["spec_max_sessions"] == 2
    for row in report["rows"]:  # over both repeats
        assert row["same_as_ar"] == 1.0 and row["tokens"] == 2 * 6 * row["clients"]
        assert len(row["tokens_per_s_per_repeat"]) == 2
        assert row["vs ar per repeat"]["min"] <= row["vs ar per repeat"]["max"] and row["vs ar batched"] is not None
    words = " ".join(proc.stdout.split())  # the title and caption may wrap
    assert "bench serve" in words and "spec batched" in words and "2 repeats" in words
    assert "below a ratio its min-max over the repeats" in words


@pytest.mark.parametrize("args, message", [
    (["--targets", "2,4"], "--targets must start at 1"),
    (["--targets", "1,x"], "--targets must be comma-separated integers, got '1,x'"),
    (["--max-batch", "0,4"], "--max-batch values must be >= 1"),
    (["--target-quant", "int4"], "--target-quant must be one of none, int8, got 'int4'"),
    (["--sessions", "0"], "--sessions and --repeats >= 1"),
    (["--repeats", "0"], "--sessions and --repeats >= 1"),
])
def test_bench_star_rejects_bad_flags_before_starting_anything(args, message):
    result = run_here("bench", "star", *args)
    assert result.returncode != 0 and message in result.stdout + result.stderr


@pytest.mark.parametrize("flag", ["--threads", "--repeats"])
def test_bench_net_rejects_counts_below_one_before_loading_anything(flag):
    _assert_one_line_error(run_here("bench", "net", flag, "0"), "--threads and --repeats must be >= 1")


@pytest.mark.parametrize("args", [
    ["teleport"], ["generate", "--no-such-flag"], ["generate", "-p", "x", "--max-tokens", "abc"], ["generate"],
    ["plan", "--ts", "ten", "--tv", "1", "--beta", "0.5", "--depth", "4"],
])
def test_usage_errors_print_the_usage_and_exit_2_without_a_traceback(args):
    proc = run_here(*args)
    assert proc.returncode == 2, proc.stderr
    assert "Usage: " in proc.stderr and "Traceback" not in proc.stderr + proc.stdout


@pytest.mark.parametrize("flags, message", [
    (["--ts", "nan"], "t_s, t_v, t_c and beta must be finite numbers"),
    (["--ts", "10", "--beta", "inf"], "t_s, t_v, t_c and beta must be finite numbers"),
    (["--ts", "10", "--standalone", "-3"], "--standalone must be a positive number of tokens/s, got -3.0"),
    (["--ts", "10", "--standalone", "nan"], "--standalone must be a positive number of tokens/s, got nan"),
])
def test_plan_refuses_non_finite_and_non_positive_inputs(flags, message):
    base = {"--ts": "10", "--tv": "100", "--beta": "0.5", "--depth": "4"}
    given = dict(zip(flags[::2], flags[1::2]))
    args = [x for k, v in {**base, **given}.items() for x in (k, v)]
    _assert_one_line_error(run_here("plan", *args), message)


def test_a_port_in_use_is_one_line_naming_it(tiny_dir):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = run("draft", "--model", f"{tiny_dir['llama']}@2", "--dtype", "fp32", "--draft-quant", "none",
                   "--port", str(port), timeout=120)
    _assert_one_line_error(proc, f"cannot listen on 127.0.0.1:{port}: address already in use; stop what listens "
                                 "there or pick another port with --port")


@pytest.mark.slow
def test_remote_generation_uses_the_tokenizer_of_the_model_the_instance_serves(tiny_dir):
    """Against a target that is not the default model: the text equals the local run of that
    model, and a --target that contradicts the instance is refused in one line."""
    from specctl.bench.processes import (
        free_port,
        spawn_role,
        stop_processes,
        wait_listening,
    )

    model = str(tiny_dir["llama-other-vocab"])
    port = free_port()
    proc = spawn_role("verify", "--model", model, "--port", str(port), "--dtype", "fp32", "--threads", "1",
                      "--log-level", "warning")
    try:
        wait_listening(proc, "target instance")
        remote = run("generate", "--remote", f"127.0.0.1:{port}", "-p", "hello world", "-n", "10", "--json")
        assert remote.returncode == 0, remote.stderr
        local = run("generate", "--target", model, "--mode", "ar", "-p", "hello world", "-n", "10", "--dtype", "fp32",
                    "--json")
        assert local.returncode == 0, local.stderr
        remote_json, local_json = json.loads(remote.stdout), json.loads(local.stdout)
        assert remote_json["target"] == model
        assert remote_json["token_ids"] == local_json["token_ids"] and remote_json["text"] == local_json["text"]
        stop = local_json["text"][4:6]  # --stop through the instance: the local text cut there
        stopped = run("generate", "--remote", f"127.0.0.1:{port}", "-p", "hello world", "-n", "10", "--json", "--stop",
                      stop)
        assert stopped.returncode == 0, stopped.stderr
        assert json.loads(stopped.stdout)["text"] == local_json["text"][:local_json["text"].index(stop)]
        assert json.loads(stopped.stdout)["finish_reason"] == "stop"
        # --stop-regex through the instance (the streamer ends it there), a salted request the same text
        pattern = re.escape(local_json["text"][4:6]) + "."
        matched = run("generate", "--remote", f"127.0.0.1:{port}", "-p", "hello world", "-n", "10", "--json",
                      "--stop-regex", pattern, "--cache-salt", "tenant-a")
        assert matched.returncode == 0, matched.stderr
        assert json.loads(matched.stdout)["text"] == local_json["text"][:re.search(pattern, local_json["text"]).end()]
        assert json.loads(matched.stdout)["stop_reason"] == pattern
        _assert_one_line_error(run("generate", "--remote", f"127.0.0.1:{port}", "--target", "qwen2.5-coder-1.5b",
                                   "-p", "x"), f"serves {model!r}, not 'qwen2.5-coder-1.5b'")
        # a thinking budget travels with the request: the instance forces the same </think>
        budgeted = [run("generate", *where, "-p", "why<think>", "-n", "12", "--json", "--thinking-budget", "2")
                    for where in (("--remote", f"127.0.0.1:{port}"), ("--target", model, "--mode", "ar", "--dtype",
                                                                         "fp32"))]
        assert all(proc.returncode == 0 for proc in budgeted), [proc.stderr for proc in budgeted]
        remote_ids, local_ids = (json.loads(proc.stdout)["token_ids"] for proc in budgeted)
        assert remote_ids == local_ids and "</think>" in json.loads(budgeted[0].stdout)["text"]
    finally:
        stop_processes([proc])


@pytest.mark.parametrize("stage, message", [
    ("abc", "--stage must be i/n with 1 <= i <= n (e.g. 1/1 or 3/8), got 'abc'"),
    ("4/3", "--stage must be i/n with 1 <= i <= n (e.g. 1/1 or 3/8), got '4/3'"),
    ("3/8", "--stage 3/8 needs --pipeline with 8 HOST:PORT addresses, one per stage in order (got 0)"),
])
def test_stage_is_checked_before_anything_loads(stage, message):
    _assert_one_line_error(run_here("verify", "--stage", stage), message)


@pytest.mark.parametrize("args, message", [
    (("--stage", "2/2", "--pipeline", "a:1,b"), "expected HOST:PORT, got 'b'"),
    (("--stage", "2/3", "--pipeline", "a:1,b:2"), "--stage 2/3 needs --pipeline with 3 HOST:PORT addresses"),
    (("--stage", "1/1", "--pipeline", "a:1"), "--pipeline needs --stage i/n with n > 1"),
    (("--stage", "2/2", "--pipeline", "a:1,b:2", "--draft", "c:3"), "--draft goes to stage 1 only (this is stage 2/2)"),
    (("--draft", "c:3", "--draft", "ngram", "--draft", "c:03"), "--draft names c:3 twice: each drafter once"),
    (("--draft", "ngram", "--draft", "ngram"), "--draft names ngram twice: each drafter once"),
    (("--draft", "c:3", "--draft-timeout", "0"), "--draft-timeout must be > 0 seconds, got 0"),
    (("--draft", "c:3", "--draft", "ngram", "--draft-deadline-ms", "-1"),
     "--draft-deadline-ms must be > 0 and --fusion-budget >= 1"),
    (("--stage", "1/3", "--pipeline", "a:1,b:2,a:01"), "--pipeline names a:1 twice: each stage listens at its own address"),
    (("--stage", "1/12", "--pipeline", ",".join(f"a:{p}" for p in range(1, 13)), "--specpipe-draft", "m", "--width",
      "16"), "SpecPipe over 12 stages at --width 16 keeps up to 401 tree nodes per session; the most is 320: lower "
             "--width or --refill"),
    (("--stage", "1/2", "--pipeline", "a:1,b:2", "--specpipe-draft", "m", "--refill", "17"),
     "refill depth must be in 0..16, got 17"),
    (("--stage", "1/2", "--pipeline", "a:1,b:2", "--specpipe-draft", "m", "--draft", "c:3"),
     "--specpipe-draft goes to stage 1 of a pipeline (--stage 1/n, n > 1), without --draft"),
    (("--stage", "1/2", "--pipeline", "a:1,b:2", "--specpipe-draft", "m", "--spread", "wide"),
     "spread must be one of likeliest, every-node, got 'wide'"),
    (("--stage", "1/2", "--pipeline", "a:1,b:2", "--specpipe"),
     "--specpipe goes to stage 1 of a pipeline (--stage 1/n, n > 1) with one --draft HOST:PORT"),
    (("--stage", "1/2", "--pipeline", "a:1,b:2", "--specpipe", "--draft", "c:3", "--draft", "d:4"),
     "--specpipe goes to stage 1 of a pipeline (--stage 1/n, n > 1) with one --draft HOST:PORT"),
])
def test_pipeline_flags_are_checked_before_anything_loads(args, message):
    _assert_one_line_error(run_here("verify", *args), message)


def test_a_gateway_given_one_target_twice_says_so_before_it_polls():
    _assert_one_line_error(run_here("gateway", "--target", "127.0.0.1:1", "--target", "127.0.0.1:1"),
                           "--target names 127.0.0.1:1 twice: each instance once")


def test_a_gateway_with_no_reachable_target_says_so_in_one_lowercase_line():
    from specctl.bench.processes import free_port

    port = free_port()  # nothing listens there
    _assert_one_line_error(run("gateway", "--target", f"127.0.0.1:{port}", "--port", "0", timeout=60),
                           "no target instance answered")


@pytest.mark.slow  # 23 s and more: the bench commands run in CI's --runslow pass, as the other bench runs do
@pytest.mark.parametrize("stages, rows", [
    ("1,3", [(1, "pp"), (1, "pp+chain"), (3, "pp"), (3, "pp+chain"), (3, "specpipe"), (3, "specpipe r=0"),
             (3, "pp+chain x2"), (3, "specpipe-db x2")]),
    pytest.param("1,2,4", [(1, "pp"), (1, "pp+chain"), (2, "pp"), (2, "pp+chain"), (2, "specpipe"), (2, "specpipe r=0"),
                           (2, "pp+chain x2"), (2, "specpipe-db x2"), (4, "pp"), (4, "pp+chain"), (4, "specpipe"),
                           (4, "specpipe r=0"), (4, "pp+chain x2"), (4, "specpipe-db x2")], marks=pytest.mark.slow)])
def test_bench_pipeline_measures_every_mode_and_stage_count_with_exact_outputs(tiny_dir, tmp_path, stages, rows):
    out = tmp_path / "pipeline.json"
    proc = run("bench", "pipeline", "--target", str(tiny_dir["llama"]), "--draft", f"{tiny_dir['llama']}@2",
               "--stages", stages, "--stage-delay-ms", "2", "-n", "5", "--limit", "1", "--repeats", "2",
               "--sessions", "2", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert [(r["stages"], r["mode"]) for r in report["rows"]] == rows
    for row in report["rows"]:
        assert row["same_as_target"] == row["runs"] == 2, row  # fp32: every mode is exact
        assert row["vs_pp"] is not None and row["vs_pp_chain"] is not None
        assert row["tbt_ms_min"] <= row["tbt_ms"] <= row["tbt_ms_max"]
        assert len(row["tbt_ms_per_prompt"]) == 1 if " x" not in row["mode"] else "tbt_ms_per_prompt" not in row
    specpipe = [r for r in report["rows"] if r["mode"] in ("specpipe", "specpipe r=0")]
    assert all(r["predicted_tbt_ms"] > 0 and 0 <= r["hit_rate"] <= 1 for r in specpipe)
    # The refill (stages - 1 levels by default) beside SpecPipe without it, same run.
    assert [r["refill"] for r in specpipe] == [r["stages"] - 1 if r["mode"] == "specpipe" else 0 for r in specpipe]
    assert "bench pipeline" in proc.stdout and "E(T) ms" in proc.stdout
    assert "│ specpipe " in proc.stdout and "…" not in proc.stdout  # piped: the table is not cut to 80 columns
    assert report["settings"]["stages_as"] == "processes"


@pytest.mark.slow
def test_bench_pipeline_in_process_runs_the_stages_as_threads(tiny_dir, tmp_path):
    out = tmp_path / "pipeline.json"
    proc = run("bench", "pipeline", "--target", str(tiny_dir["llama"]), "--draft", f"{tiny_dir['llama']}@2",
               "--stages", "2", "--in-process", "-n", "4", "--limit", "1", "--sessions", "0", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["settings"]["stages_as"] == "threads of one process"
    assert [(r["mode"], r["same_as_target"]) for r in report["rows"]] == [("pp", 1), ("pp+chain", 1), ("specpipe", 1),
                                                                           ("specpipe r=0", 1)]


def test_bench_pipeline_refuses_more_stages_than_layers(tiny_dir):
    _assert_one_line_error(run_here("bench", "pipeline", "--target", str(tiny_dir["llama"]), "--draft",
                               f"{tiny_dir['llama']}@2", "--stages", "1,5"), "has 4 layers: at most that many stages")


@pytest.mark.parametrize("args, message", [
    (("--prespec", "--mode", "ngram"), "--prespec drafts with the draft model: use --mode chain or tree (not ngram)"),
    (("--prespec", "--mode", "tree", "--saguaro-c", "0.5"), "--saguaro-c reshapes sampled chain tokens; a tree's "
     "candidates are the draft's top-k, not sampled: use --mode chain with --saguaro-c"),
    (("--prespec", "--mode", "chain", "--saguaro-c", "1.5"), "--saguaro-c must be in (0, 1], got 1.5"),
    (("--prespec", "--mode", "chain", "--fallback", "sometimes"), "--fallback must be one of auto, jit, ngram, got 'sometimes'"),
    (("--prespec", "--mode", "chain", "--prespec-budget", "0"), "the pre-speculation budget must be an integer in [1, 4096], got 0"),
    (("--fallback", "jit"), "--prespec-budget, --saguaro-c, --fallback and --no-prespec-trials need --prespec"),
])
def test_prespec_flags_are_checked_before_anything_loads(args, message):
    _assert_one_line_error(run_here("draft", "--model", "no-such-model", *args), message)


@pytest.mark.parametrize("command", [("verify", "--model", "no-such-model"), ("bench", "prespec")])
def test_a_negative_emulated_verification_time_is_refused_before_anything_loads(command):
    proc = run_here(*command, "--verify-time-ms", "-5")
    message = ("--verify-delay-ms, --verify-time-ms and --stage-delay-ms must be >= 0" if command[0] == "verify"
               else "--verify-delay-ms, --verify-time-ms and --draft-step-ms must be >= 0")
    _assert_one_line_error(proc, message)


@pytest.mark.parametrize("command, message", [
    (("draft", "--model", "no-such-model", "--step-time-ms", "-1"), "--step-time-ms must be >= 0, got -1"),
    (("bench", "prespec", "--draft-step-ms", "-1"), "--verify-delay-ms, --verify-time-ms and --draft-step-ms must be >= 0"),
    (("bench", "prespec", "--max-targets", "0"), "--depth, --max-tokens, --sessions and --repeats >= 1, --max-targets in [1, 32]"),
    (("bench", "prespec", "--depth", "0"), "--depth, --max-tokens, --sessions and --repeats >= 1, --max-targets in [1, 32]"),
])
def test_bad_emulation_and_bench_prespec_flags_are_refused_before_anything_loads(command, message):
    _assert_one_line_error(run_here(*command), message)


def test_the_cli_its_help_and_the_monitor_import_no_torch():
    """`specctl --help` (and any command's) answers without importing torch or transformers
    (1.6 -> 0.4 s here): the commands import them when they run. The monitor (its feeds read
    wire frames and HTTP) needs neither: it starts in half a second, not 1.5."""
    probe = ("import sys; from specctl.cli import app; "
             "import specctl.monitor.source, specctl.monitor.render, specctl.monitor.view; "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert (result.returncode, result.stdout.strip()) == (0, "[]"), result.stderr[-2000:]
    shown = subprocess.run([sys.executable, "-m", "specctl", "bench", "local", "--help"], capture_output=True,
                           text=True, timeout=60)
    assert shown.returncode == 0 and "--prompts" in shown.stdout


@pytest.mark.parametrize("given, url", [
    ("http://127.0.0.1:8000/", "http://127.0.0.1:8000"), ("127.0.0.1:8000", "http://127.0.0.1:8000"),
    ("https://gw.example/api/", "https://gw.example/api"), ("gw", "http://gw"), ("[::1]:8000", "http://[::1]:8000"),
])
def test_a_gateway_url_is_http_and_host_port_alone_means_http(given, url):
    from specctl.cli.roles import gateway_url

    assert gateway_url(given) == url


@pytest.mark.parametrize("given", ["http://", "ftp://gw", "http://gw:99999", "http://gw:0", "http://gw:port"])
def test_a_gateway_url_that_names_no_gateway_is_a_one_line_error(given):
    from specctl.cli.roles import gateway_url
    from specctl.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        gateway_url(given)
    assert str(err.value) == f"--gateway must be a gateway's URL, e.g. http://127.0.0.1:8000, got {given!r}"
    _assert_one_line_error(run_here("monitor", "--once", "--gateway", given), str(err.value))


@pytest.mark.parametrize("command, message", [
    (["up"], "the largest request body must be at least 1 KiB (--max-body-kb), got 0 bytes"),
    (["gateway", "--target", "127.0.0.1:1"], "--max-body-kb must be at least 1, got 0")])
def test_a_body_limit_under_1_kib_is_one_line_before_anything_starts(command, message):
    _assert_one_line_error(run_here(*command, "--max-body-kb", "0"), message)


def test_the_gateway_reads_bodies_up_to_16_mib_by_default_as_up_does():
    """vLLM takes any body; a batch of 128 long prompts (lm-eval's) is a few MiB."""
    from specctl.cluster.embedded import ClusterConfig
    from specctl.gateway.server import GatewayConfig

    assert GatewayConfig(model_name="m", context=8).max_body_bytes == ClusterConfig().max_body_bytes == 16 << 20
