"""RequestOutput streaming semantics (CUMULATIVE / DELTA / FINAL_ONLY, shared prompt objects),
incremental detokenization (vLLM's fast path: tokenizers' DecodeStream), and UTF-8 streaming on
the real default model against vLLM's recorded text."""

from __future__ import annotations

import json
import os
import random

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.detokenizer import IncrementalDetokenizer
from kvserve.engine.sampling import RequestOutputKind

CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def tiny_llm(make_tiny_model):
    return LLM(str(make_tiny_model("llama")), kv_cache_memory=1 << 24)


def _drive(engine, requests):
    """Add ``(request_id, prompt, params)`` requests and step until all finish; outputs per id."""
    outs = {rid: [] for rid, _, _ in requests}
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    for _ in range(10_000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            outs[out.request_id].append(out)
    assert not engine.has_unfinished_requests()
    return outs


def _params(kind, **kw):
    base = dict(temperature=1.0, seed=11, max_tokens=12, ignore_eos=True)
    base.update(kw)
    return SamplingParams(output_kind=kind, **base)


# ----------------------------------------------------------------------------------------------
# (a) output kinds and shared prompt objects
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA], ids=["cumulative", "delta"])
def test_every_output_shares_prompt_objects(tiny_llm, kind):
    engine = tiny_llm.llm_engine
    prompt = "some text prompt " + kind.name.lower()
    outs = _drive(engine, [(f"ident-{kind.name}", prompt, _params(kind))])[f"ident-{kind.name}"]
    assert len(outs) == 12  # one output per generated token
    first = outs[0]
    assert first.prompt is prompt  # the caller's string itself, never a copy
    assert first.prompt_token_ids == list(tiny_llm.get_tokenizer()(prompt).input_ids)
    for out in outs:
        assert out.prompt is first.prompt
        assert out.prompt_token_ids is first.prompt_token_ids
        assert len(out.outputs) == 1 and out.outputs[0].index == 0
    assert [o.finished for o in outs] == [False] * 11 + [True]
    assert [o.outputs[0].finish_reason for o in outs] == [None] * 11 + ["length"]


def test_token_prompt_has_no_prompt_text(tiny_llm):
    ids = tiny_llm.get_tokenizer()("The quick brown fox").input_ids
    outs = _drive(tiny_llm.llm_engine, [("tok-prompt", {"prompt_token_ids": ids}, _params(CUMULATIVE, max_tokens=3))])
    for out in outs["tok-prompt"]:
        assert out.prompt is None and out.prompt_token_ids == ids
        assert out.prompt_token_ids is outs["tok-prompt"][0].prompt_token_ids


def test_cumulative_grows_and_delta_concatenates_to_it(tiny_llm):
    engine = tiny_llm.llm_engine
    prompt = "Paged attention stores keys"
    kw = dict(max_tokens=16, logprobs=2)
    runs = _drive(
        engine,
        [("cum", prompt, _params(CUMULATIVE, **kw)), ("dlt", prompt, _params(DELTA, **kw)),
         ("fin", prompt, _params(FINAL_ONLY, **kw))],
    )
    cum, dlt, fin = runs["cum"], runs["dlt"], runs["fin"]
    final = cum[-1].outputs[0]
    assert len(final.token_ids) == 16
    for i, out in enumerate(cum):  # each cumulative output extends the previous one
        c = out.outputs[0]
        assert list(c.token_ids) == list(final.token_ids[: i + 1])
        assert final.text.startswith(c.text)
        assert len(c.logprobs) == i + 1
    assert "".join(o.outputs[0].text for o in dlt) == final.text
    assert [t for o in dlt for t in o.outputs[0].token_ids] == list(final.token_ids)
    assert all(len(o.outputs[0].token_ids) == 1 for o in dlt)
    dlt_lps = [e for o in dlt for e in o.outputs[0].logprobs]
    assert [list(e) for e in dlt_lps] == [list(e) for e in final.logprobs]
    assert dlt[-1].outputs[0].cumulative_logprob == pytest.approx(final.cumulative_logprob)
    assert dlt[-1].finished and not any(o.finished for o in dlt[:-1])
    # FINAL_ONLY: exactly one output, the finished cumulative one
    assert len(fin) == 1 and fin[0].finished
    f = fin[0].outputs[0]
    assert (f.text, list(f.token_ids), f.finish_reason) == (final.text, list(final.token_ids), "length")
    assert f.cumulative_logprob == pytest.approx(final.cumulative_logprob)


def test_stop_string_never_leaks_while_streaming(tiny_llm):
    """Streaming holds back len(stop) - 1 characters, so no intermediate output shows the start of a
    stop string that the final text cuts off; DELTA pieces still add up to the final text."""
    engine = tiny_llm.llm_engine
    prompt = "The quick brown fox"
    base = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    free = _drive(engine, [("free", prompt, SamplingParams(output_kind=DELTA, **base))])["free"]
    pieces = [o.outputs[0].text for o in free]
    text = "".join(pieces)
    bounds, pos = set(), 0
    for piece in pieces:
        pos += len(piece)
        bounds.add(pos)
    # a 3-character stop string that starts in one output piece and ends in a later one
    stop = None
    for i in range(2, len(text) - 3):
        s = text[i : i + 3]
        if "\ufffd" not in s and text.find(s) == i and (bounds & {i + 1, i + 2}):
            stop = s
            break
    if stop is None:
        pytest.skip("no stop string spanning two output pieces")
    runs = _drive(
        engine,
        [("s-cum", prompt, SamplingParams(output_kind=CUMULATIVE, stop=[stop], **base)),
         ("s-dlt", prompt, SamplingParams(output_kind=DELTA, stop=[stop], **base))],
    )
    cum, dlt = runs["s-cum"], runs["s-dlt"]
    final = cum[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason, final.text) == ("stop", stop, text[: text.find(stop)])
    for out in cum:
        assert final.text.startswith(out.outputs[0].text)
    assert "".join(o.outputs[0].text for o in dlt) == final.text
    assert dlt[-1].outputs[0].stop_reason == stop


# ----------------------------------------------------------------------------------------------
# Incremental detokenizer unit tests (tiny byte-level BPE tokenizer)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tok(make_tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(make_tiny_model("llama")))


def _stream(tokenizer, prompt_ids, out_ids, **kw):
    params = SamplingParams(max_tokens=max(1, len(out_ids)), **kw)
    d = IncrementalDetokenizer(tokenizer, prompt_ids, params)
    pieces = []
    for t in out_ids:
        d.update([t], False)
        pieces.append(d.get_next_output_text(False, True))
    return pieces, d


class _PlainDecoder:
    """A tokenizer that only offers ``decode`` (not a fast tokenizer): the slow path."""

    def __init__(self, backend):
        self.backend = backend

    def decode(self, ids, skip_special_tokens=True):
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)


def test_incomplete_utf8_is_withheld(tok):
    backend = tok.backend_tokenizer
    prompt = backend.encode("The quick brown fox", add_special_tokens=False).ids
    text = " 日本語のテキスト。 Привет, мир! 🙂"
    out = backend.encode(text, add_special_tokens=False).ids
    assert any("\ufffd" in backend.decode([t]) for t in out)  # some ids are partial characters
    for tokenizer in (backend, tok, _PlainDecoder(backend)):  # fast path (twice), slow path
        pieces, d = _stream(tokenizer, prompt, out)
        assert "".join(pieces) == text == d.output_text
        assert not any("\ufffd" in p for p in pieces)
        assert "" in pieces  # at least one id produced no text yet
    # cut inside the emoji: the incomplete tail is withheld, never shown as U+FFFD
    cut = next(i for i in range(len(out), 0, -1) if backend.decode(out[:i]).endswith("\ufffd"))
    pieces, d = _stream(backend, prompt, out[:cut])
    assert "\ufffd" not in d.output_text and text.startswith(d.output_text)


def test_prompt_ending_inside_a_character(tok):
    """vLLM's fast path (DecodeStream primed with the prompt) emits prompt text only up to the last
    id boundary that decodes cleanly; when the prompt ends inside a character, everything after
    that boundary (the character's first bytes and any earlier text not yet emitted) comes out as
    OUTPUT text once the output completes the character. vLLM's slow path drops it instead."""
    backend = tok.backend_tokenizer
    text = "日本語のテキスト。"
    ids = backend.encode(text, add_special_tokens=False).ids
    assert len(ids) < 24  # short prompts: DecodeStream is primed with the whole prompt
    splits = [a for a in range(1, len(ids)) if backend.decode(ids[:a]).endswith("\ufffd")]
    assert splits
    for a in splits:
        clean = max(p for p in range(a + 1) if not backend.decode(ids[:p]).endswith("\ufffd"))
        emitted = backend.decode(ids[:clean])
        pieces, d = _stream(backend, ids[:a], ids[a:])
        assert d.output_text == text[len(emitted) :]
        slow_pieces, slow = _stream(_PlainDecoder(backend), ids[:a], ids[a:])
        assert text.endswith(slow.output_text)


def test_matches_decode_stream_reference(tok):
    """Random id streams (many invalid byte sequences, special tokens) against a direct transcription
    of vLLM's FastIncrementalDetokenizer."""
    from tokenizers.decoders import DecodeStream

    backend = tok.backend_tokenizer
    vocab = backend.get_vocab_size()
    rng = random.Random(0)

    def reference(prompt, out):
        stream = DecodeStream(skip_special_tokens=True)
        suffix = prompt
        if len(prompt) > 4:
            for i in range(4, min(len(prompt) + 1, 24)):
                if "\ufffd" not in backend.decode(prompt[-i:]):
                    suffix = prompt[-i:]
                    break
        for t in suffix:
            stream.step(backend, t)
        return [stream.step(backend, t) or "" for t in out]

    corpus = "Le cœur a ses raisons. 日本語のテキスト。 Привет, мир! 🙂 def main():"
    corpus_ids = backend.encode(corpus, add_special_tokens=False).ids
    for _ in range(300):
        if rng.random() < 0.5:
            a, b = sorted(rng.sample(range(len(corpus_ids) + 1), 2))
            prompt, out = corpus_ids[:a] or [5], corpus_ids[a:b] or [7]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
            out = [rng.randrange(vocab) for _ in range(rng.randrange(1, 20))]
        pieces, _ = _stream(backend, prompt, out)
        assert pieces == reference(prompt, out), (prompt, out)


def test_stop_string_search_skips_min_tokens_text(tok):
    backend = tok.backend_tokenizer
    head = backend.encode("fox STOP dog", add_special_tokens=False).ids
    tail = backend.encode(" cat STOP end", add_special_tokens=False).ids
    prompt = backend.encode("The", add_special_tokens=False).ids
    params = SamplingParams(max_tokens=64, min_tokens=len(head), stop=["STOP"])
    d = IncrementalDetokenizer(backend, prompt, params)
    assert d.update(head + tail, False) == "STOP"  # one multi-id update
    assert d.output_text == "fox STOP dog cat "
    d = IncrementalDetokenizer(backend, prompt, SamplingParams(max_tokens=64, stop=["STOP"]))
    assert d.update(head + tail, False) == "STOP" and d.output_text == "fox "


def test_stop_terminated_token_text_left_out(tok):
    backend = tok.backend_tokenizer
    ids = backend.encode("fox dog", add_special_tokens=False).ids
    d = IncrementalDetokenizer(backend, [5], SamplingParams(max_tokens=9))
    d.update(ids, True)  # the last id ended the request (EOS / stop token id)
    assert d.output_text == backend.decode(ids[:-1]) and d.num_output_tokens == len(ids)
    d = IncrementalDetokenizer(backend, [5], SamplingParams(max_tokens=9, include_stop_str_in_output=True))
    d.update(ids, True)
    assert d.output_text == "fox dog"


# ----------------------------------------------------------------------------------------------
# (b) the real default model against vLLM's recorded output (fp32, greedy, 64 tokens)
# ----------------------------------------------------------------------------------------------

UTF8_IDS = ["pub_08_utf8_zh_sky", "pub_10_mbout_japanese", "pub_11_mbout_scripts", "pub_09_utf8_emoji_accents"]
RUN_LONG = os.environ.get("KVSERVE_SLOW_TESTS") == "1"  # the 4 long prompts add ~1 minute on 2 cores


def _load(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def golden_run(default_model_path, shared_eval):
    """All short prompts (and the long ones with KVSERVE_SLOW_TESTS=1) in ONE batched engine run,
    every request streamed in DELTA mode."""
    prompts = _load(shared_eval / "golden_public.jsonl")
    refs = {r["id"]: r for r in _load(shared_eval / "golden_public_vllm_fp32.jsonl")}
    if not RUN_LONG:
        prompts = [p for p in prompts if len(p["prompt_token_ids"]) < 200]
    assert {p["id"] for p in prompts} >= set(UTF8_IDS)
    llm = LLM(str(default_model_path), dtype="float32", max_model_len=4096, kv_cache_memory=1 << 28)
    params = SamplingParams(temperature=0.0, max_tokens=64, output_kind=DELTA)
    outs = _drive(llm.llm_engine, [(p["id"], {"prompt_token_ids": p["prompt_token_ids"]}, params) for p in prompts])
    return outs, refs


@pytest.mark.parametrize("pid", UTF8_IDS)
def test_utf8_streaming_matches_vllm(golden_run, pid):
    outs, refs = golden_run
    ref, stream = refs[pid], outs[pid]
    deltas = [o.outputs[0].text for o in stream]
    assert not any("\ufffd" in d for d in deltas)
    text = "".join(deltas)
    ids = [t for o in stream for t in o.outputs[0].token_ids]
    assert ids == ref["output_token_ids"]
    assert text == ref["text"]
    assert stream[-1].finished and stream[-1].outputs[0].finish_reason == ref["finish_reason"]
    if pid in ("pub_08_utf8_zh_sky", "pub_10_mbout_japanese"):
        # CJK output: many ids are character fragments, whose delta is empty until completed
        assert sum(d == "" for d in deltas) >= 10


def test_all_reference_texts_match_vllm(golden_run):
    outs, refs = golden_run
    assert len(outs) >= 20
    mismatched = []
    for pid, stream in outs.items():
        text = "".join(o.outputs[0].text for o in stream)
        ids = [t for o in stream for t in o.outputs[0].token_ids]
        ref = refs[pid]
        if (ids, text, stream[-1].outputs[0].finish_reason) != (ref["output_token_ids"], ref["text"], ref["finish_reason"]):
            mismatched.append(pid)
    assert not mismatched


def test_a_slow_consumer_gets_the_missed_steps_folded_into_one_output(make_tiny_model):
    """AsyncLLM's one-slot collector (vLLM's): a stream read late yields fewer, larger DELTA outputs
    whose concatenation is exactly what a prompt reader gets, text and token ids, for n = 2."""
    import asyncio

    from kvserve.config import EngineArgs
    from kvserve.engine.async_llm import AsyncLLM
    from kvserve.engine.sampling import SamplingParams

    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(make_tiny_model("llama")), dtype="float32",
                                               kv_cache_memory=1 << 22, device="cpu"))
    params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=24, ignore_eos=True)

    async def read(rid: str, pause_s: float) -> tuple[int, dict]:
        events, text, ids = 0, {0: "", 1: ""}, {0: [], 1: []}
        async for out in llm.generate("a b c d", params, rid):
            events += 1
            for c in out.outputs:
                text[c.index] += c.text
                ids[c.index] += c.token_ids
            await asyncio.sleep(pause_s)  # the engine runs ahead meanwhile
        return events, {i: (text[i], ids[i]) for i in (0, 1)}

    try:
        prompt_events, prompt_out = asyncio.run(read("prompt", 0.0))
        slow_events, slow_out = asyncio.run(read("slow", 0.3))
    finally:
        llm.shutdown()
    assert slow_out == prompt_out and all(len(v[1]) == 24 for v in slow_out.values())
    assert prompt_events >= 24 and slow_events < prompt_events / 2, (prompt_events, slow_events)
