"""The pooled evaluation and the per-step training length.

What is checked: lane batches hold each lane's rows once, packed two to a
row at most, in lockstep, one shape per row length; the pool gives every run
the testsets and its own training set only, and `evaluate` puts each margin
back where it belongs (checked with a fake step whose margin is known from
the row alone, and with the real eval step against the full model's logits,
one compilation per row length); the pool's and the training streams'
figures (prompt tokens and attention computed against needed) count what the
steps compute; a committed (loaded) base and the runs compile the train step
once.
"""

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from oodjax.config_read import read
from oodjax.data import (
    TRAIN_KEYS,
    TokenizedSet,
    bucket_lengths,
    eval_batches,
    fitting_bucket,
    load_tokenizer,
    replay_rows,
    train_steps,
)
from oodjax.engine import steps
from oodjax.engine.evaluation import evaluate, make_eval_pool, pool_figures
from oodjax.engine.geometry import BatchGeometry, batch_geometry
from oodjax.engine.run_data import few_shot_sets, training_figures
from oodjax.engine.steps import micro_batch_branches
from oodjax.models import from_config, load_pretrained
from oodjax.models.lora import LoRAConfig, adds_nothing
from tests.engine_configs import tiny_config

OPT = dict(
    model_type="opt",
    vocab_size=64,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    ffn_dim=64,
    max_position_embeddings=64,
    pad_token_id=1,
)
YES, NO = 5, 6
LORA = LoRAConfig(rank=4, alpha=8.0, dropout=0.1)


def tokenized(lengths, *, first_token=0, max_length=64, seed=0):
    """Prompts of the given lengths; prompt i starts with token first_token + i (a marker), then random ids."""
    rng = np.random.default_rng(seed)
    vocab = OPT["vocab_size"]
    rows = [np.concatenate([[first_token + i], rng.integers(2, vocab, n - 1)]) for i, n in enumerate(lengths)]
    n = len(lengths)
    return TokenizedSet(
        token_ids=np.concatenate(rows).astype(np.int32),
        starts=np.concatenate([[0], np.cumsum(lengths)]),
        labels=(np.arange(n) % 2).astype(np.int32),
        truncated=np.zeros(n, dtype=bool),
        max_length=max_length,
    )


def test_lanes_are_batched_in_lockstep_each_row_once():
    tok = tokenized([5, 40, 7, 60, 12, 33, 3, 20, 50, 9])
    lanes = [[0, 1, 2, 3, 4, 5], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], [9]]
    batches = list(eval_batches(tok, batch_tokens=128, lanes=lanes, row_lengths=(64,)))
    # Rows of 64, 2 a batch, two prompts a row at most: lane 1, the fullest, packs 5 rows
    # (60 3 | 50 12 | 40 20 | 33 9 | 7 5), so 3 batches of one shape; lane 0 packs 4 (60 | 40 12 | 33 7 | 5).
    assert [b["input_ids"].shape for b in batches] == [(3, 2, 64)] * 3
    assert [b["index"][1].tolist() for b in batches] == [[[3, 6], [8, 4]], [[1, 7], [5, 9]], [[2, 0], [-1, -1]]]
    assert [b["index"][0].tolist() for b in batches] == [[[3, -1], [1, 4]], [[5, 2], [0, -1]], [[-1, -1]] * 2]
    assert batches[1]["index"][2].tolist() == [[-1] * 2] * 2  # lane 2's one row went in the first batch
    for lane, rows in enumerate(lanes):
        seen = np.concatenate([b["index"][lane][b["valid"][lane]] for b in batches])
        assert sorted(seen.tolist()) == rows
    for b in batches:
        for lane, row, slot in zip(*np.nonzero(b["valid"])):
            prompt = tok.prompt(b["index"][lane, row, slot])
            stop = b["answer_pos"][lane, row, slot] + 1
            assert b["input_ids"][lane, row, stop - len(prompt) : stop].tolist() == prompt.tolist()
            assert (b["segment_ids"][lane, row, stop - len(prompt) : stop] == slot + 1).all()
            assert b["label"][lane, row, slot] == tok.labels[b["index"][lane, row, slot]]


def test_bad_lanes_and_buckets_are_named():
    tok = tokenized([5, 6])
    with pytest.raises(ValueError, match=r"lane 1 names rows outside \[0, 2\): \[2\]"):
        eval_batches(tok, batch_tokens=64, lanes=[[0], [1, 2]])
    with pytest.raises(ValueError, match="lanes is empty"):
        eval_batches(tok, batch_tokens=64, lanes=[])
    assert fitting_bucket((32, 64), 32) == 32 and fitting_bucket((32, 64), 33) == 64
    with pytest.raises(ValueError, match=r"65 tokens do not fit the largest bucket, 64"):
        fitting_bucket((32, 64), 65)


def pool_sets(runs=2):
    """Two shared sets, and each of ``runs`` runs' own (2 or 3 runs)."""
    shared = {"a": tokenized([5, 30, 9, 40, 12], first_token=10), "b": tokenized([8, 50, 3], first_token=20)}
    own = [
        {"train": tokenized([6, 7, 45], first_token=30)},
        {"train": tokenized([33], first_token=40)},
        {"train": tokenized([20, 44], first_token=50)},
    ]
    return shared, own[:runs]


def markers(batch):
    """Each prompt slot's marker, its prompt's first token (``tokenized``'s first_token + its index)."""
    positions = batch["answer_pos"]
    starts = np.concatenate([np.zeros_like(positions[..., :1]), positions[..., :-1] + 1], axis=-1)
    return np.take_along_axis(batch["input_ids"], starts, axis=-1)


def test_pool_gives_each_run_the_shared_sets_and_its_own_and_evaluate_places_every_margin():
    shared, own = pool_sets()
    pool = make_eval_pool(shared, own, batch_tokens=128, row_multiple=2)
    assert pool.num_runs == 2
    computed = np.zeros(2, int)
    for batch in pool.batches:
        assert batch["input_ids"].shape[0] == 2 and batch["input_ids"].shape[1] % 2 == 0
        computed += batch["valid"].sum(axis=(1, 2))
    assert computed.tolist() == [5 + 3 + 3, 5 + 3 + 1]  # no run scores the other's training set

    def fake_step(base_state, lora, batch):
        """Margin = the prompt's marker (first) token + 1000 * run: known without the pool's bookkeeping."""
        return markers(batch) + 1000.0 * np.arange(2)[:, None, None]

    margins = evaluate(fake_step, None, None, pool, place=lambda batch: batch)
    for run in range(2):
        sets = {**shared, **own[run]}
        assert list(margins[run]) == ["a", "b", "train"] and list(pool.labels_of(run)) == ["a", "b", "train"]
        for name, tok in sets.items():
            first = {"a": 10, "b": 20, "train": 30 + 10 * run}[name]
            np.testing.assert_array_equal(margins[run][name], first + np.arange(len(tok)) + 1000 * run)
            np.testing.assert_array_equal(pool.labels_of(run)[name], tok.labels)
    with pytest.raises(RuntimeError, match=r"run 0, a: no batch holds examples"):
        evaluate(fake_step, None, None, dataclasses.replace(pool, batches=pool.batches[1:]), place=lambda b: b)


def test_pool_errors():
    shared, own = pool_sets()
    with pytest.raises(ValueError, match="one mapping in `own` per run"):
        make_eval_pool(shared, [], batch_tokens=64)
    with pytest.raises(ValueError, match=r"run 1's own sets \['a'\] have the names of shared sets"):
        make_eval_pool(shared, [{}, {"a": own[0]["train"]}], batch_tokens=64)
    with pytest.raises(ValueError, match="run 0 scores no set"):
        make_eval_pool({}, [{}], batch_tokens=64)
    with pytest.raises(ValueError, match=r"must share a max_length; got \[64, 128\]"):
        make_eval_pool({"a": tokenized([5]), "b": tokenized([5], max_length=128)}, [{}], batch_tokens=64)


def test_pooled_margins_are_the_full_models_logit_differences():
    model = from_config(OPT, dtype="float32", seed=0)
    graphdef, base, runs = steps.attach_runs(model, [0, 1], LORA, steps.make_optimizer(1e-3, 10, 1, 0.0, 1.0))
    # Non-zero B, so the two runs' adapters (and margins) differ.
    runs = runs.replace(lora=jax.tree.map(lambda x: x + 0.05 * np.cos(np.arange(x.size).reshape(x.shape)), runs.lora))
    shared, own = pool_sets()
    pool = make_eval_pool(shared, own, batch_tokens=64)
    assert any(b["valid"].sum(axis=-1).max() > 1 for b in pool.batches)  # rows hold several prompts
    eval_step = steps.make_eval_step(graphdef, YES, NO)
    margins = evaluate(eval_step, base, runs.lora, pool, place=lambda batch: batch)
    shapes = {b["input_ids"].shape for b in pool.batches}  # one per row length
    assert len(pool.batches) > len(shapes) > 1 and eval_step._cache_size() == len(shapes)
    for run in range(2):
        lora_model = nnx.view(nnx.merge(graphdef, base, steps.select_run(runs.lora, run)), deterministic=True)
        for name, tok in {**shared, **own[run]}.items():
            # Each prompt alone, apart from the pool: the logits at its last token.
            prompts = [tok.prompt(i)[None] for i in range(len(tok))]
            at = np.stack([np.asarray(lora_model(ids, np.ones_like(ids)))[0, -1] for ids in prompts])
            np.testing.assert_allclose(margins[run][name], at[:, YES] - at[:, NO], rtol=0, atol=1e-5)
    assert not np.allclose(margins[0]["a"], margins[1]["a"])


def test_a_pool_like_another_scores_each_example_once_in_that_pools_batch_shapes():
    shared, own = pool_sets(runs=3)
    pool = make_eval_pool(shared, own, batch_tokens=64, row_multiple=2)
    first = make_eval_pool(shared, own, batch_tokens=64, row_multiple=2, like=pool)
    assert first.interchangeable and not pool.interchangeable and first.sets == pool.sets
    assert {b["input_ids"].shape for b in first.batches} <= {b["input_ids"].shape for b in pool.batches}
    assert {b["answer_pos"].shape for b in first.batches} <= {b["answer_pos"].shape for b in pool.batches}
    scored = np.concatenate([b["index"][b["valid"]] for b in first.batches])
    assert sorted(scored.tolist()) == list(range(len(pool.labels)))  # every example once, in some lane
    assert len(first.batches) < len(pool.batches)
    lanes = [sum(int(b["valid"][lane].sum()) for b in first.batches) for lane in range(3)]
    assert max(lanes) - min(lanes) <= 1  # dealt evenly (8 shared + 3 + 1 + 2 own examples over 3 lanes)

    def fake_step(base_state, lora, batch):
        """Margin = the prompt's marker (first) token: the runs score alike, whichever lane holds it."""
        return markers(batch).astype(np.float32)

    margins = evaluate(fake_step, None, None, first, place=lambda batch: batch)
    for run in range(3):
        assert list(margins[run]) == ["a", "b", "train"]
        for name, tok in {**shared, **own[run]}.items():
            first_token = {"a": 10, "b": 20, "train": 30 + 10 * run}[name]
            np.testing.assert_array_equal(margins[run][name], first_token + np.arange(len(tok)))
    with pytest.raises(ValueError, match="`like` was made from other sets"):
        make_eval_pool(shared, own[:2], batch_tokens=64, like=pool)


def test_a_layout_keeps_its_shapes_and_splits_a_pair_its_one_slot_cannot_hold():
    # Rows of 64 with one prompt slot: the pair 30 + 30 that the packer makes goes into two rows.
    batches = list(eval_batches(tokenized([30, 30, 10]), batch_tokens=64, layout={64: (2, 1)}))
    assert [b["input_ids"].shape for b in batches] == [(2, 64)] * 2
    assert [b["index"].tolist() for b in batches] == [[[0], [1]], [[2], [-1]]]


def test_step_zero_pool_gives_every_run_the_base_models_margins_and_compiles_nothing_new():
    model = from_config(OPT, dtype="float32", seed=0)
    graphdef, base, runs = steps.attach_runs(model, [0, 1, 2], LORA, steps.make_optimizer(1e-3, 10, 1, 0.0, 1.0))
    assert adds_nothing(runs.lora)  # B starts at zero, as peft's; A differs between the runs
    shared, own = pool_sets(runs=3)
    pool = make_eval_pool(shared, own, batch_tokens=64)
    first = make_eval_pool(shared, own, batch_tokens=64, like=pool)
    eval_step = steps.make_eval_step(graphdef, YES, NO)
    expected = evaluate(eval_step, base, runs.lora, pool, place=lambda batch: batch)
    compiled = eval_step._cache_size()
    margins = evaluate(eval_step, base, runs.lora, first, place=lambda batch: batch)
    assert eval_step._cache_size() == compiled
    for run in range(3):
        for name in expected[run]:
            np.testing.assert_allclose(margins[run][name], expected[run][name], rtol=0, atol=1e-6)
    assert not adds_nothing(jax.tree.map(lambda x: x + 0.01, runs.lora))  # B no longer zero


def test_pool_figures_count_tokens_and_causal_attention_of_every_row():
    # Rows of 64: 30 + 30 in one, 10 alone in another (a third prompt would break the two-a-row rule), one
    # row a batch; 70 prompt tokens of 128, and 2 x 64 x 65 / 2 = 4160 scores computed for
    # 2 x 30 x 31 / 2 + 10 x 11 / 2 = 985 needed.
    pool = make_eval_pool({"a": tokenized([30, 30, 10])}, [{}], batch_tokens=64, row_lengths=(64,))
    assert [b["input_ids"].shape for b in pool.batches] == [(1, 1, 64)] * 2
    assert pool_figures(pool) == {"eval_real_token_share": 70 / 128, "eval_attention_waste": 4160 / 985}
    # Split over 4 devices: one batch of 4 rows, 2 of them empty, computed all the same.
    pool = make_eval_pool({"a": tokenized([30, 30, 10])}, [{}], batch_tokens=64, row_multiple=4, row_lengths=(64,))
    assert [b["input_ids"].shape for b in pool.batches] == [(1, 4, 64)]
    assert pool_figures(pool) == {"eval_real_token_share": 70 / 256, "eval_attention_waste": 8320 / 985}


def test_training_figures_count_the_lengths_the_step_runs_at():
    # Two runs of 8 prompts of 10 tokens a step, packed over 2 devices' rows in 2 micro-batches: each of the 4
    # rows holds 4 prompts (40 tokens), so each micro-batch runs at the bucket 48: 160 prompt tokens of
    # 2 micro-batches x 2 rows x 48 computed.
    tok = tokenized([10] * 8)
    geometry = BatchGeometry(
        runs=2,
        batch_size=8,
        grad_accum=2,
        seq_len=64,
        buckets=(16, 32, 48, 64),
        packed=True,
        prompts_per_row=4,
        batch_shards=2,
    )
    stream = train_steps(
        [tok, tok], [0, 1], batch_size=8, layout=geometry.layout, seq_len=64, prompts_per_row=4, prefetch=0
    )
    figures = training_figures(stream, geometry, steps=3)
    assert figures["train_real_token_share"] == 160 / 192 and figures["host_batch_ms"] > 0


def test_a_loaded_base_and_its_runs_compile_the_train_step_once(tmp_path):
    """load_pretrained places the base on a device (committed); the runs must be too, or step 2 recompiles."""
    import torch
    import transformers

    torch.manual_seed(0)
    hf_config = transformers.OPTConfig(**{k: v for k, v in OPT.items() if k != "model_type"})
    transformers.OPTForCausalLM(hf_config).save_pretrained(tmp_path)
    model = load_pretrained(tmp_path, dtype="float32")
    optimizer = steps.make_optimizer(1e-3, 10, 1, 0.0, 1.0)
    graphdef, base, runs = steps.attach_runs(model, [0], LORA, optimizer)
    geometry = BatchGeometry(runs=1, batch_size=4, grad_accum=1, seq_len=16)
    train_step = steps.make_train_step(graphdef, optimizer, YES, NO, geometry)
    tok = tokenized([5, 9, 12, 7])
    step = next(train_steps([tok], [0], batch_size=4, layout=geometry.layout, seq_len=16, prefetch=0))
    batch = {key: step[key] for key in TRAIN_KEYS}
    for _ in range(3):
        runs, _ = train_step(base, runs, batch)
    assert train_step._cache_size() == 1


@pytest.mark.parametrize("pack", [True, False])
def test_a_job_compiles_the_micro_batch_lengths_its_streams_take_and_no_other(
    pack, tmp_path, gpt2_tokenizer_dir, hf_data_dir
):
    """batch_geometry's buckets are the lengths the train step picks for the job's real batches (built whole,
    step by step, and run through the step's own choice against every bucket), plus the row length; the
    replay it uses gives each micro-batch's longest row as the built batches hold it."""
    config = tiny_config(tmp_path / "out", gpt2_tokenizer_dir, hf_data_dir, tmp_path / "cache")
    config.data.max_length = 256
    config.data.buckets = ()  # the default ladder: 64, 80, 96, 112, 128, 160, ...
    # Prompts of about 100 to 150 tokens: the ladder's short lengths are never taken.
    config.data.template = "Read this. " * 30 + "{premise} Question: {hypothesis} Yes or No?"
    config.runs.seeds, config.runs.shots = (0, 1, 2), (16,)
    config.train.steps, config.train.pack = 40, pack
    config.train.grad_accum = 2  # unpacked: micro-batches of 4 prompts, 2 a device
    config.mesh.data = 2
    seeds = list(config.runs.seeds)
    job = read(config)
    mesh = job.mesh.make(devices=jax.devices()[:2])
    tokenizer = load_tokenizer(job.model.tokenizer)
    train_sets = few_shot_sets(job.data, tokenizer, [(seed, 16) for seed in seeds])
    geometry = batch_geometry(job.batches, mesh, train_sets, seeds, job.groups[0].total_steps)
    every_bucket = dataclasses.replace(geometry, buckets=bucket_lengths(geometry.seq_len))
    stream = train_steps(
        train_sets,
        seeds,
        batch_size=geometry.batch_size,
        layout=geometry.layout,
        seq_len=geometry.seq_len,
        prompts_per_row=geometry.prompts_per_row,
        prefetch=0,
    )
    replayed, most_prompts = replay_rows(
        train_sets, seeds, batch_size=geometry.batch_size, layout=geometry.layout, steps=config.train.steps
    )
    assert most_prompts == geometry.prompts_per_row and (most_prompts > 1) == pack
    assert geometry.seq_len <= config.data.max_length
    if pack:  # a device's 6 prompts of 100-150 tokens a micro-batch: at least 3 rows of at most data.max_length
        assert geometry.rows_per_device >= 3
    taken = set()
    for step in range(config.train.steps):
        batch = next(stream)
        built = (batch["segment_ids"] != 0).sum(-1).max(-1)  # [grad_accum]: each micro-batch's longest row
        np.testing.assert_array_equal(built, replayed[step], err_msg=f"step {step}")
        branches = np.asarray(micro_batch_branches(batch, every_bucket))
        taken |= {every_bucket.micro_batch_lengths[branch - 1] for branch in branches.tolist() if branch}
    assert set(geometry.micro_batch_lengths) == taken | {geometry.seq_len}
    assert len(geometry.micro_batch_lengths) < len(every_bucket.micro_batch_lengths)  # branches not compiled
