"""The kvserve command line on a tiny model: generate --json and the streaming chat."""

from __future__ import annotations

import json
import subprocess
import sys

KV = str(1 << 24)


def _kvserve(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvserve.entrypoints.cli", *args],
        input=stdin, capture_output=True, text=True, timeout=300,
    )


def test_generate_json_matches_the_offline_api(make_tiny_model):
    from kvserve import LLM, SamplingParams

    folder = str(make_tiny_model("qwen2"))
    res = _kvserve("generate", "The quick brown fox", "def main():", "--model", folder, "--no-chat",
                   "--max-tokens", "7", "--json", "--kv-cache-memory", KV)
    assert res.returncode == 0, res.stderr
    records = [json.loads(line) for line in res.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["The quick brown fox", "def main():"]
    llm = LLM(folder, kv_cache_memory=1 << 24)
    outs = llm.generate(["The quick brown fox", "def main():"], SamplingParams(temperature=0, max_tokens=7), use_tqdm=False)
    for rec, out in zip(records, outs):
        assert set(rec) >= {"prompt_token_ids", "output_token_ids", "text", "finish_reason"}
        assert rec["prompt_token_ids"] == out.prompt_token_ids
        assert rec["output_token_ids"] == list(out.outputs[0].token_ids)
        assert rec["text"] == out.outputs[0].text and rec["finish_reason"] == out.outputs[0].finish_reason


def test_chat_streams_one_reply_per_line_and_exits_on_eof(make_tiny_model):
    folder = str(make_tiny_model("llama"))
    res = _kvserve("chat", "--model", folder, "--temperature", "0", "--max-tokens", "6",
                   "--kv-cache-memory", KV, stdin="hello there\nand again\n")
    assert res.returncode == 0, res.stderr
    replies = [line.split("assistant> ", 1)[1] for line in res.stdout.splitlines() if "assistant> " in line]
    assert len(replies) == 2  # one streamed reply per user line; EOF ends the session cleanly
    assert "Traceback" not in res.stderr


def test_serve_refuses_skip_tokenizer_init(tiny):
    res = _kvserve("serve", str(tiny), "--skip-tokenizer-init", "--kv-cache-memory", KV)
    assert res.returncode != 0
    assert "--skip-tokenizer-init is only supported offline" in res.stderr
