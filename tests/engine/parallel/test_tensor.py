"""Tensor (and sequence) parallelism never changes the math.

Run with `mpiexec -n 2|4 python tests/support/mpi_pytest.py -m mpi --with-mpi tests/engine/parallel/test_tensor.py`.

- every TP layer against its unsharded twin: forward, input gradient, parameter gradients;
- whole runs: every DP x PP x TP layout that fits the ranks, with and without sequence
  parallelism, 1F1B and ZB-H1, equal one process (losses, gradients, weights, checkpoint);
- a checkpoint written at (dp, pp, tp) = (1, 2, 2) continues at (2, 1, 2), (4, 1, 1) and (1, 1, 1);
- the layouts and shapes TP cannot split are refused, with what would work.
"""
import os

import numpy as np
import pytest
from mpi4py import MPI

from ringpipe.engine.job import checkpoint
from ringpipe.engine.train import config as config_checks
from ringpipe.engine.train.config import Config
from ringpipe.engine.job.errors import ConfigError
from ringpipe.engine.model.layers import MLP, WHOLE, Block, CausalSelfAttention, Linear
from ringpipe.engine.model.params import ParamBuffer, ParamSpec, Split
from ringpipe.engine.train.run import run

from tests.support.parity import assert_same_arrays, assert_same_run, final_arrays, layouts, metrics, reference, train

world = MPI.COMM_WORLD
TOL = 1e-10


# ---- serial: split parameters and refusals ---------------------------------------------------------------

@pytest.mark.parametrize("dim,groups", [(0, 1), (0, 3), (1, 1)])
def test_splits_take_and_place_cover_the_parameter_once(dim, groups):
    full = np.arange(12 * 6, dtype=np.float64).reshape(12, 6)
    count = 2
    rebuilt = np.full_like(full, -1)
    for index in range(count):
        split = Split(dim, index, count, groups)
        part = split.take(full)
        assert split.full_shape(part.shape) == full.shape
        split.place(rebuilt, part)
    np.testing.assert_array_equal(rebuilt, full)
    if groups == 3:      # qkv: rank 0 holds the first half of q, of k and of v
        np.testing.assert_array_equal(Split(0, 0, 2, 3).take(full)[:, 0], [0, 6, 24, 30, 48, 54])


@pytest.mark.parametrize("count", [2, 3, 4])
def test_a_padded_split_holds_zero_rows_in_memory_only(count):
    """A full length `count` does not divide (10 rows): the last ranks hold zero rows in
    memory; the full shape, and what place() writes back, is the 10 rows alone."""
    full = np.arange(10 * 3, dtype=np.float64).reshape(10, 3)
    rows = -(-10 // count)
    rebuilt = np.full_like(full, -1)
    for index in range(count):
        split = Split(0, index, count, pad=rows * count - 10)
        part = split.take(full)
        assert part.shape == (rows, 3) and split.full_shape(part.shape) == full.shape
        lo = index * rows
        np.testing.assert_array_equal(part[:max(0, min(rows, 10 - lo))], full[lo:lo + rows])
        assert not part[max(0, 10 - lo):].any()
        split.place(rebuilt, part)
    np.testing.assert_array_equal(rebuilt, full)
    with pytest.raises(ValueError, match="one contiguous slice"):
        Split(0, 0, 2, groups=3, pad=1)


def test_the_vocabulary_parallel_wte_is_declared_at_the_model_vocabulary_for_every_tp():
    """gpt_layers with a tensor group: wte's full shape is padded_vocab rows whatever the
    group's size (what checkpoints hold), the in-memory rows a multiple of the size."""
    from ringpipe.engine.model.gpt import GPTConfig, gpt_layers
    from ringpipe.engine.parallel.tensor import TensorGroup

    class Group(TensorGroup):          # the maker's arithmetic without a communicator
        def __init__(self, size, index):
            self.size, self.index, self.sequence_parallel = size, index, False

    cfg = GPTConfig(n_layer=1, d_model=12, n_head=6, vocab=300)
    for size in (1, 2, 3):
        layers = gpt_layers(cfg, Group(size, size - 1)) if size > 1 else gpt_layers(cfg)
        for spec in (s for layer in (layers[0], layers[-1]) for s in layer.specs() if s.name == "wte"):
            assert spec.full_shape == (cfg.padded_vocab, 12) == (384, 12)
            assert spec.shape == (-(-384 // size), 12)


def test_the_plain_layers_know_no_tensor_axis():
    """engine/model/layers.py holds whole layers only: no name in its code mentions a
    tensor (group, branch or attribute); the tensor axis's layers are its subclasses."""
    import ast
    import inspect
    from ringpipe.engine.model import layers
    tree = ast.parse(inspect.getsource(layers))
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    names |= {n.arg for n in ast.walk(tree) if isinstance(n, (ast.arg, ast.keyword)) and n.arg}
    assert not [n for n in names if "tensor" in n.lower()]
    from ringpipe.engine.parallel import tensor
    assert issubclass(tensor.VocabParallelEmbedding, layers.Embedding)
    assert issubclass(tensor.VocabParallelHead, layers.LMHead)


def test_a_split_parameter_is_initialised_as_its_slice_of_the_full_parameter():
    whole = ParamBuffer([ParamSpec("w", (8, 4))])
    whole.init(5)
    for index in range(2):
        part = ParamBuffer([ParamSpec("w", (4, 4), split=Split(0, index, 2))])
        part.init(5)
        np.testing.assert_array_equal(part.view("w"), whole.view("w")[4 * index:4 * index + 4])
        part.load_flat(part.data, {"w": 2 * whole.view("w")})       # a whole array is sliced on load
        np.testing.assert_array_equal(part.view("w"), 2 * whole.view("w")[4 * index:4 * index + 4])


def _refused(match, world_size, **fields):
    with pytest.raises(ConfigError, match=match):
        config_checks.check(Config(**fields), world_size)


def test_layouts_tensor_parallelism_cannot_make_are_refused():
    _refused(r"dp 1 x pp 1 x tp 2 = 2 does not match the 4 ranks", 4, dp=1, tp=2)
    _refused(r"3 ranks do not split into pp 1 pipeline stages x tp 2", 3, tp=2)
    _refused(r"tp must be >= 1", 1, tp=0)
    _refused(r"sequence_parallel .* needs tp >= 2", 1, sequence_parallel=True)
    _refused(r"tensor parallelism .* model gpt or llama only", 2, model="mlp", tp=2)
    assert Config(tp=2, pp=2).data_parallel(8) == 2


def test_shapes_tensor_parallelism_cannot_split_are_refused():
    from ringpipe.engine.model.gpt import GPTConfig
    with pytest.raises(ConfigError, match=r"tp 4 does not divide the model's 6 attention heads .* can be 1, 2, 3, 6"):
        config_checks.check_tensor_parallel(Config(tp=4), GPTConfig(n_head=6, d_model=12), 8)
    with pytest.raises(ConfigError, match=r"seq_len is 10: use a seq_len that is a multiple of 4"):
        config_checks.check_tensor_parallel(Config(tp=4, sequence_parallel=True), GPTConfig(), 10)
    # One vocabulary padding for every layout: the tensor axis pads further in memory only.
    assert GPTConfig(vocab=256).padded_vocab == 256 and GPTConfig(vocab=300).padded_vocab == 384


# ---- each TP layer against its unsharded twin ----------------------------------------------------

def _group(size, sequence_parallel, overlap=True):
    from ringpipe.engine.parallel.tensor import TensorGroup
    sub = world.Split(world.rank // size, world.rank)
    return TensorGroup(sub, sequence_parallel=sequence_parallel, overlap=overlap)


def _bound(layer, seed=3):
    params = ParamBuffer(layer.specs(), np.float64)
    params.init(seed)
    # Biases start at zero: give them values, so a wrong bias path shows.
    rng = np.random.default_rng(seed)
    for spec in params.specs:
        if spec.init == "zeros":
            full = rng.normal(size=spec.full_shape)
            params.view(spec.name)[...] = spec.split.take(full) if spec.split else full
    layer.bind(params)
    return params


def _seq(x, t):
    """This rank's positions of (B, T, ...) under sequence parallelism."""
    return x[:, t.index * (x.shape[1] // t.size):(t.index + 1) * (x.shape[1] // t.size)] if t.sequence_parallel else x


B, T, C, HEADS = 2, 8, 16, 4
LAYERS = {   # name: (make(tensor), input kind, output kind); kinds: stream | features(groups)
    "column": (lambda t: t.column("c", C, 3 * C, groups=3) if t else Linear("c", C, 3 * C), "stream", ("features", 3)),
    "column-gelu": (lambda t: t.column("c", C, 4 * C, gelu=True) if t else Linear("c", C, 4 * C, gelu=True),
                    "stream", ("features", 1)),
    "row": (lambda t: t.row("r", 4 * C, C) if t else Linear("r", 4 * C, C), ("features", 1), "stream"),
    "attention": (lambda t: CausalSelfAttention("a", C, HEADS, 2, maker=t or WHOLE), "stream", "stream"),
    "mlp": (lambda t: MLP("m", C, 2, maker=t or WHOLE), "stream", "stream"),
    "block": (lambda t: Block("h", C, HEADS, 2, maker=t or WHOLE), "stream", "stream"),
}


def _shape_in(kind, x, t):
    if kind == "stream":
        return _seq(x, t)
    return Split(2, t.index, t.size, kind[1]).take(x)


def _compare_grads(part_params, whole_params, tensor):
    for spec in part_params.specs:
        grad = part_params.grad_view(spec.name).copy()
        if spec.partial:
            grad = tensor.allreduce(grad)
        whole = whole_params.grad_view(spec.name)
        np.testing.assert_allclose(grad, spec.split.take(whole) if spec.split else whole, rtol=TOL, atol=TOL,
                                   err_msg=f"grad {spec.name}")


def _layer_cases():
    sizes = [world.size] if world.size in (2, 4) else []      # tp 2 under 2 ranks, tp 4 under 4
    return [(name, s, sp, early) for name in LAYERS for s in sizes for sp in (False, True)
            for early in ((True, False) if name.startswith("column") or name == "block" else (True,))]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name,size,sp,early", _layer_cases())
def test_each_tensor_parallel_layer_equals_its_unsharded_twin(name, size, sp, early):
    make, kind_in, kind_out = LAYERS[name]
    tensor = _group(size, sp)
    tensor.weight_grads_early = early
    try:
        whole, part = make(None), make(tensor)
        whole_params, part_params = _bound(whole), _bound(part)
        rng = np.random.default_rng(11)
        c_in = 4 * C if name == "row" else C
        x = rng.normal(size=(B, T, c_in))
        y, ctx = whole.forward(x)
        dy = rng.normal(size=y.shape)
        dx, wctx = whole.backward_input(dy, ctx)
        whole.backward_weight(wctx)

        y_part, ctx = part.forward(_shape_in(kind_in, x, tensor))
        dx_part, wctx = part.backward_input(_shape_in(kind_out, dy, tensor), ctx)
        part.backward_weight(wctx)
        np.testing.assert_allclose(y_part, _shape_in(kind_out, y, tensor), rtol=TOL, atol=TOL, err_msg="forward")
        np.testing.assert_allclose(dx_part, _shape_in(kind_in, dx, tensor), rtol=TOL, atol=TOL, err_msg="dx")
        _compare_grads(part_params, whole_params, tensor)
    finally:
        tensor.close()
        tensor.comm.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("rows,used", [(256, 256), (256, 200), (256, 100), (255, 255), (254, 250)])
@pytest.mark.parametrize("sp", [False, True])
def test_vocabulary_parallel_embedding_and_cross_entropy_equal_the_whole_ones(rows, used, sp):
    """The embedding and the head (tied wte, padded vocabulary masked) as one chain;
    with used=100 of 256 rows and tp=4, two ranks hold only padding; with 255 or 254
    rows the group does not divide them: the last rank holds zero rows in memory only."""
    from ringpipe.engine.model.chain import LayerChain
    size = 4 if world.size % 4 == 0 else 2
    tensor = _group(size, sp)
    try:
        def chain(t):
            maker = t or WHOLE
            return LayerChain([maker.embedding(rows, T, C), maker.head(rows, C, used=used)], dtype=np.float64)
        whole, part = chain(None), chain(tensor)
        whole.params.init(9)
        part.params.init(9)
        rng = np.random.default_rng(4)
        tokens = rng.integers(0, used, size=(B, T))
        targets = rng.integers(0, used, size=(B, T))
        loss = whole.loss_and_grad(tokens, targets, grad_scale=0.25)
        loss_part = part.loss_and_grad(tokens, targets, grad_scale=0.25)
        np.testing.assert_allclose(loss_part, loss, rtol=TOL)
        _compare_grads(part.params, whole.params, tensor)
        # Without targets the head returns the whole logits (gathered), padding masked.
        logits, _ = whole.forward(tokens, None, need_grad=False)
        logits_part, _ = part.forward(tokens, None, need_grad=False)
        np.testing.assert_allclose(logits_part, logits, rtol=TOL, atol=TOL)
    finally:
        tensor.close()
        tensor.comm.Free()


@pytest.mark.mpi(min_size=2)
def test_a_tensor_group_across_nodes_is_warned_about(monkeypatch, shared_dir, capsys):
    from ringpipe.engine.parallel.tensor import tensor_notes
    monkeypatch.setenv("RINGPIPE_NODES", ",".join("ab"[r * 2 // world.size] for r in range(world.size)))
    tensor = _group(world.size, False, overlap=False)
    try:
        assert tensor.nodes == 2
        assert "spans 2 nodes" in tensor_notes(tensor)[0]
    finally:
        tensor.comm.Free()
    # A run hears of it through the rank model's own notes(), not by reaching inside it.
    model = run(base(out=os.path.join(shared_dir, "nodes"), tp=world.size, quiet=False, steps=1), world=world).model
    assert any("spans 2 nodes" in note for note in model.notes())
    if world.rank == 0:
        assert "spans 2 nodes" in capsys.readouterr().out


# ---- whole runs -------------------------------------------------------------------------------

def base(**more):
    # grad_clip 0.1: the clipping acts, so a norm that counted a parameter twice would change the weights
    return Config(**{**dict(data="synthetic", layers=2, d_model=16, heads=4, context=8, batch_size=8, steps=3, grad_clip=0.1,
                            dtype="float64", sample_tokens=0, quiet=True, overwrite=True, eval_every=3,
                            eval_batches=1), **more})


# (dp, pp, tp) with tp in {2, 4}, dp and pp in {1, 2}, that fill the ranks
LAYOUTS = layouts(world.size, tp=(2, 4), pp=(1, 2), dp=(1, 2))
RUN_CASES = [(dp, pp, tp, sp, schedule) for dp, pp, tp in LAYOUTS for sp in (False, True)
             for schedule in (("1f1b", "zbh1") if pp > 1 else (None,))]
RUN_CASES += [(dp, pp, tp, False, "interleaved") for dp, pp, tp in LAYOUTS if pp > 1]


def one_process(tmp_path_factory, dtype, m, layers=2):
    """The one-process run a layout must equal (tests/support/parity.py keeps it for the
    session), in this rank's own folder."""
    out = str(tmp_path_factory.mktemp(f"ref-{dtype}-{m}-{layers}"))
    return reference(base(out=out, dtype=dtype, microbatches=m, layers=layers))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dp,pp,tp,sp,schedule", RUN_CASES or [(None,) * 5])
def test_every_layout_with_tensor_parallelism_equals_one_process(shared_dir, tmp_path_factory, dp, pp, tp, sp,
                                                                 schedule):
    if dp is None:
        pytest.skip("no dp x pp x tp layout with tp in {2, 4} fits this many ranks")
    m = 2 * pp if pp > 1 else 2
    layers = 4 if schedule == "interleaved" else 2           # 2 chunks a rank need a layer each
    ref = one_process(tmp_path_factory, "float64", m, layers)
    out = os.path.join(shared_dir, f"tp-{dp}{pp}{tp}-{sp}-{schedule}")
    # The reductions on the communication thread with sequence parallelism, on the caller's without.
    trained = train(base(out=out, layers=layers, dp=dp, pp=pp, tp=tp, sequence_parallel=sp, schedule=schedule,
                         microbatches=m, chunks=2 if schedule == "interleaved" else 1, zero=int(dp > 1),
                         tp_overlap="on" if sp else "auto"), world)
    world.Barrier()
    # every parameter counted once in the norm (it sets the clipping); the checkpoint saved by full name, whole
    manifest = assert_same_run(trained, ref, TOL, grad_norm=True)
    assert manifest["layout"] == {"dp": dp, "pp": pp, "tp": tp, "chunks": 2 if schedule == "interleaved" else 1}
    grid = trained.model
    stats = grid.inner.tensor.stats
    if sp:
        assert stats["all-gather"][0] and stats["reduce-scatter"][0]
    assert grid.inner.tensor.weight_grads_early == (schedule != "zbh1")
    assert grid.inner.tensor.overlap == sp


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("dp,pp,tp,sp,schedule,qk_norm", [(2, 2, 2, True, "zbh1", "none"),
                                                          (2, 2, 2, True, "zbh1", "head"),
                                                          (2, 2, 2, True, "zbh1", "all"),
                                                          (2, 2, 2, True, "zbh1", "nope")],
                         ids=["llama-2-2-2-True-zbh1", "qwen3-2-2-2-True-zbh1", "olmo2-2-2-2-True-zbh1",
                              "smollm3-2-2-2-True-zbh1"])
def test_a_llama_layout_of_every_axis_equals_one_process(shared_dir, dp, pp, tp, sp, schedule, qk_norm):
    """The Llama family on all three axes at once, and Qwen3's per-head q/k norm there (its
    weight gradient summed over the tensor group) (tests/run_mpi.sh --ranks 8 selects both by
    their ids)."""
    if world.size != 8:
        pytest.skip("written for 8 ranks")
    from tests.engine.parallel.test_llama_tensor import compare_layout
    parts = {"all": dict(qk_norm="all", norm_place="post"), "nope": dict(nope_layers="1")}.get(
        qk_norm, dict(qk_norm=qk_norm))         # OLMo 2's two parts; SmolLM3's NoPE block (the second)
    compare_layout(shared_dir, f"dp2-pp2-tp2-sp-zbh1-{qk_norm}", dict(dp=dp, pp=pp, tp=tp, sequence_parallel=sp,
                                                                      schedule=schedule, microbatches=4, **parts))


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout", [dict(dp=2, pp=2, tp=2, sequence_parallel=True, schedule="zbh1", microbatches=4)],
                         ids=["gemma3-2-2-2-True-zbh1"])
def test_a_gemma3_layout_of_every_axis_equals_one_process(shared_dir, layout):
    """Gemma 3's parts on all three axes at once (tests/run_mpi.sh --ranks 8 selects it by its id)."""
    if world.size != 8:
        pytest.skip("written for 8 ranks")
    from tests.engine.parallel.test_llama_parity import gemma3
    ref = reference(gemma3(out=os.path.join(shared_dir, f"gemma3-8-ref-{world.rank}"), microbatches=4))
    trained = train(gemma3(out=os.path.join(shared_dir, "gemma3-8"), **layout), world)
    world.Barrier()
    assert_same_run(trained, ref, 1e-10, grad_norm=True)


@pytest.mark.mpi(min_size=2)
def test_float32_with_tensor_parallelism_equals_one_process(shared_dir, tmp_path_factory):
    tp = 2
    ref = one_process(tmp_path_factory, "float32", 2)
    out = os.path.join(shared_dir, "tp-float32")
    trained = train(base(out=out, dtype="float32", tp=tp, dp=world.size // tp, microbatches=2, sequence_parallel=True),
                    world)
    world.Barrier()
    assert_same_run(trained, ref, 1e-5, grad_norm=True)


@pytest.mark.mpi(min_size=4)
def test_a_tensor_parallel_checkpoint_continues_in_any_layout(shared_dir):
    """Written at (dp, pp, tp) = (1, 2, 2); continued at (2, 1, 2) with sequence parallelism,
    (4, 1, 1), and one process: all reach the uninterrupted one-process trajectory."""
    if world.size != 4:
        pytest.skip("written for 4 ranks")
    six = dict(steps=6, microbatches=2, batch_size=8)
    ref = reference(base(out=os.path.join(shared_dir, f"relayout-ref{world.rank}"), **six))
    first = os.path.join(shared_dir, "relayout-122")
    train(base(out=first, pp=2, tp=2, checkpoint_every=3, **six), world)
    world.Barrier()
    ckpt = os.path.join(first, "checkpoints", "ckpt_00000003.json")
    ref_losses = [r["loss"] for r in metrics(ref.out)]
    for name, layout, comm_ in (("212", dict(dp=2, tp=2, sequence_parallel=True), world), ("411", dict(dp=4), world),
                                (f"111-{world.rank}", {}, MPI.COMM_SELF)):
        out = os.path.join(shared_dir, f"relayout-{name}")
        train(base(out=out, resume=ckpt, **six, **layout), comm_)
        world.Barrier()
        assert_same_arrays(final_arrays(out), final_arrays(ref.out), TOL, name)
        np.testing.assert_allclose([r["loss"] for r in metrics(out)], ref_losses[3:], rtol=TOL, err_msg=name)


@pytest.mark.mpi(min_size=2)
def test_heads_that_do_not_split_are_refused_on_every_rank(shared_dir):
    with pytest.raises(ConfigError, match=r"tp 2 does not divide the model.s 3 attention heads .* can be 1, 3"):
        run(base(out=os.path.join(shared_dir, "bad-heads"), heads=3, d_model=12, tp=2, dp=world.size // 2),
            world=world)



# ---- a tp that does not divide the padding multiple (3 ranks, launched from a serial test) ----------

def test_tp3_pads_the_vocabulary_in_memory_and_its_checkpoint_continues_at_tp1(tmp_path):
    """tp 3 (3 heads) pads 256 rows to 258 in memory. It equals one process, and its
    checkpoint holds wte at 256 rows, as every layout's does: it continues at tp 1 on
    the same trajectory as it is, and loads for sampling."""
    import subprocess
    import sys

    from ringpipe.engine.interop.sample import load_run
    from tests.support import ROOT
    from tests.support.bench_cli import bench_env
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("no mpiexec next to this python")
    shape = dict(layers=2, d_model=12, heads=3, context=8, batch_size=3, steps=4, dtype="float64")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()]
    out = tmp_path / "tp3"
    r = subprocess.run([mpiexec, "-n", "3", sys.executable, "-m", "ringpipe.cli", "train", "--data", "synthetic",
                        *flags, "--tp", "3", "--checkpoint-every", "2", "--sample-tokens", "0", "--out", str(out)],
                       cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"
    assert "tp 3" in r.stdout
    common = dict(data="synthetic", sample_tokens=0, quiet=True, eval_every=4, eval_batches=4, **shape)
    ref = tmp_path / "ref"
    run(Config(out=str(ref), **common), world=MPI.COMM_SELF)
    np.testing.assert_allclose([m["loss"] for m in metrics(out)], [m["loss"] for m in metrics(ref)], rtol=TOL)
    arrays, _ = checkpoint.load(str(out / "checkpoints"))
    assert arrays["param/wte"].shape == arrays["opt/m/wte"].shape == (256, 12)
    resumed = tmp_path / "resumed"
    run(Config(out=str(resumed), resume=str(out / "checkpoints" / "ckpt_00000002.json"), **common),
        world=MPI.COMM_SELF)
    final, _ = checkpoint.load(str(resumed / "checkpoints"))
    ref_final, _ = checkpoint.load(str(ref / "checkpoints"))
    for k in ref_final:
        np.testing.assert_allclose(final[k], ref_final[k], rtol=TOL, atol=TOL, err_msg=k)
    model, _, _ = load_run(str(out))
    assert model.params.view("wte").shape == (256, 12)


def test_a_checkpoint_written_at_tp2_continues_at_tp1_and_tp3_as_it_is(tmp_path):
    """tp 2 holds wte's 256 rows as 2 x 128, tp 3 as 3 x 86 (2 zero rows in memory), tp 1
    whole: the tp-2 checkpoint (wte at 256 rows) is read with the model's own shapes at
    tp 1 and at tp 3, nothing fitted, and both continue to one process's final weights."""
    import subprocess
    import sys

    from tests.support import ROOT
    from tests.support.bench_cli import bench_env
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("no mpiexec next to this python")
    shape = dict(layers=2, d_model=12, heads=6, context=8, batch_size=3, steps=4, dtype="float64")
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in shape.items()] + ["--data", "synthetic", "--sample-tokens", "0"]

    def train(ranks, out, *more):
        r = subprocess.run([mpiexec, "-n", str(ranks), sys.executable, "-m", "ringpipe.cli", "train", *flags,
                            "--tp", str(ranks), "--out", str(out), *more],
                           cwd=ROOT, env=bench_env(), capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-3000:]}"

    written = tmp_path / "tp2"
    train(2, written, "--checkpoint-every", "2")
    step2 = written / "checkpoints" / "ckpt_00000002.json"
    arrays, manifest = checkpoint.load(str(step2))
    assert manifest["layout"]["tp"] == 2 and arrays["param/wte"].shape == arrays["opt/v/wte"].shape == (256, 12)
    common = dict(data="synthetic", sample_tokens=0, quiet=True, eval_every=4, eval_batches=4, **shape)
    ref = tmp_path / "ref"
    run(Config(out=str(ref), **common), world=MPI.COMM_SELF)
    at_tp1 = tmp_path / "tp1"
    run(Config(out=str(at_tp1), resume=str(step2), **common), world=MPI.COMM_SELF)
    at_tp3 = tmp_path / "tp3"
    train(3, at_tp3, "--resume", str(step2))
    ref_final, _ = checkpoint.load(str(ref / "checkpoints"))
    for out in (written, at_tp1, at_tp3):
        final, _ = checkpoint.load(str(out / "checkpoints"))
        assert final.keys() == ref_final.keys()
        for k in ref_final:
            np.testing.assert_allclose(final[k], ref_final[k], rtol=TOL, atol=TOL, err_msg=f"{out.name}: {k}")
