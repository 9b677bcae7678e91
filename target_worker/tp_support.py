"""Whether a target model can be sharded over a TP group, decided from its config before any rank joins the
group or loads a weight: a model refused here fails the start with one line naming the model, the TP size and
the reason, instead of failing inside transformers on some rank while its peers wait in the group."""
from __future__ import annotations


class ModelRefused(ValueError):
    """The configured model cannot be served as configured."""


def tp_refusal(model_path: str, tp_size: int) -> str | None:
    """Why `model_path` cannot run at tensor_parallel_size `tp_size`, or None if it can: it needs transformers' TP
    plan for its architecture, and attention and KV heads that divide by `tp_size`."""
    if tp_size == 1:
        return None
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_path)
    text = config.get_text_config(decoder=True)
    name = (config.architectures or [type(config).__name__])[0]
    if not getattr(text, "base_model_tp_plan", None):
        return f"{name} has no tensor-parallel plan in transformers"
    heads = getattr(text, "num_attention_heads", None)
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    for count, what in ((heads, "attention heads"), (kv_heads, "key/value heads")):
        if count and count % tp_size:
            return f"its {count} {what} do not divide by {tp_size}"
    return None


def check_tensor_parallel(model_path: str, tp_size: int) -> None:
    """Raise ModelRefused, in one line, if `model_path` cannot run at tensor_parallel_size `tp_size`."""
    reason = tp_refusal(model_path, tp_size)
    if reason:
        raise ModelRefused(f"target model {model_path!r} cannot be served at tensor_parallel_size {tp_size}: {reason}")
