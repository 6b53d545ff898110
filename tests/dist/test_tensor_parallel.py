"""Tensor parallelism (fairscale, tp = 2 on 2 gloo ranks) equals the single-process model (fp32, 1e-5).

Each rank builds the same dense DilatedLM, keeps a copy as the reference, and
parallelizes the other (its shard copied from the dense weights). On one batch:
the loss, the logits (gathered over the vocabulary shards), every gradient (this
rank's shard of the dense gradient for sharded parameters, the whole gradient for
replicated ones) and the gradient norm DeepSpeed's clipping computes with our mpu
(parameters tagged ``model_parallel``), and the one dstrain's ZeRO-0 engine keeps
(``dstrain.engine.grad_norm``), must equal the dense model's.
"""
from tests.dist import spawn

TOL = 1e-5


def _check(rank, world):
    import copy

    import torch
    from deepspeed.runtime.utils import clip_grad_norm_

    from dstrain.parallel import dims
    from models.dilated_lm import DilatedLM, DilatedLMConfig, parallelize_dilated_lm

    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")  # DeepSpeed's comm wraps the started group
    state = dims.init_parallel(tp=world)
    torch.manual_seed(0)
    cfg = DilatedLMConfig(n_layer=2, n_embd=32, n_head=4, block_size=32, segment_lengths=[8, 16, 32],
                          dilation_rates=[1, 2, 4], bias=True)
    dense = DilatedLM(cfg)
    model = parallelize_dilated_lm(copy.deepcopy(dense), state=state)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 257, (2, 32), generator=g)
    y = torch.randint(0, 257, (2, 32), generator=g)

    ref_loss = dense(x, y)
    ref_loss.backward()
    loss = model(x, y)
    loss.backward()
    errs = {"loss": abs(float(loss) - float(ref_loss))}

    with torch.no_grad():  # logits: gather the vocabulary shards
        shard = model(x)
        parts = [torch.empty_like(shard) for _ in range(world)]
        torch.distributed.all_gather(parts, shard.contiguous(), group=state.tp_group)
        errs["logits"] = float((torch.cat(parts, -1) - dense(x)).abs().max())

    dense_params = dict(dense.named_parameters())
    grad_err, tagged, n_sharded = 0.0, 0, 0
    for name, p in model.named_parameters():
        ref = dense_params[name].grad
        if p.shape != ref.shape:
            n_sharded += 1
            dim = 0 if p.shape[0] != ref.shape[0] else 1
            ref = ref.chunk(world, dim=dim)[state.tp_rank]
            tagged += int(getattr(p, "model_parallel", False))
        grad_err = max(grad_err, float((p.grad - ref).abs().max()))
    errs["grads"] = grad_err

    ref_norm = float(torch.nn.utils.clip_grad_norm_(dense.parameters(), 0.5))
    from dstrain.engine.grad_norm import total_grad_norm  # what the engine keeps at ZeRO-0 (before clipping)
    errs["dstrain_norm"] = abs(float(total_grad_norm(list(model.parameters()), state.tp_group)) - ref_norm) / ref_norm
    norm = float(clip_grad_norm_(list(model.parameters()), 0.5, mpu=dims.DeepSpeedMPU(state)))
    errs["norm"] = abs(norm - ref_norm) / ref_norm
    clipped = 0.0
    for name, p in model.named_parameters():
        ref = dense_params[name].grad
        if p.shape != ref.shape:
            ref = ref.chunk(world, dim=0 if p.shape[0] != ref.shape[0] else 1)[state.tp_rank]
        clipped = max(clipped, float((p.grad - ref).abs().max()))
    errs["clipped_grads"] = clipped
    return {"errs": errs, "tagged": tagged, "sharded": n_sharded, "loss": float(loss), "norm": ref_norm}


def test_tensor_parallel_matches_single_process():
    out = spawn.run(_check, 2)
    assert out["sharded"] > 0 and out["tagged"] == out["sharded"], out
    assert out["norm"] > 0.5  # clipping really happened
    bad = {k: v for k, v in out["errs"].items() if v >= TOL}
    assert not bad, out
