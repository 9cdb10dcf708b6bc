"""The real train and eval steps lower for NVIDIA GPUs and TPUs on this CPU host, with the fused kernels in.

The preflight's steps (``launch.compiled.abstract_steps``: the real step factories, geometry, batch
shapes and mesh on 8 fake devices, the model cut to 2 layers) of three configs are lowered (not compiled)
with ``lowering_platforms=("cuda",)`` and ``("tpu",)`` inside ``flash_attention.target_platform``: OPT-2.7B
(head size 80), SmolLM3-3B (grouped-query heads, 16 over 4, and NoPE layers) and OLMo-2 32B (its fsdp mesh,
grouped-query heads). For CUDA the lowered text must hold cuDNN's fused attention (``__cudnn$fmha``) forward
and backward custom calls; for TPU splash's Mosaic kernels (``tpu_custom_call``); and neither may hold
XLA's attention (a float32 [.., T, T] softmax of the scores). Shape, block and version errors of the kernels
then show without an accelerator.

JAX checks the local cuDNN version and GPU as it traces cuDNN's path; this host has neither, so the test
stands in an H100's (cuDNN 9.10, compute capability 9.0) for the functions JAX calls to read them
(``jax._src.cudnn.fused_attention_stablehlo.check_cudnn_version`` / ``check_compute_capability``).
"""

import re
import time

import jax
import pytest

from launch import compiled
from launch.config_files import load_config
from oodjax.config_read import read
from oodjax.models import flash_attention
from tests.conftest import ROOT

CONFIGS = {"opt2.7": "opt2.7_mnli.py", "smol3": "smol3_mnli.py", "olmo32": "olmo32_mnli.py"}
KERNEL_CALLS = {
    "cuda": (r"__cudnn\$fmhaScaleBiasSoftmax\b", r"__cudnn\$fmhaScaleBiasSoftmaxBackward\b"),
    "tpu": (r"tpu_custom_call",),
}
# XLA's attention: a softmax of float32 scores [..., T, T] (a reduce-max over the last axis of a 4- or 5-d
# tensor of scores); the fused paths compute none.
XLA_SCORES = re.compile(r"stablehlo\.reduce.*maximum.*tensor<\d+x\d+x\d+x(\d+x)?(\d+)x(\d+)xf32>")


@pytest.fixture
def on_h100(monkeypatch):
    """JAX's cuDNN checks read an H100's cuDNN and compute capability."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn_attention

    monkeypatch.setattr(cudnn_attention, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(
        cudnn_attention, "check_compute_capability", lambda c: (9, 0) >= tuple(int(x) for x in c.split("."))
    )
    monkeypatch.setattr(cudnn_attention, "is_cuda_compute_capability_equal", lambda c: c == "9.0")


@pytest.fixture(scope="module")
def abstract_steps(gpt2_tokenizer_dir):
    cache = {}

    def get(name):
        if name not in cache:
            config = load_config(ROOT / "configs" / CONFIGS[name])
            config.tokenizer = str(gpt2_tokenizer_dir)  # offline: the checkpoints' own tokenizers are not here
            config.data.pool_split = "validation_mismatched"  # nor is MNLI's train split
            cache[name] = compiled.abstract_steps(read(config), devices=jax.devices()[:8], layers=2)
        return cache[name]

    return get


def lower(step, args, platform):
    jax.clear_caches()  # the kernel is chosen as the step is traced: no trace for another platform may be reused
    with jax.set_mesh(step.mesh), flash_attention.target_platform(platform):
        return step.jitted.trace(*args).lower(lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize(
    "name,platform", [(name, platform) for name in sorted(CONFIGS) for platform in ("cuda", "tpu")]
)
def test_steps_lower_with_the_fused_kernel(abstract_steps, on_h100, name, platform):
    steps = abstract_steps(name)
    start = time.perf_counter()
    train = lower(steps.train_step, steps.train_args, platform)
    evaluation = lower(steps.eval_step, steps.eval_args, platform)
    print(f"{name} {platform}: lowered in {time.perf_counter() - start:.1f} s")
    forward = KERNEL_CALLS[platform][0]
    assert re.search(forward, evaluation), f"{name}: no fused attention in the eval step for {platform}"
    for pattern in KERNEL_CALLS[platform]:
        assert re.search(pattern, train), f"{name}: no {pattern} in the train step for {platform}"
    for text in (train, evaluation):
        assert not XLA_SCORES.search(text), f"{name}: XLA's attention in a step for {platform}"
