"""models.lean_norm: the RMSNorm that keeps its input and one float per row for backward."""

import copy

import torch
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from rlhf_core.config import ComputeConfig
from rlhf_core.models.lean_norm import lean_rmsnorm, use_lean_rmsnorm
from rlhf_core.models.loading import prepare_for_training
from tests.tiny import tiny_lm


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while ``fn`` runs, parameters excluded."""
    sizes: dict[int, int] = {}

    def keep(t):
        if not isinstance(t, torch.nn.Parameter):
            sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        fn()
    return sum(sizes.values())


def test_a_llama_gets_the_same_outputs_and_gradients_with_the_lean_norm():
    plain = tiny_lm("llama").double()
    lean = copy.deepcopy(plain)
    assert use_lean_rmsnorm(lean) == 2 * 2 + 1  # two per layer and the final norm
    ids = torch.randint(3, 16, (3, 7), generator=torch.Generator().manual_seed(1))
    out = {}
    for name, model in (("plain", plain), ("lean", lean)):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        out[name] = loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert torch.equal(out["lean"][0], out["plain"][0])
    for n, g in out["plain"][1].items():  # both norms compute in float32 whatever the model's dtype
        torch.testing.assert_close(out["lean"][1][n], g, rtol=1e-5, atol=1e-6, msg=n)
    assert use_lean_rmsnorm(lean) == 0  # installed once


def test_in_bf16_it_keeps_the_input_and_the_row_factors_instead_of_two_copies():
    x = torch.randn(4, 8, 64, dtype=torch.bfloat16, requires_grad=True)
    norm = LlamaRMSNorm(64, eps=1e-6).to(torch.bfloat16)
    # by hand: x (4*8*64 elements x 2 B) and r (4*8 rows x 4 B)
    assert saved_bytes(lambda: lean_rmsnorm(x, norm.weight, 1e-6)) == 4 * 8 * 64 * 2 + 4 * 8 * 4
    # transformers': f32(x) (x 4 B), r, and dtype(x_hat) (x 2 B)
    assert saved_bytes(lambda: norm(x)) == 4 * 8 * 64 * 4 + 4 * 8 * 4 + 4 * 8 * 64 * 2
    g = torch.randn(4, 8, 64, dtype=torch.bfloat16)
    ref_x, ref_w = torch.autograd.grad(norm(x), (x, norm.weight), g)
    lean_x, lean_w = torch.autograd.grad(lean_rmsnorm(x, norm.weight, 1e-6), (x, norm.weight), g)
    assert torch.equal(lean_rmsnorm(x, norm.weight, 1e-6), norm(x))  # the same ops: bit-equal
    torch.testing.assert_close(lean_x, ref_x, rtol=0.02, atol=0.02)  # bf16 rounding of two orders of sums
    torch.testing.assert_close(lean_w, ref_w, rtol=0.02, atol=0.05)


def test_a_norm_that_computes_something_else_or_is_partitioned_keeps_its_own_forward():
    gemma = Gemma3RMSNorm(64, eps=1e-6)  # y = (1 + w) * x_hat
    with torch.no_grad():
        gemma.weight.normal_()
    partitioned = LlamaRMSNorm(64)
    partitioned.weight = torch.nn.Parameter(torch.empty(0))  # ZeRO-3 keeps a shard elsewhere
    holder = torch.nn.ModuleList([gemma, partitioned])
    assert use_lean_rmsnorm(holder) == 0
    assert "forward" not in gemma.__dict__ and "forward" not in partitioned.__dict__


def test_without_a_gradient_the_modules_own_forward_runs():
    norm = LlamaRMSNorm(64)
    use_lean_rmsnorm(norm)
    x = torch.randn(2, 64, requires_grad=True)
    assert type(norm(x).grad_fn).__name__ == "_LeanRMSNormBackward"
    with torch.no_grad():
        assert norm(x).grad_fn is None
    with torch.inference_mode():
        assert torch.equal(norm(x), LlamaRMSNorm.forward(norm, x))


def test_training_models_get_it_unless_compute_lean_rmsnorm_is_off():
    lean = prepare_for_training(tiny_lm("llama"), ComputeConfig(), seed=0)
    plain = prepare_for_training(tiny_lm("llama"), ComputeConfig(lean_rmsnorm=False), seed=0)
    assert sum("forward" in m.__dict__ for m in lean.modules()) == 5
    assert sum("forward" in m.__dict__ for m in plain.modules()) == 0
