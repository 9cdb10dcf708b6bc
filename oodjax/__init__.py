"""oodjax: do out-of-distribution generalisation results generalise? LoRA fine-tuning and NLI evaluation of LLMs in pure JAX."""
