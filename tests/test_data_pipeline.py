"""Few-shot sampling, stratified subsets, and the grain evaluation and training pipelines."""

import collections
import json
import os
import pathlib
import subprocess
import sys

import datasets
import numpy as np
import pytest

from oodjax.data import (
    TokenizedSet,
    bucket_lengths,
    eval_batches,
    few_shot,
    load_testset,
    pack_rows,
    packed_batch,
    stratified_subset,
    train_batches,
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
    return datasets.Dataset.from_dict({"premise": ["p"] * len(labels), "hypothesis": ["h"] * len(labels), "label": labels})


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
    assert set(few_shot(mnli_pool, 64, seed=42)["hypothesis"][:]) != set(few_shot(mnli_pool, 64, seed=99)["hypothesis"][:])


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
    with pytest.raises(ValueError, match=r"few-shot n=8 needs 4 examples of label 1 but the pool \(13 rows\) has only 3"):
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
    assert bucket_lengths(512) == (64, 128, 256, 512)
    assert bucket_lengths(300) == (64, 128, 256, 300)
    assert bucket_lengths(50) == (50,)
    assert bucket_lengths(300, [100, 32, 1000]) == (32, 100, 300)
    with pytest.raises(ValueError, match=r"bucket lengths must be positive, got \[0, 64\]"):
        bucket_lengths(128, [0, 64])


def check_batch_rows(batch, tokenized):
    """Every valid row holds its prompt, right-padded, with the answer at its last token."""
    for r in range(len(batch["index"])):
        i = batch["index"][r]
        if not batch["valid"][r]:
            assert i == -1 and batch["attention_mask"][r].tolist() == [1] + [0] * (batch["input_ids"].shape[1] - 1)
            continue
        prompt = tokenized.prompt(i)
        n = len(prompt)
        assert batch["input_ids"][r, :n].tolist() == prompt.tolist()
        assert not batch["input_ids"][r, n:].any()
        assert batch["attention_mask"][r].tolist() == [1] * n + [0] * (batch["input_ids"].shape[1] - n)
        assert batch["answer_pos"][r] == n - 1
        assert batch["label"][r] == tokenized.labels[i]


def check_packed_rows(batch, tokenized):
    """Each row holds its prompts one after another, each under its own id, answer at its last token."""
    rows, width = batch["input_ids"].shape
    for r in range(rows):
        slots = np.flatnonzero(batch["valid"][r])
        assert slots.tolist() == list(range(len(slots)))  # prompts fill the first slots
        assert (batch["index"][r, len(slots):] == -1).all()
        if not len(slots):
            assert batch["attention_mask"][r].tolist() == [1] + [0] * (width - 1)
            continue
        start = 0
        for slot in slots:
            prompt = tokenized.prompt(batch["index"][r, slot])
            stop = start + len(prompt)
            assert batch["input_ids"][r, start:stop].tolist() == prompt.tolist()
            assert (batch["attention_mask"][r, start:stop] == slot + 1).all()
            assert batch["answer_pos"][r, slot] == stop - 1
            assert batch["label"][r, slot] == tokenized.labels[batch["index"][r, slot]]
            start = stop
        assert not batch["input_ids"][r, start:].any() and not batch["attention_mask"][r, start:].any()


def test_eval_batches_pack_every_example_once_into_the_fewest_rows():
    lengths = [3, 64, 65, 300, 128, 10, 129, 200, 7, 64, 1]  # 971 tokens: at least 4 rows of 300
    tokenized = toy_tokenized(lengths)
    batches = list(eval_batches(tokenized, batch_tokens=600))
    seen = np.concatenate([b["index"][b["valid"]] for b in batches])
    assert sorted(seen.tolist()) == list(range(len(lengths)))
    # 600 tokens = 2 rows a batch; best fit packs 4 rows, the most full holding 6 prompts.
    assert [b["input_ids"].shape for b in batches] == [(2, 300)] * 2
    assert {b["answer_pos"].shape for b in batches} == {(2, 6)}
    for b in batches:
        assert {b[k].dtype for k in ("input_ids", "attention_mask", "answer_pos", "label", "index")} == {np.dtype(np.int32)}
        assert b["valid"].dtype == bool
        check_packed_rows(b, tokenized)


def test_pack_rows_best_fit_decreasing():
    # Longest first, each into the fullest row it fits: 300 | 200 65 10 7 3 1 | 129 128 | 64 64.
    rows = pack_rows(np.array([3, 64, 65, 300, 128, 10, 129, 200, 7, 64, 1]), 300)
    assert rows == [[3], [7, 2, 5, 8, 0, 10], [6, 4], [1, 9]]
    assert pack_rows(np.array([], dtype=int), 8) == []
    with pytest.raises(ValueError, match=r"prompts \[1\] are longer than the row length 8"):
        pack_rows(np.array([8, 9]), 8)


def test_eval_batches_on_a_real_testset(gpt2_tokenizer_dir, hf_data_dir, tmp_path):
    from transformers import AutoTokenizer

    from oodjax.data import tokenize_testset

    tokenizer = AutoTokenizer.from_pretrained(gpt2_tokenizer_dir)
    tokenized = tokenize_testset(load_testset("anli", data_dir=hf_data_dir), tokenizer, max_length=128, cache_dir=tmp_path)
    batches = list(eval_batches(tokenized, batch_tokens=2048, row_multiple=8))
    seen = np.concatenate([b["index"][b["valid"]] for b in batches])
    assert sorted(seen.tolist()) == list(range(len(tokenized)))
    assert len({b["input_ids"].shape for b in batches}) == 1
    rows = sum(int((b["valid"].any(axis=1)).sum()) for b in batches)
    # No packing needs fewer rows than the tokens fill, nor than the prompts longer than half a row.
    fewest = max(-(-tokenized.lengths.sum() // 128), int((tokenized.lengths > 64).sum()))
    print(f"anli r3, {len(tokenized)} prompts: {rows} rows, at least {fewest} needed; "
          f"{len(batches)} batches of {batches[0]['input_ids'].shape}")
    assert rows <= 1.03 * fewest
    for b in batches:
        check_packed_rows(b, tokenized)


def test_batch_size_in_tokens():
    tokenized = toy_tokenized([100] * 15 + [250] * 5)  # 5 + 5 rows of 300 (100+100+100, 250)
    shapes = collections.Counter(b["input_ids"].shape for b in eval_batches(tokenized, batch_tokens=1200, row_multiple=2))
    # 1200 // 300 = 4 rows at most: 10 rows -> 3 batches, evened to 4 rows (a multiple of 2).
    assert shapes == {(4, 300): 3}
    shapes = collections.Counter(b["input_ids"].shape for b in eval_batches(tokenized, batch_tokens=300, row_multiple=4))
    # 300 // 300 = 1 row -> at least row_multiple = 4.
    assert shapes == {(4, 300): 3}
    shapes = collections.Counter(b["input_ids"].shape for b in eval_batches(tokenized, batch_tokens=30_000))
    assert shapes == {(10, 300): 1}  # one batch, no empty row


def test_eval_batch_size_errors():
    tokenized = toy_tokenized([5, 6])
    with pytest.raises(ValueError, match="must be positive, got 0 and 1"):
        eval_batches(tokenized, batch_tokens=0)
    with pytest.raises(ValueError, match="lanes is empty"):
        eval_batches(tokenized, batch_tokens=64, lanes=[])


# ---- training stream -------------------------------------------------------------


def as_lists(batch):
    return {k: v.tolist() for k, v in batch.items()}


def test_training_stream_epochs_are_shuffled_permutations():
    tokenized = toy_tokenized([5, 70, 9, 12, 33, 8, 20, 41], max_length=128)
    stream = train_batches(tokenized, batch_size=4, seed=0)
    batches = [next(stream) for _ in range(6)]
    assert {b["input_ids"].shape for b in batches} == {(4, 128)}  # 70 tokens -> bucket 128
    epochs = [np.concatenate([b["index"] for b in batches[e : e + 2]]) for e in (0, 2, 4)]
    assert all(sorted(e.tolist()) == list(range(8)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3 and tuple(epochs[0]) != tuple(range(8))
    for b in batches:
        assert b["valid"].all()
        assert (np.diff(b["attention_mask"].sum(-1)) >= 0).all()  # shortest first, for length-grouped micro-batches
        check_batch_rows(b, tokenized)


def test_packed_training_stream_holds_the_same_batches_packed():
    tokenized = toy_tokenized([5, 70, 9, 12, 33, 8, 20, 41], max_length=128)
    plain, packed = (train_batches(tokenized, batch_size=4, seed=0, pack=pack) for pack in (False, True))
    for _ in range(6):
        one_a_row, b = next(plain), next(packed)
        assert b["input_ids"].shape == (4, 128) and b["answer_pos"].shape == (4, 4)  # 128 // 5 slots, at most 4
        assert sorted(b["index"][b["valid"]].tolist()) == sorted(one_a_row["index"].tolist())  # same examples
        used = (b["attention_mask"] != 0).sum(-1) * b["valid"].any(-1)
        assert (np.diff(used) <= 0).all()  # fullest rows first, empty rows last: trailing micro-batches skip
        check_packed_rows(b, tokenized)


def test_packed_batch_needs_room():
    tokenized = toy_tokenized([60, 60, 60, 10, 10], max_length=64)
    batch = packed_batch(tokenized, np.arange(5), 4, 64, 2)
    assert batch["index"].tolist() == [[0, -1], [1, -1], [2, -1], [3, 4]]
    with pytest.raises(ValueError, match=r"5 prompts need 4 rows of 64 tokens with up to 2 prompts each; the batch "
                                         r"has 3 rows of 2 prompt slots"):
        packed_batch(tokenized, np.arange(5), 3, 64, 2)
    with pytest.raises(ValueError, match=r"the batch has 4 rows of 1 prompt slots"):
        packed_batch(tokenized, np.arange(5), 4, 64, 1)


def test_training_stream_is_seeded():
    tokenized = toy_tokenized([5] * 32, max_length=64)
    first = [next(train_batches(tokenized, batch_size=8, seed=s))["index"].tolist() for s in (0, 0, 1)]
    assert first[0] == first[1] and first[0] != first[2]


def test_training_stream_state_round_trips():
    tokenized = toy_tokenized([5, 70, 9, 12, 33, 8, 20, 41, 3, 2], max_length=128)
    stream = train_batches(tokenized, batch_size=4, seed=42)
    for _ in range(7):
        next(stream)
    state = json.loads(json.dumps(stream.get_state()))  # survives a JSON checkpoint
    expected = [as_lists(next(stream)) for _ in range(5)]
    resumed = train_batches(tokenized, batch_size=4, seed=42)
    resumed.set_state(state)
    assert [as_lists(next(resumed)) for _ in range(5)] == expected


@pytest.mark.parametrize("pack", [False, True])
def test_rows_take_positions_of_each_global_batch(pack):
    """Processes that hold complementary positions together see exactly the single-process batches."""
    tokenized = toy_tokenized([40, 5, 30, 20, 12, 50, 7, 33, 25, 9, 60, 14], max_length=64)
    single = train_batches(tokenized, batch_size=8, seed=7, pack=pack)
    positions = ([0, 1, 4, 5], [2, 3, 6, 7])  # e.g. grad_accum 2, each process half of each micro-batch
    shards = [train_batches(tokenized, batch_size=8, seed=7, pack=pack, rows=rows) for rows in positions]
    for _ in range(5):  # 12 examples in batches of 8: crosses epochs
        whole = next(single)
        parts = [next(s) for s in shards]
        for rows, part in zip(positions, parts):
            for key, value in part.items():
                np.testing.assert_array_equal(value, whole[key][rows])


def test_training_stream_errors():
    tokenized = toy_tokenized([5, 70, 9], max_length=128)
    with pytest.raises(ValueError, match="batch_size must be positive, got 0"):
        train_batches(tokenized, batch_size=0, seed=0)
    with pytest.raises(ValueError, match=r"rows must be distinct positions in a batch of 4; got \[1, 4\] "
                                         r"\(outside \[0, 4\): \[4\]\)"):
        train_batches(tokenized, batch_size=4, seed=0, rows=[1, 4])
    with pytest.raises(ValueError, match=r"rows must be distinct positions in a batch of 4; got \[1, 1\]$"):
        train_batches(tokenized, batch_size=4, seed=0, rows=[1, 1])
    with pytest.raises(ValueError, match=r"seq_len 64 is shorter than the longest training prompt \(70 tokens\)"):
        train_batches(tokenized, batch_size=4, seed=0, seq_len=64)
