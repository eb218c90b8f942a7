import torch
from dsfuse.gdn.cutedsl.fused_fwd import fused_forward
torch.manual_seed(0)
cu=[0,1,63,63,127,192,392]; t=cu[-1]+7; h,hv,d=2,6,64
r=lambda *s: torch.randn(s,device="cuda")
q,k,v=r(t,h,d).bfloat16(),r(t,h,d).bfloat16(),r(t,hv,d).bfloat16()
g=-torch.rand(t,hv,device="cuda")*0.3; beta=torch.rand(t,hv,device="cuda").bfloat16()
o,ht,a=fused_forward(q,k,v,g,beta,initial_state=r(6,hv,d,d)*0.1,cu_seqlens=cu,use_qk_l2norm=True)
torch.cuda.synchronize(); print("ok", float(o.float().norm()))
