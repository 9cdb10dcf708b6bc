"""Side-by-side benchmarks of oodjax against transformers + PEFT on PyTorch: `python -m benchmarks`.

Kept free of JAX and PyTorch imports: `benchmarks.environment` must set the
process up before either is loaded.
"""
