"""AOT-compile a Triton kernel for sm_90 and dump ttgir/ptx/sass + inner-loop op counts."""
import collections, re, subprocess, sys, os, tempfile
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget

BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")

def compile_kernel(fn, sig, consts, num_warps=4, num_stages=3, tag="k", div16=()):
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in div16}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    target = GPUTarget("cuda", 90, 32)
    k = triton.compile(src, target=target, options={"num_warps": num_warps, "num_stages": num_stages})
    out = f"/tmp/aot/{tag}"
    os.makedirs(out, exist_ok=True)
    for ext in ("ttgir", "ptx", "llir"):
        open(f"{out}/k.{ext}", "w").write(k.asm[ext])
    open(f"{out}/k.cubin", "wb").write(k.asm["cubin"])
    sass = subprocess.run([f"{BIN}/cuobjdump", "-sass", f"{out}/k.cubin"], capture_output=True, text=True).stdout
    open(f"{out}/k.sass", "w").write(sass)
    return k, sass

def loop_counts(sass):
    """Find the hottest backward branch loop: instructions between a label and BRA back to it."""
    lines = [l for l in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", l)]
    addr = lambda l: int(re.match(r"\s+/\*([0-9a-f]+)\*/", l).group(1), 16)
    loops = []
    for i, l in enumerate(lines):
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", l)
        mm = re.search(r"BRA.*\(\.L_x_(\d+)\)", l)
        if "BRA" in l:
            tgt = re.search(r"0x([0-9a-f]+)", l.split("BRA")[1])
            if tgt:
                t = int(tgt.group(1), 16)
                if t < addr(l):
                    body = [x for x in lines if t <= addr(x) <= addr(l)]
                    loops.append(body)
    if not loops:
        return None
    body = max(loops, key=len)
    ops = collections.Counter()
    for x in body:
        ins = x.split("*/", 1)[1].strip()
        ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
        ops[ins.split()[0].split(".")[0]] += 1
    return len(body), ops

def all_loops(sass):
    lines = [l for l in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", l)]
    addr = lambda l: int(re.match(r"\s+/\*([0-9a-f]+)\*/", l).group(1), 16)
    res = []
    for l in lines:
        if "BRA" in l:
            tgt = re.search(r"0x([0-9a-f]+)", l.split("BRA")[1])
            if tgt and int(tgt.group(1), 16) < addr(l):
                t = int(tgt.group(1), 16)
                body = [x for x in lines if t <= addr(x) <= addr(l)]
                ops = collections.Counter()
                for x in body:
                    ins = x.split("*/", 1)[1].strip()
                    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
                    ops[ins.split()[0].split(".")[0]] += 1
                res.append((len(body), ops))
    return res
