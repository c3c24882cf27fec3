"""A request's options drawn together by hypothesis (tests/test_combinations.py) through a
target split over 3 pipeline stages (TCP between them): plain PP, PP with every drafter, and
SpecPipe's tree levels — each output the whole target's alone, token for token, with the same
log-probabilities."""

import asyncio
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specctl.engine.loader import load_model
from specctl.pipeline.local import LocalPipeline
from specctl.pipeline.specpipe import SpecPipeRun
from specctl.pipeline.token_source import DraftLevels, TreeShape, max_tree_nodes
from specctl.spec.decode import DecodeSession
from specctl.errors import NoTokenAllowed
from tests.test_combinations import MODES, SETTINGS, _drafter, _options, _plain, _prompt, _run, assert_same_session


@pytest.fixture(scope="module")
def pipeline(tiny_dir):
    """(the whole target, stage 1 of it over 3 stages): the stages' servers on a loop of their
    own thread, so that a test drives stage 1 as a target in this one."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    target = load_model("t", tiny_dir["llama"], "fp32")
    stages = LocalPipeline(target, 3)
    try:
        staged = asyncio.run_coroutine_threadsafe(stages.start(), loop).result(120)
        yield target.decoder, staged.decoder
    finally:
        asyncio.run_coroutine_threadsafe(stages.close(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


def _drawn(pipeline, data) -> tuple:
    """(the whole target, stage 1, a drawn prompt, drawn options for it)."""
    target, staged = pipeline
    prompt = _prompt(data)
    return target, staged, prompt, _options(data, _plain(target, prompt))


@SETTINGS
@given(data=st.data())
def test_drawn_options_through_pipeline_stages_in_every_mode_equal_the_whole_target(pipeline, tiny, data):
    target, staged, prompt, params = _drawn(pipeline, data)
    mode = data.draw(st.sampled_from(MODES))
    reference, session = _run(target, prompt, params), _run(staged, prompt, params, _drafter(mode, tiny["llama-draft"]))
    if isinstance(reference, str):  # the options bar every token somewhere: the same error
        assert session == reference
    else:
        assert_same_session(session, reference)


@SETTINGS
@given(data=st.data())
def test_drawn_options_through_specpipe_s_tree_levels_equal_the_whole_target(pipeline, tiny, data):
    target, staged, prompt, params = _drawn(pipeline, data)
    shape = TreeShape(data.draw(st.integers(1, 3)), data.draw(st.integers(1, 2)))
    session = DecodeSession(staged, prompt, params, (), None, None, max_tree_nodes(3, shape))
    levels = DraftLevels.for_session(tiny["llama-self2"], shape, session)
    try:
        reference = _run(target, prompt, params)
        if isinstance(reference, str):
            with pytest.raises(NoTokenAllowed) as caught:
                SpecPipeRun(staged, session, levels).run()
            assert str(caught.value) == reference
        else:
            SpecPipeRun(staged, session, levels).run()
            assert_same_session(session, reference)
    finally:
        session.close()
        levels.close()
