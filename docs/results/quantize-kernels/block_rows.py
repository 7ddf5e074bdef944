import time, torch
from torch import nn
from specdecode.models.quantize import Int4Linear, Int8Linear, Bf16Linear, _packed_bf16_call
torch.manual_seed(0)
def t(f, n=20):
    f(); f()
    s=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-s)/n*1e3
for (i,o) in [(896,4864),(4864,896),(896,896),(1536,8960),(8960,1536)]:
    lin=nn.Linear(i,o,bias=False)
    q4=Int4Linear(lin,tied=False,group_size=64); q8=Int8Linear(lin,tied=False)
    packed=torch.ops.mkldnn._reorder_linear_weight(lin.weight.detach().bfloat16(),None)
    row=[]
    for m in (1,2,4,8,16,32,64,300):
        x=torch.randn(m,i).bfloat16()
        row.append((m, round(t(lambda: q4.matmul(x)),3), round(t(lambda: q8.matmul(x)),3), round(t(lambda: _packed_bf16_call(packed,x)),3)))
    print((i,o), row, flush=True)
