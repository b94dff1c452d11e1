"""A post-grad pass for torch.compile: GEMMs that accumulate into a whole matrix stay a GEMM and an add.

Inductor rewrites ``C + A @ B`` into ``addmm(C, A, B)`` when the sum feeds anything but elementwise ops (its
``addmm`` pattern in ``torch/_inductor/fx_passes/post_grad.py``), and runs it as ``addmm(C, A, B, out=D)``. With
``D`` not ``C`` (C is still needed), aten first copies ``C`` into ``D`` (a device memcpy), then runs the GEMM with
beta = 1, which reads ``D`` again. In the MLPerf DLRM-DCNv2 backward that is x0's gradient, ``C`` the sum of every
other path's gradient (written by one fused elementwise kernel) plus the first cross layer's ``gu V``: a 453 MB
copy a step (0.295 ms on an H100, Nsight Systems by way of the PyTorch profiler, 2026-11-25) and a 0.505 ms
beta = 1 GEMM where the plain GEMM takes 0.449. Left as ``mm`` + ``add``, the add joins the elementwise kernel that
writes ``C``, which reads the GEMM's output once instead. Measured in `results/addmm_unfused.md`.

Only full-matrix accumulations (``C`` of the output's 2-D shape, alpha = beta = 1) are touched; bias adds (a 1-D
``C``) keep cuBLASLt's bias epilogue.
"""

from __future__ import annotations

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

__all__ = ["UnfuseMatrixAddmm", "UNFUSE_MATRIX_ADDMM"]

# Whether compiled CUDA steps take the pass (module-level, so that a benchmark can compare both).
UNFUSE_MATRIX_ADDMM = True


class UnfuseMatrixAddmm(CustomGraphPass):
    """``addmm(C, A, B)`` with a 2-D ``C`` of the output's shape -> ``C + mm(A, B)`` (see the module docstring).

    Passed as torch.compile's ``post_grad_custom_post_pass`` option (it runs after Inductor's own patterns).

    Example:
        >>> from torch._inductor.utils import run_and_get_code
        >>> f = lambda c, a, b, w: (c * 2 + a @ b) @ w
        >>> args = [torch.randn(8, 4), torch.randn(8, 3), torch.randn(3, 4), torch.randn(4, 2)]
        >>> out, code = run_and_get_code(torch.compile(f, options={"post_grad_custom_post_pass": UnfuseMatrixAddmm()}), *args)
        >>> "addmm" in code[0], torch.allclose(out, f(*args), atol=1e-5)
        (False, True)
    """

    def __call__(self, graph: torch.fx.Graph) -> None:
        aten = torch.ops.aten
        for node in list(graph.nodes):
            if node.op != "call_function" or node.target is not aten.addmm.default or len(node.args) != 3:
                continue
            inp, m1, m2 = node.args
            if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1 or not isinstance(inp, torch.fx.Node):
                continue
            val, inp_val = node.meta.get("val"), inp.meta.get("val")
            if val is None or inp_val is None or inp_val.dim() != 2 or tuple(inp_val.shape) != tuple(val.shape):
                continue
            with graph.inserting_before(node):
                mm = graph.call_function(aten.mm.default, (m1, m2))
                mm.meta["val"] = aten.mm.default(m1.meta["val"], m2.meta["val"])
                add = graph.call_function(aten.add.Tensor, (inp, mm))
                add.meta["val"] = aten.add.Tensor(inp_val, mm.meta["val"])
            node.replace_all_uses_with(add)
            graph.erase_node(node)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))
