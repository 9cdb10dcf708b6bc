# shellcheck shell=bash
# The XLA flags oodjax's launchers set on accelerators: the one place they are chosen, sourced by
# launch/slurm.sbatch (GPU) and launch/tpu_pod.sh (TPU). Flags already in XLA_FLAGS / LIBTPU_INIT_ARGS
# come last and so win; OODJAX_XLA_FLAGS=none leaves both untouched.
#
# FSDP and data parallelism over a scanned decoder all-gather each layer's weights and reduce its adapter
# gradients, so overlapping those collectives with the neighbouring layer's compute is what the flags buy:
# the GPU set is the JAX GPU performance guide's and NVIDIA's JAX toolbox's (double buffering the scan's
# carried weights is what the pipelining needs; the combine thresholds merge the many small
# per-projection collectives), the TPU set MaxText's.

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
