"""Tiny random models of the families users bring, built offline from their transformers configs.

Each family is a target (random init) and a draft that is the same model with noise added to its weights,
so the draft agrees with the target often but not always: rounds accept some drafts and roll back the rest.
Both share the byte-level tokenizer of engine/model_pair.py. Sliding windows are WINDOW tokens, so a prompt of
a few dozen tokens runs past them.
"""
from __future__ import annotations

from pathlib import Path

WINDOW = 8
SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)


def _llama(t):
    return t.LlamaConfig(**SHAPE)


def _qwen2(t):     # layer 0 full attention, layer 1 sliding (max_window_layers)
    return t.Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)


def _qwen3(t):
    return t.Qwen3Config(**SHAPE, head_dim=8)


def _mistral(t):
    return t.MistralConfig(**SHAPE, sliding_window=WINDOW)


def _gemma2(t):    # sliding and global layers alternating; eager attention with soft-capping
    return t.Gemma2Config(**SHAPE, head_dim=8, sliding_window=WINDOW)


def _gemma3(t):    # sliding and global layers interleaved
    shape = {**SHAPE, "num_hidden_layers": 3}
    return t.Gemma3TextConfig(**shape, head_dim=8, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _gpt2(t):      # no tensor-parallel plan in transformers
    return t.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=256, tie_word_embeddings=False)


def _phi3(t):      # fused qkv and gate_up projections
    return t.Phi3Config(**SHAPE, pad_token_id=0)


def _mixtral(t):   # mixture of experts
    return t.MixtralConfig(**SHAPE, num_local_experts=4, num_experts_per_tok=2)


def _qwen3_moe(t):     # Qwen3's MoE (Qwen3-30B-A3B, -235B-A22B)
    return t.Qwen3MoeConfig(**SHAPE, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _gpt_oss(t):       # sliding and full layers alternating, attention sinks, MoE
    return t.GptOssConfig(**SHAPE, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                          layer_types=["sliding_attention", "full_attention"])


def _deepseek_v3(t):   # multi-head latent attention (its cache holds the compressed latents), a dense layer, then MoE
    return t.DeepseekV3Config(**{**SHAPE, "num_key_value_heads": 4}, kv_lora_rank=16, q_lora_rank=16,
                              qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1,
                              topk_group=1)


def _glm4_moe(t):      # GLM-4.5 / 4.6: a dense layer, then MoE with a shared expert
    return t.Glm4MoeConfig(**SHAPE, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                           first_k_dense_replace=1, n_group=1, topk_group=1)


def _qwen3_next(t):    # Gated DeltaNet (linear attention: a recurrent state, no crop) and full attention, MoE
    return t.Qwen3NextConfig(**SHAPE, head_dim=8, layer_types=["linear_attention", "full_attention"],
                             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                             linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


def _gemma4(t):    # Gemma 4: sliding and global layers interleaved
    shape = {**SHAPE, "num_hidden_layers": 3}
    return t.Gemma4TextConfig(**shape, head_dim=8, sliding_window=WINDOW,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])


def _olmo3(t):     # OLMo 3: sliding and full layers
    return t.Olmo3Config(**SHAPE, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])


def _exaone4(t):   # EXAONE 4: sliding and full layers
    return t.Exaone4Config(**SHAPE, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])


def _seed_oss(t):  # Seed-OSS: full attention
    return t.SeedOssConfig(**SHAPE, head_dim=8)


def _llama4(t):    # Llama 4's text model: chunked attention (a layer attends within its chunk of WINDOW tokens), MoE
    return t.Llama4TextConfig(**SHAPE, head_dim=8, num_local_experts=4, num_experts_per_tok=1,
                              attention_chunk_size=WINDOW, intermediate_size_mlp=64)


def _qwen3_5(t):   # Qwen3.5: Gated DeltaNet (recurrent, as Qwen3-Next's) and full attention
    return t.Qwen3_5TextConfig(**SHAPE, head_dim=8, layer_types=["linear_attention", "full_attention"],
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                               linear_value_head_dim=8)


DSA = dict(kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, n_routed_experts=4,
           num_experts_per_tok=2, moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1,
           index_head_dim=8, index_n_heads=32, index_topk=6)
# DSA: each query attends to its indexer's top 6 keys, so the sparse selection matters at these contexts. With 32
# indexer heads a score of exactly 0 (every head's ReLU zero) is improbable: such scores tie, and which of tied keys
# top-k keeps depends on the tensor's shape, so with 2 heads even transformers' generate() and a one-token-at-a-time
# run of the same model disagree.


def _deepseek_v32(t):  # DeepSeek V3.2: V3's latent attention with a sparse-attention indexer, whose keys the cache
    return t.DeepseekV32Config(**{**SHAPE, "num_key_value_heads": 4}, **DSA)                            # holds too


def _deepseek_v4(t):   # DeepSeek V4: windowed compressed attention (its layers roll back only within the window),
    shape = {**SHAPE, "num_key_value_heads": 1}                                         # hash-routed experts, then MoE
    return t.DeepseekV4Config(**shape, q_lora_rank=16, head_dim=16, qk_rope_head_dim=8, o_groups=2, o_lora_rank=16,
                              n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, index_n_heads=2,
                              index_head_dim=16, sliding_window=WINDOW, mlp_layer_types=["hash_moe", "moe"],
                              layer_types=["heavily_compressed_attention", "compressed_sparse_attention"])


def _glm5(t):          # GLM-5 (glm_moe_dsa): latent attention with DeepSeek's sparse-attention indexer, MoE
    return t.GlmMoeDsaConfig(**{**SHAPE, "num_key_value_heads": 4}, **DSA)


FAMILIES = {"llama": _llama, "qwen2-sliding": _qwen2, "qwen3": _qwen3, "mistral-sliding": _mistral,
            "gemma2-hybrid": _gemma2, "gemma3-hybrid": _gemma3, "gpt2": _gpt2, "phi3": _phi3, "mixtral-moe": _mixtral,
            "qwen3-moe": _qwen3_moe, "gpt-oss-hybrid": _gpt_oss, "deepseek-v3-mla": _deepseek_v3,
            "glm4-moe": _glm4_moe, "qwen3-next-linear": _qwen3_next, "gemma4-hybrid": _gemma4,
            "olmo3-hybrid": _olmo3, "exaone4-hybrid": _exaone4, "seed-oss": _seed_oss, "llama4-chunked": _llama4,
            "qwen3.5-linear": _qwen3_5, "deepseek-v3.2-dsa": _deepseek_v32, "glm5-dsa": _glm5,
            "deepseek-v4": _deepseek_v4}
SLIDING = {"qwen2-sliding", "mistral-sliding", "gemma2-hybrid", "gemma3-hybrid",      # some layers attend over a window
           "gpt-oss-hybrid", "gemma4-hybrid", "olmo3-hybrid", "exaone4-hybrid", "llama4-chunked"}
NO_TP_PLAN = {"gpt2"}
RECURRENT = {"qwen3-next-linear", "qwen3.5-linear"}    # some layers hold a recurrent state: rolled back to
                                                       # checkpoints, not batched
UNPADDED = {"deepseek-v4"}             # some cache layers are neither attention nor recurrent (V4's compressed
                                       # windows): cropped on rollback, one row per forward
RESTARTED = {"deepseek-v4"}            # a rollback past the window cannot be cropped: the session starts again


def build_family(name: str, out: Path, seed: int = 0, draft_noise: float = 0.3) -> tuple[str, str]:
    """Write out/draft and out/target for family `name`; returns (draft, target) paths."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from engine.model_pair import build_tokenizer

    tokenizer = build_tokenizer(None)
    config = FAMILIES[name](transformers)
    eos = tokenizer.eos_token_id
    config.vocab_size, config.eos_token_id, config.bos_token_id, config.pad_token_id = len(tokenizer), eos, eos, eos
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config.pad_token_id = eos
    paths = {}
    for role in ("target", "draft"):
        if role == "draft":
            with torch.no_grad():
                for param in model.parameters():
                    spread = param.std().nan_to_num(0.0) if param.numel() > 1 else 0.0
                    param.add_(torch.randn_like(param) * draft_noise * spread)
        path = out / role
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
        paths[role] = str(path)
    return paths["draft"], paths["target"]


def reference(target: str, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy transformers generate() of the target alone, one prompt at a time (EOS ignored)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target).eval()
    return [model.generate(torch.tensor([p]), max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False,
                           eos_token_id=None)[0, len(p):].tolist() for p in prompts]
