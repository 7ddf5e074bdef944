import statistics, sys, time, torch
from specdecode.models.loading import load_model
name, n = sys.argv[1], int(sys.argv[2])
prompt = torch.randint(100, 1000, (n,), generator=torch.Generator().manual_seed(0))
for label, kw in (("fp32", {}), ("int4", {"quantize": "int4"})):
    b = load_model(name, **kw).backend
    ts = []
    for _ in range(3):
        c = b.new_cache(); t = time.perf_counter(); b.forward(prompt, c, logits_rows=slice(-1, None), invariant=False); ts.append(time.perf_counter() - t)
    print(name, label, n, "prefill %.0f ms" % (min(ts) * 1e3), flush=True)
