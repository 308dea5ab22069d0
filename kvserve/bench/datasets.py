"""Prompts for ``kvserve bench serve``: the ``random`` dataset (vLLM's ``--dataset-name random``).

Each request gets an input length drawn uniformly from
``[floor(input_len * (1 - r)), ceil(input_len * (1 + r))]`` and an output length from
``[max(floor(output_len * (1 - r)), 1), ceil(output_len * (1 + r))]`` (r = ``--range-ratio``),
then random token ids of that length (seeded: the same ``--seed`` gives the same prompts).

How the prompt is sent:

* ``--tokenizer`` given: the ids are drawn from the tokenizer's vocabulary (special tokens
  excluded) and decoded to text, as vLLM does; the text is re-encoded and trimmed or padded
  until it encodes to the target length, so ``prompt_len`` is exact for that tokenizer.
* no tokenizer, ``/v1/completions``: the prompt is sent as a list of token ids (the OpenAI
  completions API accepts ``prompt: [int, ...]``), drawn from ``[1000, 10000)`` -- inside the
  vocabulary of every common model and clear of the low special-token ids; ``prompt_len`` is exact.
* no tokenizer, ``/v1/chat/completions``: chat needs text, so the prompt is ``input_len``
  random common English words (about one token each with a leading space); ``prompt_len`` is then
  the server's ``usage.prompt_tokens`` when it reports one (it includes the chat template), else
  the word count.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DATASETS = ("random",)
TOKEN_ID_LOW, TOKEN_ID_HIGH = 1000, 10000  # default id range when no tokenizer is given

_WORDS = (
    "time year people way day man thing woman life child world school state family student group "
    "country problem hand part place case week company system program question work government number "
    "night point home water room mother area money story fact month lot right study book eye job word "
    "business issue side kind head house service friend father power hour game line end member law car "
    "city community name president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason research girl guy "
    "moment air teacher force education foot boy age policy music market sense nation plan college "
    "interest death experience effect use class control care field development role effort rate heart "
    "drug show leader light voice wife police mind price report decision son view relationship town road "
    "arm difference value building action model season society tax director position player record paper "
    "space ground form event official matter center couple site project activity star table need court "
    "oil situation cost industry figure street image phone data picture practice piece land product doctor "
    "wall patient worker news test movie north love support technology step baby computer type attention "
    "film tree source organization hair window evidence population site river garden green blue small"
).split()


@dataclass
class SampleRequest:
    """One benchmark request: ``prompt`` is text or a list of token ids."""

    prompt: str | list[int]
    prompt_len: int
    expected_output_len: int
    exact_prompt_len: bool = True  # False: word prompts without a tokenizer (server usage preferred)


def _check(name: str, v: Any, lo: int) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} {v!r} is invalid: expected an integer >= {lo}")


def load_tokenizer(path: str | None) -> Any:
    """transformers AutoTokenizer for ``path`` (a folder or hub name), or None."""
    if not path:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError as e:  # pragma: no cover - transformers is a dependency
        raise RuntimeError(f"--tokenizer {path!r} needs the transformers package: {e}") from None
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any loading failure is a bad --tokenizer value
        raise ValueError(f"--tokenizer {path!r} could not be loaded: {type(e).__name__}: {e}") from None


def _lengths(rng: Any, n: int, input_len: int, output_len: int, r: float) -> tuple[list[int], list[int]]:
    in_lo, in_hi = max(math.floor(input_len * (1 - r)), 1), math.ceil(input_len * (1 + r))
    out_lo, out_hi = max(math.floor(output_len * (1 - r)), 1), max(math.ceil(output_len * (1 + r)), 1)
    ins = rng.integers(in_lo, in_hi + 1, size=n).tolist()
    outs = rng.integers(out_lo, out_hi + 1, size=n).tolist()
    return ins, outs


def _fit_text(tokenizer: Any, ids: list[int], target: int, rng: Any, allowed: Any) -> tuple[str, int]:
    """Decode ``ids``; re-encode and trim / extend until the text encodes to ``target`` tokens."""
    text = tokenizer.decode(ids)
    for _ in range(10):
        enc = tokenizer.encode(text, add_special_tokens=False)
        if len(enc) == target:
            return text, target
        if len(enc) > target:
            enc = enc[:target]
        else:
            enc = enc + rng.choice(allowed, size=target - len(enc)).tolist()
        text = tokenizer.decode(enc)
    return text, len(tokenizer.encode(text, add_special_tokens=False))


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    seed: int = 0, tokenizer: Any = None, chat: bool = False) -> list[SampleRequest]:
    """The ``random`` dataset (module docstring)."""
    import numpy as np

    _check("num_prompts", num_prompts, 1)
    _check("input_len", input_len, 1)
    _check("output_len", output_len, 1)
    if not isinstance(range_ratio, (int, float)) or isinstance(range_ratio, bool) or not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio {range_ratio!r} is invalid: expected a number in [0, 1)")
    rng = np.random.default_rng(seed)
    ins, outs = _lengths(rng, num_prompts, input_len, output_len, float(range_ratio))
    reqs: list[SampleRequest] = []
    if tokenizer is not None:
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        vocab = len(tokenizer)
        allowed = np.array([i for i in range(vocab) if i not in special])
        for n, o in zip(ins, outs):
            ids = rng.choice(allowed, size=n).tolist()
            text, plen = _fit_text(tokenizer, ids, n, rng, allowed)
            reqs.append(SampleRequest(text, plen, o))
    elif not chat:
        for n, o in zip(ins, outs):
            reqs.append(SampleRequest(rng.integers(TOKEN_ID_LOW, TOKEN_ID_HIGH, size=n).tolist(), n, o))
    else:
        words = np.array(_WORDS)
        for n, o in zip(ins, outs):
            reqs.append(SampleRequest(" ".join(rng.choice(words, size=n).tolist()), n, o, exact_prompt_len=False))
    return reqs
