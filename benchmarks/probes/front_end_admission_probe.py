"""Admission cost of the API front end without HTTP (cProfile over the event loop): 256 completions,
512-word prompts, max_tokens 1 (or OUT), through OpenAIServing.create_completion on the event-loop AsyncLLM."""
import asyncio, cProfile, pstats, sys, time, json, os
TREE = os.environ.get("TREE", "/work/main"); sys.path[:0] = [TREE, TREE + "/benchmarks"]
from pathlib import Path
from kvserve.config import EngineArgs
from kvserve.engine.async_llm import AsyncLLM
from kvserve.entrypoints.openai.serving import OpenAIServing
from kvserve.entrypoints.openai.protocol import CompletionRequest
import serve_bench as sb
work = Path("/tmp/probe/w"); (work / "m").mkdir(parents=True, exist_ok=True)
(work / "m" / "config.json").write_text(json.dumps(sb.SMOKE_CONFIG))
tok = sb.write_word_tokenizer(work / "tok", sb.SMOKE_CONFIG["vocab_size"])
OUT = int(os.environ.get("OUT_TOKENS", "1")); N = int(os.environ.get("N", "256")); ISL = int(os.environ.get("ISL", "500"))
if __name__ == "__main__":
    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(work / "m"), tokenizer=str(tok), load_format="dummy", device="cpu",
                                               kv_cache_memory=1 << 26, max_model_len=512, max_num_seqs=256), multiprocess=True)
    serving = OpenAIServing(llm, "m")
    prompts = [" ".join(f"w{(i * 7 + j) % 4000 + 10}" for j in range(ISL)) for i in range(N)]
    
    async def one(i):
        req = CompletionRequest(model="m", prompt=prompts[i], max_tokens=OUT, ignore_eos=True, temperature=0, stream=True)
        async def disc(): return False
        it = await serving.create_completion(req, disc)
        async for _ in it: pass
    
    async def main():
        await one(0)
        pr = cProfile.Profile(); t0 = time.perf_counter(); c0 = time.process_time()
        pr.enable()
        await asyncio.gather(*(one(i) for i in range(N)))
        pr.disable()
        print(f"{N} requests ISL {ISL} OUT {OUT}: wall {time.perf_counter()-t0:.2f}s, front-end CPU {time.process_time()-c0:.3f}s = {(time.process_time()-c0)/N*1e3:.2f} ms a request")
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)
    
    asyncio.run(main()); llm.shutdown()
