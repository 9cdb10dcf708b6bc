"""Every field of a config, its default and what it means: the one place they live.

Config files start from `get_config()` (through `configs.base`) and change fields;
the returned ConfigDict is locked, so a misspelt key (in a config file or on
the command line as `--config.train.stepz=10`) is an error, not a silently
ignored setting.
"""

from ml_collections import config_dict

from oodjax.data import DEFAULT_ANSWERS, DEFAULT_MAX_LENGTH, DEFAULT_TEMPLATE, TESTSETS
from oodjax.models.lora import LoRAConfig

EIGHT_TESTSETS = tuple(TESTSETS)  # the study's eight, in the order of the testsets table

# The type of the items of each list field: the command line reads
# `--config.runs.seeds=0,42` as integers and `--config.data.testsets=snli,hans`
# as strings by it (oodjax.config_cli), and the config checks hold config
# files to it.
LIST_ITEM_TYPES = {
    "model.adapters": str,
    "lora.targets": str,
    "data.testsets": str,
    "data.answers": str,
    "data.buckets": int,
    "eval.row_lengths": int,
    "runs.seeds": int,
    "runs.shots": int,
    "wandb.tags": str,
}
# List fields whose comma-separated items the command line keeps exactly as
# written, spaces included (`--config.data.answers=" yes"," no"`): an answer's
# leading space makes it another token.
VERBATIM_LIST_ITEMS = ("data.answers",)


def get_config() -> config_dict.ConfigDict:
    config = config_dict.ConfigDict()

    config.model = config_dict.ConfigDict()
    # Local checkpoint directory (config.json + safetensors) or a hub id.
    # Leave empty to build a randomly initialised model from `hf_config`.
    config.model.path = ""
    # A transformers-style config (model_type, hidden_size, ...) for a random
    # model; used only when `path` is empty (demo, tests, benchmarks).
    config.model.hf_config = config_dict.ConfigDict()
    # Seed of the random initialisation from `hf_config`.
    config.model.init_seed = 0
    # Short model name used in run directory names; empty = derived from
    # `path` (its last component) or from `hf_config.model_type`.
    config.model.name = ""
    # dtype of the frozen base weights: "bfloat16" for real runs, "float32"
    # for exact tests. LoRA adapters and optimizer state are always float32.
    config.model.dtype = "bfloat16"
    # dtype the forward and backward passes compute in (base and adapters cast
    # to it inside the step); empty = the base's dtype. "bfloat16" with a
    # float32 base is mixed precision.
    config.model.compute_dtype = ""
    # Rematerialisation policy of each (scanned) decoder layer: what it keeps
    # for the backward pass, the rest recomputed (oodjax.models.REMAT_POLICIES).
    # "none" keeps everything (fastest, most memory); "full" keeps only the
    # layer's input; "save_dots" keeps the matmul outputs; "save_dots_except_mlp"
    # keeps them but for the MLP's, the largest.
    config.model.remat = "none"
    # Attention implementation (oodjax.models.flash_attention): "auto" = the
    # fused kernel of the platform (cuDNN's on GPU where it applies, else
    # XLA's; splash on TPU), XLA's on CPU; or "xla", "cudnn", "splash" by
    # name, or "pallas_gpu" (Triton; its backward is unverified on sm80+).
    # Sliding windows and soft caps always take XLA's path.
    config.model.attention = "auto"
    # PEFT LoRA adapter folders to evaluate, one run each, with
    # `python -m oodjax.evaluate` (export.peft writes <run_dir>/adapter/).
    config.model.adapters = ()

    # Tokenizer directory or hub id; empty = the same as `model.path`.
    config.tokenizer = ""

    config.lora = config_dict.ConfigDict()
    lora = LoRAConfig()  # the study's adapter, whose defaults live there
    config.lora.rank = lora.rank  # inner dimension of each adapter (B @ A)
    config.lora.alpha = lora.alpha  # the adapter output is scaled by alpha / rank
    config.lora.dropout = lora.dropout  # dropout on the adapter input, training only
    # Names of the linear layers that get adapters (e.g. ("q_proj", "v_proj"));
    # empty = the model's attention projections q/k/v and the output
    # projection (OPT's out_proj, OLMo2/Llama's o_proj).
    config.lora.targets = ()

    config.data = config_dict.ConfigDict()
    # Testset whose examples the few-shot training sets are drawn from, and
    # which counts as in-domain in the results ("mnli" or "snli").
    config.data.train_set = "mnli"
    # Split of `train_set` the few-shot sets are drawn from; empty = the data
    # layer's offline pool (MNLI validation_mismatched, SNLI validation: in the
    # shared data, for the demo, tests and laptop configs). The study configs
    # set `train`, as the study did (configs/models.py, docs/protocol.md).
    config.data.pool_split = ""
    # Local mirror laid out as <hub_id>/<config>/<split>.jsonl; empty =
    # $OODJAX_DATA_DIR, or the Hugging Face hub when that is unset. A split
    # missing from the mirror comes from the hub, unless it is offline.
    config.data.data_dir = ""
    # Testsets evaluated at step 0 and through each run (eval.points or
    # eval.every; the training set is evaluated too, always): built-in or
    # declared ones.
    config.data.testsets = EIGHT_TESTSETS
    # Testsets declared here rather than in code, name -> fields: source (a
    # hub id, or a local .jsonl/.parquet/.csv file), config (hub config,
    # optional), split (hub sources), premise, hypothesis, label (column
    # names), entailment, not_entailment (lists of label values), neutral
    # (values handled as data.neutral says), unlabelled (values always
    # dropped), cap (replaces eval_cap). A built-in's name overrides the
    # fields given, e.g. {'anli': {'split': 'test_r1'}}. Assign the whole
    # dict in a config file. See docs/data.md.
    config.data.extra_testsets = config_dict.ConfigDict()
    # A JSON or YAML file of more such declarations (name -> fields); relative
    # source files in it are relative to its folder. Empty = none.
    config.data.extra_testsets_file = ""
    # Cap each testset to this many examples (stratified by label, seeded by
    # `eval_seed`) so dense evaluation stays affordable; 0 = the full split.
    # The in-domain testset (data.train_set) only with cap_in_domain.
    config.data.eval_cap = 0
    # Also cap the in-domain testset (by eval_cap, or its own declared cap).
    # Off: it is evaluated whole, since the partial correlations control for
    # its accuracy, and a noisy covariate biases them upward (by about +0.09
    # at a cap of 2,000, +0.28 at 500 in a simulation: docs/analysis.md).
    config.data.cap_in_domain = False
    config.data.eval_seed = 0  # seed of the `eval_cap` subsets
    # Prompt template; the model scores the next token (data.answers).
    config.data.template = DEFAULT_TEMPLATE
    # The answer words (yes, no) whose next-token logits are read: entailment
    # is the first. Each must be one token of the model's tokenizer, leading
    # space included.
    config.data.answers = DEFAULT_ANSWERS
    # Prompts longer than this are truncated inside the premise.
    config.data.max_length = DEFAULT_MAX_LENGTH
    # Static sequence lengths a training micro-batch is cut to (a branch of the
    # train step each); empty = from 64, four per doubling (64, 80, 96, 112,
    # 128, 160, ...) up to max_length. Evaluation rows: eval.row_lengths.
    config.data.buckets = ()
    # Neutral examples of three-way testsets: "drop" them, or count them as
    # "not_entailment".
    config.data.neutral = "drop"
    # Where tokenised testsets are cached; empty = $OODJAX_CACHE_DIR, else
    # ~/.cache/oodjax.
    config.data.cache_dir = ""

    # Every (seed, shots) pair is one run; all of them train together on one
    # copy of the frozen base.
    config.runs = config_dict.ConfigDict()
    # A run's seed draws its few-shot set, its data order, its adapter
    # initialisation and its dropout.
    config.runs.seeds = (0, 42, 99)
    # Sizes of the few-shot training sets (label-balanced draws from the pool).
    config.runs.shots = (32, 64, 128)
    # What a run's LoRA initialisation and dropout keys come from: "seed", the
    # study's way (a seed's runs of every shot count and training set start
    # alike, so their results are correlated), or "seed_shots_train_set"
    # (each run its own keys; a departure from the study, for new sweeps).
    config.runs.key_source = "seed"
    # A job locks each of its runs (<run_dir>/run.lock) while it trains or
    # evaluates them. A run locked by another live job stops this one before
    # it writes anything, naming the run and that job; True leaves such runs
    # out (with a warning) and goes on with the others.
    config.runs.skip_locked = False

    config.train = config_dict.ConfigDict()
    config.train.steps = 500  # optimizer steps per run (unless train.epochs)
    # Passes over each run's few-shot set: a run trains ceil(epochs x shots /
    # batch_size) steps, so runs of more shots train longer (runs of one length
    # train together, each length after the other, on one loaded model).
    # 0 = every run trains train.steps.
    config.train.epochs = 0.0
    config.train.batch_size = 16  # examples per optimizer step, per run
    # Micro-batches per optimizer step (gradients accumulated inside the
    # jitted step); must divide batch_size. Every run's prompts of a step are
    # spread over them, so more micro-batches hold fewer tokens at once: the
    # memory knob. The update is the same.
    config.train.grad_accum = 1
    # Pack all runs' prompts of a step into the fewest rows per device per
    # micro-batch of at most data.max_length tokens, a row mixing runs (each
    # token adapted by its own run's adapters), balanced over the rows, so
    # little is padding and little attention crosses prompts. Off: one
    # prompt a row, each run's micro-batch a grad_accum-th of its batch.
    # Same examples per step and the same update either way, up to dropout
    # masks: they are keyed by each prompt's run, place in its run's batch
    # and token position, the same within a layout whatever trains beside it.
    config.train.pack = True
    config.train.learning_rate = 1e-4  # peak, after warm-up
    # A fixed linear warm-up from 0 to the peak, in steps, then
    # train.schedule; 0 = train.warmup_ratio (both 0: no warm-up). With
    # train.epochs, one that would take more than a quarter of a run is
    # refused: a ratio follows each run's own length.
    config.train.warmup_steps = 0
    # The warm-up as a share of each run's own steps, rounded up
    # (transformers' warmup_ratio), unless train.warmup_steps is set: 0.1 is
    # DL2024's (docs/protocol.md), 50 steps of 500.
    config.train.warmup_ratio = 0.1
    # The learning rate after warm-up, to train.steps (optax's schedules, as
    # transformers' get_*_schedule_with_warmup): "linear" decays linearly to
    # 0 (the study's), "cosine" follows a half cosine to 0, "constant" stays
    # at the peak. A run resumes only with the schedule it started with.
    config.train.schedule = "linear"
    config.train.weight_decay = 0.0  # AdamW decoupled weight decay
    config.train.max_grad_norm = 1.0  # global-norm clipping; 0 = off

    config.eval = config_dict.ConfigDict()
    # Fixed steps between evaluations (step 0 and the last step always);
    # 0 = eval.points. With train.epochs, one that would leave a run fewer
    # than 10 evaluations, step 0's among them, is refused.
    config.eval.every = 0
    # Evaluations after step 0 per run, unless eval.every is set, spread
    # evenly over the run's own steps (floor(k x steps / points), k =
    # 1..points: the last is its final step; every step of a shorter run), so
    # runs of every length (train.epochs) get as many: every 25 steps of 500.
    config.eval.points = 20
    # Evaluation batches hold about batch_size x max_length tokens, in rows of
    # one of row_lengths, each holding one or two prompts (little padding,
    # little attention between prompts; one compiled shape per row length).
    config.eval.batch_size = 32
    # Lengths of evaluation rows; empty = 32 and 48 times the powers of two
    # (32, 48, 64, 96, 128, ...) up to data.max_length.
    config.eval.row_lengths = ()
    # `python -m oodjax.evaluate` only: evaluate each (seed, shots) run in
    # context instead, every test prompt preceded by the run's few-shot set
    # (answers filled in) as demonstrations, nothing trained; runs are named
    # and grouped as model "<model>-icl".
    config.eval.in_context = False

    # Device mesh axis sizes; -1 = all remaining devices. The batch is split
    # over data x fsdp; parameters over fsdp and tensor by the logical rules.
    config.mesh = config_dict.ConfigDict()
    config.mesh.data = -1  # data parallel: each holds the whole (frozen) model
    config.mesh.fsdp = 1  # fully sharded data parallel: splits the batch and the parameters
    config.mesh.tensor = 1  # tensor parallel: splits each layer's matrices

    # Root of the results: one sub-directory per run, <output_dir>/<run name>/,
    # holding its metrics.npz, events.jsonl and its own checkpoints/.
    config.output_dir = "results"
    config.checkpoint_every = 100  # steps between checkpoints (and at the end)
    # Checkpoints kept per run (<run_dir>/checkpoints/), the newest; older ones
    # are deleted as new ones are written. At least 1; 2 keeps one to fall
    # back on should the newest be damaged. May change when a run resumes.
    config.checkpoint_keep = 2
    config.log_every = 10  # steps between loss lines in the log, the event log and the trackers

    # Live metrics, beside each run's events.jsonl and at the same steps: the
    # mean training loss and gradient norm (global, before clipping) since
    # the last line, the learning rate, examples/s, and every accuracy.
    config.wandb = config_dict.ConfigDict()
    config.wandb.enabled = False  # also stream metrics to Weights & Biases
    config.wandb.project = "oodjax"  # W&B project the runs are logged to
    config.wandb.entity = ""  # W&B team or user; empty = your default entity
    # Each run is its own W&B run named as the run; the group gathers a
    # config's runs (empty = "<model>_<train_set>").
    config.wandb.group = ""
    config.wandb.tags = ()  # W&B tags of every run (strings)
    # "online", "offline" (sync later with `wandb sync`) or "disabled";
    # empty = wandb's default (the WANDB_MODE variable, else online).
    config.wandb.mode = ""

    config.tensorboard = config_dict.ConfigDict()
    # Also write TensorBoard event files to <run_dir>/tensorboard/
    # (`tensorboard --logdir <output_dir>` shows every run; the viewer is the
    # `tensorboard` extra, `pip install ".[tensorboard]"`).
    config.tensorboard.enabled = False

    # The trained adapters in PEFT format (adapter_config.json and
    # adapter_model.safetensors), for `peft.PeftModel.from_pretrained`.
    config.export = config_dict.ConfigDict()
    # Write each run's adapters to <run_dir>/adapter/ when training ends.
    config.export.peft = False
    # Also rewrite them at every checkpoint (checkpoint_every steps).
    config.export.every_checkpoint = False
    # A Hugging Face hub repo id ("user/name"): each export is also pushed
    # there, one folder per run (named as the run); needs the hub (not
    # HF_HUB_OFFLINE) and a token with write access. Empty = no push.
    config.export.hub_repo = ""

    config.lock()
    return config
