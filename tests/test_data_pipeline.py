"""Few-shot sampling, stratified subsets, and the grain evaluation and training pipelines."""

import collections
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

import datasets
import numpy as np
import pytest

from oodjax.data import (
    StepLayout,
    TokenizedSet,
    balance_rows,
    bucket_lengths,
    epoch_permutation,
    eval_batches,
    eval_row_lengths,
    few_shot,
    load_testset,
    packed_layout,
    pair_rows,
    prompt_lengths,
    replay_rows,
    step_layout,
    stratified_subset,
    stream_examples,
    train_steps,
    training_pool,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mnli_pool(hf_data_dir):
    return training_pool("mnli", data_dir=hf_data_dir)


def toy_tokenized(lengths, max_length=300, labels=None):
    """A TokenizedSet whose prompt i is the tokens 1000*i + 1, ..., 1000*i + lengths[i]."""
    rows = [1000 * i + 1 + np.arange(n) for i, n in enumerate(lengths)]
    n = len(lengths)
    return TokenizedSet(
        token_ids=np.concatenate(rows).astype(np.int32),
        starts=np.concatenate([[0], np.cumsum(lengths)]),
        labels=np.asarray(labels if labels is not None else np.arange(n) % 2, dtype=np.int32),
        truncated=np.zeros(n, dtype=bool),
        max_length=max_length,
    )


def binary(labels):
    return datasets.Dataset.from_dict(
        {"premise": ["p"] * len(labels), "hypothesis": ["h"] * len(labels), "label": labels}
    )


# ---- few-shot ----------------------------------------------------------------


@pytest.mark.parametrize("n, per_label", [(32, [16, 16]), (64, [32, 32]), (128, [64, 64]), (33, [17, 16]), (1, [1, 0])])
def test_few_shot_is_balanced_and_drawn_from_the_pool(mnli_pool, n, per_label):
    sample = few_shot(mnli_pool, n, seed=0)
    assert np.bincount(sample["label"][:], minlength=2).tolist() == per_label
    pool_rows = set(zip(mnli_pool["premise"][:], mnli_pool["hypothesis"][:], mnli_pool["label"][:]))
    rows = list(zip(sample["premise"][:], sample["hypothesis"][:], sample["label"][:]))
    assert len(set(rows)) == n and set(rows) <= pool_rows


def test_few_shot_is_reproducible_and_seed_dependent(mnli_pool):
    assert few_shot(mnli_pool, 64, seed=42)["hypothesis"][:] == few_shot(mnli_pool, 64, seed=42)["hypothesis"][:]
    assert set(few_shot(mnli_pool, 64, seed=42)["hypothesis"][:]) != set(
        few_shot(mnli_pool, 64, seed=99)["hypothesis"][:]
    )


def test_few_shot_is_the_same_in_another_process(mnli_pool, hf_data_dir):
    """A fresh interpreter with another hash seed draws the same examples in the same order."""
    script = (
        "import json, sys; from oodjax.data import few_shot, training_pool;"
        f"pool = training_pool('mnli', data_dir={str(hf_data_dir)!r});"
        "print(json.dumps(few_shot(pool, 32, seed=99)['hypothesis'][:]))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", script], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == few_shot(mnli_pool, 32, seed=99)["hypothesis"][:]


def test_few_shot_larger_than_the_pool_is_an_error():
    pool = binary([0] * 10 + [1] * 3)
    with pytest.raises(
        ValueError, match=r"few-shot n=8 needs 4 examples of label 1 but the pool \(13 rows\) has only 3"
    ):
        few_shot(pool, 8, seed=0)
    with pytest.raises(ValueError, match="few-shot size n must be positive, got 0"):
        few_shot(pool, 0, seed=0)


def test_few_shot_rejects_unmapped_labels():
    with pytest.raises(ValueError, match=r"few-shot pool has labels \[2\]; expected binary labels \(0, 1\)"):
        few_shot(binary([0, 1, 2, 1]), 2, seed=0)


# ---- stratified subsets --------------------------------------------------------


def test_stratified_subset_keeps_label_proportions(hf_data_dir):
    ds = load_testset("scitail", data_dir=hf_data_dir)  # 842 entailment, 1284 not
    subset = stratified_subset(ds, 500, seed=0)
    # 500 * 842 / 2126 = 198.02..., 500 * 1284 / 2126 = 301.97...: largest remainder gives 198 / 302.
    assert np.bincount(subset["label"][:]).tolist() == [198, 302]
    rows = list(zip(ds["premise"][:], ds["hypothesis"][:]))
    positions = [rows.index(r) for r in zip(subset["premise"][:], subset["hypothesis"][:])]
    assert positions == sorted(set(positions))  # distinct rows, in the testset's order
    assert subset["hypothesis"][:] == stratified_subset(ds, 500, seed=0)["hypothesis"][:]
    assert subset["hypothesis"][:] != stratified_subset(ds, 500, seed=1)["hypothesis"][:]


def test_stratified_subset_of_a_small_set_is_the_whole_set():
    ds = binary([0, 1, 1])
    assert stratified_subset(ds, 3, seed=0) is ds
    with pytest.raises(ValueError, match="subset size n must be positive, got 0"):
        stratified_subset(ds, 0, seed=0)


# ---- evaluation batches ----------------------------------------------------------


def test_bucket_lengths():
    assert bucket_lengths(512) == (64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512)
    assert bucket_lengths(300) == (64, 80, 96, 112, 128, 160, 192, 224, 256, 300)
    assert bucket_lengths(50) == (50,)
    assert bucket_lengths(300, [100, 32, 1000]) == (32, 100, 300)
    with pytest.raises(ValueError, match=r"bucket lengths must be positive, got \[0, 64\]"):
        bucket_lengths(128, [0, 64])


def test_eval_row_lengths():
    assert eval_row_lengths(512) == (32, 48, 64, 96, 128, 192, 256, 384, 512)
    assert eval_row_lengths(100) == (32, 48, 64, 96, 100)
    assert eval_row_lengths(20) == (20,)
    assert eval_row_lengths(128, [64, 16, 500]) == (16, 64, 128)
    with pytest.raises(ValueError, match=r"evaluation row lengths must be positive, got \[-1\]"):
        eval_row_lengths(128, [-1])


def check_batch_rows(batch, tokenized):
    """Every valid row holds its prompt, right-padded, with the answer at its last token."""
    for r in range(len(batch["index"])):
        i = batch["index"][r]
        if not batch["valid"][r]:
            assert i == -1 and batch["segment_ids"][r].tolist() == [1] + [0] * (batch["input_ids"].shape[1] - 1)
            continue
        prompt = tokenized.prompt(i)
        n = len(prompt)
        assert batch["input_ids"][r, :n].tolist() == prompt.tolist()
        assert not batch["input_ids"][r, n:].any()
        assert batch["segment_ids"][r].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
        assert batch["answer_pos"][r] == n - 1
        assert batch["label"][r] == tokenized.labels[i]


def check_packed_rows(batch, tokenized, pad_id=0):
    """Each row holds its prompts one after another, each under its own id, answer at its last token, then
    padding. ``tokenized`` is the set, or, for a training step's rows (whose slots name their run), the runs' sets."""
    rows, width = batch["input_ids"].shape
    for r in range(rows):
        slots = np.flatnonzero(batch["valid"][r])
        assert slots.tolist() == list(range(len(slots)))  # prompts fill the first slots
        assert (batch["index"][r, len(slots) :] == -1).all()
        if not len(slots):
            assert batch["segment_ids"][r].tolist() == [1] + [0] * (width - 1)
            assert (batch["input_ids"][r] == pad_id).all()
            continue
        start = 0
        for slot in slots:
            i = batch["index"][r, slot]
            source = tokenized[batch["run"][r, slot]] if isinstance(tokenized, list) else tokenized
            prompt = source.prompt(i)
            stop = start + len(prompt)
            assert batch["input_ids"][r, start:stop].tolist() == prompt.tolist()
            assert (batch["segment_ids"][r, start:stop] == slot + 1).all()
            assert batch["answer_pos"][r, slot] == stop - 1
            assert batch["label"][r, slot] == source.labels[i]
            start = stop
        assert (batch["input_ids"][r, start:] == pad_id).all() and not batch["segment_ids"][r, start:].any()


def test_pair_rows_fill_rows_of_several_lengths_two_prompts_at_most():
    # Longest first, each opening the row its best filling fills most (the shortest of equals): 300 fills a
    # row of 300; 200 + 65 fill 88% of a 300 (200 + 10: 82% of a 256); 129 + 128 86% of a 300 (129 + 64:
    # 75% of a 256); each 64 fills a 64 alone; 10 + 7 are 53% of a 32, and 3 + 1 the last 32.
    lengths = np.array([3, 64, 65, 300, 128, 10, 129, 200, 7, 64, 1])
    rows = pair_rows(lengths, (32, 64, 128, 256, 300))
    assert rows == [(300, [3]), (300, [7, 2]), (300, [6, 4]), (64, [1]), (64, [9]), (32, [5, 8]), (32, [0, 10])]
    assert pair_rows(np.array([30, 20, 10]), (64,), prompts_per_row=3) == [(64, [0, 1, 2])]
    assert pair_rows(np.array([], dtype=int), (8,)) == []
    with pytest.raises(ValueError, match=r"prompts \[1\] are longer than the longest row, 8"):
        pair_rows(np.array([8, 9]), (4, 8))


def test_eval_batches_hold_every_example_once_one_row_length_a_batch():
    lengths = [3, 64, 65, 300, 128, 10, 129, 200, 7, 64, 1]
    tokenized = toy_tokenized(lengths)  # max_length 300: the rows of the test above
    batches = list(eval_batches(tokenized, batch_tokens=600, row_lengths=(32, 64, 128, 256)))
    seen = np.concatenate([b["index"][b["valid"]] for b in batches])
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    # Shortest rows first; 600 tokens hold 2 rows of 300, so its 3 rows take 2 batches of 2 (the last half
    # empty); a length's prompt slots are the most prompts one of its rows holds.
    shapes = [(b["input_ids"].shape, b["answer_pos"].shape) for b in batches]
    assert shapes == [((2, 32), (2, 2)), ((2, 64), (2, 1)), ((2, 300), (2, 2)), ((2, 300), (2, 2))]
    for b in batches:
        assert {b[k].dtype for k in ("input_ids", "segment_ids", "answer_pos", "label", "index")} == {
            np.dtype(np.int32)
        }
        assert b["valid"].dtype == bool
        check_packed_rows(b, tokenized)
        np.testing.assert_array_equal(prompt_lengths(b), np.where(b["valid"], tokenized.lengths[b["index"]], 0))


def test_eval_batches_on_a_real_testset_are_nearly_all_prompt_and_attention(gpt2_tokenizer_dir, hf_data_dir, tmp_path):
    """MNLI matched (6,692 prompts) at the study's rows (up to 512 tokens, 32 x 512 tokens a batch, 8 devices): at
    least 95% of the tokens computed are prompt tokens, and the rows compute at most twice the causal attention
    scores the prompts need (packed into rows of 512, as many as fit, they computed about 9x)."""
    from transformers import AutoTokenizer

    from oodjax.data import tokenize_testset

    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    mnli = load_testset("mnli", data_dir=hf_data_dir)
    tokenized = tokenize_testset(mnli, tokenizer, max_length=512, cache_dir=tmp_path)
    batches = list(eval_batches(tokenized, batch_tokens=32 * 512, row_multiple=8))
    seen = np.concatenate([b["index"][b["valid"]] for b in batches])
    assert sorted(seen.tolist()) == list(range(len(tokenized)))
    lengths = [prompt_lengths(b) for b in batches]
    real = sum(int(n.sum()) for n in lengths) / sum(b["input_ids"].size for b in batches)
    needed = sum(int((n * (n + 1) // 2).sum()) for n in lengths)
    computed = sum(rows * length * (length + 1) // 2 for rows, length in (b["input_ids"].shape for b in batches))
    shapes = collections.Counter(b["input_ids"].shape for b in batches)
    print(f"mnli, {len(tokenized)} prompts: {real:.1%} prompt tokens, attention {computed / needed:.2f}x; {shapes}")
    assert real >= 0.95 and computed / needed <= 2
    for b in batches:
        assert b["input_ids"].shape[0] % 8 == 0
        check_packed_rows(b, tokenized)


def test_batch_size_in_tokens():
    tokenized = toy_tokenized([100] * 6 + [250] * 5)  # 3 rows of 200 (100 + 100), 5 of 256 (250)
    batches = list(eval_batches(tokenized, batch_tokens=1200, row_multiple=2, row_lengths=(200, 256)))
    # 1200 // 200 = 6 rows at most: 3 rows -> 1 batch, evened to 4 rows (a multiple of 2); 1200 // 256 = 4
    # (a multiple of 2): 5 rows -> 2 batches, evened to 3 and rounded up to 4.
    assert [b["input_ids"].shape for b in batches] == [(4, 200), (4, 256), (4, 256)]

    def shapes(**sizes):
        return collections.Counter(
            b["input_ids"].shape for b in eval_batches(tokenized, row_lengths=(200, 256), **sizes)
        )

    assert shapes(batch_tokens=100, row_multiple=4) == {(4, 200): 1, (4, 256): 2}  # under a row: row_multiple rows
    assert shapes(batch_tokens=30_000) == {(3, 200): 1, (5, 256): 1}  # one batch a length, no empty row


def test_eval_batch_size_errors():
    tokenized = toy_tokenized([5, 6])
    with pytest.raises(ValueError, match="must be positive, got 0 and 1"):
        eval_batches(tokenized, batch_tokens=0)
    with pytest.raises(ValueError, match="lanes is empty"):
        eval_batches(tokenized, batch_tokens=64, lanes=[])


# ---- training stream -------------------------------------------------------------


def as_lists(step):
    return {k: v.tolist() for k, v in step.items()}


def toy_runs():
    """Three runs' sets of different sizes (10, 7 and 12 prompts), lengths and labels; run r's tokens are offset by
    100,000 * r, so a row's tokens tell which run's prompt it holds, not just which index."""
    specs = [
        ([5, 70, 9, 12, 33, 8, 20, 41, 3, 2], None),
        ([14, 6, 27, 11, 50, 8, 19], [1, 1, 0, 1, 0, 0, 1]),
        ([40, 5, 30, 20, 12, 50, 7, 33, 25, 9, 60, 14], [0] * 12),
    ]
    sets = []
    for r, (lengths, labels) in enumerate(specs):
        tokenized = toy_tokenized(lengths, max_length=128, labels=labels)
        sets.append(dataclasses.replace(tokenized, token_ids=tokenized.token_ids + 100_000 * r))
    return sets


SEEDS = (3, 0, 11)


def global_batch(seed, size, batch_size, index):
    """A run's global batch ``index`` from its definition, not from the stream's code: elements [index *
    batch_size, (index + 1) * batch_size) of the set's epoch permutations laid end to end."""
    stop = (index + 1) * batch_size
    epochs = np.concatenate([epoch_permutation(seed, size, e) for e in range(-(-stop // size))])
    return epochs[index * batch_size : stop]


def check_step(step, sets, seeds, batch_size, index, pad_id=0):
    """Step ``index`` holds each run's global batch ``index`` exactly once: every place of the batch (``example``)
    in one valid slot, holding the batch's prompt at that place, its tokens and label in its row."""
    micro_batches, rows, seq_len = step["input_ids"].shape
    slots = step["answer_pos"].shape[-1]
    assert step["segment_ids"].shape == (micro_batches, rows, seq_len)
    for key in ("answer_pos", "label", "run", "example", "index", "valid"):
        assert step[key].shape == (micro_batches, rows, slots)
    assert {step[k].dtype for k in step if k != "valid"} == {np.dtype(np.int32)} and step["valid"].dtype == bool
    assert step["valid"].sum() == len(sets) * batch_size  # so no valid slot names a run outside the sets
    for r, (tokenized, seed) in enumerate(zip(sets, seeds, strict=True)):
        batch = global_batch(seed, len(tokenized), batch_size, index)
        mine = step["valid"] & (step["run"] == r)
        examples = step["example"][mine]
        assert sorted(examples.tolist()) == list(range(batch_size))  # each place of the batch once
        assert step["index"][mine].tolist() == batch[examples].tolist()  # holding the prompt at that place
    flat = {key: value.reshape(micro_batches * rows, *value.shape[2:]) for key, value in step.items()}
    check_packed_rows(flat, sets, pad_id=pad_id)


def row_members(step):
    """Each row's (run, example) pairs, [micro-batch][row], in slot order."""
    pairs = np.stack([step["run"], step["example"]], axis=-1).tolist()
    return [
        [[tuple(p) for p, v in zip(row, valid) if v] for row, valid in zip(micro, valid_micro)]
        for micro, valid_micro in zip(pairs, step["valid"].tolist())
    ]


def row_tokens(step):
    """Each row's prompt tokens, [micro-batch, row], from its segment ids (an empty row's 1 on its first position
    is not a prompt's)."""
    return np.where(step["valid"].any(-1), (step["segment_ids"] != 0).sum(-1), 0)


def test_training_stream_epochs_are_shuffled_permutations():
    """A run's stream is its set's epochs one after another, each a fresh permutation; a batch may straddle two."""
    tokenized = toy_tokenized([5, 70, 9, 12, 33, 8, 20, 41], max_length=128)
    stream = train_steps([tokenized], [0], batch_size=4, layout=StepLayout(1, 4, False), seq_len=80)
    steps = [next(stream) for _ in range(6)]
    assert {s["input_ids"].shape for s in steps} == {(1, 4, 80)}
    epochs = [np.concatenate([s["index"].reshape(-1) for s in steps[e : e + 2]]) for e in (0, 2, 4)]
    assert all(sorted(e.tolist()) == list(range(8)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3 and tuple(epochs[0]) != tuple(range(8))
    for e, epoch in enumerate(epochs):  # each epoch's examples are that epoch's permutation, batch by batch
        assert [sorted(epoch[:4].tolist()), sorted(epoch[4:].tolist())] == [
            sorted(epoch_permutation(0, 8, e)[:4].tolist()),
            sorted(epoch_permutation(0, 8, e)[4:].tolist()),
        ]
    for index, step in enumerate(steps):
        check_step(step, [tokenized], [0], 4, index)
        assert (np.diff(row_tokens(step)[0]) >= 0).all()  # one a row: shortest first, for length-grouped micro-batches
    for size in (7, 8, 10):  # batches of 4 of 7 or 10 examples straddle epochs
        for index in range(8):
            assert stream_examples(5, size, 4, index).tolist() == global_batch(5, size, 4, index).tolist()


def test_step_layout_by_hand():
    """Two runs' batches of lengths [5, 3, 3, 9] and [2, 7], in 2 micro-batches."""
    lengths = [np.array([5, 3, 3, 9]), np.array([2, 7])]
    # One a row: micro-batch i holds, run after run, slice i of each run's prompts by length (ties in order):
    # run 0's are 1, 2 (3 tokens) | 0, 3; run 1's 0 | 1.
    assert step_layout(lengths, StepLayout(2, 3, False)) == [[(0, 1)], [(0, 2)], [(1, 0)], [(0, 0)], [(0, 3)], [(1, 1)]]
    # Packed over 2 x 2 rows: longest first, each to the least-filled row of all: 9 | 7 | 5 | 3, then the second
    # 3 -> row 3 (6), 2 -> row 2 (7); both runs share row 2.
    assert step_layout(lengths, StepLayout(2, 2, True)) == [[(0, 3)], [(1, 1)], [(0, 0), (1, 0)], [(0, 1), (0, 2)]]
    # One prompt a row over 2 x 4 rows: the rows of both micro-batches take them, not the first's alone.
    assert step_layout(lengths, StepLayout(2, 4, True), prompts_per_row=1) == [
        [(0, 3)],
        [(1, 1)],
        [(0, 0)],
        [(0, 1)],
        [(0, 2)],
        [(1, 0)],
        [],
        [],
    ]
    with pytest.raises(ValueError, match="do not fit 4 rows of 9 tokens and 1 prompt slots"):
        step_layout(lengths, StepLayout(2, 2, True), row_length=9, prompts_per_row=1)


def test_balance_rows_puts_each_prompt_in_the_least_filled_row_with_room():
    # 3 rows of at most 40 tokens and 3 prompts. Longest first, each to the least-filled row with room:
    # 30 | 25 | 20, then 12 -> row 2 (32), 10 -> row 1 (35), 9 -> row 0 (39), 8 -> row 2 (40).
    lengths = np.array([9, 30, 12, 25, 8, 20, 10])
    assert balance_rows(lengths, num_rows=3, row_length=40, prompts_per_row=3) == [[1, 0], [3, 6], [5, 2, 4]]
    with pytest.raises(
        ValueError,
        match=r"7 prompts of 114 tokens \(longest 30\) do not fit 3 rows of 40 tokens "
        r"and 2 prompt slots; at prompt 4 \(8 tokens\)",
    ):
        balance_rows(lengths, num_rows=3, row_length=40, prompts_per_row=2)  # every row full of prompts
    with pytest.raises(ValueError, match=r"do not fit 2 rows of 40 tokens and 3 prompt slots; at prompt 5 \(20"):
        balance_rows(lengths, num_rows=2, row_length=40, prompts_per_row=3)  # 30 | 25, then 20 fits neither


@pytest.mark.parametrize(
    "layout, batch_size, prompts_per_row",
    [
        (StepLayout(2, 6, False), 4, 1),  # one a row: 3 runs x 4 prompts / 2 micro-batches
        (StepLayout(2, 3, True), 4, 12),  # packed: 12 prompts over 2 x 3 rows
        (StepLayout(2, 4, True), 2, 1),  # packed, more rows than prompts: empty rows
    ],
)
def test_steps_hold_each_runs_global_batch_once(layout, batch_size, prompts_per_row):
    """Step t holds run r's global batch t, whatever the layout, across the sets' epochs (7, 10 and 12 prompts)."""
    sets = toy_runs()
    stream = train_steps(
        sets, SEEDS, batch_size=batch_size, layout=layout, seq_len=128, prompts_per_row=prompts_per_row, pad_id=-1
    )
    for index in range(8):
        step = next(stream)
        rows = layout.rows if layout.packed else len(sets) * batch_size // layout.micro_batches
        assert step["input_ids"].shape == (layout.micro_batches, rows, 128)
        assert step["answer_pos"].shape == (layout.micro_batches, rows, prompts_per_row)
        check_step(step, sets, SEEDS, batch_size, index, pad_id=-1)


def test_packed_rows_mix_runs_and_are_balanced():
    """Packed, each row takes prompts of any run, and all micro-batches' rows are filled evenly: a row is at most
    one prompt longer than the emptiest, so the longest row, the length the step runs at, is as short as can be."""
    sets = toy_runs()
    stream = train_steps(sets, SEEDS, batch_size=8, layout=StepLayout(2, 3, True), seq_len=1024, prompts_per_row=24)
    for index in range(6):
        step = next(stream)
        check_step(step, sets, SEEDS, 8, index)
        tokens = row_tokens(step)
        lengths = np.zeros(step["index"].shape, dtype=np.int64)  # each slot's prompt's length, from the sets
        for slot in zip(*np.nonzero(step["valid"])):
            lengths[slot] = sets[step["run"][slot]].lengths[step["index"][slot]]
        np.testing.assert_array_equal(tokens, lengths.sum(-1))
        assert tokens.max() - tokens.min() <= lengths.max()
        assert (tokens > 0).all()  # both micro-batches hold prompts
        assert any(len({run for run, _ in row}) > 1 for micro in row_members(step) for row in micro)


def test_one_a_row_micro_batches_hold_each_runs_slices_by_length():
    """One a row, micro-batch i holds, run after run, slice i of each run's batch ordered by length (ties in batch
    order), so a micro-batch's rows are of similar length, as each run's would be trained alone."""
    sets = toy_runs()
    stream = train_steps(sets, SEEDS, batch_size=8, layout=StepLayout(4, 6, False), seq_len=128)
    for index in range(6):  # batches of 8 of the 7-prompt set repeat a prompt: equal lengths
        step = next(stream)
        check_step(step, sets, SEEDS, 8, index)
        expected = [[] for _ in range(4)]
        for r, (tokenized, seed) in enumerate(zip(sets, SEEDS)):
            batch_lengths = tokenized.lengths[global_batch(seed, len(tokenized), 8, index)]
            order = sorted(range(8), key=lambda e: (batch_lengths[e], e))
            for i in range(4):
                expected[i] += [[(r, e)] for e in order[2 * i : 2 * i + 2]]
        assert row_members(step) == expected


@pytest.mark.parametrize(
    "layout, batch_size",
    [(StepLayout(2, 12, False), 8), (StepLayout(2, 3, True), 8), (StepLayout(3, 2, True), 6)],
)
def test_replay_rows_agrees_with_the_steps(layout, batch_size):
    """The replay's longest row per micro-batch and most prompts a row are those of the steps themselves, laid out
    with the replay's figures as bounds (as a job compiles its step for them)."""
    sets = toy_runs()
    longest, most_prompts = replay_rows(sets, SEEDS, batch_size=batch_size, layout=layout, steps=7)
    assert longest.shape == (7, layout.micro_batches)
    stream = train_steps(
        sets, SEEDS, batch_size=batch_size, layout=layout, seq_len=int(longest.max()), prompts_per_row=most_prompts
    )
    steps = [next(stream) for _ in range(7)]
    for index, step in enumerate(steps):
        check_step(step, sets, SEEDS, batch_size, index)
    np.testing.assert_array_equal(np.stack([row_tokens(s).max(-1) for s in steps]), longest)
    assert most_prompts == max(int(s["valid"].sum(-1).max()) for s in steps)
    if layout.packed:
        assert most_prompts > 1
    else:
        assert most_prompts == 1


@pytest.mark.parametrize("micro_batches, shards, row_length", [(1, 1, 80), (2, 2, 80), (1, 2, 70), (2, 1, 128)])
def test_packed_layout_takes_the_fewest_rows_per_device_that_keep_rows_within_the_length(
    micro_batches, shards, row_length
):
    """Every row of every step within row_length (the steps themselves, laid out with the replay's figures as
    bounds), rows a multiple of the devices, and one row fewer per device would overflow some step's row."""
    sets, batch_size, steps = toy_runs(), 8, 9
    layout, longest, most_prompts = packed_layout(
        sets,
        SEEDS,
        batch_size=batch_size,
        micro_batches=micro_batches,
        shards=shards,
        row_length=row_length,
        steps=steps,
    )
    assert layout.packed and layout.micro_batches == micro_batches and layout.rows % shards == 0
    replayed, replayed_most = replay_rows(sets, SEEDS, batch_size=batch_size, layout=layout, steps=steps)
    np.testing.assert_array_equal(longest, replayed)
    assert most_prompts == replayed_most
    assert 0 < longest.max() <= row_length
    stream = train_steps(
        sets, SEEDS, batch_size=batch_size, layout=layout, seq_len=row_length, prompts_per_row=most_prompts
    )
    assert max(int(row_tokens(next(stream)).max()) for _ in range(steps)) == longest.max()
    if layout.rows > shards:
        fewer = dataclasses.replace(layout, rows=layout.rows - shards)
        assert replay_rows(sets, SEEDS, batch_size=batch_size, layout=fewer, steps=steps)[0].max() > row_length
    with pytest.raises(ValueError, match="a training prompt of 70 tokens outgrows rows of 60"):
        packed_layout(sets, SEEDS, batch_size=batch_size, micro_batches=1, shards=1, row_length=60, steps=steps)


@pytest.mark.parametrize(
    "layout, positions",
    [(StepLayout(2, 6, False), ([0, 1, 5], [2, 3, 4])), (StepLayout(2, 4, True), ([3, 0], [1, 2]))],
)
def test_rows_take_positions_of_each_step(layout, positions):
    """Processes that hold complementary row positions of each micro-batch together see exactly the single-process
    steps, each prompt on the row where a single process puts it."""
    sets = toy_runs()
    kwargs = dict(batch_size=4, layout=layout, seq_len=128, prompts_per_row=4)
    single = train_steps(sets, SEEDS, **kwargs)
    shards = [train_steps(sets, SEEDS, rows=rows, **kwargs) for rows in positions]
    for _ in range(5):  # crosses the sets' epochs
        whole = next(single)
        parts = [next(s) for s in shards]
        for rows, part in zip(positions, parts):
            assert part.keys() == whole.keys()
            for key, value in part.items():
                np.testing.assert_array_equal(value, whole[key][:, rows])


def test_training_stream_is_seeded():
    """Run r's examples depend on its own seed alone: reseeding one run changes its batches, not the others'."""
    sets = toy_runs()

    def run_indices(seeds):
        stream = train_steps(sets, seeds, batch_size=4, layout=StepLayout(2, 2, True), seq_len=128, prompts_per_row=6)
        steps = [next(stream) for _ in range(3)]
        return [[sorted(s["index"][s["valid"] & (s["run"] == r)].tolist()) for s in steps] for r in range(3)]

    first, again, reseeded = run_indices(SEEDS), run_indices(SEEDS), run_indices((3, 1, 11))
    assert first == again
    assert first[0] == reseeded[0] and first[2] == reseeded[2] and first[1] != reseeded[1]


@pytest.mark.parametrize("layout", [StepLayout(2, 6, False), StepLayout(2, 3, True)])
def test_training_stream_state_round_trips(layout):
    sets = toy_runs()
    kwargs = dict(batch_size=4, layout=layout, seq_len=128, prompts_per_row=4)
    stream = train_steps(sets, SEEDS, **kwargs)
    for _ in range(7):
        next(stream)
    state = json.loads(json.dumps(stream.get_state()))  # survives a JSON checkpoint
    assert state == {"next_index": 7}
    expected = [as_lists(next(stream)) for _ in range(5)]
    resumed = train_steps(sets, SEEDS, **kwargs)
    resumed.set_state(state)
    assert [as_lists(next(resumed)) for _ in range(5)] == expected


class RecordingSet(TokenizedSet):
    """A TokenizedSet that records the thread that reads each prompt, i.e. builds each step."""

    def prompt(self, i):
        THREADS_READING.append(threading.current_thread().name)
        return super().prompt(i)


THREADS_READING = []


def test_steps_are_built_ahead_in_a_thread_and_the_state_counts_those_handed_out():
    runs = toy_runs()[:2]
    recording = [RecordingSet(**vars(tokenized)) for tokenized in runs]
    kwargs = dict(batch_size=4, layout=StepLayout(2, 2, True), seq_len=128, prompts_per_row=4)
    THREADS_READING.clear()
    stream = train_steps(recording, SEEDS[:2], prefetch=2, **kwargs)
    handed_out = [as_lists(next(stream)) for _ in range(3)]
    deadline = time.monotonic() + 10
    reads = 5 * 2 * 4  # 3 steps handed out and 2 ahead, 2 runs x 4 prompts each
    while len(THREADS_READING) < reads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(THREADS_READING) == reads and threading.current_thread().name not in THREADS_READING
    state = json.loads(json.dumps(stream.get_state()))
    assert state == {"next_index": 3}  # the steps built ahead are not consumed
    after = [as_lists(next(stream)) for _ in range(4)]
    unprefetched = train_steps(runs, SEEDS[:2], prefetch=0, **kwargs)
    assert [as_lists(next(unprefetched)) for _ in range(7)] == handed_out + after  # prefetching changes nothing
    resumed = train_steps(runs, SEEDS[:2], **kwargs)
    resumed.set_state(state)
    assert [as_lists(next(resumed)) for _ in range(4)] == after
    stream.set_state(state)  # rewound, what it had built ahead is dropped
    assert [as_lists(next(stream)) for _ in range(4)] == after


def test_training_stream_errors():
    sets = toy_runs()  # longest prompt: 70 tokens
    one_a_row, packed = StepLayout(2, 6, False), StepLayout(2, 4, True)

    def steps(sets=sets, seeds=SEEDS, batch_size=4, layout=one_a_row, seq_len=128, **kwargs):
        return train_steps(sets, seeds, batch_size=batch_size, layout=layout, seq_len=seq_len, **kwargs)

    with pytest.raises(ValueError, match="train_steps needs one set per seed, got 3 sets and 2 seeds"):
        steps(seeds=SEEDS[:2])
    with pytest.raises(ValueError, match="train_steps needs one set per seed, got 0 sets and 0 seeds"):
        steps(sets=[], seeds=[])
    with pytest.raises(ValueError, match="batch_size 6 must be a positive multiple of 4 micro-batches"):
        steps(batch_size=6, layout=StepLayout(4, 6, False))
    with pytest.raises(ValueError, match="batch_size 0 must be a positive multiple of 2 micro-batches"):
        steps(batch_size=0)
    with pytest.raises(ValueError, match=r"training streams' seeds must be >= 0, got \[3, -1, 11\]"):
        steps(seeds=(3, -1, 11))
    with pytest.raises(ValueError, match="prefetch must be >= 0 steps, got -1"):
        steps(prefetch=-1)
    empty = TokenizedSet(np.zeros(0, np.int32), np.zeros(1, np.int64), np.zeros(0, np.int32), np.zeros(0, bool), 8)
    with pytest.raises(ValueError, match="cannot train on an empty set"):
        steps(sets=[sets[0], empty], seeds=[0, 1])
    # One a row, a micro-batch has 3 runs x 4 prompts / 2 rows; packed, the layout's 4.
    with pytest.raises(
        ValueError,
        match=r"rows must be distinct positions in a micro-batch of 6 rows; got \[1, 6\] "
        r"\(outside \[0, 6\): \[6\]\)",
    ):
        steps(rows=[1, 6])
    with pytest.raises(ValueError, match=r"rows must be distinct positions in a micro-batch of 6 rows; got \[1, 1\]$"):
        steps(rows=[1, 1])
    with pytest.raises(ValueError, match=r"rows must be distinct positions in a micro-batch of 4 rows; got \[\]$"):
        steps(layout=packed, rows=[])
    with pytest.raises(
        ValueError,
        match=r"rows must be distinct positions in a micro-batch of 4 rows; got \[-1\] "
        r"\(outside \[0, 4\): \[-1\]\)",
    ):
        steps(layout=packed, rows=[-1])
    with pytest.raises(ValueError, match=r"seq_len 64 is shorter than the longest training prompt \(70 tokens\)"):
        steps(seq_len=64)
