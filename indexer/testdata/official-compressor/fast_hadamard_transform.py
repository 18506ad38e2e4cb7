# Stand-in for the fast_hadamard_transform package (spec §3.5): the library's own
# reference form F.linear(x, hadamard(n)) * scale, fp32, cast back. Written for
# sparsemla; not the library's code.
import torch
import torch.nn.functional as F


def hadamard_transform(x, scale=1.0):
    n = x.size(-1)
    h = torch.ones(1, 1, device=x.device, dtype=torch.float32)
    while h.size(0) < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (F.linear(x.float(), h) * scale).to(x.dtype)
