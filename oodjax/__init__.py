"""oodjax: do out-of-distribution generalisation results generalise?

LoRA fine-tuning and NLI evaluation of LLMs in pure JAX.
"""

import logging as _logging

# transformers says "PyTorch was not found. Models won't be available ..." on
# import when torch is absent, as in a runtime environment (oodjax needs only
# its tokenizers and configs). Every entry point imports this package before
# transformers, so this filter on transformers' logger drops exactly that line
# for all of them; its other warnings still show.
TORCH_NOT_FOUND_NOTICE = "PyTorch was not found."

_logging.getLogger("transformers").addFilter(lambda record: not str(record.msg).startswith(TORCH_NOT_FOUND_NOTICE))
