"""CPU probe: the batched causal forward's self-attention per row (a loop of unmasked SDPA calls) vs one padded
SDPA call with a key-padding mask, rows of one chunk (T tokens) over different history lengths (in chunks).
1.3B head geometry (12 heads x 128). ``python bench/probe_causal_attention.py``; docs/realtime.md quotes it."""
import time

import torch
import torch.nn.functional as F
torch.manual_seed(0)
def run(T, hist_chunks, H=12, D=128):
    B=len(hist_chunks)
    q=torch.randn(B,H,T,D); k=torch.randn(B,H,T,D); v=torch.randn(B,H,T,D)
    hk=[torch.randn(1,H,n*T,D) for n in hist_chunks]; hv=[torch.randn(1,H,n*T,D) for n in hist_chunks]
    def loop():
        return torch.cat([F.scaled_dot_product_attention(q[b:b+1], torch.cat([hk[b],k[b:b+1]],2), torch.cat([hv[b],v[b:b+1]],2)) for b in range(B)])
    L=max(hist_chunks)*T+T
    def padded():
        K=torch.zeros(B,H,L,D); V=torch.zeros(B,H,L,D); m=torch.zeros(B,1,1,L,dtype=torch.bool)
        for b,n in enumerate(hist_chunks):
            K[b,:,:n*T]=hk[b][0]; K[b,:,n*T:(n+1)*T]=k[b]; V[b,:,:n*T]=hv[b][0]; V[b,:,n*T:(n+1)*T]=v[b]; m[b,...,:(n+1)*T]=True
        return F.scaled_dot_product_attention(q,K,V,attn_mask=m)
    a,p=loop(),padded(); assert (a-p).abs().max()<1e-4
    out={}
    for name,f in (("loop",loop),("padded",padded)):
        f(); t=time.perf_counter(); 
        for _ in range(3): f()
        out[name]=(time.perf_counter()-t)/3*1e3
    print(f"T={T} hist={hist_chunks}: loop {out['loop']:.1f} ms, padded+mask {out['padded']:.1f} ms")
torch.set_num_threads(2)
run(390, [0,2,4]); run(390,[3,3]); run(120,[0,1,2,3]); run(780,[0,6])
