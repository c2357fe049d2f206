import time, torch, statistics
from logitserve.kernels.reference import sample as ref
torch.set_num_threads(1)
def args(b):
    g = torch.Generator().manual_seed(0)
    return dict(temperature=torch.rand(b, generator=g) + 0.5, top_k=torch.randint(0, 100, (b,), generator=g),
                top_p=torch.full((b,), 0.9), min_p=torch.zeros(b), seed=torch.arange(b), step=torch.zeros(b, dtype=torch.int64))
def T(label, fn, n=5):
    fn(); ts=[]
    for _ in range(n):
        t0=time.perf_counter(); fn(); ts.append(time.perf_counter()-t0)
    return statistics.median(ts)
for b in (1, 4, 27):
    x = (torch.randn(b, 128256) * 3).to(torch.bfloat16)
    a = args(b)
    whole = T("", lambda: ref.sample(x, **a))
    rows = T("", lambda: [ref.sample(x[i:i+1], **{k: v[i:i+1] for k, v in a.items()}) for i in range(b)])
    print(f"b={b}: batch {whole*1e3/b:.2f} ms/row, row by row {rows*1e3/b:.2f} ms/row")
