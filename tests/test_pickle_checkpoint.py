"""Pickled PyTorch checkpoints (the OPT repositories' only weights on `main`), read without torch and
without running anything from the file; which files a hub repository's listing makes the loader fetch.

The tiny OPT checkpoints here are written in the layouts the hub publishes:
one fp16 ``pytorch_model.bin`` (torch.save's zip format and its legacy one)
and shards with ``pytorch_model.bin.index.json``, named and split as
transformers' ``save_pretrained`` did before it wrote only safetensors.
"""

import collections
import contextlib
import copy
import json
import os
import pathlib
import pickle
import re
import subprocess
import sys
import zipfile

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from huggingface_hub import split_torch_state_dict_into_shards
from huggingface_hub.errors import OfflineModeIsEnabled
from jax.sharding import AxisType
from test_models_parity import LAYOUTS, assert_matches_hf, tiny_hf_model

from configs.models import LAPTOP_PUBLISHED_FILES, MODELS
from oodjax.models import load_pretrained, loading
from oodjax.models.hf_checkpoint import PickleFile, TensorFile, files_to_download
from oodjax.models.loading import hf_parameter_names, verify_checkpoint
from oodjax.models.torch_pickle import UnsafePickleError
from oodjax.usage_errors import MissingInputError, NotFetchedError

ROOT = pathlib.Path(__file__).resolve().parents[1]
VOCAB = 96  # LAYOUTS["opt_pre_ln"]'s


@pytest.fixture(scope="module")
def opt_fp16():
    """A tiny OPT in fp16, its state dict as the hub names it, and the fp32 model of the same fp16-rounded
    weights, whose logits a float32 load must match."""
    hf16 = tiny_hf_model(LAYOUTS["opt_pre_ln"]()).half()
    state = hf16.state_dict()
    # OPT's hub checkpoints name tensors without the "model." prefix and store the tied lm_head; the dict keeps
    # the _metadata that Module.state_dict attaches (pickled with a BUILD opcode), as torch.save wrote it.
    hub_state = collections.OrderedDict((name.removeprefix("model."), tensor) for name, tensor in state.items())
    hub_state._metadata = state._metadata
    return hf16.config, hub_state, copy.deepcopy(hf16).float()


def write_single(folder, config, state, *, legacy=False):
    folder.mkdir(exist_ok=True)
    config.to_json_file(folder / "config.json")
    torch.save(state, folder / "pytorch_model.bin", _use_new_zipfile_serialization=not legacy)
    return folder


def write_shards(folder, config, state):
    """Shards and index as transformers' save_pretrained(safe_serialization=False) wrote them."""
    folder.mkdir(exist_ok=True)
    config.to_json_file(folder / "config.json")
    split = split_torch_state_dict_into_shards(
        state, filename_pattern="pytorch_model{suffix}.bin", max_shard_size="20KB"
    )
    assert split.is_sharded
    for filename, names in split.filename_to_tensors.items():
        torch.save({name: state[name] for name in names}, folder / filename)
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    return folder


def fsdp_mesh():
    return jax.make_mesh((1, 4, 2), ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)


# ----------------------------------------------------------------------------- loading the published layouts


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_fp16_pytorch_model_bin_loads_with_transformers_logits(opt_fp16, tmp_path, legacy):
    config, state, reference = opt_fp16
    model = load_pretrained(write_single(tmp_path, config, state, legacy=legacy), dtype="float32")
    assert_matches_hf(model, reference, VOCAB)


def test_sharded_pickles_load_onto_a_mesh_each_block_its_slice(opt_fp16, tmp_path):
    """fsdp- and tensor-sharded blocks, each read from its rows, equal the stored tensors' slices."""
    config, state, reference = opt_fp16
    model = load_pretrained(write_shards(tmp_path, config, state), dtype="float32", mesh=fsdp_mesh())
    sharded = 0
    for path, variable in nnx.iter_graph(model):
        if not isinstance(variable, nnx.Param):
            continue
        names, transposed = hf_parameter_names(path, config.num_hidden_layers)
        expected = np.stack([state[name.removeprefix("model.")].float().numpy() for name in names])
        expected = np.swapaxes(expected, -1, -2) if transposed else expected
        expected = expected if len(names) > 1 else expected[0]  # stacked layers: [layers, ...]
        array = variable[...]
        sharded += not array.sharding.is_fully_replicated
        for shard in array.addressable_shards:
            np.testing.assert_array_equal(np.asarray(shard.data), expected[shard.index], err_msg=names[0])
    assert sharded > 0
    assert_matches_hf(model, reference, VOCAB)


def test_the_loader_needs_no_torch(opt_fp16, tmp_path):
    """In a process where importing torch fails, a pickled checkpoint verifies and loads."""
    config, state, _ = opt_fp16
    folder = write_shards(tmp_path, config, state)
    script = f"""
import sys
sys.modules["torch"] = None  # any `import torch` now raises ImportError
from oodjax.models import load_pretrained
from oodjax.models.loading import verify_checkpoint
print(verify_checkpoint({str(folder)!r}), load_pretrained({str(folder)!r}).config.model_type)
"""
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(len(state) - 1), "opt"]  # all but the tied lm_head


# ----------------------------------------------------------------------------- what is refused


def global_call(module, name, *args):
    """A protocol-2 pickle that calls ``module.name(*args)`` when loaded (as a __reduce__ payload does)."""
    arguments = pickle.dumps(args, protocol=2)[2:-1]  # the tuple's opcodes, without PROTO and STOP
    return b"\x80\x02c" + f"{module}\n{name}\n".encode() + arguments + b"R."


def zip_with_pickle(path, data_pkl):
    """A torch.save-style zip archive whose data.pkl is ``data_pkl``."""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")


class CreatesFile:
    """A __reduce__ payload: unpickling it creates ``path`` (calls ``open(path, "w")``)."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("layout", ["zip", "legacy"])
def test_a_reduce_payload_is_refused_before_it_runs(tmp_path, layout):
    marker = tmp_path / "created-by-the-payload"
    payload = pickle.dumps(collections.OrderedDict(weight=CreatesFile(marker)), protocol=2)
    pickle.loads(payload)  # the payload is live: plain pickle runs it ...
    assert marker.exists()
    marker.unlink()
    folder = tmp_path / "checkpoint"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LAYOUTS["opt_pre_ln"]().to_dict()))
    checkpoint = folder / "pytorch_model.bin"
    if layout == "zip":
        zip_with_pickle(checkpoint, payload)
    else:
        header = [0x1950A86A20F9469CFC6C, 1001, {"protocol_version": 1001, "little_endian": True}]
        checkpoint.write_bytes(b"".join(pickle.dumps(obj, protocol=2) for obj in header) + payload)
    message = rf"{re.escape(str(checkpoint))} names the global 'io.open', which a PyTorch state dict does not contain"
    with pytest.raises(UnsafePickleError, match=message):
        load_pretrained(folder)
    with pytest.raises(UnsafePickleError, match=message):
        verify_checkpoint(folder)
    assert not marker.exists()  # ... ours refused it first


@pytest.mark.parametrize(
    "module, name, args",
    [
        ("os", "system", ("touch {marker}",)),
        ("builtins", "eval", ("open({marker!r}, 'w')",)),
        ("builtins", "exec", ("open({marker!r}, 'w')",)),
        ("subprocess", "call", ("touch {marker}",)),
        ("torch", "load", ("{marker}",)),  # a torch global that is not a storage class
        ("torch._utils", "_rebuild_parameter", ("{marker}",)),
    ],
)
def test_any_other_global_is_refused_by_name(tmp_path, module, name, args):
    marker = tmp_path / "created-by-the-payload"
    args = tuple(arg.format(marker=str(marker)) for arg in args)
    checkpoint = tmp_path / "pytorch_model.bin"
    zip_with_pickle(checkpoint, global_call(module, name, *args))
    (tmp_path / "config.json").write_text(json.dumps(LAYOUTS["opt_pre_ln"]().to_dict()))
    with pytest.raises(UnsafePickleError, match=rf"names the global '{re.escape(module)}\.{name}'.*refusing"):
        load_pretrained(tmp_path)
    assert not marker.exists()


def test_a_payload_in_the_legacy_header_pickles_is_refused(tmp_path):
    """The legacy format's first pickle (the magic number) is unpickled with the same restrictions."""
    marker = tmp_path / "created-by-the-payload"
    checkpoint = tmp_path / "pytorch_model.bin"
    checkpoint.write_bytes(global_call("builtins", "open", str(marker), "w"))
    (tmp_path / "config.json").write_text(json.dumps(LAYOUTS["opt_pre_ln"]().to_dict()))
    with pytest.raises(UnsafePickleError, match=r"names the global 'builtins\.open'"):
        load_pretrained(tmp_path)
    assert not marker.exists()


def _cut(path, keep):
    path.write_bytes(path.read_bytes()[:keep])


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
@pytest.mark.parametrize("keep", [-100, 40, 0], ids=["last-100-bytes", "first-40-bytes", "empty"])
def test_a_truncated_bin_is_an_error_naming_the_file(opt_fp16, tmp_path, legacy, keep):
    config, state, _ = opt_fp16
    folder = write_single(tmp_path, config, state, legacy=legacy)
    checkpoint = folder / "pytorch_model.bin"
    _cut(checkpoint, keep)
    with pytest.raises(ValueError, match=rf"{re.escape(str(checkpoint))}.*truncated"):
        load_pretrained(folder)


def test_a_truncated_legacy_bin_names_the_tensors_cut_short(opt_fp16, tmp_path):
    """The last byte cut off lies in the storage written last. torch.save's legacy format orders storages by
    the string of their address (``sorted(serialized_storages)``), so which storage that is varies between
    processes: it may be the tied embedding, which two tensors share."""
    config, state, _ = opt_fp16
    folder = write_single(tmp_path, config, state, legacy=True)
    storage_of = {name: str(tensor.untyped_storage()._cdata) for name, tensor in state.items()}
    last = [name for name, key in storage_of.items() if key == max(storage_of.values())]
    users = f"tensor {last[0]!r}" if len(last) == 1 else f"tensors {last}"
    _cut(folder / "pytorch_model.bin", -1)
    with pytest.raises(
        ValueError,
        match=rf"pytorch_model.bin: the storage of {re.escape(users)} ends at byte \d+, but "
        r"the file has \d+ bytes: the file is truncated",
    ):
        load_pretrained(folder)


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_views_into_a_shared_storage_read_their_own_elements(tmp_path, legacy):
    """Tensors saved as views (tied weights, rows of a fused matrix) share one storage at their own offsets."""
    torch.manual_seed(0)
    fused = torch.randn(7, 3).half()
    tensors = {"fused": fused, "tied": fused, "rows": fused[2:5], "row": fused[6], "ids": torch.arange(4)}
    torch.save(tensors, tmp_path / "w.bin", _use_new_zipfile_serialization=not legacy)
    with contextlib.ExitStack() as stack:
        stored = PickleFile(tmp_path / "w.bin", stack)
        for name, tensor in tensors.items():
            read = stored.read(name, (slice(None),) * tensor.dim())
            assert read.dtype == tensor.numpy().dtype
            np.testing.assert_array_equal(read, tensor.numpy(), err_msg=name)


def test_non_contiguous_tensors_are_refused_naming_them(tmp_path):
    torch.save({"decoder.fc.weight": torch.randn(3, 4).t(), "decoder.fc.bias": torch.zeros(4)}, tmp_path / "w.bin")
    with pytest.raises(ValueError, match=r"'decoder.fc.weight' in .*w.bin has strides \(1, 4\), not the row-major"):
        _open(tmp_path / "w.bin")


def test_compressed_storages_are_refused_naming_the_tensor(tmp_path):
    """torch.save stores storages uncompressed; a re-zipped (deflated) file cannot be read row by row."""
    torch.save({"decoder.fc.weight": torch.randn(3, 4)}, tmp_path / "stored.bin")
    with zipfile.ZipFile(tmp_path / "stored.bin") as stored, zipfile.ZipFile(tmp_path / "w.bin", "w") as deflated:
        for info in stored.infolist():
            deflated.writestr(info.filename, stored.read(info), compress_type=zipfile.ZIP_DEFLATED)
    with pytest.raises(ValueError, match=r"w.bin stores .*data/0 \(tensor 'decoder.fc.weight'\) compressed"):
        _open(tmp_path / "w.bin")


def test_dtypes_torch_saves_another_way_are_refused(tmp_path):
    """uint16 and float8 tensors are saved through torch.storage.UntypedStorage and _rebuild_tensor_v3, which a
    state dict of the study's weights never names: refused, as every global off the list."""
    torch.save({"w": torch.zeros(2, dtype=torch.float8_e4m3fn)}, tmp_path / "w.bin")
    with pytest.raises(UnsafePickleError, match=r"names the global 'torch._utils._rebuild_tensor_v3'"):
        _open(tmp_path / "w.bin")


def _open(path):
    with contextlib.ExitStack() as stack:
        return PickleFile(path, stack).tensors


# ----------------------------------------------------------------------------- verifying from headers alone


def test_verify_checkpoint_reads_no_tensor_data(opt_fp16, tmp_path, monkeypatch):
    config, state, _ = opt_fp16
    folder = write_shards(tmp_path, config, state)

    def no_reads(self, name, index):
        raise AssertionError(f"verify_checkpoint read tensor {name!r}")

    monkeypatch.setattr(TensorFile, "read", no_reads)
    assert verify_checkpoint(folder) == len(state) - 1  # every tensor but the tied lm_head, which HF ignores


def test_verify_checkpoint_names_a_misshapen_tensor(opt_fp16, tmp_path):
    config, state, _ = opt_fp16
    wrong = collections.OrderedDict(state, **{"decoder.layers.0.fc1.weight": torch.zeros(32, 64).half()})
    folder = write_single(tmp_path, config, wrong, legacy=True)
    match = r"'decoder.layers.0.fc1.weight' in pytorch_model.bin has shape \(32, 64\), expected \(64, 32\)"
    with pytest.raises(ValueError, match=match):
        verify_checkpoint(folder)


# ----------------------------------------------------------------------------- what a repository's listing fetches

# Besides its weights, what a repository's main branch usually holds.
OTHER_FILES = (
    "config.json",
    ".gitattributes",
    "README.md",
    "generation_config.json",
    "merges.txt",
    "vocab.json",
    "special_tokens_map.json",
    "tokenizer_config.json",
    "tokenizer.json",
    "LICENSE.md",
)

PUBLISHED = {resources.hub_id: resources.published_files for resources in MODELS.values()} | LAPTOP_PUBLISHED_FILES


@pytest.mark.parametrize("hub_id", sorted(hub_id for hub_id, files in PUBLISHED.items() if files))
def test_each_repository_fetches_one_format_and_all_of_it(hub_id):
    published = PUBLISHED[hub_id]
    chosen = files_to_download([*OTHER_FILES, *published])
    assert chosen[0] == "config.json" and set(chosen[1:]) <= set(published)
    kind = "pytorch_model" if hub_id.startswith("facebook/opt-") else "model"
    extension = ".bin" if kind == "pytorch_model" else ".safetensors"
    # Every published file of the chosen format, and nothing else: no flax, TF or second format.
    assert set(chosen[1:]) == {f for f in published if f.startswith(kind) and (f.endswith(extension) or ".index" in f)}
    assert not any(f.startswith(("flax_model", "tf_model")) for f in chosen)


def test_the_big_opt_checkpoints_fetch_their_pickle_shards_and_index_the_small_ones_one_bin():
    shards = {"facebook/opt-13b": 3, "facebook/opt-30b": 7}
    for hub_id, count in shards.items():
        expected = [f"pytorch_model-{i:05d}-of-{count:05d}.bin" for i in range(1, count + 1)]
        assert files_to_download([*OTHER_FILES, *PUBLISHED[hub_id]]) == [
            "config.json",
            "pytorch_model.bin.index.json",
            *expected,
        ]
    for hub_id in ("facebook/opt-2.7b", "facebook/opt-125m"):
        assert files_to_download([*OTHER_FILES, *PUBLISHED[hub_id]]) == ["config.json", "pytorch_model.bin"]


def test_the_repositories_without_a_listing_are_known():
    """Where no listing of `main` was found the table says so with an empty tuple (configs/models.py)."""
    without = {hub_id for hub_id, files in PUBLISHED.items() if not files}
    assert without == {"allenai/OLMo-2-0325-32B", "HuggingFaceTB/SmolLM3-3B-Base"}


def test_safetensors_are_preferred_and_a_listing_without_weights_is_named():
    both = [
        "config.json",
        "model.safetensors",
        "pytorch_model.bin",
        "pytorch_model.bin.index.json",
        "pytorch_model-00001-of-00001.bin",
    ]
    assert files_to_download(both) == ["config.json", "model.safetensors"]
    assert files_to_download([*both, "model.safetensors.index.json", "model-00001-of-00001.safetensors"]) == [
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00001.safetensors",
    ]
    flax_and_tf = ["config.json", "flax_model.msgpack", "tf_model.h5", "onnx/model.onnx"]
    with pytest.raises(FileNotFoundError, match=r"\['config.json', 'flax_model.msgpack', .*\] hold no weights"):
        files_to_download(flax_and_tf)
    with pytest.raises(FileNotFoundError, match=r"include no config.json"):
        files_to_download(["model.safetensors"])


# ----------------------------------------------------------------------------- hub ids: the huggingface_hub seam


class FakeHub:
    """HfApi's listing of a repository, or the exception an unreachable hub raises."""

    listing: list[str] | Exception = []

    def list_repo_files(self, repo_id):
        if isinstance(self.listing, Exception):
            raise self.listing
        return self.listing


def test_a_hub_id_downloads_exactly_the_chosen_files(opt_fp16, tmp_path, monkeypatch):
    config, state, _ = opt_fp16
    snapshot = write_shards(tmp_path / "snapshot", config, state)
    downloads = []

    def snapshot_download(repo_id, *, allow_patterns):
        downloads.append((repo_id, allow_patterns))
        return str(snapshot)

    monkeypatch.setattr(loading, "is_offline_mode", lambda: False)
    monkeypatch.setattr(FakeHub, "listing", [*OTHER_FILES, *PUBLISHED["facebook/opt-30b"]])
    monkeypatch.setattr(loading, "HfApi", FakeHub)
    monkeypatch.setattr(loading, "snapshot_download", snapshot_download)
    assert loading._resolve("facebook/opt-30b") == snapshot
    shards = [f"pytorch_model-{i:05d}-of-00007.bin" for i in range(1, 8)]
    assert downloads == [("facebook/opt-30b", ["config.json", "pytorch_model.bin.index.json", *shards])]


def test_a_hub_repository_without_readable_weights_is_named(monkeypatch):
    monkeypatch.setattr(loading, "is_offline_mode", lambda: False)
    monkeypatch.setattr(FakeHub, "listing", ["config.json", "flax_model.msgpack"])
    monkeypatch.setattr(loading, "HfApi", FakeHub)
    with pytest.raises(MissingInputError, match=r"hub repository 'someone/flax-only': .* hold no weights"):
        loading._resolve("someone/flax-only")


def _cache(monkeypatch, directory):
    """try_to_load_from_cache finding config.json in ``directory`` (None: the cache has no copy)."""
    found = None if directory is None else str(directory / "config.json")
    monkeypatch.setattr(loading, "try_to_load_from_cache", lambda repo_id, filename: found)


def test_offline_a_hub_id_missing_from_the_cache_is_not_fetched(monkeypatch):
    _cache(monkeypatch, None)
    with pytest.raises(NotFetchedError, match=r"^'facebook/opt-30b' is not a local folder, and with the hub out of"):
        load_pretrained("facebook/opt-30b")


def test_offline_a_cached_copy_missing_shards_is_not_fetched(opt_fp16, tmp_path, monkeypatch):
    config, state, _ = opt_fp16
    snapshot = write_shards(tmp_path, config, state)
    (snapshot / "pytorch_model-00002-of-00003.bin").unlink()
    _cache(monkeypatch, snapshot)
    missing = r"lists the shards \['pytorch_model-00002-of-00003.bin'\], which are not in"
    with pytest.raises(NotFetchedError, match=rf"'facebook/opt-30b': its copy in the Hugging Face cache .*{missing}"):
        load_pretrained("facebook/opt-30b")
    (snapshot / "pytorch_model.bin.index.json").unlink()
    for shard in snapshot.glob("pytorch_model-*.bin"):
        shard.unlink()
    with pytest.raises(NotFetchedError, match=r"incomplete \(the files \['config.json'\] hold no weights"):
        load_pretrained("facebook/opt-30b")


def test_an_unreachable_hub_falls_back_to_the_cache(opt_fp16, tmp_path, monkeypatch):
    config, state, _ = opt_fp16
    snapshot = write_single(tmp_path, config, state)
    monkeypatch.setattr(loading, "is_offline_mode", lambda: False)
    monkeypatch.setattr(FakeHub, "listing", OfflineModeIsEnabled("no network"))
    monkeypatch.setattr(loading, "HfApi", FakeHub)
    _cache(monkeypatch, snapshot)
    assert loading._resolve("facebook/opt-125m") == snapshot


def _damage_zip_header(path, damage):
    """Rewrite the local zip header of the first storage member (data/0) with ``damage``."""
    with zipfile.ZipFile(path) as archive:
        offset = next(info.header_offset for info in archive.infolist() if info.filename.endswith("/data/0"))
    data = bytearray(path.read_bytes())
    damage(data, offset)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "damage, message",
    [
        (
            lambda data, at: data.__setitem__(slice(at, at + 4), b"XXXX"),
            r"w.bin has a corrupt zip header for \w+/data/0 \(tensor 'decoder.fc.weight'\)",
        ),
        # An extra field longer than the file puts the data past its end.
        (
            lambda data, at: data.__setitem__(slice(at + 28, at + 30), b"\xff\xff"),
            r"w.bin: the storage of tensor 'decoder.fc.weight' ends at byte \d+, but the file has \d+ bytes",
        ),
    ],
    ids=["signature", "extra-length"],
)
def test_a_corrupt_zip_member_header_is_an_error_naming_the_tensor(tmp_path, damage, message):
    torch.save({"decoder.fc.weight": torch.randn(3, 4)}, tmp_path / "w.bin")
    _damage_zip_header(tmp_path / "w.bin", damage)
    with pytest.raises(ValueError, match=message):
        _open(tmp_path / "w.bin")


@pytest.mark.parametrize(
    "global_name, state",
    [
        (b"torch\nHalfStorage\n", {"dtype": "float32"}),  # would make every later HalfStorage float32
        (b"torch._utils\n_rebuild_tensor_v2\n", (None, {"__call__": "x"})),  # setattr on the stand-in
    ],
    ids=["storage-class", "rebuild-function"],
)
def test_a_pickle_may_not_set_the_state_of_a_stand_in(tmp_path, global_name, state):
    """BUILD calls the object's __setstate__ (or writes its attributes): the stand-ins are shared by every load
    in the process, so a pickle that tries to change one is refused, and the next load reads as before."""
    build = b"\x80\x02c" + global_name + pickle.dumps(state, protocol=2)[2:-1] + b"b."  # GLOBAL, state, BUILD
    zip_with_pickle(tmp_path / "w.bin", build)
    with pytest.raises(UnsafePickleError, match=r"w.bin sets the state of a \w+, which a PyTorch state dict does"):
        _open(tmp_path / "w.bin")
    torch.save({"w": torch.ones(2, 3).half()}, tmp_path / "ok.bin")
    with contextlib.ExitStack() as stack:
        np.testing.assert_array_equal(PickleFile(tmp_path / "ok.bin", stack).read("w", (slice(None),)), np.ones((2, 3)))
