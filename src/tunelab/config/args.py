"""The option groups of a run: one dataclass per concern.

Key names follow LlamaFactory where the concept exists there, so its users' YAML files carry over
(see docs/config.md for the deliberate differences). Defaults live here and nowhere else; the help
text of every option is its `metadata["help"]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from tunelab.assets import EMBEDDED_MODELS
from tunelab.config.applicability import LORA_ONLY, Applies
from tunelab.config.export_formats import DEFAULT_GGUF_TYPE, GGUF_TYPES
from tunelab.config.stages import DEFAULT_STAGE, STAGE_NAMES, applies_where
from tunelab.config.training_options import option_help as _help  # args.py's short name: every field below
from tunelab.config.training_values import TrainingValues

if TYPE_CHECKING:
    from tunelab.config.training_args import TrainingArguments

# The names of GRPO's loss reductions (TRL's GRPOConfig.loss_type) and advantage estimators (verl's adv_estimator):
# the options' vocabulary here, the arithmetic behind each in train/rl/losses.py. "grpo" in both is the
# DeepSeekMath rule, not the stage.
GRPO_LOSS_TYPES = ("grpo", "dapo", "dr_grpo", "bnpo")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")

# Where the stage options act (checked by config/applicability.py), asked of the stage table (config/stages.py).
PT_ONLY = applies_where(lambda row: row.reads == "text", grouped=True)  # the raw-text window options
DPO = applies_where(lambda row: row.reference == "pref_loss")  # the preference losses and their options
KTO = applies_where(lambda row: row.reads == "unpaired")
DPO_KTO = applies_where(lambda row: row.reference in ("pref_loss", "always"))  # preference against a reference
GRPO = applies_where(lambda row: row.scorer == "reward_functions")
PPO = applies_where(lambda row: row.scorer == "reward_model")
RL = applies_where(lambda row: row.rl)
KD = applies_where(lambda row: row.teacher)  # distillation from a teacher model
# The peft methods other than LoRA (model/adapters.py); modules trained in full beside an adapter act under each.
OFT_ONLY, VERA_ONLY = Applies("finetuning_type", ("oft",), grouped=True), Applies("finetuning_type", ("vera",), grouped=True)
ADAPTER_TYPES = Applies("finetuning_type", ("lora", "oft", "vera"), grouped=True)
# LoRA initialisations whose adapter does not start at zero: the base holds the rest (pissa, olora) or the adapter
# starts as the quantization error (loftq). Saved as the change from that start (model/adapters.py).
NONZERO_LORA_INITS = ("pissa", "olora", "loftq")
# The memory-saving optimizers act on full-weight training (train/optimizers.py); BAdam picks the trained block itself.
FULL_OR_FREEZE = Applies("finetuning_type", ("full", "freeze"), grouped=True)
FULL_ONLY = Applies("finetuning_type", ("full",), grouped=True)


@dataclass(frozen=True)
class ModelArguments:
    model_name_or_path: str = _help(
        "A Hugging Face model folder (config.json + weights), a Hub id (org/name) fetched into the Hugging Face "
        "cache (HF_HOME, HF_HUB_OFFLINE and HF_TOKEN apply), or a GGUF file (path/to/model.gguf: llama.cpp, Ollama, "
        "LM Studio), dequantized to the compute dtype. 'tiny' is the embedded tiny Llama, "
        "'tiny-vision' the embedded tiny LLaVA.",
        default="tiny",
    )
    gguf_file: str | None = _help(
        "The GGUF file to load from model_name_or_path when that is a folder or a Hub id holding several (e.g. "
        "model-Q4_K_M.gguf); a path relative to it. A GGUF file can also be given directly as model_name_or_path.",
        default=None,
    )
    model_revision: str = _help(
        "Hub ids: the branch, tag or commit of model_name_or_path to use; the run records the commit it read.",
        default="main",
    )
    adapter_name_or_path: str | None = _help(
        "LoRA adapter folder (or Hub id) to load on top of the model.", default=None
    )
    trust_remote_code: bool = _help("Run custom modelling code shipped in the model folder.", default=False)
    use_kernels: bool = _help(
        "Let transformers swap layers for kernels it downloads from the Hub (the `kernels` package, "
        "kernels-community repos; GPUs). It runs code fetched at train time and needs the network, so it is off "
        "unless set: transformers itself turns it on whenever that package is installed.",
        default=False,
    )
    allow_pickle_weights: bool = _help(
        "Load a model or adapter whose weights are only pickle files (pytorch_model.bin, adapter_model.bin), "
        "which can run code when loaded; by default tunelab reads safetensors only.",
        default=False,
    )
    flash_attn: Literal["auto", "disabled", "sdpa", "fa2"] = _help(
        "Attention implementation: auto (transformers' choice), disabled (eager), sdpa, fa2 (flash_attention_2).",
        default="auto",
    )
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = _help(
        "dtype of the loaded weights; auto follows bf16/fp16 training flags, else float32.", default="auto"
    )
    rope_scaling: Literal["linear", "dynamic", "yarn", "llama3"] | None = _help(
        "Stretch the model's rotary position embeddings (RoPE) to a longer context than it was trained on: linear "
        "(positions divided by the factor), dynamic (NTK), yarn or llama3, by rope_factor. Set when the model loads; "
        "the saved config.json (LoRA: tunelab_config.yaml) carries it to eval, chat and export.",
        default=None,
    )
    rope_factor: float | None = _help(
        "rope_scaling: the factor (> 1); default cutoff_len / the model's max_position_embeddings, rounded up (as "
        "LlamaFactory). The run records the factor it used.",
        default=None,
    )
    add_special_tokens: list[str] | None = _help(
        "Tokens to add to the tokenizer as special tokens, comma separated (e.g. a template's end-of-turn marker the "
        "tokenizer lacks). The embeddings grow to fit and the new rows train (LoRA: as trainable tokens saved with "
        "the adapter; freeze: the embedding and output layers train).",
        default=None,
    )
    quantization_bit: int | None = _help("Load the base weights in 4 or 8 bits with bitsandbytes (QLoRA).", default=None)
    quantization_type: Literal["nf4", "fp4"] = _help("4-bit data type.", default="nf4")
    double_quantization: bool = _help("Quantize the 4-bit quantization constants too.", default=True)
    image_max_pixels: int = _help(
        "Vision-language models: an image with more pixels (width x height) is scaled down to this many, keeping "
        "its aspect ratio, before the model's processor sees it.", default=768 * 768,
    )
    image_min_pixels: int = _help(
        "Vision-language models: an image with fewer pixels is scaled up to this many before the processor.",
        default=32 * 32,
    )

    def __post_init__(self):
        if self.model_name_or_path in EMBEDDED_MODELS:
            # (frozen: the name is resolved as the value is made)
            object.__setattr__(self, "model_name_or_path", str(EMBEDDED_MODELS[self.model_name_or_path]))


@dataclass(frozen=True)
class DataArguments:
    template: str | None = _help(
        "Chat template: a built-in name or LlamaFactory alias (tunelab template list), or 'model' for the "
        "tokenizer's own chat_template.",
        default=None,
    )
    template_kwargs: dict[str, Any] | None = _help(
        "Variables the chat template reads, e.g. {enable_thinking: false} (Qwen3 without thinking) or "
        "{date_string: 01 Jan 2025} (Llama-3.1); used wherever the template renders: training, evaluation, "
        "chat, the API and export. On the command line as JSON: template_kwargs='{\"enable_thinking\": false}'. "
        "A key the template does not read is refused.",
        default=None,
    )
    dataset: list[str] | None = _help("Training dataset names from dataset_info.json, comma separated.", default=None)
    eval_dataset: list[str] | None = _help("Evaluation dataset names, comma separated.", default=None)
    dataset_dir: str | None = _help(
        "Folder holding your dataset_info.json and data files; the built-in datasets are always available.",
        default=None,
    )
    cutoff_len: int = _help("Maximum tokens per example after tokenisation.", default=2048)
    train_on_prompt: bool = _help("Supervise prompt tokens too, not only the assistant answers.", default=False)
    mask_history: bool = _help("Supervise only the last assistant turn of each conversation.", default=False)
    mix_strategy: Literal["concat", "interleave_under", "interleave_over"] = _help(
        "How several datasets are combined.", default="concat"
    )
    interleave_probs: list[float] | None = _help("Sampling probabilities for interleave strategies.", default=None)
    max_samples: int | None = _help("Keep at most this many rows of each dataset (for quick runs).", default=None)
    val_size: float = _help("Hold out this fraction (<1) or number (>=1) of training rows for evaluation.", default=0.0)
    packing: bool = _help(
        "Pack several examples into one row of cutoff_len; samples stay isolated (attention and positions).",
        default=False,
    )
    padding_free: bool | None = _help(
        "Unpacked sft/pt, and dpo/kto pairs: lay each batch's sequences side by side in rows no longer than its "
        "longest (isolated as in packing) instead of padding each one: same sequences, same loss, fewer positions. "
        "Default: on where the model's attention isolates packed samples natively (logged when off).",
        default=None,
    )
    dedup: Literal["none", "exact", "near"] = _help(
        "Remove duplicate training rows before encoding: exact (same rendered conversation) or near "
        "(MinHash LSH over the text; pip install tunelab[dedup]).",
        default="none",
    )
    dedup_threshold: float = _help(
        "dedup: near: estimated Jaccard similarity (character 5-grams) at or above which a row is a duplicate.",
        default=0.85,
    )
    stride: int | None = _help(
        "pt: step between window starts (< cutoff_len overlaps windows); default cutoff_len.",
        default=None, applies=PT_ONLY,
    )
    min_length: int = _help(
        "pt: drop documents shorter than this many tokens (counted in the log).",
        default=1, applies=PT_ONLY,
    )
    tail: Literal["keep", "drop"] = _help(
        "pt: the last window shorter than cutoff_len is kept as a shorter window, or dropped (counted).",
        default="keep", applies=PT_ONLY,
    )
    text_column: list[str] | None = _help(
        "pt: the text column(s) of json/csv/parquet rows; with several, each row takes the first one it has a "
        "value in. Default: 'text' and 'content'.",
        default=None, applies=PT_ONLY,
    )
    txt_sample_by: Literal["line", "paragraph", "document"] = _help(
        "pt: a .txt document is one line, one blank-line-separated block, or the whole file.",
        default="line", applies=PT_ONLY,
    )
    streaming: bool = _help("Read, tokenise and batch on the fly with bounded memory (needs max_steps).", default=False)
    buffer_size: int = _help("streaming: shuffle buffer size in examples.", default=16384)
    tokenized_cache_dir: str | None = _help(
        "Folder of the tokenized-dataset cache; default ~/.cache/tunelab/tokenized (or $TUNELAB_CACHE).", default=None
    )
    ignore_pad_token_for_loss: bool = _help(
        "LlamaFactory's key, accepted as true: padding is never a training target in tunelab (labels of padding are "
        "always -100, packed and padding-free rows have no padding to learn); false is refused.",
        default=True,
    )
    skip_bad_rows: bool = _help(
        "Leave out lines of JSON-lines files that are not valid JSON or not UTF-8 (counted in the log and "
        "data_report.json) instead of stopping at the first one.",
        default=False,
    )
    preprocessing_num_workers: int | None = _help(
        "Processes used to tokenise datasets. Unset: one per CPU (at most 8) for sets of 50,000 rows or more "
        "(logged), else this process.",
        default=None,
    )
    overwrite_cache: bool = _help("Rebuild tokenised datasets even if a cached copy exists.", default=False)


@dataclass(frozen=True)
class FinetuningArguments:
    stage: Literal[STAGE_NAMES] = _help("Training stage.", default=DEFAULT_STAGE)
    finetuning_type: Literal["lora", "oft", "vera", "freeze", "full"] = _help(
        "Which parameters train: lora (low-rank adapters, peft), oft (orthogonal rotations of the adapted layers, "
        "peft OFT), vera (two scaling vectors per layer over frozen random projections shared by all layers, peft "
        "VeRA), freeze (the last or first N decoder layers) or full.",
        default="lora",
    )
    lora_rank: int = _help("LoRA rank r.", default=8, applies=LORA_ONLY)
    lora_alpha: int | None = _help("LoRA scale alpha; default 2 * lora_rank.", default=None, applies=LORA_ONLY)
    lora_dropout: float = _help("Dropout on the LoRA input.", default=0.0, applies=LORA_ONLY)
    lora_target: list[str] = _help(
        "Modules that get LoRA: 'all' (every linear layer but the output head) or names, comma separated.",
        default_factory=lambda: ["all"], applies=LORA_ONLY,
    )
    additional_target: list[str] | None = _help(
        "Modules trained in full beside the adapter (LoRA, OFT or VeRA) and saved with it (e.g. embed_tokens,lm_head).",
        default=None, applies=ADAPTER_TYPES,
    )
    use_dora: bool = _help("Weight-decomposed LoRA (DoRA).", default=False, applies=LORA_ONLY)
    use_rslora: bool = _help("Rank-stabilised LoRA scaling alpha / sqrt(r).", default=False, applies=LORA_ONLY)
    init_lora_weights: Literal["default", "gaussian", "pissa", "olora", "loftq"] = _help(
        "How the LoRA matrices start (peft's init_lora_weights). default: B = 0, so training starts from the base "
        "model; gaussian: A Gaussian-initialised, B = 0; pissa: B·A is the principal part of each weight's SVD and "
        "the base keeps the residual (LlamaFactory's pissa_init); olora: likewise from a QR decomposition; loftq: "
        "with quantization_bit 4, B·A starts as the low-rank part of the quantization error (peft computes it on a "
        "CUDA GPU). pissa, olora and loftq adapters are saved as the change from that start, a plain LoRA of the "
        "original base (rank 2 x lora_rank): docs/training.md#lora-initialisations.",
        default="default", applies=LORA_ONLY,
    )
    pissa_init: bool = _help("PiSSA initialisation (LlamaFactory's key for init_lora_weights: pissa).", default=False,
                             applies=LORA_ONLY)
    pissa_iter: int = _help(
        "PiSSA: subspace iterations of peft's fast randomized SVD (pissa_niter_N); -1: the full SVD.",
        default=16, applies=LORA_ONLY,
    )
    pissa_convert: bool = _help(
        "PiSSA: save the adapter as a plain LoRA of the original base (the change from its start, rank 2 x "
        "lora_rank), which loads anywhere. false saves it as trained: peft then decomposes the base again when "
        "loading it, which reproduces the training start only with pissa_iter: -1 (the full SVD).",
        default=True, applies=LORA_ONLY,
    )
    oft_rank: int = _help(
        "OFT: orthogonal blocks per adapted layer (peft's r); 0: the count follows from oft_block_size. Set one of the "
        "two.", default=0, applies=OFT_ONLY,
    )
    oft_block_size: int = _help(
        "OFT: size of each orthogonal block (it must divide the layers' input width); 0: set by oft_rank.",
        default=32, applies=OFT_ONLY,
    )
    oft_target: list[str] = _help(
        "OFT: modules that get OFT, as lora_target: 'all', 'attention', 'mlp' or names, comma separated.",
        default_factory=lambda: ["all"], applies=OFT_ONLY,
    )
    module_dropout: float = _help(
        "OFT: probability that a block of the rotation is the identity in a training step (multiplicative dropout).",
        default=0.0, applies=OFT_ONLY,
    )
    vera_rank: int = _help(
        "VeRA: rank of the frozen random projections shared by every adapted layer (peft's r).",
        default=256, applies=VERA_ONLY,
    )
    vera_target: list[str] = _help(
        "VeRA: modules that get VeRA, as lora_target: 'all', 'attention', 'mlp' or names, comma separated.",
        default_factory=lambda: ["all"], applies=VERA_ONLY,
    )
    loraplus_lr_ratio: float | None = _help(
        "LoRA+: the B matrices (lora_B) train at learning_rate x this ratio (lr_B / lr_A, e.g. 16), the A matrices "
        "at learning_rate (peft's create_loraplus_optimizer).",
        default=None, applies=LORA_ONLY,
    )
    loraplus_lr_embedding: float = _help(
        "LoRA+: the learning rate of LoRA adapters on embedding layers.", default=1e-6, applies=LORA_ONLY
    )
    pure_bf16: bool = _help(
        "Training in bf16: the trainable weights themselves are bf16 (no float32 master copy: less memory for the "
        "weights, gradients and optimizer states, but AdamW drops updates smaller than bf16's resolution). Off: "
        "trainable weights are float32 and autocast runs the matmuls in bf16 (docs/training.md#mixed-precision).",
        default=False,
    )
    freeze_trainable_layers: int = _help(
        "freeze: train the last N decoder layers (negative: the first N).", default=2
    )
    freeze_trainable_modules: list[str] = _help(
        "freeze: module names inside the trainable layers that train ('all' for every one).",
        default_factory=lambda: ["all"],
    )
    freeze_extra_modules: list[str] | None = _help(
        "freeze: modules outside the decoder layers that train too (e.g. embed_tokens,norm).", default=None
    )
    pref_beta: float = _help(
        "dpo / kto: beta, the strength of the reference (KL) constraint; orpo: weight of the odds-ratio term; "
        "simpo: reward scale.",
        default=0.1, applies=DPO_KTO,
    )
    pref_loss: Literal["sigmoid", "ipo", "hinge", "orpo", "simpo"] = _help(
        "dpo: the preference loss: sigmoid (DPO), ipo, hinge (SLiC), orpo or simpo (these two use no reference model).",
        default="sigmoid", applies=DPO,
    )
    pref_ftx: float = _help(
        "dpo: weight of an extra SFT term, the mean token NLL of the chosen answer (0: none).",
        default=0.0, applies=DPO,
    )
    dpo_label_smoothing: float = _help(
        "dpo, pref_loss sigmoid: probability that a preference label is flipped (conservative DPO), in [0, 0.5).",
        default=0.0, applies=(DPO, Applies("pref_loss", ("sigmoid",))),
    )
    simpo_gamma: float = _help("dpo, pref_loss simpo: the target reward margin gamma.", default=0.5,
                               applies=(DPO, Applies("pref_loss", ("simpo",))))
    precompute_ref_log_probs: bool = _help(
        "dpo / kto: compute the reference log-probs once before training (stored as dataset columns) instead of "
        "a reference forward pass every step.",
        default=False, applies=DPO_KTO,
    )
    kto_desirable_weight: float = _help("kto: weight of the loss of desirable examples.", default=1.0, applies=KTO)
    kto_undesirable_weight: float = _help("kto: weight of the loss of undesirable examples.", default=1.0, applies=KTO)
    reward_funcs: list[str] | None = _help(
        "grpo: reward functions, comma separated: built-ins exact_match (1 when the answer equals the dataset's "
        "reference), format (1 when it ends at the end-of-turn token with the reference's shape) and item_match (the "
        "share of list items in the reference's positions), code_tests (runs the answer's code against the "
        "reference, a program of assert statements, in a sandbox: the share that pass), or your own "
        "path/to/file.py:fn / package.module:fn with fn(prompts, completions, references) -> list[float].",
        default=None, applies=GRPO,
    )
    reward_weights: list[float] | None = _help(
        "grpo: one weight per reward function (default 1 each); a completion's reward is the weighted sum.",
        default=None, applies=GRPO,
    )
    tools: list[str] | None = _help(
        "grpo: tools the policy may call during a rollout, comma separated (TRL's GRPOTrainer tools): the built-in "
        "python (runs the call's code in the code_tests sandbox and returns what it prints) or your own "
        "path/to/file.py:fn / package.module:fn, described to the model by its type hints and Google-style docstring "
        "(transformers' get_json_schema) and run in a child process of its own. The prompts render them; each call "
        "and its result become turns of the rollout (train/rl/tool_rollout.py).",
        default=None, applies=GRPO,
    )
    max_tool_turns: int = _help(
        "grpo with tools: the most tool-calling turns of one rollout (TRL's max_tool_calling_iterations); a call "
        "after the last is not run and ends the rollout.",
        default=2, applies=GRPO,
    )
    reward_model: str | None = _help(
        "ppo: the reward model folder a stage rm run wrote (a full model or a LoRA adapter).",
        default=None, applies=PPO,
    )
    num_generations: int = _help(
        "grpo: completions sampled per prompt (the group), at least 2.",
        default=8, applies=GRPO,
    )
    kl_coef: float = _help(
        "grpo / ppo: weight of the KL penalty to the reference (the model training started from; for LoRA the "
        "base with the adapter disabled). grpo: k3 estimator in the loss; ppo: per-token penalty in the reward. "
        "0 skips the reference.",
        default=0.04, applies=RL,
    )
    epsilon: float = _help(
        "grpo / ppo: clip range of the policy ratio, 1 ± epsilon (ppo: also of the value update).",
        default=0.2, applies=RL,
    )
    num_iterations: int = _help(
        "grpo / ppo: optimizer steps on each batch of rollouts (mu); >1 reuses samples with the clipped ratio.",
        default=1, applies=RL,
    )
    rollout_merge_adapter: bool = _help(
        "grpo / ppo with LoRA: sample rollouts from a copy of the adapted weights with the adapter merged in (one "
        "matmul per layer instead of three; the original weights are put back unchanged; train/rl/merged_sampling.py). "
        "false samples through the adapter, as it trains. Plain LoRA in one process or DDP; the run's log says "
        "what its rollouts sample from.",
        default=True, applies=(RL, LORA_ONLY),
    )
    # GRPO variants, by TRL's GRPOConfig names and meanings (train/rl/losses.py, docs/config.md).
    loss_type: Literal[GRPO_LOSS_TYPES] = _help(
        "grpo: how the per-token losses are averaged. grpo: over each completion's tokens, then over completions "
        "(DeepSeekMath); bnpo: over the batch's tokens; dapo: over all tokens of the optimizer step (DAPO); "
        "dr_grpo: their sum over completions x max_new_tokens (Dr. GRPO: no length normalisation).",
        default="grpo", applies=GRPO,
    )
    scale_rewards: Literal["group", "batch", "none"] = _help(
        "grpo: what the advantages (reward - group mean) are divided by: the group's reward std, the batch's, or "
        "none (Dr. GRPO).",
        default="group", applies=(GRPO, Applies("advantage_estimator", ("grpo",))),
    )
    advantage_estimator: Literal[ADVANTAGE_ESTIMATORS] = _help(
        "grpo: how rewards become advantages (verl's adv_estimator names). grpo: reward - group mean, divided as "
        "scale_rewards says; rloo: reward - the mean of the group's other rewards (RLOO); reinforce_plus_plus: each "
        "token gets its completion's reward, whitened over the batch's tokens (REINFORCE++); "
        "reinforce_plus_plus_baseline: the same after subtracting the group mean.",
        default="grpo", applies=GRPO,
    )
    epsilon_high: float | None = _help(
        "grpo: upper clip range, the ratio is clipped to [1 - epsilon, 1 + epsilon_high] (DAPO's clip-higher, "
        "e.g. 0.28); default epsilon.",
        default=None, applies=GRPO,
    )
    importance_sampling_level: Literal["token", "sequence"] = _help(
        "grpo: one policy ratio per token, or per completion (sequence: the mean of its tokens' log-ratios, "
        "GSPO).",
        default="token", applies=GRPO,
    )
    mask_truncated_completions: bool = _help(
        "grpo: completions cut by max_new_tokens (no end-of-turn token) are left out of the loss (DAPO's "
        "overlong filtering); they still count in their group's reward mean and std.",
        default=False, applies=GRPO,
    )
    dynamic_sampling: bool = _help(
        "grpo: leave out of the loss the groups whose completions all got the same reward (DAPO's dynamic "
        "sampling, without resampling: the batch shrinks); counted as dropped_groups in the log.",
        default=False, applies=GRPO,
    )
    top_entropy_quantile: float = _help(
        "grpo: the policy term of the loss acts only on this top share of each batch's completion tokens by the "
        "entropy they were sampled with (\"Beyond the 80/20 rule\": 0.2); 1.0 keeps every token.",
        default=1.0, applies=GRPO,
    )
    ppo_vf_coef: float = _help("ppo: weight of the value loss beside the policy loss.", default=0.1, applies=PPO)
    ppo_gamma: float = _help("ppo: discount factor of the per-token rewards (GAE gamma).", default=1.0, applies=PPO)
    ppo_lam: float = _help("ppo: GAE lambda, the bias-variance trade-off of the advantages.", default=0.95, applies=PPO)
    # Distillation, by TRL's GKDConfig names and meanings (train/distillation_losses.py, docs/stages.md).
    teacher_model_name_or_path: str | None = _help(
        "kd: the teacher, as model_name_or_path takes a model (a folder, a Hub id or a GGUF file); loaded frozen with "
        "the student's model options (dtype, attention, quantization). Its tokenizer must equal the student's.",
        default=None, applies=KD,
    )
    lmbda: float = _help(
        "kd: the share of training examples answered by the student itself (GKD's on-policy data): each example is "
        "drawn with this probability and its last answer replaced by the student's sample (temperature, "
        "max_new_tokens); 0 trains on the dataset's answers only.",
        default=0.0, applies=KD,
    )
    beta: float = _help(
        "kd: the generalised Jensen-Shannon divergence's interpolation: 0 is the forward KL(teacher || student), 1 "
        "the reverse KL(student || teacher), in between the JSD with mixture beta * teacher + (1 - beta) * student.",
        default=0.5, applies=KD,
    )
    # Memory-saving optimizers, by LlamaFactory's names and defaults (train/optimizers.py, docs/training.md).
    use_galore: bool = _help(
        "GaLore: the gradients of the targeted weight matrices are projected to galore_rank before AdamW, so their "
        "optimizer states are rank x width instead of the matrix's size (pip install 'tunelab[galore]').",
        default=False, applies=FULL_OR_FREEZE,
    )
    galore_target: list[str] = _help(
        "GaLore: the linear layers it projects: 'all' (every trainable linear layer but the output head) or module "
        "names, comma separated (q_proj, mlp, self_attn.o_proj).",
        default_factory=lambda: ["all"], applies=FULL_OR_FREEZE,
    )
    galore_rank: int = _help("GaLore: the rank of the projected gradients.", default=16, applies=FULL_OR_FREEZE)
    galore_update_interval: int = _help(
        "GaLore: optimizer steps between recomputations of the projection (an SVD of the gradient).",
        default=200, applies=FULL_OR_FREEZE,
    )
    galore_scale: float = _help("GaLore: scale of the projected-back update.", default=2.0, applies=FULL_OR_FREEZE)
    galore_proj_type: Literal["std", "reverse_std", "right", "left", "full"] = _help(
        "GaLore: which side of each matrix is projected (std: the smaller one).", default="std", applies=FULL_OR_FREEZE
    )
    galore_layerwise: bool = _help(
        "GaLore: step each weight's optimizer during the backward pass and free its gradient at once (less memory; "
        "needs gradient_accumulation_steps: 1, no clipping, one process, no resume).",
        default=False, applies=FULL_OR_FREEZE,
    )
    use_apollo: bool = _help(
        "APOLLO: AdamW whose states for the targeted matrices live in a random (or SVD) projection of rank "
        "apollo_rank and scale the raw gradient per channel: near-SGD memory (pip install 'tunelab[apollo]').",
        default=False, applies=FULL_OR_FREEZE,
    )
    apollo_target: list[str] = _help(
        "APOLLO: the linear layers it projects: 'all' (every trainable linear layer but the output head) or module "
        "names, comma separated.",
        default_factory=lambda: ["all"], applies=FULL_OR_FREEZE,
    )
    apollo_rank: int = _help("APOLLO: the rank of the projection.", default=16, applies=FULL_OR_FREEZE)
    apollo_update_interval: int = _help(
        "APOLLO: optimizer steps between new projections.", default=200, applies=FULL_OR_FREEZE
    )
    apollo_scale: float = _help("APOLLO: scale of the gradient scaling factor.", default=32.0, applies=FULL_OR_FREEZE)
    apollo_proj: Literal["svd", "random"] = _help(
        "APOLLO: the projection: random (seeded Gaussian) or svd (of the gradient).", default="random",
        applies=FULL_OR_FREEZE,
    )
    apollo_proj_type: Literal["std", "right", "left"] = _help(
        "APOLLO: which side of each matrix is projected (std: the smaller one).", default="std", applies=FULL_OR_FREEZE
    )
    apollo_scale_type: Literal["channel", "tensor"] = _help(
        "APOLLO: one gradient scale per channel, or one per matrix (APOLLO-Mini with apollo_rank 1).",
        default="channel", applies=FULL_OR_FREEZE,
    )
    apollo_layerwise: bool = _help(
        "APOLLO: step each weight's optimizer during the backward pass (as galore_layerwise).",
        default=False, applies=FULL_OR_FREEZE,
    )
    apollo_scale_front: bool = _help(
        "APOLLO: apply the norm-growth limiter before the gradient scaling instead of after.",
        default=False, applies=FULL_OR_FREEZE,
    )
    use_badam: bool = _help(
        "BAdam: full fine-tuning one decoder layer (block) at a time: only that block has gradients and Adam states, "
        "switched every badam_switch_interval steps; embeddings, final norm and head stay as loaded "
        "(pip install 'tunelab[badam]').",
        default=False, applies=FULL_ONLY,
    )
    badam_mode: Literal["layer", "ratio"] = _help(
        "BAdam: layer (one decoder layer at a time). LlamaFactory's ratio mode is refused (see docs/training.md).",
        default="layer", applies=FULL_ONLY,
    )
    badam_start_block: int | None = _help(
        "BAdam: the decoder layer trained first; default the first (ascending) or last (descending).",
        default=None, applies=FULL_ONLY,
    )
    badam_switch_mode: Literal["ascending", "descending", "random", "fixed"] = _help(
        "BAdam: the order blocks take turns in (random: a new permutation each round; fixed: badam_start_block only).",
        default="ascending", applies=FULL_ONLY,
    )
    badam_switch_interval: int = _help(
        "BAdam: optimizer steps before the next block takes over (its Adam states start from zero).",
        default=50, applies=FULL_ONLY,
    )
    use_adam_mini: bool = _help(
        "Adam-mini: Adam with one second-moment value per block (attention head, neuron, embedding row) instead of "
        "per weight: about half of AdamW's state (pip install 'tunelab[adam-mini]').",
        default=False, applies=FULL_OR_FREEZE,
    )
    use_muon: bool = _help(
        "Muon (torch.optim.Muon): momentum orthogonalised by Newton-Schulz for the 2-D hidden weights, learning rate "
        "matched to AdamW's update size; embeddings, heads, norms and biases train with AdamW. One state per weight "
        "instead of two.",
        default=False, applies=FULL_OR_FREEZE,
    )
    # Quantization-aware training (model/qat.py, docs/quantization.md).
    qat: str | None = _help(
        "Quantization-aware training with torchao (stages pt / sft): the linear layers train through the rounding "
        "of a quantization scheme, so the model keeps its accuracy once exported with export_quantization. "
        "int8-int4 (int8 dynamic activations + int4 weights per group), int4-weight or int8-weight (weights per "
        "group). The saved weights stay full precision. pip install 'tunelab[qat]'.",
        default=None,
    )
    qat_group_size: int | None = _help(
        "qat / export_quantization: input columns that share one weight scale; must divide every linear layer's "
        "input width. Default 32; tunelab export: the group size the model trained with.",
        default=None,
    )
    freeze_vision_tower: bool = _help(
        "Vision-language models: the vision tower stays frozen (full / freeze; LoRA never targets it unless "
        "lora_target names its modules).", default=True,
    )
    freeze_multi_modal_projector: bool = _help(
        "Vision-language models: the projector from image features to the language model stays frozen (full / "
        "freeze; LoRA leaves it alone unless lora_target names it).", default=True,
    )
    train_mm_proj_only: bool = _help(
        "Vision-language models: train the multi-modal projector only (everything else frozen; finetuning_type "
        "full).", default=False,
    )
    qat_start_step: int = _help(
        "qat: optimizer steps trained in full precision before fake quantisation switches on.", default=0
    )

    def lora_init(self) -> str:
        """How the LoRA matrices start: init_lora_weights, or pissa under LlamaFactory's pissa_init."""
        return "pissa" if self.pissa_init else self.init_lora_weights


@dataclass(frozen=True)
class GenerationArguments:
    eval_generation: bool = _help(
        "Before and after training, generate greedy answers for eval rows and report exact-match accuracy.",
        default=False,
    )
    eval_generation_samples: int = _help(
        "How many eval rows the generation check uses (eval_generation: of the first eval set; generate_at_eval: of "
        "each eval set).",
        default=200,
    )
    generate_at_eval: bool = _help(
        "sft: at each evaluation during training (eval_strategy), also generate greedy answers for the first "
        "eval_generation_samples rows of each eval set and log eval[_<name>]_exact_match, _bleu and _rouge_l beside "
        "eval_loss (trainer_log.jsonl, eval_generation.png; usable as metric_for_best_model). Same generation and "
        "scores as tunelab eval.",
        default=False,
    )
    max_new_tokens: int = _help("Tokens generated per answer at most.", default=64)
    temperature: float = _help(
        "Sampling temperature of the completions grpo / ppo generate while training (evaluation stays greedy); kd: "
        "the temperature both models' logits are divided by in the divergence, and the student's samples' (lmbda).",
        default=1.0,
    )


@dataclass(frozen=True)
class ExportArguments:
    export_dir: str | None = _help(
        "tunelab export: folder for the plain model (LoRA merged into its base), tokenizer, chat template and "
        "generation config; with export_format gguf, the .gguf file and its Ollama Modelfile. The export's check "
        "writes export_report.json there.",
        default=None,
    )
    export_dtype: Literal["auto", "float32", "bfloat16", "float16"] = _help(
        "tunelab export: dtype of the saved weights; auto keeps the base model's. The merge itself runs in float32.",
        default="auto",
    )
    export_size: float | str = _help(
        "tunelab export: largest safetensors shard, in GB (e.g. 2) or as a size string (e.g. 500MB); bigger "
        "models are split and indexed by model.safetensors.index.json.",
        default=5,
    )
    export_quantization: str | None = _help(
        "tunelab export: quantize the exported model with torchao using a qat scheme (int8-int4, int4-weight, "
        "int8-weight), with or without QAT before it; the folder loads with plain transformers + torchao.",
        default=None,
    )
    export_format: Literal["hf", "gguf"] = _help(
        "tunelab export: hf writes a Hugging Face model folder; gguf writes one .gguf file (llama.cpp, Ollama, LM "
        "Studio) with an Ollama Modelfile beside it, a LoRA adapter merged first, the chat template the run trained "
        "with embedded (docs/deploy.md).",
        default="hf",
    )
    export_gguf_type: str = field(
        metadata={
            "help": "tunelab export with export_format gguf: the tensor type of the file's matrices (f32, f16 and "
            "bf16 keep the weights; q8_0 to q4_0 quantize them in blocks; q6_k, q5_k_m and q4_k_m are llama.cpp's "
            "k-quant mixes; other k-quants come from llama.cpp's llama-quantize run on an f16 file).",
            "choices": tuple(GGUF_TYPES),
        },
        default=DEFAULT_GGUF_TYPE,
    )
    export_parity: bool = _help(
        "tunelab export: read the export back with plain transformers (a folder) or transformers' GGUF loader (a "
        ".gguf) and compare it with the model as trained on a few probe conversations (template, token ids, logits "
        "within the type's tolerance, greedy answers); export_report.json, and the export fails when they differ. "
        "false skips it (it holds a float32 copy of the model and runs both models on the probes).",
        default=True,
    )
    export_check_only: bool = _help(
        "tunelab export: write nothing; run the export check on what an earlier export with the same options wrote "
        "into export_dir (`tunelab export --check-only`).",
        default=False,
    )
    export_check_dataset: str | None = _help(
        "tunelab export: a dataset (a name from dataset_info.json, as eval_dataset takes) whose first "
        "export_check_samples rows the export check answers greedily with the trained model and with the export, "
        "reporting both exact-match accuracies; default: the run's eval set (val_size or eval_dataset), if any.",
        default=None,
    )
    export_check_samples: int = _help("tunelab export: how many held-out rows the export check scores.", default=50)
    export_check_max_drop: float = _help(
        "tunelab export: percentage points of held-out exact match the export may lose against the trained model; "
        "more fails the check, naming the type to export instead.",
        default=5.0,
    )


def training_group(purpose: str = "train") -> type:
    """Where a config's training options go. `tunelab data` (purpose "data") reads them into TrainingValues: the
    same names and defaults, without building transformers' TrainingArguments."""
    if purpose == "data":

        return TrainingValues
    # lazy: TrainingArguments imports peft and bitsandbytes (peft alone 7.8 s): commands that train only
    from tunelab.config.training_args import TrainingArguments

    return TrainingArguments


def option_groups(purpose: str = "train") -> tuple[type, ...]:
    """The option groups a config is read into, in RunConfig's order."""
    return ModelArguments, DataArguments, FinetuningArguments, GenerationArguments, training_group(purpose), ExportArguments

@dataclass(frozen=True)
class RunConfig:
    """Everything a run decided, resolved and checked. Frozen, as are the option groups: a step that resolves a value
    makes a new one (dataclasses.replace); transformers' TrainingArguments, which tunelab does not freeze, is copied
    with the new values (config/training_values.py `training_with`), never changed in place. Functions below the
    entry points take the groups they read, not the whole config (tests/test_preflight_plan.py lists the
    exceptions)."""

    model: ModelArguments
    data: DataArguments
    finetuning: FinetuningArguments
    generation: GenerationArguments
    training: TrainingArguments
    export: ExportArguments = field(default_factory=ExportArguments)
    source: str | None = None  # the YAML file it came from
    precision: str | None = None  # what bf16 / fp16 auto chose and why (config/precision.py); None when both were set
