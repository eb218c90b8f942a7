"""The reverse chain of this tree against another copy of its module (e.g. main's, from ``git show``) on
the state-backward test's inputs (bf16 with and without the L2 norm, fp16): the same bits? Exit 1 if not.

    python3 experiments/gdn/explored/kernel_copies/same_bits_state_bwd.py OLD_STATE_BWD.py
"""
import importlib.util
import sys

import torch

sys.path.insert(0, "tests/gdn"); sys.path.insert(0, "tests")
import test_gdn_cutedsl_state_backward as t
from dsfuse.gdn.cutedsl import state_bwd

spec = importlib.util.spec_from_file_location("state_bwd_old", sys.argv[1])
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
new_fn = state_bwd.launch_state_backward
same = True
for dtype, l2, (h, hv) in [(torch.bfloat16, True, (2, 4)), (torch.bfloat16, False, (1, 3)), (torch.float16, False, (2, 4))]:
    x, _ = t._inputs(h, hv, dtype, l2, seed=5)
    try:
        state_bwd.launch_state_backward = new_fn
        a = t._run(x, l2)
        state_bwd.launch_state_backward = old.launch_state_backward
        b = t._run(x, l2)
    finally:
        state_bwd.launch_state_backward = new_fn
    torch.cuda.synchronize()
    equal = torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    same = same and equal and not (a[0].isnan().any() or a[1].isnan().any())
    print(dtype, l2, (h, hv), "dstates equal:", torch.equal(a[0], b[0]), "dh0 equal:", torch.equal(a[1], b[1]),
          "nan:", bool(a[0].isnan().any() or a[1].isnan().any()))
sys.exit(0 if same else 1)
