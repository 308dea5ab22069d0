"""Incremental detokenization (vLLM semantics): text grows token by token, an incomplete UTF-8
character at the end is withheld, stop strings are found in the new text and cut."""

from __future__ import annotations

from typing import Any

from kvserve.engine.sampling import SamplingParams

# vLLM primes the window with the prompt's last tokens (INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
_INITIAL_OFFSET = 5


class IncrementalDetokenizer:
    """Decodes a small window of ids per step, so the cost per token does not grow with length."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        self.params = params
        self.skip_special = params.skip_special_tokens
        self.ids = list(prompt_token_ids[-(_INITIAL_OFFSET + 2) :])
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - _INITIAL_OFFSET, 0)
        self.output_text = ""
        self.num_output_tokens = 0
        self.stop = list(params.stop or [])
        self.stop_buffer_length = (
            max(len(s) for s in self.stop) - 1 if self.stop and not params.include_stop_str_in_output else 0
        )
        self._sent = 0  # characters of output_text already returned in DELTA mode

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _step(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # an incomplete character (or nothing visible) so far: wait for more ids
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return new_text[len(prefix_text) :]

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Add ids; returns the stop string that matched (text is then cut), else None.

        ``stop_terminated``: the last id is the EOS / stop token that ended the request; its text
        is left out unless ``include_stop_str_in_output``."""
        if not self.params.detokenize:
            self.num_output_tokens += len(new_token_ids)
            return None
        skip_last = stop_terminated and not self.params.include_stop_str_in_output
        ids = new_token_ids[:-1] if skip_last else new_token_ids
        stop_check_offset = len(self.output_text)
        for token_id in ids:
            self.output_text += self._step(token_id)
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
