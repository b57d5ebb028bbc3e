"""Train the embedded default MoE target: a small DeepSeek-V3 on the Python standard library.

DeepSeek-V3's router (`DeepseekV3TopkRouter`) adds `e_score_correction_bias` to the sigmoid scores
for top-k *selection* only and takes the gates from the unbiased scores; the bias is a buffer saved
with the weights. That is aux-loss-free load balancing (Wang et al. 2024, "Auxiliary-Loss-Free Load
Balancing Strategy for Mixture-of-Experts"), so a plain `from_pretrained` restores the balanced
model. We keep the router's learning rate at 0.1x and refine the bias proportionally to each
expert's load error a few times after every optimizer step (see FINDINGS.md: sign updates with
the full router learning rate collapsed).

    moe-spec train-target --out runs/default_target --minutes 65 --threads 1   (moe_spec/cli/train_target.py)

Rerunning the same command resumes from `OUT/checkpoint/` (safetensors weights and optimizer state
plus `state.json`; nothing is unpickled). The run ends with `OUT/model/`
(bfloat16 weights, the bias kept in fp32, the tokenizer and `moe_spec_meta.json`).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DeepseekV3Config, PreTrainedModel

from moe_spec.errors import MoeSpecError
from moe_spec.tensor_file import check_expected, read_header, read_tensors
from moe_spec.training.corpus import SourceFile, load_corpus
from moe_spec.training.tokenizer_training import encode_documents, train_tokenizer

# Not saved in config.json: whoever loads the model passes it again (FINDINGS: 2.4x eager on CPU).
EXPERTS_IMPLEMENTATION = "grouped_mm"
META_FILE = "moe_spec_meta.json"
CHECKPOINT_DIR = "checkpoint"  # under OUT: STATE_FILE and the weights file it names
STATE_FILE = "state.json"
LEGACY_CHECKPOINT = "state.pt"  # pickled; never read
CHECKPOINT_FORMAT = "moe_spec.train_target_checkpoint.v1"
LOG_FILE = "train_log.jsonl"  # under OUT
_UNTIMED_STEPS = 2  # the first steps pay one-off costs and are left out of the calibration


@dataclass(frozen=True)
class TargetShape:
    hidden_size: int
    num_layers: int
    num_heads: int
    n_routed_experts: int
    top_k: int
    moe_intermediate_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    vocab_size: int
    max_position_embeddings: int

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.n_routed_experts:
            raise ValueError(f"top_k={self.top_k} must be in 1..{self.n_routed_experts}")


DEFAULT_SHAPE = TargetShape(
    hidden_size=256, num_layers=8, num_heads=4, n_routed_experts=64, top_k=4, moe_intermediate_size=96,
    kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, vocab_size=8192,
    max_position_embeddings=2048,
)
# For tests only: trains in seconds.
TINY_SHAPE = TargetShape(
    hidden_size=32, num_layers=2, num_heads=2, n_routed_experts=8, top_k=2, moe_intermediate_size=16,
    kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, vocab_size=512,
    max_position_embeddings=256,
)


def build_config(shape: TargetShape, special_token_id: int) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=4 * shape.hidden_size,  # unused: every layer is MoE (first_k_dense_replace=0)
        moe_intermediate_size=shape.moe_intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_heads,
        n_shared_experts=0,  # accepted: the shared MLP then has zero width and adds nothing
        n_routed_experts=shape.n_routed_experts,
        num_experts_per_tok=shape.top_k,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        q_lora_rank=None,
        kv_lora_rank=shape.kv_lora_rank,
        qk_rope_head_dim=shape.qk_rope_head_dim,
        qk_nope_head_dim=shape.qk_nope_head_dim,
        v_head_dim=shape.v_head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        tie_word_embeddings=True,
        num_mtp_layers=0,
        bos_token_id=special_token_id,
        eos_token_id=special_token_id,
        pad_token_id=special_token_id,
    )


@dataclass(frozen=True)
class TrainSettings:
    out: str
    minutes: float = 65.0
    seed: int = 0
    shape: TargetShape = DEFAULT_SHAPE
    seq_len: int = 256
    batch_size: int = 8
    lr: float = 1.5e-3
    router_lr_scale: float = 0.1
    weight_decay: float = 0.1
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1
    calibration_steps: int = 30  # steps timed to turn the minute budget into a step count
    max_steps: int | None = None  # fixes the step count (reproduces a run exactly); else calibrated
    stop_after_steps: int | None = None  # checkpoint and exit early (tests resume)
    checkpoint_every_s: float = 300.0
    log_every: int = 25
    eval_every: int = 100
    eval_windows: int = 16
    final_eval_tokens: int = 131072
    corpus_chars: int | None = None  # use only the first files up to this many characters (tests)
    balance_gamma: float = 0.01
    balance_refinements: int = 3
    bias_clip: float = 1.0

    def __post_init__(self) -> None:
        if self.calibration_steps <= _UNTIMED_STEPS:
            raise ValueError(f"calibration_steps must exceed the {_UNTIMED_STEPS} untimed first steps")
        if self.max_steps is None and self.calibration_steps > self.warmup_steps:
            raise ValueError("calibration must end within warmup, whose learning rates need no step count")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError("max_steps must be positive")
        if self.seq_len > self.shape.max_position_embeddings:
            raise ValueError("seq_len exceeds max_position_embeddings")

    def resume_key(self) -> dict:
        """Settings that must match for a checkpoint to be resumed."""
        fields = asdict(self)
        for volatile in ("out", "stop_after_steps", "checkpoint_every_s", "minutes"):
            fields.pop(volatile)
        return fields


# ---------------------------------------------------------------------------------------------
# Routing: load counting and bias refinement


class RouterRecorder:
    """Context manager: counts each layer's expert choices and keeps the router inputs.

    Hooks on the routers' forward, which return `(router_logits, topk_weights, topk_indices)`.
    """

    def __init__(self, routers: Sequence[torch.nn.Module]):
        self.routers = list(routers)
        n_experts = self.routers[0].num_experts
        self.counts = torch.zeros(len(self.routers), n_experts, dtype=torch.long)  # [L, E]
        self.inputs: list[torch.Tensor | None] = [None] * len(self.routers)  # each [B*T, D]
        self._handles: list = []

    def __enter__(self) -> RouterRecorder:
        for layer, router in enumerate(self.routers):
            self._handles.append(router.register_forward_hook(self._hook(layer)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            hidden = inputs[0].detach()
            self.inputs[layer] = hidden.reshape(-1, hidden.shape[-1])
            topk_indices = output[2]  # [B*T, K]
            self.counts[layer] += torch.bincount(topk_indices.flatten(), minlength=self.counts.shape[1]).cpu()

        return hook


@torch.no_grad()
def refine_biases(
    routers: Sequence[torch.nn.Module], inputs: Sequence[torch.Tensor | None], gamma: float, refinements: int,
    clip: float,
) -> None:
    """Move each router's selection bias toward equal load on the batch it just routed.

    bias += gamma * clamp((mean_load - load) / mean_load, -1, 1), repeated `refinements` times with
    the selection recomputed by the router itself (its `forward`, which bypasses recording hooks).
    """
    for router, hidden in zip(routers, inputs):
        if hidden is None:
            continue
        for _ in range(refinements):
            topk_indices = router.forward(hidden)[2]  # [B*T, K]
            load = torch.bincount(topk_indices.flatten(), minlength=router.num_experts).float()  # [E]
            mean = load.mean()
            error = ((mean - load) / mean).clamp(-1.0, 1.0)
            router.e_score_correction_bias.add_(gamma * error).clamp_(-clip, clip)


def load_spread(counts: torch.Tensor) -> list[tuple[float, float]]:
    """Per layer (min load / mean load, max load / mean load) from counts [L, E]."""
    counts = counts.double()
    mean = counts.mean(dim=1).clamp(min=1e-9)
    return [(round(float(lo), 3), round(float(hi), 3)) for lo, hi in
            zip(counts.min(dim=1).values / mean, counts.max(dim=1).values / mean)]


def routers_of(model: PreTrainedModel) -> list[torch.nn.Module]:
    return [layer.mlp.gate for layer in model.model.layers]


# ---------------------------------------------------------------------------------------------
# Data, optimizer, schedule


def batch_at(stream: torch.Tensor, step: int, settings: TrainSettings) -> torch.Tensor:
    """Random windows [B, T] for `step`: a pure function of (seed, step), so resuming needs no state."""
    generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
    starts = torch.randint(0, len(stream) - settings.seq_len, (settings.batch_size,), generator=generator)
    return torch.stack([stream[s : s + settings.seq_len] for s in starts.tolist()])


def make_optimizer(model: PreTrainedModel, settings: TrainSettings) -> torch.optim.AdamW:
    router_params, decay, no_decay = [], [], []
    for name, param in model.named_parameters():
        if name.endswith("mlp.gate.weight"):
            router_params.append(param)
        elif param.ndim >= 2:
            decay.append(param)
        else:
            no_decay.append(param)
    groups = [
        {"params": decay, "weight_decay": settings.weight_decay, "lr_scale": 1.0},
        {"params": no_decay, "weight_decay": 0.0, "lr_scale": 1.0},
        {"params": router_params, "weight_decay": 0.0, "lr_scale": settings.router_lr_scale},
    ]
    return torch.optim.AdamW(groups, lr=settings.lr, betas=(0.9, 0.95))


def lr_at(step: int, total_steps: int | None, settings: TrainSettings) -> float:
    """Linear warmup, then cosine down to min_lr_ratio * lr at `total_steps`."""
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    assert total_steps is not None, "the step count is calibrated before warmup ends"
    progress = min(1.0, (step - settings.warmup_steps) / max(1, total_steps - settings.warmup_steps))
    floor = settings.min_lr_ratio
    return settings.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def count_params(model: PreTrainedModel) -> tuple[int, int]:
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".mlp.experts." in name)
    return total, experts


# ---------------------------------------------------------------------------------------------
# Evaluation


@torch.no_grad()
def evaluate(model: PreTrainedModel, stream: torch.Tensor, seq_len: int, max_tokens: int, batch_size: int = 8) -> dict:
    """Next-token loss, top-1 accuracy, share of top-1 probabilities > 0.8, and per-layer load,
    over consecutive windows of `seq_len` covering up to `max_tokens` of `stream`."""
    was_training = model.training
    model.eval()
    n_windows = min(len(stream), max_tokens) // seq_len
    windows = stream[: n_windows * seq_len].view(n_windows, seq_len)  # [B, T]
    nll, correct, confident, n = 0.0, 0, 0, 0
    with RouterRecorder(routers_of(model)) as recorder:
        for chunk in windows.split(batch_size):
            logits = model(input_ids=chunk, use_cache=False).logits[:, :-1].float()  # [B, T-1, V]
            targets = chunk[:, 1:]  # [B, T-1]
            logp = torch.log_softmax(logits, dim=-1)
            nll -= logp.gather(-1, targets.unsqueeze(-1)).sum().item()
            top_logp, top_index = logp.max(dim=-1)
            correct += (top_index == targets).sum().item()
            confident += (top_logp > math.log(0.8)).sum().item()
            n += targets.numel()
    model.train(was_training)
    spread = load_spread(recorder.counts)
    return {
        "tokens": n,
        "loss": round(nll / n, 4),
        "top1": round(correct / n, 4),
        "top1_prob_gt_0.8": round(confident / n, 4),
        "load_min_over_mean": [lo for lo, _ in spread],
        "load_max_over_mean": [hi for _, hi in spread],
        "balanced_0.1_to_3x": all(lo >= 0.1 and hi <= 3.0 for lo, hi in spread),
    }


# ---------------------------------------------------------------------------------------------
# Training


@dataclass
class Progress:
    step: int = 0
    elapsed_s: float = 0.0
    tokens_seen: int = 0
    total_steps: int | None = None


def _limit_chars(files: Sequence[SourceFile], limit: int | None) -> list[SourceFile]:
    if limit is None:
        return list(files)
    chosen, chars = [], 0
    for source in files:
        if chars >= limit:
            break
        chosen.append(source)
        chars += len(source.text)
    return chosen


def _append_log(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


class CheckpointError(MoeSpecError):
    """A checkpoint that cannot be resumed: unreadable, corrupt, or written by another run or format."""


def _save_checkpoint(directory: Path, model, optimizer, progress: Progress, settings: TrainSettings) -> None:
    """`directory`/weights-STEP.safetensors (model and optimizer tensors) and `directory`/state.json
    (the rest, RNG state as a list of bytes). No pickle: a checkpoint is data, never code. state.json
    names its weights file and is replaced last, so a crash between the two writes leaves the
    previous checkpoint whole."""
    directory.mkdir(parents=True, exist_ok=True)
    weights = f"weights-{progress.step}.safetensors"
    tensors, stored = {}, set()
    for name, tensor in model.state_dict().items():
        tensor = tensor.detach().contiguous()
        if tensor.data_ptr() in stored:  # a tied weight (lm_head = embed_tokens): safetensors stores no aliases
            tensor = tensor.clone()
        stored.add(tensor.data_ptr())
        tensors[f"model.{name}"] = tensor
    optimizer_state = optimizer.state_dict()["state"]
    for index, state in optimizer_state.items():
        tensors.update({f"optimizer.{index}.{key}": _as_tensor(value).contiguous() for key, value in state.items()})
    save_file(tensors, str(directory / (weights + ".tmp")))
    os.replace(directory / (weights + ".tmp"), directory / weights)
    state = {
        "format": CHECKPOINT_FORMAT,
        "weights": weights,
        "weights_sha256": hashlib.sha256((directory / weights).read_bytes()).hexdigest(),
        "progress": asdict(progress),
        "resume_key": settings.resume_key(),
        "torch_rng": torch.get_rng_state().tolist(),
        "optimizer_params": len(optimizer_state),
    }
    (directory / (STATE_FILE + ".tmp")).write_text(json.dumps(state) + "\n")
    os.replace(directory / (STATE_FILE + ".tmp"), directory / STATE_FILE)
    for old in directory.glob("weights-*.safetensors"):
        if old.name != weights:
            old.unlink()


def has_checkpoint(directory: Path) -> bool:
    """Whether `directory` holds a checkpoint to resume; `CheckpointError` for an older moe_spec's
    pickled one, which is never loaded (unpickling a file runs whatever code it holds)."""
    if (directory / STATE_FILE).exists():
        return True
    if (directory / LEGACY_CHECKPOINT).exists():
        raise CheckpointError(f"{directory / LEGACY_CHECKPOINT} is a pickled checkpoint of an older moe_spec, "
                              "which is not loaded (a pickle can run code); delete it to start again")
    return False


def _as_tensor(value) -> torch.Tensor:
    """Optimizer state entries are tensors (AdamW's `step` included); a plain number is stored as one."""
    return value if isinstance(value, torch.Tensor) else torch.tensor(value)


def _load_checkpoint(directory: Path, model, optimizer, settings: TrainSettings) -> Progress:
    """Restore model, optimizer and RNG from `_save_checkpoint`'s files; `CheckpointError` naming the
    file and the problem for anything else. The optimizer's param groups are rebuilt from the
    settings (equal by `resume_key`); only its per-parameter state is read."""
    state_path = directory / STATE_FILE
    try:
        state = json.loads(state_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"cannot read checkpoint {state_path}: {error}") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{state_path} is not a {CHECKPOINT_FORMAT} checkpoint; use another --out or delete it")
    if state.get("resume_key") != settings.resume_key():
        raise CheckpointError(f"{state_path} was written with other settings; use another --out or delete it")
    try:
        progress = Progress(**state["progress"])
        rng = torch.tensor(state["torch_rng"], dtype=torch.uint8)
        weights = directory / Path(str(state["weights"])).name
        digest = str(state["weights_sha256"])
    except (KeyError, TypeError, ValueError, OverflowError, RuntimeError) as error:
        raise CheckpointError(f"{state_path} is malformed ({type(error).__name__}: {error})") from None
    if rng.shape != torch.get_rng_state().shape:
        raise CheckpointError(f"{state_path}: torch_rng holds {rng.numel()} bytes, expected {torch.get_rng_state().numel()}")
    fresh = optimizer.state_dict()
    expected = {f"model.{name}": (tuple(t.shape), t.dtype) for name, t in model.state_dict().items()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, param in enumerate(params):  # AdamW's state of each parameter
        expected[f"optimizer.{index}.step"] = ((), torch.float32)
        expected[f"optimizer.{index}.exp_avg"] = (tuple(param.shape), param.dtype)
        expected[f"optimizer.{index}.exp_avg_sq"] = (tuple(param.shape), param.dtype)
    header = read_header(weights)
    check_expected(weights, header, expected)
    if hashlib.sha256(weights.read_bytes()).hexdigest() != digest:
        raise CheckpointError(f"{weights} does not match the checksum in {state_path} (corrupt, or from another checkpoint)")
    tensors = read_tensors(weights)
    model.load_state_dict({name.removeprefix("model."): t for name, t in tensors.items() if name.startswith("model.")})
    optimizer_state = {index: {key: tensors[f"optimizer.{index}.{key}"] for key in ("step", "exp_avg", "exp_avg_sq")}
                       for index in range(len(params))}
    optimizer.load_state_dict({"state": optimizer_state, "param_groups": fresh["param_groups"]})
    torch.set_rng_state(rng)
    return progress


@dataclass(frozen=True)
class TokenStreams:
    tokenizer: object
    train: torch.Tensor  # [T_train] long: the training files, one stream
    heldout: torch.Tensor  # [T_heldout] long
    corpus_sha256: str
    python_version: str  # of the standard library the corpus was read from


@dataclass
class _Interval:
    """What the training log sums up since its last line."""

    counts: torch.Tensor  # [L, E] expert choices
    loss: float = 0.0
    steps: int = 0

    def add(self, loss: float, counts: torch.Tensor) -> None:
        self.loss += loss
        self.steps += 1
        self.counts += counts

    def record(self, step: int, lr: float, tokens_seen: int) -> dict:
        """The log line for the interval; starts the next one."""
        spread = load_spread(self.counts)
        record = {"step": step, "lr": lr, "train_loss": round(self.loss / self.steps, 4), "tokens_seen": tokens_seen,
                  "load_min_over_mean": [lo for lo, _ in spread], "load_max_over_mean": [hi for _, hi in spread]}
        self.loss, self.steps = 0.0, 0
        self.counts.zero_()
        return record


def train(settings: TrainSettings, command: str = "") -> dict:
    """Train (or resume), evaluate, save OUT/model; returns the metadata written beside the model
    (`command`, how the run was started, is recorded in it).

    Randomness is explicit: batches come from per-step generators (`batch_at`), and the weights
    are initialised from `settings.seed` inside `torch.random.fork_rng`, which also holds the RNG
    state a checkpoint saves and restores, so the caller's global RNG is left as it was. The thread
    count is the caller's (the CLI sets it).
    """
    out = Path(settings.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = out / "model"
    if (model_dir / META_FILE).exists():
        print(f"{model_dir} is complete; delete it to train again", file=sys.stderr)
        return json.loads((model_dir / META_FILE).read_text())
    # 1) tokenizer and token streams
    data = token_streams(settings, out / "tokenizer")
    with torch.random.fork_rng():
        torch.manual_seed(settings.seed)
        # 2) the model and optimizer: fresh, or from the checkpoint
        model, optimizer, progress = _start_or_resume(settings, data, out)
        # 3) the steps, until the step count or `stop_after_steps`
        stopped = _train_steps(model, optimizer, progress, data, settings, out)
    if stopped:
        return {"stopped_at_step": progress.step}
    # 4) evaluate, save, reload, evaluate again
    return _finish(model, data, progress, settings, command)


def token_streams(settings: TrainSettings, tokenizer_dir: Path) -> TokenStreams:
    """The corpus (cut to `corpus_chars`) encoded with the tokenizer in `tokenizer_dir`, trained there first if absent."""
    corpus = load_corpus()
    train_files = _limit_chars(corpus.train_files, settings.corpus_chars)
    heldout_files = _limit_chars(corpus.heldout_files, settings.corpus_chars)
    if tokenizer_dir.exists():
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        tokenizer = train_tokenizer([f.text for f in train_files], settings.shape.vocab_size)
        tokenizer.save_pretrained(tokenizer_dir)
    train_stream = torch.tensor(encode_documents(tokenizer, [f.text for f in train_files]))
    heldout_stream = torch.tensor(encode_documents(tokenizer, [f.text for f in heldout_files]))
    if len(heldout_stream) < settings.final_eval_tokens:
        raise ValueError(f"held-out text has {len(heldout_stream)} tokens, fewer than {settings.final_eval_tokens}")
    return TokenStreams(tokenizer, train_stream, heldout_stream, corpus.sha256, corpus.python_version)


def _start_or_resume(settings: TrainSettings, data: TokenStreams, out: Path):
    """(model, optimizer, progress): a model initialised from the global RNG, restored from
    OUT/checkpoint when one exists; the log records which."""
    config = build_config(settings.shape, data.tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config, experts_implementation=EXPERTS_IMPLEMENTATION)
    model.train()
    optimizer = make_optimizer(model, settings)
    checkpoint_path, log_path = out / CHECKPOINT_DIR, out / LOG_FILE
    if has_checkpoint(checkpoint_path):
        progress = _load_checkpoint(checkpoint_path, model, optimizer, settings)
        _append_log(log_path, {"event": "resume", **asdict(progress)})
        return model, optimizer, progress
    total, in_experts = count_params(model)
    _append_log(log_path, {"event": "start", "settings": asdict(settings), "params_total": total,
                           "params_experts": in_experts, "train_tokens": len(data.train),
                           "heldout_tokens": len(data.heldout), "corpus_sha256": data.corpus_sha256})
    return model, optimizer, Progress(total_steps=settings.max_steps)


def _train_steps(model, optimizer, progress: Progress, data: TokenStreams, settings: TrainSettings, out: Path) -> bool:
    """Steps until `progress.total_steps` (False) or `stop_after_steps` (True); logs, evaluates on
    held-out windows and checkpoints along the way."""
    routers = routers_of(model)
    log_path = out / LOG_FILE
    eval_stream = data.heldout[: settings.eval_windows * settings.seq_len]
    interval = _Interval(torch.zeros(len(routers), settings.shape.n_routed_experts, dtype=torch.long))
    calibration_start: float | None = None
    last_checkpoint = time.monotonic()
    bar = tqdm(total=progress.total_steps, initial=progress.step, desc="train-target", mininterval=30, file=sys.stderr)
    while progress.total_steps is None or progress.step < progress.total_steps:
        step_start = time.monotonic()
        lr = lr_at(progress.step, progress.total_steps, settings)
        loss, counts = _optimizer_step(model, optimizer, routers, batch_at(data.train, progress.step, settings), lr, settings)
        progress.step += 1
        progress.tokens_seen += settings.batch_size * settings.seq_len
        interval.add(loss, counts)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
        if progress.total_steps is None:
            calibration_start = _calibrate(progress, settings, calibration_start, log_path)
            bar.total = progress.total_steps

        record = None
        if progress.step % settings.log_every == 0 or progress.step == progress.total_steps:
            record = interval.record(progress.step, lr, progress.tokens_seen)
        if progress.step % settings.eval_every == 0:
            heldout = evaluate(model, eval_stream, settings.seq_len, len(eval_stream))
            record = (record or {"step": progress.step}) | {"heldout_loss": heldout["loss"]}
        progress.elapsed_s += time.monotonic() - step_start
        if record is not None:
            record["elapsed_min"] = round(progress.elapsed_s / 60, 2)
            record["train_tok_per_s"] = round(progress.tokens_seen / max(progress.elapsed_s, 1e-9))
            _append_log(log_path, record)
            bar.write(json.dumps(record))

        finished = progress.step == progress.total_steps
        stopping = settings.stop_after_steps is not None and progress.step >= settings.stop_after_steps
        if finished or stopping or time.monotonic() - last_checkpoint >= settings.checkpoint_every_s:
            _save_checkpoint(out / CHECKPOINT_DIR, model, optimizer, progress, settings)
            last_checkpoint = time.monotonic()
        if stopping and not finished:
            bar.close()
            _append_log(log_path, {"event": "stopped", "step": progress.step})
            return True
    bar.close()
    return False


def _optimizer_step(model, optimizer, routers, input_ids: torch.Tensor, lr: float,
                    settings: TrainSettings) -> tuple[float, torch.Tensor]:
    """One step on input_ids [B, T], then the routers' bias refinement; (loss, expert counts [L, E])."""
    for group in optimizer.param_groups:
        group["lr"] = lr * group["lr_scale"]
    with RouterRecorder(routers) as recorder:
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    refine_biases(routers, recorder.inputs, settings.balance_gamma, settings.balance_refinements, settings.bias_clip)
    return loss.item(), recorder.counts


def _calibrate(progress: Progress, settings: TrainSettings, started: float | None, log_path: Path) -> float | None:
    """Turn the minute budget into a step count once `calibration_steps` are timed (the first
    `_UNTIMED_STEPS` left out); returns when the timed steps started."""
    if progress.step == _UNTIMED_STEPS:
        return time.monotonic()
    if progress.step == settings.calibration_steps:
        seconds_per_step = (time.monotonic() - started) / (settings.calibration_steps - _UNTIMED_STEPS)
        seconds_per_step *= 1.03  # periodic evaluation and checkpoints
        progress.total_steps = max(progress.step + 1, int(settings.minutes * 60 / seconds_per_step))
        _append_log(log_path, {"event": "calibrated", "seconds_per_step": round(seconds_per_step, 3),
                               "total_steps": progress.total_steps})
    return started


def _finish(model, data: TokenStreams, progress: Progress, settings: TrainSettings, command: str) -> dict:
    """Evaluate in fp32, save in bfloat16 (selection bias kept fp32), reload and evaluate again."""
    out = Path(settings.out)
    model_dir = out / "model"
    heldout_fp32 = evaluate(model, data.heldout, settings.seq_len, settings.final_eval_tokens)
    params_total, params_experts = count_params(model)

    routers = routers_of(model)
    biases = [router.e_score_correction_bias.detach().clone() for router in routers]  # [E] each, fp32
    model.to(torch.bfloat16)
    for router, bias in zip(routers, biases):
        router.e_score_correction_bias.data = bias  # a bf16 bias would perturb near-tied selections
    model.save_pretrained(model_dir)
    data.tokenizer.save_pretrained(model_dir)

    reloaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                    experts_implementation=EXPERTS_IMPLEMENTATION)
    bias_restored = all(torch.equal(router.e_score_correction_bias, bias)
                        for router, bias in zip(routers_of(reloaded), biases))
    if not bias_restored:
        raise RuntimeError("e_score_correction_bias did not survive save_pretrained / from_pretrained")
    heldout_bf16 = evaluate(reloaded, data.heldout, settings.seq_len, settings.final_eval_tokens)

    meta = {
        "command": command,
        "corpus_sha256": data.corpus_sha256,
        "python_version": data.python_version,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "experts_implementation": EXPERTS_IMPLEMENTATION,
        "seed": settings.seed,
        "torch_threads": torch.get_num_threads(),
        "training_minutes": round(progress.elapsed_s / 60, 2),
        "steps": progress.step,
        "tokens_seen": progress.tokens_seen,
        "params_total": params_total,
        "params_experts": params_experts,
        "experts_share": round(params_experts / params_total, 4),
        "heldout_fp32": heldout_fp32,
        "heldout_bf16_weights": heldout_bf16,
        "bias_restored_by_from_pretrained": bias_restored,
        "shape": asdict(settings.shape),
        "settings": asdict(settings),
    }
    (model_dir / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    _append_log(out / LOG_FILE, {"event": "final", "heldout_fp32": heldout_fp32,
                                           "heldout_bf16_weights": heldout_bf16})
    return meta
