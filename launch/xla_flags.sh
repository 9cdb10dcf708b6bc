# shellcheck shell=bash
# The XLA flags oodjax's launchers set on accelerators: the one place they are chosen, sourced by
# launch/slurm.sbatch (GPU) and launch/tpu_pod.sh (TPU). Flags already in XLA_FLAGS / LIBTPU_INIT_ARGS
# come last and so win; OODJAX_XLA_FLAGS=none leaves both untouched.
#
# The workload: a scanned decoder, data parallel (its adapter gradients all-reduced) or, for the 30B models,
# FSDP over pairs of GPUs (docs/clusters.md, Sizing), where each layer's weights are all-gathered before use
# and its adapter gradients reduced after, so overlap of those collectives with the neighbouring layer's
# compute is what the flags buy (the JAX GPU performance guide and NVIDIA's JAX
# toolbox recommend the GPU set; MaxText ships the TPU set).
#
# GPU (XLA_FLAGS):
#   latency_hiding_scheduler         schedule collectives early, so they overlap compute
#   pipelined_all_gather / _reduce_scatter / _all_reduce
#                                    move the next scanned layer's collectives into this layer's iteration
#   while_loop_double_buffering      double-buffer the layer scan's carried weights, which the pipelining needs
#   *_combine_threshold_bytes=128M   combine the many small per-projection collectives into few large ones
# TPU (LIBTPU_INIT_ARGS):
#   async collective fusion (all-gathers included, over several steps), compute/collective overlap,
#   async all-gather, and the data-parallel all-reduce optimisation.

if [[ "${OODJAX_XLA_FLAGS:-}" != none ]]; then
  oodjax_gpu_flags=(
    --xla_gpu_enable_latency_hiding_scheduler=true
    --xla_gpu_enable_pipelined_all_gather=true
    --xla_gpu_enable_pipelined_reduce_scatter=true
    --xla_gpu_enable_pipelined_all_reduce=true
    --xla_gpu_enable_while_loop_double_buffering=true
    --xla_gpu_all_gather_combine_threshold_bytes=134217728
    --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728
    --xla_gpu_all_reduce_combine_threshold_bytes=134217728
  )
  oodjax_tpu_flags=(
    --xla_tpu_enable_data_parallel_all_reduce_opt=true
    --xla_tpu_data_parallel_opt_different_sized_ops=true
    --xla_tpu_enable_async_collective_fusion=true
    --xla_tpu_enable_async_collective_fusion_fuse_all_gather=true
    --xla_tpu_enable_async_collective_fusion_multiple_steps=true
    --xla_tpu_overlap_compute_collective_tc=true
    --xla_enable_async_all_gather=true
  )
  export XLA_FLAGS="${oodjax_gpu_flags[*]} ${XLA_FLAGS:-}"
  export LIBTPU_INIT_ARGS="${oodjax_tpu_flags[*]} ${LIBTPU_INIT_ARGS:-}"
  unset oodjax_gpu_flags oodjax_tpu_flags
fi
