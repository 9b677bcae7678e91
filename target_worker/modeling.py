"""Loading Hugging Face causal LMs and running them incrementally over a session's KV cache."""
from __future__ import annotations

from pathlib import Path

import torch

from target_worker.sessions import Session

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def load_model(name_or_path: str, dtype: str = "float32", device: str = "cpu", tp_plan: str | None = None):
    """An eval-mode AutoModelForCausalLM; tp_plan="auto" shards it over the initialised process group."""
    from transformers import AutoModelForCausalLM

    kwargs = {"dtype": DTYPES[dtype]}
    if tp_plan:
        kwargs["tp_plan"] = tp_plan
    model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if not tp_plan:
        model.to(device)
    return model.eval()


def load_lm_head(name_or_path: str, dtype: str = "float32", device: str = "cpu") -> torch.nn.Module:
    """Only the output projection of a causal LM (the draft's LM head, held by the target)."""
    return load_model(name_or_path, dtype, device).get_output_embeddings()


def tokenizer_vocab(name_or_path: str) -> dict[str, int] | None:
    """token -> id of the model's tokenizer.json, or None when the model has none."""
    path = Path(name_or_path) / "tokenizer.json"
    if not path.exists():
        try:
            from huggingface_hub import hf_hub_download
            path = Path(hf_hub_download(name_or_path, "tokenizer.json"))
        except Exception:
            return None
    from tokenizers import Tokenizer
    return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)


def check_same_vocabulary(draft: str, target: str, draft_vocab_size: int, target_vocab_size: int) -> None:
    """Refuse a pair whose vocabularies differ: speculation compares token IDs position by position."""
    problem = None
    if draft_vocab_size != target_vocab_size:
        problem = f"vocab sizes differ ({draft_vocab_size} vs {target_vocab_size})"
    elif tokenizer_vocab(draft) != tokenizer_vocab(target):
        problem = "their tokenizers map tokens to different IDs"
    if problem:
        raise ValueError(f"draft model {draft!r} and target model {target!r} do not share a vocabulary: {problem}")


def model_info(model) -> dict:
    """What the router needs to validate requests: vocab size, context length, EOS ids."""
    config = model.config
    eos = model.generation_config.eos_token_id if model.generation_config else config.eos_token_id
    eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
    return {"vocab_size": int(config.vocab_size),
            "max_context": int(getattr(config, "max_position_embeddings", 0) or 0),
            "eos_token_ids": eos_ids,
            "hidden_size": int(config.hidden_size)}


def _inputs(model, session: Session, token_ids: list[int]) -> dict:
    from transformers import DynamicCache

    if session.cache is None:
        session.cache = DynamicCache(config=model.config)
    session.length += len(token_ids)
    return {"input_ids": torch.tensor([token_ids], device=model.device),
            "past_key_values": session.cache, "use_cache": True}


@torch.inference_mode()
def extend(model, session: Session, token_ids: list[int], keep: int) -> torch.Tensor:
    """Append token_ids to the session's cache; return logits of the last `keep` positions [keep, vocab]."""
    return model(**_inputs(model, session, token_ids), logits_to_keep=keep).logits[0, -keep:]


@torch.inference_mode()
def extend_hidden(model, session: Session, token_ids: list[int]) -> torch.Tensor:
    """Append token_ids; return the final (post-norm) hidden state of the last position [hidden]."""
    return model.get_decoder()(**_inputs(model, session, token_ids)).last_hidden_state[0, -1]
