"""Tensor (and sequence) parallelism for the Llama family never changes the math (issue 23).

Run with `mpiexec -n 2|4 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/engine/parallel/test_llama_tensor.py`.

- each split Llama layer (grouped-query attention, SwiGLU with an uneven d_ff, the block,
  the embedding and head without a position table, tied and untied) against its whole twin;
- whole runs through the parity harness: tp 2 (with and without sequence parallelism, tied
  and untied, GQA and MHA, an odd d_ff) under 2 ranks; dp2 x tp2, pp2 x tp2 (1F1B, ZB-H1)
  and tp 4 under 4 ranks;
- a checkpoint written at tp 2 continues at tp 1;
- key/value heads the group cannot split are refused before any work, on every rank.
"""
import dataclasses
import os

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe.engine.job import checkpoint
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model.chain import LayerChain
from ringpipe.engine.model.layers import WHOLE
from ringpipe.engine.model.llama import (GroupedQueryAttention, LlamaBlock, LlamaConfig, Rotary,
                                        SwiGLU, WidthRMSNorm, llama_layers)
from ringpipe.engine.model.params import ParamBuffer, Split
from ringpipe.engine.train import config as config_checks
from ringpipe.engine.train.config import Config
from ringpipe.engine.train.run import run

from tests.support.parity import assert_same_arrays, assert_same_run, final_arrays, metrics, reference, train

world = MPI.COMM_WORLD
TOL = 1e-10


# ---- serial: shapes and refusals --------------------------------------------------------------------------

class _Group:
    """A tensor group's layer-making arithmetic without a communicator."""

    def __new__(cls, size, index, sequence_parallel=False):
        from ringpipe.engine.parallel.tensor import TensorGroup

        class Group(TensorGroup):
            def __init__(self):
                self.size, self.index, self.sequence_parallel = size, index, sequence_parallel
        return Group()


def test_an_uneven_d_ff_is_padded_in_memory_and_declared_whole():
    """d_ff 37 at tp 2: gate and up hold 19 rows a rank (the last one a zero row), down 19
    columns; their full shapes, what checkpoints hold, are 37 as at tp 1."""
    cfg = LlamaConfig(n_layer=1, d_model=8, n_head=4, n_kv_head=2, d_ff=37, vocab=99)
    for index in range(2):
        specs = {s.name: s for layer in llama_layers(cfg, _Group(2, index)) for s in layer.specs()}
        assert specs["h.0.mlp.gate.w"].shape == specs["h.0.mlp.up.w"].shape == (19, 8)
        assert specs["h.0.mlp.down.w"].shape == (8, 19)
        assert specs["h.0.mlp.gate.w"].full_shape == (37, 8) and specs["h.0.mlp.down.w"].full_shape == (8, 37)
        assert specs["h.0.attn.k.w"].shape == (2, 8) and specs["h.0.attn.q.w"].shape == (4, 8)
        assert specs["wte"].full_shape == (128, 8) and "wpe" not in specs


def test_key_value_heads_tensor_parallelism_cannot_split_are_refused():
    shape = LlamaConfig(n_head=8, n_kv_head=2, d_model=32).validate()
    with pytest.raises(ConfigError, match=r"tp 4 does not divide the model's 2 key/value heads .* can be 1, 2 "):
        config_checks.check_tensor_parallel(Config(model="llama", tp=4), shape, 8)
    mqa = LlamaConfig(n_head=4, n_kv_head=1, d_model=16).validate()
    with pytest.raises(ConfigError, match=r"tp 2 does not divide the model's 1 key/value heads .* can be 1 "):
        config_checks.check_tensor_parallel(Config(model="llama", tp=2), mqa, 8)
    config_checks.check_tensor_parallel(Config(model="llama", tp=2), shape, 8)      # 2 of 2 KV heads: fine


# ---- each split layer against its whole twin ----------------------------------------------------------

def _group(size, sequence_parallel):
    from ringpipe.engine.parallel.tensor import TensorGroup
    sub = world.Split(world.rank // size, world.rank)
    return TensorGroup(sub, sequence_parallel=sequence_parallel)


def _bound(layer, seed=3):
    params = ParamBuffer(layer.specs(), np.float64)
    params.init(seed)
    rng = np.random.default_rng(seed)
    for spec in params.specs:       # biases start at 0 and norms at 1: other values, so a wrong path shows
        if spec.init != "normal":
            full = rng.normal(size=spec.full_shape)
            params.view(spec.name)[...] = spec.split.take(full) if spec.split else full
    layer.bind(params)
    return params


def _seq(x, t):
    n = x.shape[1] // t.size
    return x[:, t.index * n:(t.index + 1) * n] if t.sequence_parallel else x


def _cfg(kv_heads, qkv_bias=False):
    # d_ff 13: no tp divides it, so the padded split is exercised
    return LlamaConfig(n_layer=2, d_model=16, n_head=4 if world.size < 4 else 8, n_kv_head=kv_heads, d_ff=13,
                       context=8, qkv_bias=qkv_bias).validate()


def _rotary(cfg):
    return Rotary(cfg.head_dim, cfg.rope_theta)


def _qk_normed(cfg):
    return dataclasses.replace(cfg, qk_norm="head")


def _olmo2(cfg):
    return dataclasses.replace(cfg, qk_norm="all", norm_place="post")


LAYERS = {
    "gqa": lambda cfg, m: GroupedQueryAttention("a", cfg, _rotary(cfg), maker=m),
    "swiglu": lambda cfg, m: SwiGLU("m", cfg, maker=m),
    "block": lambda cfg, m: LlamaBlock("h", cfg, _rotary(cfg), maker=m),
    # Qwen3's per-head q/k norm: whole on every rank, applied to its own heads
    "gqa-qk-norm": lambda cfg, m: GroupedQueryAttention("a", _qk_normed(cfg), _rotary(cfg), maker=m),
    "block-qk-norm": lambda cfg, m: LlamaBlock("h", _qk_normed(cfg), _rotary(cfg), maker=m),
    # SmolLM3's NoPE block: no rotary positions
    "gqa-nope": lambda cfg, m: GroupedQueryAttention("a", cfg, None, maker=m),
    # OLMo 2: the q/k norm over all heads (its sums all-reduced over the group), the norms after
    "gqa-olmo2": lambda cfg, m: GroupedQueryAttention("a", _olmo2(cfg), _rotary(cfg), maker=m),
    "block-olmo2": lambda cfg, m: LlamaBlock("h", _olmo2(cfg), _rotary(cfg), maker=m),
}


def _layer_cases():
    size = world.size if world.size in (2, 4) else 0
    kv = [size, 2 * size] if size else []          # GQA (2 or 4 query heads a KV head), and MHA at tp 2
    return [(name, size, k, sp, bias) for name in LAYERS for k in kv for sp in (False, True)
            for bias in ((False, True) if name.startswith("gqa") else (False,))]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name,size,kv,sp,bias", _layer_cases() or [(None,) * 5])
def test_each_llama_tensor_parallel_layer_equals_its_whole_twin(name, size, kv, sp, bias):
    if name is None:
        pytest.skip("written for 2 or 4 ranks")
    cfg = _cfg(kv, qkv_bias=bias)
    tensor = _group(size, sp)
    try:
        whole, part = LAYERS[name](cfg, WHOLE), LAYERS[name](cfg, tensor)
        whole_params, part_params = _bound(whole), _bound(part)
        rng = np.random.default_rng(11)
        x = rng.normal(size=(2, 8, cfg.d_model))
        y, ctx = whole.forward(x)
        dy = rng.normal(size=y.shape)
        dx, wctx = whole.backward_input(dy, ctx)
        whole.backward_weight(wctx)
        y_part, ctx = part.forward(_seq(x, tensor))
        dx_part, wctx = part.backward_input(_seq(dy, tensor), ctx)
        part.backward_weight(wctx)
        np.testing.assert_allclose(y_part, _seq(y, tensor), rtol=TOL, atol=TOL, err_msg="forward")
        np.testing.assert_allclose(dx_part, _seq(dx, tensor), rtol=TOL, atol=TOL, err_msg="dx")
        # q, k and v (gate and up) share f: one gather of x and one reduction of its gradient
        # per sub-layer, as GPT's fused qkv; plus g (o's, down's) forward and backward.
        subs = 2 if name.startswith("block") else 1
        calls = {kind: n for kind, (n, _) in ((k, tensor.stats[k]) for k in ("all-reduce", "all-gather",
                                                                             "reduce-scatter"))}
        norms = 4 if name.endswith("olmo2") else 0   # OLMo 2's q and k norm sums, forward and backward
        assert calls == ({"all-reduce": norms, "all-gather": 3 * subs, "reduce-scatter": 2 * subs} if sp else
                         {"all-reduce": 2 * subs + norms, "all-gather": 0, "reduce-scatter": 0})
        _compare_grads(part_params, whole_params, tensor)      # (its partial sums add all-reduces)
        if name.endswith("qk-norm"):
            # The negative control: a rank's q/k norm gradient is its heads' part alone, and
            # wrong without the group's sum (ParamSpec.partial).
            for which in ("q_norm", "k_norm"):
                spec = next(s for s in part_params.specs if s.name.endswith(f".{which}.w"))
                assert spec.partial, spec.name
                mine, whole_grad = part_params.grad_view(spec.name), whole_params.grad_view(spec.name)
                assert np.abs(mine - whole_grad).max() > 1e-6 * np.abs(whole_grad).max(), spec.name
        if name.endswith("olmo2"):
            # The negative control: each rank normalising its own heads' channels by their own RMS
            # (the sums not all-reduced) is another model.
            WidthRMSNorm._summed, kept = (lambda self, rows: rows), WidthRMSNorm._summed
            try:
                y_shard, _ = part.forward(_seq(x, tensor))
            finally:
                WidthRMSNorm._summed = kept
            assert np.abs(y_shard - _seq(y, tensor)).max() > 1e-6
    finally:
        tensor.close()
        tensor.comm.Free()


def _compare_grads(part_params, whole_params, tensor):
    for spec in part_params.specs:
        grad = part_params.grad_view(spec.name).copy()
        if spec.partial:
            grad = tensor.allreduce(grad)
        whole = whole_params.grad_view(spec.name)
        np.testing.assert_allclose(grad, spec.split.take(whole) if spec.split else whole, rtol=TOL, atol=TOL,
                                   err_msg=f"grad {spec.name}")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tied,softcap", [(True, None), (False, None), (True, 0.5)],
                         ids=["tied", "untied", "tied, final-logit soft-capping"])
@pytest.mark.parametrize("sp", [False, True])
def test_the_split_llama_model_equals_the_whole_one(tied, softcap, sp):
    """The whole chain (vocabulary-parallel embedding without a position table, blocks, the
    head with norm_f, tied or untied), vocabulary 99 of 128 rows: loss, gradients, logits. A
    softcap bends each rank's columns of the logits before the vocabulary-parallel softmax."""
    size = 4 if world.size % 4 == 0 else 2
    cfg = LlamaConfig(n_layer=1, d_model=16, n_head=4, n_kv_head=size, d_ff=13, context=8, vocab=99,
                      tie_embeddings=tied, logit_softcap=softcap).validate()
    tensor = _group(size, sp)
    try:
        whole = LayerChain(llama_layers(cfg), dtype=np.float64)
        part = LayerChain(llama_layers(cfg, tensor), dtype=np.float64)
        whole.params.init(9)
        part.params.init(9)
        rng = np.random.default_rng(4)
        tokens, targets = rng.integers(0, 99, size=(2, 8)), rng.integers(0, 99, size=(2, 8))
        np.testing.assert_allclose(part.loss_and_grad(tokens, targets, grad_scale=0.25),
                                   whole.loss_and_grad(tokens, targets, grad_scale=0.25), rtol=TOL)
        _compare_grads(part.params, whole.params, tensor)
        if not sp:       # without targets the head gathers the whole logits
            np.testing.assert_allclose(part.forward(tokens, None, need_grad=False)[0],
                                       whole.forward(tokens, None, need_grad=False)[0], rtol=TOL, atol=TOL)
    finally:
        tensor.close()
        tensor.comm.Free()


# ---- whole runs through the parity harness ----------------------------------------------------------

def base(**more):
    # grad_clip 0.1: the clipping acts, so a norm that counted a parameter twice would change the weights
    return Config(**{**dict(model="llama", data="synthetic", layers=2, d_model=16, heads=4, kv_heads=2, d_ff=13,
                            context=8, batch_size=8, steps=3, grad_clip=0.1, dtype="float64", sample_tokens=0,
                            quiet=True, overwrite=True, eval_every=3, eval_batches=1), **more})


SHAPE_KEYS = ("layers", "heads", "kv_heads", "d_model", "tie_embeddings", "d_ff", "qk_norm", "nope_layers",
              "norm_place", "sliding_window", "window_layers")
RUNS_2 = {
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, sequence_parallel=True),
    "tp2-untied": dict(tp=2, tie_embeddings=False),
    "tp2-sp-untied": dict(tp=2, sequence_parallel=True, tie_embeddings=False, tp_overlap="on"),
    "tp2-mha": dict(tp=2, kv_heads=4),
    "tp2-sp-mha-even-dff": dict(tp=2, sequence_parallel=True, kv_heads=4, d_ff=24),
    "tp2-qwen3-qk-norm": dict(tp=2, qk_norm="head"),
    "tp2-sp-qwen3-qk-norm-recompute": dict(tp=2, sequence_parallel=True, qk_norm="head", recompute="selective"),
    "tp2-sp-smollm3-nope": dict(tp=2, sequence_parallel=True, nope_layers="0"),
    "tp2-olmo2": dict(tp=2, qk_norm="all", norm_place="post", tie_embeddings=False),
    "tp2-sp-window": dict(tp=2, sequence_parallel=True, sliding_window=3),
    "tp2-sp-olmo2-recompute": dict(tp=2, sequence_parallel=True, qk_norm="all", norm_place="post",
                                   recompute="full"),
}
RUNS_4 = {
    "dp2-tp2": dict(dp=2, tp=2, zero=1),
    "dp2-tp2-sp": dict(dp=2, tp=2, sequence_parallel=True),
    "pp2-tp2-1f1b": dict(pp=2, tp=2, schedule="1f1b", microbatches=4),
    "pp2-tp2-sp-1f1b": dict(pp=2, tp=2, schedule="1f1b", microbatches=4, sequence_parallel=True),
    "pp2-tp2-zbh1": dict(pp=2, tp=2, schedule="zbh1", microbatches=4),
    "pp2-tp2-sp-zbh1-untied": dict(pp=2, tp=2, schedule="zbh1", microbatches=4, sequence_parallel=True,
                                   tie_embeddings=False),
    "pp2-tp2-interleaved": dict(pp=2, tp=2, schedule="interleaved", chunks=2, microbatches=2, layers=4),
    "tp4": dict(tp=4, heads=8, kv_heads=4),
    "tp4-sp": dict(tp=4, heads=8, kv_heads=4, sequence_parallel=True),
    "pp2-tp2-zbh1-qwen3-qk-norm": dict(pp=2, tp=2, schedule="zbh1", microbatches=4, qk_norm="head"),
    "dp2-tp2-olmo2": dict(dp=2, tp=2, zero=1, qk_norm="all", norm_place="post"),
}


def compare_layout(shared_dir, name, layout):
    """The run of `layout` (its shape settings and micro-batches shared by the one-process
    reference) equals one process; also used by test_tensor.py's 8-rank layout."""
    layout = dict(layout)
    shape = {k: layout.pop(k) for k in SHAPE_KEYS if k in layout}
    m = dict(microbatches=layout.pop("microbatches", 2))
    ref = reference(base(out=os.path.join(shared_dir, f"llama-tp-ref-{name}-{world.rank}"), **shape, **m))
    trained = train(base(out=os.path.join(shared_dir, f"llama-tp-{name}"), **shape, **m, **layout), world)
    world.Barrier()
    manifest = assert_same_run(trained, ref, TOL, grad_norm=True)
    assert manifest["layout"]["tp"] == layout["tp"] and manifest["layout"]["pp"] == layout.get("pp", 1)
    if layout.get("sequence_parallel"):
        stats = trained.model.inner.tensor.stats
        assert stats["all-gather"][0] and stats["reduce-scatter"][0]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", list(RUNS_2))
def test_llama_tensor_parallel_run_equals_one_process(shared_dir, name):
    if world.size != 2:
        pytest.skip("written for 2 ranks")
    compare_layout(shared_dir, name, RUNS_2[name])


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("name", list(RUNS_4))
def test_llama_tensor_parallel_layout_of_4_ranks_equals_one_process(shared_dir, name):
    if world.size != 4:
        pytest.skip("written for 4 ranks")
    compare_layout(shared_dir, name, RUNS_4[name])


@pytest.mark.mpi(min_size=2)
def test_a_llama_checkpoint_written_at_tp2_continues_at_tp1(shared_dir):
    """Written at tp 2 (d_ff 13: padded in memory, held at 13 in the checkpoint), continued
    by one process: it reaches the uninterrupted one-process trajectory."""
    if world.size != 2:
        pytest.skip("written for 2 ranks")
    four = dict(steps=4, eval_every=4, microbatches=2)
    ref = reference(base(out=os.path.join(shared_dir, f"llama-tp-relayout-ref{world.rank}"), **four))
    first = os.path.join(shared_dir, "llama-tp-relayout-tp2")
    train(base(out=first, tp=2, checkpoint_every=2, **four), world)
    world.Barrier()
    ckpt = os.path.join(first, "checkpoints", "ckpt_00000002.json")
    arrays, manifest = checkpoint.load(ckpt)
    assert manifest["layout"]["tp"] == 2 and arrays["param/h.0.mlp.gate.w"].shape == (13, 16)
    out = os.path.join(shared_dir, f"llama-tp-relayout-one-{world.rank}")
    train(base(out=out, resume=ckpt, **four), MPI.COMM_SELF)
    world.Barrier()
    assert_same_arrays(final_arrays(out), final_arrays(ref.out), TOL, "tp2 -> tp1")


@pytest.mark.mpi(min_size=2)
def test_key_value_heads_that_do_not_split_are_refused_on_every_rank(shared_dir):
    """Multi-query attention (1 key/value head) at tp 2: every rank raises before work."""
    with pytest.raises(ConfigError, match=r"tp 2 does not divide the model.s 1 key/value heads .* can be 1 "):
        run(base(out=os.path.join(shared_dir, "llama-bad-kv"), kv_heads=1, tp=2, dp=world.size // 2), world=world)


def test_the_split_specs_hold_the_hugging_face_row_order():
    """q's rows on rank r are heads r*H/tp ... in order (Split 0, one contiguous slice), so a
    whole checkpoint or HF import slices with no permutation."""
    cfg = LlamaConfig(n_layer=1, d_model=16, n_head=4, n_kv_head=2, d_ff=16).validate()
    specs = {s.name: s for s in llama_layers(cfg, _Group(2, 1))[1].specs()}
    assert specs["h.0.attn.q.w"].split == Split(0, 1, 2)
    assert specs["h.0.attn.o.w"].split == Split(1, 1, 2)
    assert specs["h.0.norm1.w"].split is None


def test_the_command_line_refuses_key_value_heads_tp_cannot_split_with_exit_2(tmp_path):
    """ringpipe train under 2 ranks, multi-query attention at --tp 2: exit 2 before any
    step, the message naming the --tp that works."""
    import subprocess
    import sys

    from tests.support import ROOT
    from tests.support.bench_cli import bench_env
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("no mpiexec next to this python")
    out = tmp_path / "mqa"
    r = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "ringpipe.cli", "train", "--model", "llama",
                        "--data", "synthetic", "--layers", "1", "--d-model", "16", "--heads", "4", "--kv-heads", "1",
                        "--tp", "2", "--steps", "1", "--sample-tokens", "0", "--out", str(out)],
                       cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "--tp 2 does not divide the model's 1 key/value heads" in r.stderr and "--tp can be 1 " in r.stderr
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_hugging_face_llama_fine_tunes_at_tp2_as_one_process(shared_dir, family):
    """--init-from a save_pretrained folder of transformers' own test shape (2 key/value heads,
    intermediate 37: padded to 2 x 19 at tp 2), untied, trained at tp 2 with sequence
    parallelism: the same losses, gradients and weights as one process. Qwen3: the same with
    its per-head q/k norm and head_dim 16 (not 32 / 4)."""
    if world.size != 2:
        pytest.skip("written for 2 ranks")
    transformers = pytest.importorskip("transformers")
    import torch
    folder = os.path.join(shared_dir, f"{family}-tp-hf")
    if world.rank == 0:
        torch.manual_seed(5)
        shape = dict(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, intermediate_size=37, max_position_embeddings=16,
                     tie_word_embeddings=False, rms_norm_eps=1e-5)
        if family == "qwen3":
            model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**shape, head_dim=16))
            with torch.no_grad():         # the q/k norms away from 1, so a mix-up of heads shows
                for name, p in model.named_parameters():
                    if name.endswith(("q_norm.weight", "k_norm.weight")):
                        p.uniform_(0.5, 1.5)
        else:
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape))
        model.save_pretrained(folder)
    world.Barrier()
    common = dict(model="llama", init_from=f"hf:{folder}", data="synthetic", seq_len=16, batch_size=4, steps=3,
                  dtype="float64", sample_tokens=0, quiet=True, overwrite=True, eval_every=3, eval_batches=1)
    ref = reference(Config(out=os.path.join(shared_dir, f"{family}-tp-hf-ref{world.rank}"), **common))
    trained = train(Config(out=os.path.join(shared_dir, f"{family}-tp-hf-run"), tp=2, sequence_parallel=True,
                           **common), world)
    world.Barrier()
    # (a fine-tuning run's first record is the validation before step 1, without a loss)
    got, want = metrics(trained.out), metrics(ref.out)
    for key in ("loss", "grad_norm", "val_loss"):
        np.testing.assert_allclose([m.get(key, np.nan) for m in got], [m.get(key, np.nan) for m in want],
                                   rtol=TOL, err_msg=key)
    assert_same_arrays(final_arrays(trained.out), final_arrays(ref.out), TOL, "checkpoint")
    assert trained.model.params.view("h.0.mlp.gate.w").shape == (19, 32)


@pytest.mark.mpi(min_size=4)
def test_a_llama_checkpoint_written_at_pp2_tp2_continues_at_dp2_tp2_and_one_process(shared_dir):
    """Written at (dp, pp, tp) = (1, 2, 2), untied; continued at (2, 1, 2) with sequence
    parallelism and by one process: both reach the uninterrupted one-process trajectory."""
    if world.size != 4:
        pytest.skip("written for 4 ranks")
    six = dict(steps=6, eval_every=6, microbatches=2, tie_embeddings=False)
    ref = reference(base(out=os.path.join(shared_dir, f"llama-tp-relayout4-ref{world.rank}"), **six))
    first = os.path.join(shared_dir, "llama-tp-relayout4-122")
    train(base(out=first, pp=2, tp=2, checkpoint_every=3, **six), world)
    world.Barrier()
    ckpt = os.path.join(first, "checkpoints", "ckpt_00000003.json")
    for name, layout, comm_ in (("212", dict(dp=2, tp=2, sequence_parallel=True), world),
                                (f"111-{world.rank}", {}, MPI.COMM_SELF)):
        out = os.path.join(shared_dir, f"llama-tp-relayout4-{name}")
        train(base(out=out, resume=ckpt, **six, **layout), comm_)
        world.Barrier()
        assert_same_arrays(final_arrays(out), final_arrays(ref.out), TOL, name)
