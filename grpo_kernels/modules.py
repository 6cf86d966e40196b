"""nn.Module wrappers that hold a GRPO loss configuration (validated when the module is built).

Each ``__init__`` takes its function's keywords, written out as the function writes them (every GRPO
keyword: ``tools/signatures.py``), checks them at once, and holds those that differ from the
function's defaults as ``config``; ``forward`` calls the function with them, keywords given per call
(any keyword of the function) overriding the held ones.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Union

import torch

from . import _validation as V
from . import functional
from .objective import GRPOLossOutput
from .options import BACKENDS, NOT_GIVEN, NotGiven, split_grpo_keywords
from .prepare import FP32_LOGITS_DEFAULT
from .sampling_mask import SamplingMask


def _held(function: Callable, keywords: Dict[str, Any]) -> Dict[str, Any]:
    """The ``keywords`` whose values differ from ``function``'s defaults: what a module holds (and its repr
    shows). A tensor always differs (no default is one)."""
    defaults = {name: p.default for name, p in inspect.signature(function).parameters.items()}
    return {name: value for name, value in keywords.items()
            if value is not defaults[name] and not (type(value) is type(defaults[name]) and value == defaults[name])}


def _overridden(held: Dict[str, Any], per_call: Dict[str, Any]) -> Dict[str, Any]:
    """The keywords of a module's call: those it holds, each given per call (not NOT_GIVEN) overriding."""
    return {**held, **{name: value for name, value in per_call.items() if value is not NOT_GIVEN}}


class GRPOLoss(torch.nn.Module):
    """``GRPOLoss(**keywords)(logits, completion_ids, advantages, completion_mask=None, **per_call)``:
    :func:`grpo_kernels.grpo_loss` with the keywords given here; keywords given per call (e.g.
    ``old_logps``, ``ref_logps``, ``num_items_in_batch``; any keyword of the function) override them.
    """

    def __init__(
        self,
        *,
        # >>> GRPO keywords (tools/signatures.py)
        # per-call tensors, constants of the loss (options.GRPOInputs)
        old_logps: Optional[torch.Tensor] = None,
        ref_logps: Optional[torch.Tensor] = None,
        is_ratio: Optional[torch.Tensor] = None,
        num_items_in_batch: Any = None,
        segment_ids: Optional[torch.Tensor] = None,
        rollout_logps: Optional[torch.Tensor] = None,
        global_batch_size: Any = None,
        sampling_mask: Optional[SamplingMask] = None,
        # the loss's options, each checked against its declaration (options.GRPOOptions)
        beta: float = 0.0,
        eps_low: float = 0.2,
        eps_high: Optional[float] = None,
        delta: Optional[float] = None,
        temperature: Union[float, torch.Tensor] = 1.0,
        softcap: Optional[float] = None,
        logit_scale: float = 1.0,
        top_k: Union[int, torch.Tensor, None] = None,
        top_p: Union[float, torch.Tensor, None] = None,
        loss_type: Optional[str] = None,
        loss_mode: Optional[str] = None,
        loss_agg_mode: Optional[str] = None,
        kl_loss_type: Optional[str] = None,
        max_completion_length: Optional[int] = None,
        importance_sampling_level: str = "token",
        entropy_coef: float = 0.0,
        use_bias_correction_kl: bool = False,
        top_entropy_quantile: float = 1.0,
        off_policy_mask_threshold: Optional[float] = None,
        rollout_correction: Optional[str] = None,
        rollout_correction_max: Optional[float] = 3.0,
        rollout_correction_min: Optional[float] = None,
        clip_cov_ratio: Optional[float] = None,
        clip_cov_lb: Optional[float] = None,
        clip_cov_ub: Optional[float] = None,
        kl_cov_ratio: Optional[float] = None,
        ppo_kl_coef: Optional[float] = None,
        dro_beta: Optional[float] = None,
        dp_size: int = 1,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        # verl's spellings of the options above (options.VERL_SPELLINGS)
        clip_ratio_low: Union[float, NotGiven] = NOT_GIVEN,
        clip_ratio_high: Union[float, None, NotGiven] = NOT_GIVEN,
        clip_ratio_c: Union[float, None, NotGiven] = NOT_GIVEN,
        kl_loss_coef: Union[float, NotGiven] = NOT_GIVEN,
        entropy_coeff: Union[float, NotGiven] = NOT_GIVEN,
        rollout_is_weights: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        tau_pos: Union[float, NotGiven] = NOT_GIVEN,
        tau_neg: Union[float, NotGiven] = NOT_GIVEN,
        loss_scale_factor: Union[int, None, NotGiven] = NOT_GIVEN,
        batch_num_tokens: Any = NOT_GIVEN,
        clip_ratio: Union[float, NotGiven] = NOT_GIVEN,
        # verl keys without an equivalent: refused, saying what to pass (options.VERL_WITHOUT_EQUIVALENT)
        use_kl_loss: NotGiven = NOT_GIVEN,
        calculate_entropy: NotGiven = NOT_GIVEN,
        policy_loss: NotGiven = NOT_GIVEN,
        global_batch_info: NotGiven = NOT_GIVEN,
        # <<< GRPO keywords
        backend: str = "auto",
        inplace_backward: bool = False,
        process_group: Optional[Any] = None,
        reduce_hidden_grad: bool = False,
    ) -> None:
        super().__init__()
        V.check_choice("backend", backend, BACKENDS)
        inplace_backward = V.check_flag("inplace_backward", inplace_backward)
        grpo_kwargs = {
            # >>> GRPO keywords passed on (tools/signatures.py)
            "old_logps": old_logps, "ref_logps": ref_logps, "is_ratio": is_ratio,
            "num_items_in_batch": num_items_in_batch, "segment_ids": segment_ids, "rollout_logps": rollout_logps,
            "global_batch_size": global_batch_size, "sampling_mask": sampling_mask, "beta": beta, "eps_low": eps_low,
            "eps_high": eps_high, "delta": delta, "temperature": temperature, "softcap": softcap,
            "logit_scale": logit_scale, "top_k": top_k, "top_p": top_p, "loss_type": loss_type, "loss_mode": loss_mode,
            "loss_agg_mode": loss_agg_mode, "kl_loss_type": kl_loss_type,
            "max_completion_length": max_completion_length, "importance_sampling_level": importance_sampling_level,
            "entropy_coef": entropy_coef, "use_bias_correction_kl": use_bias_correction_kl,
            "top_entropy_quantile": top_entropy_quantile, "off_policy_mask_threshold": off_policy_mask_threshold,
            "rollout_correction": rollout_correction, "rollout_correction_max": rollout_correction_max,
            "rollout_correction_min": rollout_correction_min, "clip_cov_ratio": clip_cov_ratio,
            "clip_cov_lb": clip_cov_lb, "clip_cov_ub": clip_cov_ub, "kl_cov_ratio": kl_cov_ratio,
            "ppo_kl_coef": ppo_kl_coef, "dro_beta": dro_beta, "dp_size": dp_size,
            "sapo_temperature_pos": sapo_temperature_pos, "sapo_temperature_neg": sapo_temperature_neg,
            "vespo_k_pos": vespo_k_pos, "vespo_lambda_pos": vespo_lambda_pos, "vespo_k_neg": vespo_k_neg,
            "vespo_lambda_neg": vespo_lambda_neg, "clip_ratio_low": clip_ratio_low, "clip_ratio_high": clip_ratio_high,
            "clip_ratio_c": clip_ratio_c, "kl_loss_coef": kl_loss_coef, "entropy_coeff": entropy_coeff,
            "rollout_is_weights": rollout_is_weights, "tau_pos": tau_pos, "tau_neg": tau_neg,
            "loss_scale_factor": loss_scale_factor, "batch_num_tokens": batch_num_tokens, "clip_ratio": clip_ratio,
            "use_kl_loss": use_kl_loss, "calculate_entropy": calculate_entropy, "policy_loss": policy_loss,
            "global_batch_info": global_batch_info,
            # <<< GRPO keywords passed on
        }
        split_grpo_keywords(grpo_kwargs, "grpo_loss")  # raises now, not at the first forward
        self.config: Dict[str, Any] = _held(functional.grpo_loss, dict(
            grpo_kwargs, backend=backend, inplace_backward=inplace_backward, process_group=process_group,
            reduce_hidden_grad=reduce_hidden_grad))

    def forward(
        self,
        logits: torch.Tensor,
        completion_ids: torch.Tensor,
        advantages: torch.Tensor,
        completion_mask: Optional[torch.Tensor] = None,
        *,
        # >>> GRPO keywords per call (tools/signatures.py)
        # per-call tensors, constants of the loss (options.GRPOInputs)
        old_logps: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        ref_logps: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        is_ratio: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        num_items_in_batch: Any = NOT_GIVEN,
        segment_ids: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        rollout_logps: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        global_batch_size: Any = NOT_GIVEN,
        sampling_mask: Union[SamplingMask, None, NotGiven] = NOT_GIVEN,
        # the loss's options, each checked against its declaration (options.GRPOOptions)
        beta: Union[float, NotGiven] = NOT_GIVEN,
        eps_low: Union[float, NotGiven] = NOT_GIVEN,
        eps_high: Union[float, None, NotGiven] = NOT_GIVEN,
        delta: Union[float, None, NotGiven] = NOT_GIVEN,
        temperature: Union[float, torch.Tensor, NotGiven] = NOT_GIVEN,
        softcap: Union[float, None, NotGiven] = NOT_GIVEN,
        logit_scale: Union[float, NotGiven] = NOT_GIVEN,
        top_k: Union[int, torch.Tensor, None, NotGiven] = NOT_GIVEN,
        top_p: Union[float, torch.Tensor, None, NotGiven] = NOT_GIVEN,
        loss_type: Union[str, None, NotGiven] = NOT_GIVEN,
        loss_mode: Union[str, None, NotGiven] = NOT_GIVEN,
        loss_agg_mode: Union[str, None, NotGiven] = NOT_GIVEN,
        kl_loss_type: Union[str, None, NotGiven] = NOT_GIVEN,
        max_completion_length: Union[int, None, NotGiven] = NOT_GIVEN,
        importance_sampling_level: Union[str, NotGiven] = NOT_GIVEN,
        entropy_coef: Union[float, NotGiven] = NOT_GIVEN,
        use_bias_correction_kl: Union[bool, NotGiven] = NOT_GIVEN,
        top_entropy_quantile: Union[float, NotGiven] = NOT_GIVEN,
        off_policy_mask_threshold: Union[float, None, NotGiven] = NOT_GIVEN,
        rollout_correction: Union[str, None, NotGiven] = NOT_GIVEN,
        rollout_correction_max: Union[float, None, NotGiven] = NOT_GIVEN,
        rollout_correction_min: Union[float, None, NotGiven] = NOT_GIVEN,
        clip_cov_ratio: Union[float, None, NotGiven] = NOT_GIVEN,
        clip_cov_lb: Union[float, None, NotGiven] = NOT_GIVEN,
        clip_cov_ub: Union[float, None, NotGiven] = NOT_GIVEN,
        kl_cov_ratio: Union[float, None, NotGiven] = NOT_GIVEN,
        ppo_kl_coef: Union[float, None, NotGiven] = NOT_GIVEN,
        dro_beta: Union[float, None, NotGiven] = NOT_GIVEN,
        dp_size: Union[int, NotGiven] = NOT_GIVEN,
        sapo_temperature_pos: Union[float, NotGiven] = NOT_GIVEN,
        sapo_temperature_neg: Union[float, NotGiven] = NOT_GIVEN,
        vespo_k_pos: Union[float, NotGiven] = NOT_GIVEN,
        vespo_lambda_pos: Union[float, NotGiven] = NOT_GIVEN,
        vespo_k_neg: Union[float, NotGiven] = NOT_GIVEN,
        vespo_lambda_neg: Union[float, NotGiven] = NOT_GIVEN,
        # verl's spellings of the options above (options.VERL_SPELLINGS)
        clip_ratio_low: Union[float, NotGiven] = NOT_GIVEN,
        clip_ratio_high: Union[float, None, NotGiven] = NOT_GIVEN,
        clip_ratio_c: Union[float, None, NotGiven] = NOT_GIVEN,
        kl_loss_coef: Union[float, NotGiven] = NOT_GIVEN,
        entropy_coeff: Union[float, NotGiven] = NOT_GIVEN,
        rollout_is_weights: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        tau_pos: Union[float, NotGiven] = NOT_GIVEN,
        tau_neg: Union[float, NotGiven] = NOT_GIVEN,
        loss_scale_factor: Union[int, None, NotGiven] = NOT_GIVEN,
        batch_num_tokens: Any = NOT_GIVEN,
        clip_ratio: Union[float, NotGiven] = NOT_GIVEN,
        # verl keys without an equivalent: refused, saying what to pass (options.VERL_WITHOUT_EQUIVALENT)
        use_kl_loss: NotGiven = NOT_GIVEN,
        calculate_entropy: NotGiven = NOT_GIVEN,
        policy_loss: NotGiven = NOT_GIVEN,
        global_batch_info: NotGiven = NOT_GIVEN,
        # <<< GRPO keywords per call
        backend: Union[str, NotGiven] = NOT_GIVEN,
        inplace_backward: Union[bool, NotGiven] = NOT_GIVEN,
        process_group: Any = NOT_GIVEN,
        reduce_hidden_grad: Union[bool, NotGiven] = NOT_GIVEN,
    ) -> GRPOLossOutput:
        """:func:`grpo_kernels.grpo_loss` with the held keywords; a keyword given here overrides its own."""
        per_call = {
            # >>> GRPO keywords passed on (tools/signatures.py)
            "old_logps": old_logps, "ref_logps": ref_logps, "is_ratio": is_ratio,
            "num_items_in_batch": num_items_in_batch, "segment_ids": segment_ids, "rollout_logps": rollout_logps,
            "global_batch_size": global_batch_size, "sampling_mask": sampling_mask, "beta": beta, "eps_low": eps_low,
            "eps_high": eps_high, "delta": delta, "temperature": temperature, "softcap": softcap,
            "logit_scale": logit_scale, "top_k": top_k, "top_p": top_p, "loss_type": loss_type, "loss_mode": loss_mode,
            "loss_agg_mode": loss_agg_mode, "kl_loss_type": kl_loss_type,
            "max_completion_length": max_completion_length, "importance_sampling_level": importance_sampling_level,
            "entropy_coef": entropy_coef, "use_bias_correction_kl": use_bias_correction_kl,
            "top_entropy_quantile": top_entropy_quantile, "off_policy_mask_threshold": off_policy_mask_threshold,
            "rollout_correction": rollout_correction, "rollout_correction_max": rollout_correction_max,
            "rollout_correction_min": rollout_correction_min, "clip_cov_ratio": clip_cov_ratio,
            "clip_cov_lb": clip_cov_lb, "clip_cov_ub": clip_cov_ub, "kl_cov_ratio": kl_cov_ratio,
            "ppo_kl_coef": ppo_kl_coef, "dro_beta": dro_beta, "dp_size": dp_size,
            "sapo_temperature_pos": sapo_temperature_pos, "sapo_temperature_neg": sapo_temperature_neg,
            "vespo_k_pos": vespo_k_pos, "vespo_lambda_pos": vespo_lambda_pos, "vespo_k_neg": vespo_k_neg,
            "vespo_lambda_neg": vespo_lambda_neg, "clip_ratio_low": clip_ratio_low, "clip_ratio_high": clip_ratio_high,
            "clip_ratio_c": clip_ratio_c, "kl_loss_coef": kl_loss_coef, "entropy_coeff": entropy_coeff,
            "rollout_is_weights": rollout_is_weights, "tau_pos": tau_pos, "tau_neg": tau_neg,
            "loss_scale_factor": loss_scale_factor, "batch_num_tokens": batch_num_tokens, "clip_ratio": clip_ratio,
            "use_kl_loss": use_kl_loss, "calculate_entropy": calculate_entropy, "policy_loss": policy_loss,
            "global_batch_info": global_batch_info,
            # <<< GRPO keywords passed on
            "backend": backend, "inplace_backward": inplace_backward, "process_group": process_group,
            "reduce_hidden_grad": reduce_hidden_grad,
        }
        return functional.grpo_loss(logits, completion_ids, advantages, completion_mask,
                                    **_overridden(self.config, per_call))

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())


class FusedLinearGRPOLoss(torch.nn.Module):
    """``FusedLinearGRPOLoss(**keywords)(hidden, weight, completion_ids, advantages, completion_mask=None,
    bias=None, **per_call)``: :func:`grpo_kernels.fused_linear_grpo_loss` with the keywords given here;
    keywords given per call override them.
    """

    def __init__(
        self,
        *,
        # >>> GRPO keywords (tools/signatures.py)
        # per-call tensors, constants of the loss (options.GRPOInputs)
        old_logps: Optional[torch.Tensor] = None,
        ref_logps: Optional[torch.Tensor] = None,
        is_ratio: Optional[torch.Tensor] = None,
        num_items_in_batch: Any = None,
        segment_ids: Optional[torch.Tensor] = None,
        rollout_logps: Optional[torch.Tensor] = None,
        global_batch_size: Any = None,
        sampling_mask: Optional[SamplingMask] = None,
        # the loss's options, each checked against its declaration (options.GRPOOptions)
        beta: float = 0.0,
        eps_low: float = 0.2,
        eps_high: Optional[float] = None,
        delta: Optional[float] = None,
        temperature: Union[float, torch.Tensor] = 1.0,
        softcap: Optional[float] = None,
        logit_scale: float = 1.0,
        top_k: Union[int, torch.Tensor, None] = None,
        top_p: Union[float, torch.Tensor, None] = None,
        loss_type: Optional[str] = None,
        loss_mode: Optional[str] = None,
        loss_agg_mode: Optional[str] = None,
        kl_loss_type: Optional[str] = None,
        max_completion_length: Optional[int] = None,
        importance_sampling_level: str = "token",
        entropy_coef: float = 0.0,
        use_bias_correction_kl: bool = False,
        top_entropy_quantile: float = 1.0,
        off_policy_mask_threshold: Optional[float] = None,
        rollout_correction: Optional[str] = None,
        rollout_correction_max: Optional[float] = 3.0,
        rollout_correction_min: Optional[float] = None,
        clip_cov_ratio: Optional[float] = None,
        clip_cov_lb: Optional[float] = None,
        clip_cov_ub: Optional[float] = None,
        kl_cov_ratio: Optional[float] = None,
        ppo_kl_coef: Optional[float] = None,
        dro_beta: Optional[float] = None,
        dp_size: int = 1,
        sapo_temperature_pos: float = 1.0,
        sapo_temperature_neg: float = 1.05,
        vespo_k_pos: float = 2.0,
        vespo_lambda_pos: float = 3.0,
        vespo_k_neg: float = 3.0,
        vespo_lambda_neg: float = 2.0,
        # verl's spellings of the options above (options.VERL_SPELLINGS)
        clip_ratio_low: Union[float, NotGiven] = NOT_GIVEN,
        clip_ratio_high: Union[float, None, NotGiven] = NOT_GIVEN,
        clip_ratio_c: Union[float, None, NotGiven] = NOT_GIVEN,
        kl_loss_coef: Union[float, NotGiven] = NOT_GIVEN,
        entropy_coeff: Union[float, NotGiven] = NOT_GIVEN,
        rollout_is_weights: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        tau_pos: Union[float, NotGiven] = NOT_GIVEN,
        tau_neg: Union[float, NotGiven] = NOT_GIVEN,
        loss_scale_factor: Union[int, None, NotGiven] = NOT_GIVEN,
        batch_num_tokens: Any = NOT_GIVEN,
        clip_ratio: Union[float, NotGiven] = NOT_GIVEN,
        # verl keys without an equivalent: refused, saying what to pass (options.VERL_WITHOUT_EQUIVALENT)
        use_kl_loss: NotGiven = NOT_GIVEN,
        calculate_entropy: NotGiven = NOT_GIVEN,
        policy_loss: NotGiven = NOT_GIVEN,
        global_batch_info: NotGiven = NOT_GIVEN,
        # <<< GRPO keywords
        chunk_size: Optional[int] = None,
        accumulate_in_weight_dtype: bool = False,
        fp32_logits: bool = FP32_LOGITS_DEFAULT,
        backend: str = "auto",
        process_group: Optional[Any] = None,
        reduce_hidden_grad: bool = False,
    ) -> None:
        super().__init__()
        V.check_choice("backend", backend, BACKENDS)
        accumulate_in_weight_dtype = V.check_flag("accumulate_in_weight_dtype", accumulate_in_weight_dtype)
        fp32_logits = V.check_flag("fp32_logits", fp32_logits)
        chunk_size = V.check_chunk_size(chunk_size)
        grpo_kwargs = {
            # >>> GRPO keywords passed on (tools/signatures.py)
            "old_logps": old_logps, "ref_logps": ref_logps, "is_ratio": is_ratio,
            "num_items_in_batch": num_items_in_batch, "segment_ids": segment_ids, "rollout_logps": rollout_logps,
            "global_batch_size": global_batch_size, "sampling_mask": sampling_mask, "beta": beta, "eps_low": eps_low,
            "eps_high": eps_high, "delta": delta, "temperature": temperature, "softcap": softcap,
            "logit_scale": logit_scale, "top_k": top_k, "top_p": top_p, "loss_type": loss_type, "loss_mode": loss_mode,
            "loss_agg_mode": loss_agg_mode, "kl_loss_type": kl_loss_type,
            "max_completion_length": max_completion_length, "importance_sampling_level": importance_sampling_level,
            "entropy_coef": entropy_coef, "use_bias_correction_kl": use_bias_correction_kl,
            "top_entropy_quantile": top_entropy_quantile, "off_policy_mask_threshold": off_policy_mask_threshold,
            "rollout_correction": rollout_correction, "rollout_correction_max": rollout_correction_max,
            "rollout_correction_min": rollout_correction_min, "clip_cov_ratio": clip_cov_ratio,
            "clip_cov_lb": clip_cov_lb, "clip_cov_ub": clip_cov_ub, "kl_cov_ratio": kl_cov_ratio,
            "ppo_kl_coef": ppo_kl_coef, "dro_beta": dro_beta, "dp_size": dp_size,
            "sapo_temperature_pos": sapo_temperature_pos, "sapo_temperature_neg": sapo_temperature_neg,
            "vespo_k_pos": vespo_k_pos, "vespo_lambda_pos": vespo_lambda_pos, "vespo_k_neg": vespo_k_neg,
            "vespo_lambda_neg": vespo_lambda_neg, "clip_ratio_low": clip_ratio_low, "clip_ratio_high": clip_ratio_high,
            "clip_ratio_c": clip_ratio_c, "kl_loss_coef": kl_loss_coef, "entropy_coeff": entropy_coeff,
            "rollout_is_weights": rollout_is_weights, "tau_pos": tau_pos, "tau_neg": tau_neg,
            "loss_scale_factor": loss_scale_factor, "batch_num_tokens": batch_num_tokens, "clip_ratio": clip_ratio,
            "use_kl_loss": use_kl_loss, "calculate_entropy": calculate_entropy, "policy_loss": policy_loss,
            "global_batch_info": global_batch_info,
            # <<< GRPO keywords passed on
        }
        split_grpo_keywords(grpo_kwargs, "fused_linear_grpo_loss")  # raises now, not at the first forward
        self.config: Dict[str, Any] = _held(functional.fused_linear_grpo_loss, dict(
            grpo_kwargs, chunk_size=chunk_size, accumulate_in_weight_dtype=accumulate_in_weight_dtype,
            fp32_logits=fp32_logits, backend=backend, process_group=process_group,
            reduce_hidden_grad=reduce_hidden_grad))

    def forward(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        completion_ids: torch.Tensor,
        advantages: torch.Tensor,
        completion_mask: Optional[torch.Tensor] = None,
        bias: Optional[torch.Tensor] = None,
        *,
        # >>> GRPO keywords per call (tools/signatures.py)
        # per-call tensors, constants of the loss (options.GRPOInputs)
        old_logps: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        ref_logps: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        is_ratio: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        num_items_in_batch: Any = NOT_GIVEN,
        segment_ids: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        rollout_logps: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        global_batch_size: Any = NOT_GIVEN,
        sampling_mask: Union[SamplingMask, None, NotGiven] = NOT_GIVEN,
        # the loss's options, each checked against its declaration (options.GRPOOptions)
        beta: Union[float, NotGiven] = NOT_GIVEN,
        eps_low: Union[float, NotGiven] = NOT_GIVEN,
        eps_high: Union[float, None, NotGiven] = NOT_GIVEN,
        delta: Union[float, None, NotGiven] = NOT_GIVEN,
        temperature: Union[float, torch.Tensor, NotGiven] = NOT_GIVEN,
        softcap: Union[float, None, NotGiven] = NOT_GIVEN,
        logit_scale: Union[float, NotGiven] = NOT_GIVEN,
        top_k: Union[int, torch.Tensor, None, NotGiven] = NOT_GIVEN,
        top_p: Union[float, torch.Tensor, None, NotGiven] = NOT_GIVEN,
        loss_type: Union[str, None, NotGiven] = NOT_GIVEN,
        loss_mode: Union[str, None, NotGiven] = NOT_GIVEN,
        loss_agg_mode: Union[str, None, NotGiven] = NOT_GIVEN,
        kl_loss_type: Union[str, None, NotGiven] = NOT_GIVEN,
        max_completion_length: Union[int, None, NotGiven] = NOT_GIVEN,
        importance_sampling_level: Union[str, NotGiven] = NOT_GIVEN,
        entropy_coef: Union[float, NotGiven] = NOT_GIVEN,
        use_bias_correction_kl: Union[bool, NotGiven] = NOT_GIVEN,
        top_entropy_quantile: Union[float, NotGiven] = NOT_GIVEN,
        off_policy_mask_threshold: Union[float, None, NotGiven] = NOT_GIVEN,
        rollout_correction: Union[str, None, NotGiven] = NOT_GIVEN,
        rollout_correction_max: Union[float, None, NotGiven] = NOT_GIVEN,
        rollout_correction_min: Union[float, None, NotGiven] = NOT_GIVEN,
        clip_cov_ratio: Union[float, None, NotGiven] = NOT_GIVEN,
        clip_cov_lb: Union[float, None, NotGiven] = NOT_GIVEN,
        clip_cov_ub: Union[float, None, NotGiven] = NOT_GIVEN,
        kl_cov_ratio: Union[float, None, NotGiven] = NOT_GIVEN,
        ppo_kl_coef: Union[float, None, NotGiven] = NOT_GIVEN,
        dro_beta: Union[float, None, NotGiven] = NOT_GIVEN,
        dp_size: Union[int, NotGiven] = NOT_GIVEN,
        sapo_temperature_pos: Union[float, NotGiven] = NOT_GIVEN,
        sapo_temperature_neg: Union[float, NotGiven] = NOT_GIVEN,
        vespo_k_pos: Union[float, NotGiven] = NOT_GIVEN,
        vespo_lambda_pos: Union[float, NotGiven] = NOT_GIVEN,
        vespo_k_neg: Union[float, NotGiven] = NOT_GIVEN,
        vespo_lambda_neg: Union[float, NotGiven] = NOT_GIVEN,
        # verl's spellings of the options above (options.VERL_SPELLINGS)
        clip_ratio_low: Union[float, NotGiven] = NOT_GIVEN,
        clip_ratio_high: Union[float, None, NotGiven] = NOT_GIVEN,
        clip_ratio_c: Union[float, None, NotGiven] = NOT_GIVEN,
        kl_loss_coef: Union[float, NotGiven] = NOT_GIVEN,
        entropy_coeff: Union[float, NotGiven] = NOT_GIVEN,
        rollout_is_weights: Union[torch.Tensor, None, NotGiven] = NOT_GIVEN,
        tau_pos: Union[float, NotGiven] = NOT_GIVEN,
        tau_neg: Union[float, NotGiven] = NOT_GIVEN,
        loss_scale_factor: Union[int, None, NotGiven] = NOT_GIVEN,
        batch_num_tokens: Any = NOT_GIVEN,
        clip_ratio: Union[float, NotGiven] = NOT_GIVEN,
        # verl keys without an equivalent: refused, saying what to pass (options.VERL_WITHOUT_EQUIVALENT)
        use_kl_loss: NotGiven = NOT_GIVEN,
        calculate_entropy: NotGiven = NOT_GIVEN,
        policy_loss: NotGiven = NOT_GIVEN,
        global_batch_info: NotGiven = NOT_GIVEN,
        # <<< GRPO keywords per call
        chunk_size: Union[int, None, NotGiven] = NOT_GIVEN,
        accumulate_in_weight_dtype: Union[bool, NotGiven] = NOT_GIVEN,
        fp32_logits: Union[bool, NotGiven] = NOT_GIVEN,
        backend: Union[str, NotGiven] = NOT_GIVEN,
        process_group: Any = NOT_GIVEN,
        reduce_hidden_grad: Union[bool, NotGiven] = NOT_GIVEN,
    ) -> GRPOLossOutput:
        """:func:`grpo_kernels.fused_linear_grpo_loss` with the held keywords; a keyword given here
        overrides its own."""
        per_call = {
            # >>> GRPO keywords passed on (tools/signatures.py)
            "old_logps": old_logps, "ref_logps": ref_logps, "is_ratio": is_ratio,
            "num_items_in_batch": num_items_in_batch, "segment_ids": segment_ids, "rollout_logps": rollout_logps,
            "global_batch_size": global_batch_size, "sampling_mask": sampling_mask, "beta": beta, "eps_low": eps_low,
            "eps_high": eps_high, "delta": delta, "temperature": temperature, "softcap": softcap,
            "logit_scale": logit_scale, "top_k": top_k, "top_p": top_p, "loss_type": loss_type, "loss_mode": loss_mode,
            "loss_agg_mode": loss_agg_mode, "kl_loss_type": kl_loss_type,
            "max_completion_length": max_completion_length, "importance_sampling_level": importance_sampling_level,
            "entropy_coef": entropy_coef, "use_bias_correction_kl": use_bias_correction_kl,
            "top_entropy_quantile": top_entropy_quantile, "off_policy_mask_threshold": off_policy_mask_threshold,
            "rollout_correction": rollout_correction, "rollout_correction_max": rollout_correction_max,
            "rollout_correction_min": rollout_correction_min, "clip_cov_ratio": clip_cov_ratio,
            "clip_cov_lb": clip_cov_lb, "clip_cov_ub": clip_cov_ub, "kl_cov_ratio": kl_cov_ratio,
            "ppo_kl_coef": ppo_kl_coef, "dro_beta": dro_beta, "dp_size": dp_size,
            "sapo_temperature_pos": sapo_temperature_pos, "sapo_temperature_neg": sapo_temperature_neg,
            "vespo_k_pos": vespo_k_pos, "vespo_lambda_pos": vespo_lambda_pos, "vespo_k_neg": vespo_k_neg,
            "vespo_lambda_neg": vespo_lambda_neg, "clip_ratio_low": clip_ratio_low, "clip_ratio_high": clip_ratio_high,
            "clip_ratio_c": clip_ratio_c, "kl_loss_coef": kl_loss_coef, "entropy_coeff": entropy_coeff,
            "rollout_is_weights": rollout_is_weights, "tau_pos": tau_pos, "tau_neg": tau_neg,
            "loss_scale_factor": loss_scale_factor, "batch_num_tokens": batch_num_tokens, "clip_ratio": clip_ratio,
            "use_kl_loss": use_kl_loss, "calculate_entropy": calculate_entropy, "policy_loss": policy_loss,
            "global_batch_info": global_batch_info,
            # <<< GRPO keywords passed on
            "chunk_size": chunk_size, "accumulate_in_weight_dtype": accumulate_in_weight_dtype,
            "fp32_logits": fp32_logits, "backend": backend, "process_group": process_group,
            "reduce_hidden_grad": reduce_hidden_grad,
        }
        return functional.fused_linear_grpo_loss(hidden, weight, completion_ids, advantages, completion_mask, bias=bias,
                                                 **_overridden(self.config, per_call))

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v!r}" for k, v in self.config.items())
