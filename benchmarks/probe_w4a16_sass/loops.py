import sys; sys.path.insert(0, "/tmp/aot")
from aot import all_loops
for tag in sys.argv[1:]:
    sass = open(f"/tmp/aot/{tag}/k.sass").read()
    for n, ops in all_loops(sass):
        print(tag, n, "HMUL2", ops["HMUL2"], "HGMMA", ops["HGMMA"], "LDGSTS", ops["LDGSTS"], ops.most_common(10))
