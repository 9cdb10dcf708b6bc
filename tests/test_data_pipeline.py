"""Few-shot sampling, stratified subsets, and the grain evaluation and training pipelines."""

import collections
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
    TokenizedSet,
    balance_rows,
    balanced_batch,
    bucket_lengths,
    epoch_permutation,
    eval_batches,
    eval_row_lengths,
    few_shot,
    load_testset,
    pair_rows,
    prompt_lengths,
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


def check_packed_rows(batch, tokenized):
    """Each row holds its prompts one after another, each under its own id, answer at its last token."""
    rows, width = batch["input_ids"].shape
    for r in range(rows):
        slots = np.flatnonzero(batch["valid"][r])
        assert slots.tolist() == list(range(len(slots)))  # prompts fill the first slots
        assert (batch["index"][r, len(slots):] == -1).all()
        if not len(slots):
            assert batch["segment_ids"][r].tolist() == [1] + [0] * (width - 1)
            continue
        start = 0
        for slot in slots:
            prompt = tokenized.prompt(batch["index"][r, slot])
            stop = start + len(prompt)
            assert batch["input_ids"][r, start:stop].tolist() == prompt.tolist()
            assert (batch["segment_ids"][r, start:stop] == slot + 1).all()
            assert batch["answer_pos"][r, slot] == stop - 1
            assert batch["label"][r, slot] == tokenized.labels[batch["index"][r, slot]]
            start = stop
        assert not batch["input_ids"][r, start:].any() and not batch["segment_ids"][r, start:].any()


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
        assert {b[k].dtype for k in ("input_ids", "segment_ids", "answer_pos", "label", "index")} == {np.dtype(np.int32)}
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
        return collections.Counter(b["input_ids"].shape for b in eval_batches(tokenized, row_lengths=(200, 256), **sizes))

    assert shapes(batch_tokens=100, row_multiple=4) == {(4, 200): 1, (4, 256): 2}  # under a row: row_multiple rows
    assert shapes(batch_tokens=30_000) == {(3, 200): 1, (5, 256): 1}  # one batch a length, no empty row


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
    assert {b["input_ids"].shape for b in batches} == {(4, 80)}  # 70 tokens -> bucket 80
    epochs = [np.concatenate([b["index"] for b in batches[e : e + 2]]) for e in (0, 2, 4)]
    assert all(sorted(e.tolist()) == list(range(8)) for e in epochs)
    assert len({tuple(e) for e in epochs}) == 3 and tuple(epochs[0]) != tuple(range(8))
    for e, epoch in enumerate(epochs):  # each epoch's examples are that epoch's permutation, batch by batch
        assert [sorted(epoch[:4].tolist()), sorted(epoch[4:].tolist())] == [
            sorted(epoch_permutation(0, 8, e)[:4].tolist()), sorted(epoch_permutation(0, 8, e)[4:].tolist())
        ]
    for b in batches:
        assert b["valid"].all()
        assert (np.diff(b["segment_ids"].sum(-1)) >= 0).all()  # shortest first, for length-grouped micro-batches
        check_batch_rows(b, tokenized)


def test_balance_rows_spreads_prompts_over_the_first_micro_batch():
    # 2 micro-batches of 3 rows of at most 40 tokens and 2 prompts. Longest first, each to the least-filled
    # row of the first micro-batch with room: 30 | 25 | 20, then 12 -> row 2 (32), 10 -> row 1 (35),
    # 9 -> row 0 (39); 8 fits no row of the first (full of prompts), so the second micro-batch takes it.
    lengths = np.array([9, 30, 12, 25, 8, 20, 10])
    rows = balance_rows(lengths, num_rows=6, micro_batches=2, row_length=40, prompts_per_row=2)
    assert rows == [[1, 0], [3, 6], [5, 2], [4], [], []]
    # With more slots, 8 joins the least-filled row of the first micro-batch, row 2 (32 + 8 = 40).
    assert balance_rows(lengths, num_rows=6, micro_batches=2, row_length=40, prompts_per_row=3)[2] == [5, 2, 4]
    with pytest.raises(ValueError, match=r"7 prompts of 114 tokens \(longest 30\) do not fit 2 rows of 40 tokens "
                                         r"and 2 prompt slots; at prompt 5 \(20 tokens\)"):
        balance_rows(lengths, num_rows=2, micro_batches=1, row_length=40, prompts_per_row=2)
    with pytest.raises(ValueError, match="6 rows cannot be split into 4 micro-batches of equal size"):
        balance_rows(lengths, num_rows=6, micro_batches=4, row_length=40, prompts_per_row=2)


def test_packed_training_stream_holds_the_same_batches_balanced():
    """Packed (2 micro-batches of 4 rows, e.g. a mesh of 4 devices): the same examples as one a row, every
    micro-batch's rows holding what ``balance_rows`` gives them."""
    lengths = [5, 70, 9, 12, 33, 8, 20, 41]
    tokenized = toy_tokenized(lengths, max_length=128)
    plain = train_batches(tokenized, batch_size=8, seed=0)
    packed = train_batches(tokenized, batch_size=8, seed=0, pack=True, grad_accum=2)
    for _ in range(4):
        one_a_row, b = next(plain), next(packed)
        assert b["input_ids"].shape == (8, 80) and b["answer_pos"].shape == (8, 8)  # 80 // 5 slots, at most 8
        examples = one_a_row["index"]
        assert sorted(b["index"][b["valid"]].tolist()) == sorted(examples.tolist())  # same examples
        rows = balance_rows(tokenized.lengths[examples], num_rows=8, micro_batches=2, row_length=80, prompts_per_row=8)
        assert [sorted(row[row >= 0].tolist()) for row in b["index"]] == [sorted(examples[r].tolist()) for r in rows]
        check_packed_rows(b, tokenized)
    # 198 tokens over 4 rows of 80: the first micro-batch holds them all, its fullest row 70 (+ nothing).
    assert not b["valid"][4:].any() and (b["segment_ids"][:4] != 0).sum(-1).max() == 70


def test_balanced_batch_matches_its_rows():
    tokenized = toy_tokenized([9, 30, 12, 25, 8, 20, 10], max_length=64)
    batch = balanced_batch(tokenized, np.arange(7)[::-1], 6, 40, 2, micro_batches=2)
    # The examples in reverse order: the same rows as test_balance_rows_..., of examples 6 - i.
    assert batch["index"].tolist() == [[1, 0], [3, 6], [5, 2], [4, -1], [-1, -1], [-1, -1]]
    check_packed_rows(batch, tokenized)


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
    single = train_batches(tokenized, batch_size=8, seed=7, pack=pack, grad_accum=2)
    positions = ([0, 1, 4, 5], [2, 3, 6, 7])  # e.g. grad_accum 2, each process half of each micro-batch
    shards = [train_batches(tokenized, batch_size=8, seed=7, pack=pack, grad_accum=2, rows=rows) for rows in positions]
    for _ in range(5):  # 12 examples in batches of 8: crosses epochs
        whole = next(single)
        parts = [next(s) for s in shards]
        for rows, part in zip(positions, parts):
            for key, value in part.items():
                np.testing.assert_array_equal(value, whole[key][rows])


class RecordingSet(TokenizedSet):
    """A TokenizedSet that records the thread that reads each prompt, i.e. builds each batch."""

    def prompt(self, i):
        THREADS_READING.append(threading.current_thread().name)
        return super().prompt(i)


THREADS_READING = []


def test_batches_are_built_ahead_in_a_thread_and_the_state_counts_those_handed_out():
    lengths = [5, 70, 9, 12, 33, 8, 20, 41, 3, 2]
    tokenized = RecordingSet(**vars(toy_tokenized(lengths, max_length=128)))
    THREADS_READING.clear()
    stream = train_batches(tokenized, batch_size=4, seed=42, prefetch=2)
    handed_out = [as_lists(next(stream)) for _ in range(3)]
    deadline = time.monotonic() + 10
    while len(THREADS_READING) < 5 * 4 and time.monotonic() < deadline:  # 3 handed out and 2 ahead, 4 prompts each
        time.sleep(0.01)
    assert len(THREADS_READING) == 5 * 4 and threading.current_thread().name not in THREADS_READING
    state = json.loads(json.dumps(stream.get_state()))
    assert state == {"next_index": 3}  # the batches built ahead are not consumed
    after = [as_lists(next(stream)) for _ in range(4)]
    unprefetched = train_batches(toy_tokenized(lengths, max_length=128), batch_size=4, seed=42, prefetch=0)
    assert [as_lists(next(unprefetched)) for _ in range(7)] == handed_out + after
    resumed = train_batches(toy_tokenized(lengths, max_length=128), batch_size=4, seed=42)
    resumed.set_state(state)
    assert [as_lists(next(resumed)) for _ in range(4)] == after
    stream.set_state(state)  # rewound, what it had built ahead is dropped
    assert [as_lists(next(stream)) for _ in range(4)] == after


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
    with pytest.raises(ValueError, match="grad_accum must be a positive divisor of batch_size 4, got 3"):
        train_batches(tokenized, batch_size=4, seed=0, pack=True, grad_accum=3)
    with pytest.raises(ValueError, match="the training stream's seed must be >= 0, got -1"):
        train_batches(tokenized, batch_size=4, seed=-1)
