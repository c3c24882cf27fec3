"""llama.cpp's ``samplers``: which of its samplers run, in which order — a list of names
(``["top_k", "top_p", "min_p", "temperature"]``, its aliases too) or a string of their letters
(``"kpmt"``). Its default — penalties, DRY, top-n-sigma, top-k, typical, top-p, min-p, XTC,
temperature — applies temperature last: top-p and min-p read the unscaled distribution, where
vLLM (and the OpenAI routes here) scale it first. /completion and /infill apply llama.cpp's
order (SamplingParams.sampler_order); the OpenAI routes take ``samplers`` as llama.cpp's
extension, vLLM's order without it.

As in llama.cpp, a sampler the list leaves out does not run: top-k, top-p, min-p off, no
temperature (the distribution as it is, T = 1), no penalties. DRY, typical, XTC and
top-n-sigma may be listed (their options are refused when set: gateway.llama). The infill
sampler, which llama.cpp's editor plugins list (llama.vim: top_k, top_p, infill), is accepted
and not applied: an infill here samples the target's own distribution and ends at the model's
FIM end tokens (engine.fim) — refusing it would turn those plugins away. The penalties must come
before the others (specctl applies them, with logit_bias, first). Unknown names and letters are
refused rather than skipped."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from specctl.gateway.api import ApiError
from specctl.spec.params import SAMPLER_ORDER, SamplingParams

DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature")
NAMES = {**{name: name for name in DEFAULT_SAMPLERS},
         "top-k": "top_k", "top-p": "top_p", "nucleus": "top_p", "min-p": "min_p", "temp": "temperature",
         "typical_p": "typ_p", "typical-p": "typ_p", "typical": "typ_p", "typ-p": "typ_p", "typ": "typ_p",
         "infill": "infill"}
LETTERS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p", "m": "min_p",
           "x": "xtc", "t": "temperature", "i": "infill"}


@dataclass(frozen=True, slots=True)
class SamplerChain:
    """What a ``samplers`` list asks for: the served samplers' order (those it leaves out last:
    they are off) and the samplers it lists, by their canonical names."""
    order: tuple[str, ...]
    names: tuple[str, ...]

    def runs(self, sampler: str) -> bool:
        return sampler in self.names

    def applied(self, params: SamplingParams) -> SamplingParams:
        """``params`` sampled by this chain: its order, and the samplers it leaves out off —
        without the temperature sampler the distribution is unscaled (T = 1, llama.cpp's), but
        0 stays greedy, as everywhere."""
        penalties = self.runs("penalties")
        return dataclasses.replace(
            params, sampler_order=self.order,
            temperature=params.temperature if self.runs("temperature") or params.temperature == 0 else 1.0,
            top_p=params.top_p if self.runs("top_p") else 1.0, top_k=params.top_k if self.runs("top_k") else 0,
            min_p=params.min_p if self.runs("min_p") else 0.0,
            presence_penalty=params.presence_penalty if penalties else 0.0,
            frequency_penalty=params.frequency_penalty if penalties else 0.0,
            repetition_penalty=params.repetition_penalty if penalties else 1.0)


def sampler_chain(samplers: list[str] | str) -> SamplerChain:
    """The chain ``samplers`` names; a 400 saying what is wrong with it."""
    names = list(samplers) if isinstance(samplers, list) else [LETTERS.get(letter.lower(), letter) for letter in samplers]
    chain = []
    for given in names:
        name = NAMES.get(given.lower())
        if name is None:
            raise ApiError(400, f"samplers names {given!r}, which is not one of llama.cpp's samplers: give "
                                f"{', '.join(DEFAULT_SAMPLERS)} (or their letters, e.g. \"kpmt\")", param="samplers")
        if name in chain:
            raise ApiError(400, f"samplers lists {name} twice: give each sampler once", param="samplers")
        chain.append(name)
    served = [name for name in chain if name in SAMPLER_ORDER]
    if "penalties" in chain and served and chain.index("penalties") > chain.index(served[0]):
        raise ApiError(400, f"samplers puts penalties after {served[0]}: specctl applies the penalties (and "
                            "logit_bias) before the other samplers; list penalties first", param="samplers")
    return SamplerChain((*served, *(name for name in SAMPLER_ORDER if name not in served)), tuple(chain))
