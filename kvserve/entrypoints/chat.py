"""``kvserve chat``: an interactive terminal chat that streams tokens as they are generated."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Iterator


def stream_reply(llm: Any, messages: list[dict[str, str]], params: Any, request_id: str) -> Iterator[str]:
    """Yield the assistant's reply text piece by piece (DELTA outputs of one request)."""
    from kvserve.engine.sampling import RequestOutputKind

    engine = llm.llm_engine
    params = params.clone()
    params.output_kind = RequestOutputKind.DELTA
    engine.add_request(request_id, {"prompt_token_ids": llm.apply_chat_template(messages)}, params)
    try:
        finished = False
        while not finished:
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                if out.outputs[0].text:
                    yield out.outputs[0].text
                finished = out.finished
    finally:
        if request_id in engine.states:  # interrupted: free its KV blocks now
            engine.abort_request(request_id)


def run_chat(args: argparse.Namespace, llm_kwargs: dict[str, Any], params: Any) -> int:
    from kvserve import LLM

    llm = LLM(**llm_kwargs)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("kvserve chat: type a message; Ctrl-C stops a reply, Ctrl-D or /exit quits, /reset clears.", flush=True)
    turn = 0
    while True:
        try:
            user = input("\nuser> ")
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            return 0
        if user.strip() in ("/exit", "/quit"):
            return 0
        if user.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        if not user.strip():
            continue
        messages.append({"role": "user", "content": user})
        print("assistant> ", end="", flush=True)
        reply = []
        try:
            for piece in stream_reply(llm, messages, params, f"chat-{turn}"):
                reply.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [interrupted]", flush=True)
        except (ValueError, RuntimeError) as e:
            print(flush=True)
            print(f"kvserve: error: {e}", file=sys.stderr, flush=True)
            messages.pop()
            continue
        else:
            print(flush=True)
        turn += 1
        messages.append({"role": "assistant", "content": "".join(reply)})
