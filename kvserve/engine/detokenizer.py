"""Incremental detokenization (vLLM semantics): text grows token by token, an incomplete UTF-8
character at the end is withheld, stop strings are found in the new text and cut.

Like vLLM's ``IncrementalDetokenizer.from_new_request``, a fast (Rust ``tokenizers``) tokenizer is
streamed with ``tokenizers.decoders.DecodeStream`` (vLLM's ``FastIncrementalDetokenizer``: primed
with the shortest prompt suffix of 4..23 ids that decodes without U+FFFD, else the whole prompt);
any other tokenizer uses the slow path (vLLM's ``detokenize_incrementally``: a 5-id prefix window
primed from the prompt's last 7 ids). The two differ when the prompt ends inside a multi-byte
character: the fast path then emits that character, completed by the first output id, as output
text; the slow path drops it."""

from __future__ import annotations

from typing import Any

from kvserve.engine.sampling import SamplingParams
from kvserve.logger import init_logger

logger = init_logger(__name__)

try:  # vLLM: USE_FAST_DETOKENIZER = tokenizers >= 0.21.1
    from tokenizers import Tokenizer as _RustTokenizer
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # pragma: no cover - very old tokenizers
    _RustTokenizer = None  # type: ignore[assignment,misc]
    _DecodeStream = None  # type: ignore[assignment,misc]

# vLLM primes the window with the prompt's last tokens (INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
_INITIAL_OFFSET = 5
# tokenizers' DecodeStream error when a decode is not an extension of the previous one (vLLM resets)
_INVALID_PREFIX_ERR_MSG = "Invalid prefix encountered"


def _rust_tokenizer(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` (itself, or a HF fast tokenizer's backend)."""
    if _DecodeStream is None:
        return None
    if isinstance(tokenizer, _RustTokenizer):
        return tokenizer
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend if isinstance(backend, _RustTokenizer) else None


class _FastDecoder:
    """vLLM's ``FastIncrementalDetokenizer.decode_next`` on a ``DecodeStream``."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.stream = _DecodeStream(skip_special_tokens=self.skip_special)
        # Find a safe place to start: a short prompt suffix without an incomplete character.
        suffix = prompt_token_ids
        if len(prompt_token_ids) > 4:
            for i in range(4, min(len(prompt_token_ids) + 1, 24)):
                candidate = prompt_token_ids[-i:]
                if "\ufffd" not in tokenizer.decode(candidate):
                    suffix = candidate
                    break
        for tid in suffix:
            self._step(tid)
        self.spaces_between_special = params.skip_special_tokens or params.spaces_between_special_tokens
        self.added_token_ids: dict[int, str] = {}
        if not self.spaces_between_special:
            self.added_token_ids = {
                tid: tok.content for tid, tok in tokenizer.get_added_tokens_decoder().items()
            }
            if not self.added_token_ids:
                self.spaces_between_special = True
        self.last_special = False

    def _step(self, token_id: int) -> str | None:
        try:
            return self.stream.step(self.tokenizer, token_id)
        except (OverflowError, TypeError):
            logger.warning("Encountered invalid token id: %r", token_id)
            return None
        except Exception as e:  # tokenizers raises a plain Exception for an invalid prefix
            if not str(e).startswith(_INVALID_PREFIX_ERR_MSG):
                raise
            logger.warning("Encountered invalid prefix detokenization error, resetting decode stream.")
            self.stream = _DecodeStream(skip_special_tokens=self.skip_special)
            return self.stream.step(self.tokenizer, token_id)

    def decode_next(self, token_id: int) -> str:
        text = self._step(token_id)
        if not self.spaces_between_special:
            special = self.added_token_ids.get(token_id)
            if special is not None and self.last_special:
                text = special  # the raw token, without the space the decoder puts between specials
            self.last_special = special is not None
        return text or ""


class _SlowDecoder:
    """vLLM's slow path (``detokenize_incrementally``): decode a small window of ids per step."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer
        self.skip_special = params.skip_special_tokens
        self.ids = list(prompt_token_ids[-(_INITIAL_OFFSET + 2) :])
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - _INITIAL_OFFSET, 0)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def decode_next(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character (or nothing visible) so far: wait for more ids
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]


class IncrementalDetokenizer:
    """vLLM's ``BaseIncrementalDetokenizer``: per-step decoding of a bounded window (the cost per
    token does not grow with length), min_tokens-aware stop-string search and stream hold-back."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """``tokenizer`` None (``skip_tokenizer_init``): vLLM's no-op detokenizer -- no text, and
        stop strings are not looked for (``IncrementalDetokenizer.from_new_request``)."""
        self.params = params
        detokenize = params.detokenize and tokenizer is not None
        rust = _rust_tokenizer(tokenizer) if detokenize else None
        self._decoder: _FastDecoder | _SlowDecoder | None = None
        if rust is not None:
            self._decoder = _FastDecoder(rust, prompt_token_ids, params)
        elif detokenize:
            self._decoder = _SlowDecoder(tokenizer, prompt_token_ids, params)
        self.output_text = ""
        self.num_output_tokens = 0
        self.stop = list(params.stop or []) if tokenizer is not None else []
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not params.include_stop_str_in_output else 0
        )
        self._sent = 0  # characters of output_text already returned in DELTA mode

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add ids; returns the stop string that matched (text is then cut), else None.

        ``stop_terminated``: the last id is the EOS / stop token that ended the request; its text
        is left out unless ``include_stop_str_in_output``."""
        if self._decoder is None:
            self.num_output_tokens += len(new_token_ids)
            return None
        skip_last = stop_terminated and not self.params.include_stop_str_in_output
        ids = new_token_ids[:-1] if skip_last else new_token_ids
        stop_check_offset = len(self.output_text)
        for token_id in ids:
            self.output_text += self._decoder.decode_next(token_id)
            self.num_output_tokens += 1
            if self.num_output_tokens <= self.params.min_tokens:
                stop_check_offset = len(self.output_text)
        if skip_last:
            self.num_output_tokens += 1
        if self.stop and self.num_output_tokens > self.params.min_tokens:
            return self._check_stop_strings(len(self.output_text) - stop_check_offset)
        return None

    def _check_stop_strings(self, new_char_count: int) -> str | None:
        if not new_char_count:
            return None
        text = self.output_text
        for stop_str in self.stop:
            idx = text.find(stop_str, max(0, len(text) - new_char_count - len(stop_str) + 1))
            if idx == -1:
                continue
            if self.params.include_stop_str_in_output:
                idx += len(stop_str)
            self.output_text = text[:idx]
            return stop_str
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """Text to report now; the last ``len(stop)-1`` characters wait while a stop string could still match."""
        buffer = 0 if finished else self.stop_buffer_length
        end = max(len(self.output_text) - buffer, 0)
        if not delta:
            return self.output_text[:end]
        if end <= self._sent:
            return ""
        out, self._sent = self.output_text[self._sent : end], end
        return out
