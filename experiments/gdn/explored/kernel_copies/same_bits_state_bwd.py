"""The reverse chain at this tree against a copy of main's (build/k2cmp/state_bwd_old.py): the same bits?"""
import importlib.util
import sys

import torch

sys.path.insert(0, "tests/gdn"); sys.path.insert(0, "tests")
import test_gdn_cutedsl_state_backward as t
from dsfuse.gdn.cutedsl import state_bwd

spec = importlib.util.spec_from_file_location("state_bwd_old", "build/k2cmp/state_bwd_old.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
new_fn = state_bwd.launch_state_backward
for dtype, l2, (h, hv) in [(torch.bfloat16, True, (2, 4)), (torch.bfloat16, False, (1, 3)), (torch.float16, False, (2, 4))]:
    x, _ = t._inputs(h, hv, dtype, l2, seed=5)
    state_bwd.launch_state_backward = new_fn
    a = t._run(x, l2)
    state_bwd.launch_state_backward = old.launch_state_backward
    b = t._run(x, l2)
    state_bwd.launch_state_backward = new_fn
    torch.cuda.synchronize()
    print(dtype, l2, (h, hv), "dstates equal:", torch.equal(a[0], b[0]), "dh0 equal:", torch.equal(a[1], b[1]),
          "nan:", bool(a[0].isnan().any() or a[1].isnan().any()))
