"""Probe (tenth session, dev CPU): the API server's CPU per admitted request (512 token-id prompt, max_tokens 1,
streaming, N concurrent; per-thread CPU from psutil). Run: python benchmarks/probes/api_admission_probe.py 256."""
import asyncio, json, os, subprocess, sys, time, random
import aiohttp, psutil
sys.path.insert(0, "/work/main/benchmarks"); sys.path.insert(0, "/work/main")
import serve_bench as sb, common
from pathlib import Path
work = Path("/tmp/adm/m"); work.mkdir(exist_ok=True)
(work / "config.json").write_text(json.dumps({**sb.SMOKE_CONFIG, "max_position_embeddings": 1024}))
tok = sb.write_word_tokenizer(Path("/tmp/adm/tok"), sb.SMOKE_CONFIG["vocab_size"])
port = 8765
cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "serve", "--model", str(work), "--tokenizer", str(tok),
       "--load-format", "dummy", "--device", "cpu", "--kv-cache-memory", str(1 << 27), "--max-model-len", "1024",
       "--port", str(port), "--max-num-seqs", "256"]
env = {**os.environ, "PYTHONPATH": "/work/main"}
p = subprocess.Popen(cmd, env=env, stdout=open("/tmp/adm/server.log", "w"), stderr=subprocess.STDOUT, start_new_session=True)
url = f"http://127.0.0.1:{port}"
import urllib.request
for _ in range(300):
    try:
        urllib.request.urlopen(url + "/health", timeout=1); break
    except Exception:
        time.sleep(0.5)
proc = psutil.Process(p.pid)
print("server pid", p.pid, [(c.pid, c.name(), c.cmdline()[:3]) for c in proc.children(recursive=True)], proc.name())
N = int(sys.argv[1]) if len(sys.argv) > 1 else 256
errs = []
async def main():
    rng = random.Random(0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=N)) as s:
        async def one(i):
            body = {"model": str(work), "prompt": [rng.randrange(1000, 10000) for _ in range(512)], "max_tokens": 1,
                    "stream": True, "ignore_eos": True}
            try:
                async with s.post(url + "/v1/completions", json=body) as r:
                    async for _ in r.content: pass
            except aiohttp.ClientError as e:
                errs.append(repr(e)[:80])
        await one(0)

        await asyncio.sleep(1)
        for rep in range(int(os.environ.get("REPS", "3"))):
            c0 = proc.cpu_times(); t0 = time.time(); th0 = {t.id: t.user_time + t.system_time for t in proc.threads()}
            await asyncio.gather(*(one(i) for i in range(N)))
            c1 = proc.cpu_times(); dt = time.time() - t0
            cpu = (c1.user + c1.system) - (c0.user + c0.system)
            th1 = {t.id: t.user_time + t.system_time for t in proc.threads()}
            print(sorted(((round(v - th0.get(k, 0), 2), k) for k, v in th1.items()), reverse=True)[:5])
            print(f"rep {rep}: {N} requests in {dt:.2f} s; API server CPU {cpu:.2f} s = {cpu / N * 1e3:.2f} ms a request; errors {len(errs)} {errs[:2]}", flush=True); errs.clear()
try:
    asyncio.run(main())
finally:
    os.killpg(p.pid, 15)
os.killpg(p.pid, 15); p.wait()
