"""moe_spec as a drop-in decoding loop for transformers' `model.generate`.

    from moe_spec import LookupDrafter
    from moe_spec.integrations.hf_generate import speculative_generate

    out = model.generate(input_ids, custom_generate=speculative_generate, drafter=LookupDrafter(),
                         max_new_tokens=64)                      # greedy: identical to plain generate
    out = model.generate(input_ids, custom_generate=speculative_generate, drafter=LookupDrafter(),
                         controller=MoeAwareController(profile),  # optional: a moe_spec controller
                         do_sample=True, temperature=0.8, top_p=0.95, moe_streamer=streamer,
                         return_dict_in_generate=True)
    out = model.generate(input_ids, custom_generate=speculative_generate, drafter="runs/head",
                         method="moe-aware", profile="runs/profile.json")  # a method by name

transformers 5.23 runs a callable `custom_generate` after its own preparation (generation config,
special tokens, `max_length`, logits processors, stopping criteria) as
`custom_generate(model, input_ids, logits_processor=..., stopping_criteria=..., generation_config=...,
**custom_kwargs, **model_kwargs)`; parameters of the callable that `_sample` lacks (`drafter`,
`controller`, `method`, `profile`, `generator`, `observer`, `moe_streamer`, `offload`) are taken from
`generate`'s keyword arguments and handed over. This function then decodes with `SpecDecoder`, so the output is the target's own: greedy
output equals `model.generate(..., do_sample=False)`, sampled output is distributed as the target's
(see `acceptance.py`).

How `generate`'s settings are mapped:
- `do_sample=False` -> greedy; `do_sample=True` -> the generation config's `temperature`, `top_k`
  and `top_p` (transformers' defaults included, e.g. `top_k=50`), applied in transformers' order;
- `max_new_tokens` / `max_length` -> the generation config's prepared `max_length` minus the prompt
  length (as `generate` counts it, left padding included);
- `eos_token_id` -> the generation config's (after `generate` filled it from the model);
- `drafter`: a `Drafter`, a name for `moe_spec.loading.load_drafter` ('lookup', 'mtp', 'default',
  an EAGLE-3 head folder or a draft model's folder) or None (plain autoregressive decoding through moe_spec's cache machinery);
- `controller`: a moe_spec `Controller`, or None: with a drafter and no `method`, `moe-aware` on
  `profile` where one is given, else the best fixed tree measured so far (`static:4`, with a warning);
- `method`: instead of `controller`, a method of `moe_spec.policy.registry` by name (`ar`, `eagle2`,
  `static:N`, `truncate`, `moe-aware`, `moe-aware-noexperts`), built as `moe-spec bench` builds
  it: on `drafter` (needed by every method but `ar`, which decodes without one) and, for the
  methods that price nodes, `profile` (a `Profile` or the path of a profile JSON of this target);
- `generator`: a `torch.Generator` for sampling; without one a generator is seeded from torch's
  global RNG, so `torch.manual_seed(s)` makes a sampled call reproducible as it does for `generate`;
- `offload`: the `ExpertOffload` that `moe_spec.offload.offloaded_experts.offload_experts` installed
  on this model, so the decode reads its counters and residency (as `TargetModel(model, offload=...)`);
  an offloaded model decodes without it too, its reads then go uncounted;
- `moe_streamer`: a streamer (`put` / `end`, as transformers' `TextStreamer`) that receives the
  prompt, then the new tokens step by step, then `end()`. Pass it instead of `streamer`:
  transformers 5.23 never hands `streamer` to a callable `custom_generate` (`streamer` is a
  parameter of `_sample`, so `_extract_generation_mode_kwargs` does not count it among the
  callable's own arguments, and it is not among the model kwargs either). `generate` only sends it
  the prompt, and nothing that reaches this function tells that one was given, so it cannot be
  refused here: a `streamer=` gets the prompt and never `end()`;
- a batch is given left-padded with its `attention_mask`, as for `generate`; rows decode together
  in one verify pass per step (a batched drafter such as `EagleDrafter` drafts them together, a per-sequence
  one runs one `spawn()`ed copy per row), and rows that finish
  early are padded with the generation config's `pad_token_id` (else its first EOS id);
- `return_dict_in_generate=True` -> `GenerateDecoderOnlyOutput(sequences=...)`; else the
  `[B, T_prompt + T_new]` sequences tensor.

Refused with `InputError`, rather than silently ignored: beams or several return sequences, logits
processors other than temperature / top-k / top-p (repetition penalty, min length, ...: tree
verification scores drafts with the raw distribution), stopping criteria other than max
length and EOS, `output_scores` / `output_logits` / attentions / hidden states, a non-empty cache;
and, by name, a value of the wrong type or range (a `max_new_tokens` of 2.5 or True, which `generate`
would add to `max_length` unchecked; a non-bool `do_sample`; non-integer EOS ids; a negative
`pad_token_id`; a `drafter`, `controller`, `method`, `profile`, `observer` or `offload` of the wrong kind
(or an offload installed on another model); and
everything `SpecDecoder.generate` checks). What `generate` itself refuses before it calls this
function (e.g. `temperature=nan` with `do_sample=True`, `top_k=2.5`) stays transformers' own error.
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import GenerationConfig, PreTrainedModel
from transformers.generation import GenerateDecoderOnlyOutput
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from moe_spec.core.control import Controller
from moe_spec.core.drafting import Drafter
from moe_spec.core.engine import SpecDecoder
from moe_spec.core.step_record import DecodeObserver
from moe_spec.errors import InputError
from moe_spec.core.target import TargetModel
from moe_spec.loading import load_drafter
from moe_spec.integrations.decoder import method_for
from moe_spec.offload.offloaded_experts import ExpertOffload
from moe_spec.profile.artifact import Profile

_SAMPLING_WARPERS = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
_STOPPING = (MaxLengthCriteria, EosTokenCriteria)
# what `generate` prepares for a decoder-only forward; moe_spec builds its own cache, positions and masks
_PREPARED_MODEL_KWARGS = {"attention_mask", "past_key_values", "position_ids", "use_cache", "logits_to_keep", "cache_position"}
_UNSUPPORTED_OUTPUTS = ("output_scores", "output_logits", "output_attentions", "output_hidden_states")


def speculative_generate(
    model: PreTrainedModel,
    input_ids: torch.Tensor,  # [B, T] long, as prepared by `generate`
    logits_processor=None,
    stopping_criteria=None,
    generation_config: GenerationConfig | None = None,
    drafter: Drafter | str | None = None,
    controller: Controller | None = None,
    method: str | None = None,
    profile: Profile | str | Path | None = None,
    generator: torch.Generator | None = None,
    observer: DecodeObserver | None = None,
    moe_streamer=None,
    offload: ExpertOffload | None = None,
    **model_kwargs,
) -> torch.Tensor | GenerateDecoderOnlyOutput:
    """The decoding loop `model.generate(..., custom_generate=speculative_generate)` runs; see module docstring.

    `model_kwargs` are what `generate` prepared for the model's forward; only `attention_mask`
    ([B, T], left padding; None: no padding) is used, since `SpecDecoder` builds its own cache,
    positions and tree masks. (They must stay in `**model_kwargs`: a named parameter here would make
    `generate` treat it as a custom argument and hand it over twice.)
    """
    config = generation_config if generation_config is not None else model.generation_config
    _check_supported(input_ids, config, logits_processor, stopping_criteria, model_kwargs)
    _check_arguments(drafter, controller, method, profile, observer)
    _check_offload(model, offload)
    _check_lengths(config)
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2:
        raise InputError(f"input_ids must be a [B, T] integer torch.Tensor, got {type(input_ids).__name__}")
    attention_mask = model_kwargs.get("attention_mask")
    # `generate` drops an all-ones mask before calling this (any dtype, and any shape that broadcasts),
    # keeping only its width: a mask of the wrong width is refused here rather than ignored
    dropped_width = getattr(config, "_mask_length", None)
    if attention_mask is None and dropped_width is not None and dropped_width != input_ids.shape[1]:
        raise InputError(f"attention_mask has {dropped_width} columns, input_ids {input_ids.shape[1]}")
    max_new_tokens = config.max_length - int(input_ids.shape[1])
    if max_new_tokens < 1:
        raise InputError(f"the prompt ({input_ids.shape[1]} tokens) already reaches max_length={config.max_length}")
    target = TargetModel(model, offload=offload)
    drafter, controller = _drafter_and_controller(target, drafter, controller, method, profile)
    sampling = _sampling_settings(config)
    if sampling["temperature"] > 0 and generator is None:
        # what `generate` does implicitly (torch.multinomial on the global RNG), made explicit
        generator = torch.Generator().manual_seed(int(torch.randint(0, 2**62, ())))
    eos = _eos_ids(config)
    decoder = SpecDecoder(target, drafter=drafter, controller=controller, observer=observer)
    result = decoder.generate(
        input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos,
        generator=generator,
        streamer=moe_streamer,
        **sampling,
    )
    pad = _pad_id(config, eos)
    sequences = _padded_after_eos(result.sequences, input_ids.shape[1], set(eos), int(pad)).to(input_ids.device)
    if config.return_dict_in_generate:
        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


def _drafter_and_controller(target: TargetModel, drafter, controller, method: str | None, profile):
    """The drafter and controller to decode with: as given, or method `method` of the registry."""
    if isinstance(drafter, str):
        drafter = load_drafter(drafter, target)
    return method_for(target, drafter, method, profile, caller="speculative_generate", controller=controller)


def _check_arguments(drafter, controller, method, profile, observer) -> None:
    """The custom arguments' types, so a wrong one is named rather than failing mid-decode."""
    if drafter is not None and not isinstance(drafter, str) and not _has_methods(drafter, "begin", "propose", "commit"):
        raise InputError(f"drafter= must be a Drafter (begin / propose / commit), a spec string such as 'lookup' "
                         f"or a head folder, or None; got {type(drafter).__name__}")
    if controller is not None and not _has_methods(controller, "begin", "plan", "observe"):
        raise InputError(f"controller= must be a moe_spec Controller (begin / plan / observe) or None; "
                         f"got {type(controller).__name__}")
    if method is not None and not isinstance(method, str):
        raise InputError(f"method= must be a method name such as 'eagle2' or None; got {type(method).__name__}")
    if profile is not None and not isinstance(profile, (Profile, str, Path)):
        raise InputError(f"profile= must be a Profile, the path of a profile JSON, or None; got {type(profile).__name__}")
    if observer is not None and not _has_methods(observer, "on_prefill", "on_step"):
        raise InputError(f"observer= must be a DecodeObserver (on_prefill / on_step) or None; got {type(observer).__name__}")


def _check_offload(model: PreTrainedModel, offload) -> None:
    """`offload` is None or the `ExpertOffload` serving this model's experts now (its registered
    implementation is the one the model runs)."""
    if offload is None:
        return
    if not isinstance(offload, ExpertOffload):
        raise InputError(f"offload= must be the ExpertOffload that offload_experts returned, or None; "
                         f"got {type(offload).__name__}")
    running = getattr(model.config, "_experts_implementation", None)
    if offload.implementation is None or running != offload.implementation:
        raise InputError(f"offload= is not installed on this model (it runs experts implementation {running!r}, "
                         f"the offload registered {offload.implementation!r})")


def _has_methods(value, *names: str) -> bool:
    return all(callable(getattr(value, name, None)) for name in names)


def _check_lengths(config: GenerationConfig) -> None:
    """`generate` adds `max_new_tokens` to the prompt length unchecked: 2.5 or True would decode 2 or 1 tokens."""
    for name in ("max_new_tokens", "max_length"):
        value = getattr(config, name, None)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise InputError(f"{name} must be an integer, got {value!r} ({type(value).__name__})")
    if not isinstance(config.do_sample, bool):
        raise InputError(f"do_sample must be True or False, got {config.do_sample!r} ({type(config.do_sample).__name__})")


def _check_supported(input_ids, config: GenerationConfig, logits_processor, stopping_criteria, model_kwargs: dict) -> None:
    if (config.num_beams or 1) > 1 or (config.num_return_sequences or 1) > 1:
        raise InputError("speculative_generate supports neither beam search nor num_return_sequences > 1")
    requested = [name for name in _UNSUPPORTED_OUTPUTS if getattr(config, name, False)]
    if requested:
        raise InputError(f"speculative_generate returns sequences only; unsupported: {', '.join(requested)}")
    others = [type(p).__name__ for p in (logits_processor or []) if not isinstance(p, _SAMPLING_WARPERS)]
    if others:
        raise InputError(
            f"speculative_generate verifies drafts against the model's own distribution (temperature, top-k, top-p); "
            f"it cannot apply {', '.join(others)}"
        )
    stops = [type(c).__name__ for c in (stopping_criteria or []) if not isinstance(c, _STOPPING)]
    if stops:
        raise InputError(f"speculative_generate stops at max length and EOS only; unsupported: {', '.join(stops)}")
    cache = model_kwargs.get("past_key_values")
    if cache is not None and cache.get_seq_length() > 0:
        raise InputError("speculative_generate starts from an empty cache; pass no past_key_values")
    unknown = sorted(set(model_kwargs) - _PREPARED_MODEL_KWARGS)
    if unknown:
        raise InputError(f"speculative_generate takes input_ids and attention_mask only; unsupported: {', '.join(unknown)}")


def _sampling_settings(config: GenerationConfig) -> dict:
    """`SpecDecoder.generate`'s temperature / top_k / top_p for a generation config."""
    if not config.do_sample:
        return {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    temperature = 1.0 if config.temperature is None else float(config.temperature)
    if temperature <= 0:
        raise InputError(f"do_sample=True needs temperature > 0, got {temperature}; use do_sample=False for greedy")
    return {
        "temperature": temperature,
        "top_k": int(config.top_k or 0),
        "top_p": 1.0 if config.top_p is None else float(config.top_p),
    }


def _eos_ids(config: GenerationConfig) -> list[int]:
    """The generation config's EOS ids; an empty list (not None) so `SpecDecoder` does not fall back.

    Non-integer ids are refused here rather than truncated (`int(2.5)` would stop at token 2);
    `SpecDecoder` checks the range."""
    eos = config.eos_token_id
    if eos is None:
        return []
    ids = torch.as_tensor(eos)
    if ids.dtype == torch.bool or ids.dtype.is_floating_point or ids.dtype.is_complex:
        raise InputError(f"eos_token_id must be integer token ids, got {eos!r}")
    return ids.flatten().tolist()


def _pad_id(config: GenerationConfig, eos: list[int]) -> int:
    """The generation config's `pad_token_id` (a non-negative integer), else the first EOS id, else 0."""
    pad = config.pad_token_id
    if pad is None:
        return eos[0] if eos else 0
    if isinstance(pad, torch.Tensor) and pad.numel() == 1 and not pad.dtype.is_floating_point and pad.dtype != torch.bool:
        pad = int(pad)
    if isinstance(pad, bool) or not isinstance(pad, int) or pad < 0:
        raise InputError(f"pad_token_id must be a non-negative integer token id, got {pad!r}")
    return pad


def _padded_after_eos(sequences: torch.Tensor, prompt_len: int, eos: set[int], pad: int) -> torch.Tensor:
    """[B, T] sequences with every position after a row's first new EOS set to `pad`, as `generate` pads."""
    sequences = sequences.clone()
    for row in sequences:
        new = row[prompt_len:].tolist()
        first = next((i for i, t in enumerate(new) if t in eos), None)
        if first is not None:
            row[prompt_len + first + 1:] = pad
    return sequences
